"""Shape, dtype and device checks at the entry points (host metadata only, never values).

``lead`` is 1 for ``LocalGroup`` (every per-rank tensor starts with a rank
dim of size P) and 0 for a real rank.
"""
from __future__ import annotations

from typing import Sequence

import torch

_INT = (torch.int64, torch.int32)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_tensors(tensors, name: str, lead: int, P: int) -> list[torch.Tensor]:
    """A non-empty list of tensors with a common row count; returns it as a list."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence) or len(tensors) == 0:
        raise ValueError(f"{name} must be a non-empty list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.dim() < lead + 1:
            want = "[P, N, *f]" if lead else "[N, *f]"
            raise ValueError(f"{name}[{i}] must be {want}, got shape {_shape(t)}")
        if lead and t.shape[0] != P:
            raise ValueError(f"{name}[{i}] has leading dim {t.shape[0]}, but LocalGroup has P = {P} ranks "
                             f"(shape {_shape(t)})")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device}, {name}[0] on {tensors[0].device}")
    rows = {t.shape[lead] for t in tensors}
    if len(rows) > 1:
        raise ValueError(f"{name} must share one row count, got shapes {[_shape(t) for t in tensors]}")
    return tensors


def check_split(split, P: int, device: torch.device) -> torch.Tensor:
    """``[P, P]`` integer tensor on the rows' device; returned as int64."""
    if not isinstance(split, torch.Tensor) or split.dtype not in _INT:
        raise ValueError(f"split must be an int64 [P, P] tensor, got {getattr(split, 'dtype', type(split))}")
    if _shape(split) != (P, P):
        raise ValueError(f"split must be [P, P] = [{P}, {P}], got {_shape(split)}")
    if split.device != device:
        raise ValueError(f"split is on {split.device}, the rows on {device}: keep it on the rows' device")
    return split.long()


def check_send_index(send_index, lead: int, P: int, device: torch.device) -> torch.Tensor:
    """``[send_cap]`` (or ``[P, send_cap]`` with a rank dim) integer tensor; returned as int64."""
    want = "[P, send_cap]" if lead else "[send_cap]"
    if not isinstance(send_index, torch.Tensor) or send_index.dtype not in _INT:
        raise ValueError(f"send_index must be an int64 {want} tensor, got "
                         f"{getattr(send_index, 'dtype', type(send_index))}")
    if send_index.dim() != lead + 1 or (lead and send_index.shape[0] != P):
        raise ValueError(f"send_index must be {want} with P = {P}, got {_shape(send_index)}")
    if send_index.device != device:
        raise ValueError(f"send_index is on {send_index.device}, the rows on {device}")
    return send_index.long()


def check_out(out, tensors: list[torch.Tensor], recv_capacity: int, lead: int) -> list[torch.Tensor]:
    """One receive buffer per cast tensor: ``[.., recv_capacity, *f]``, same dtype, trailing shape, device."""
    if isinstance(out, torch.Tensor) or not isinstance(out, Sequence) or len(out) != len(tensors):
        raise ValueError(f"out must be a list of {len(tensors)} tensors (one per cast tensor), got "
                         f"{type(out).__name__}")
    out = list(out)
    for i, (o, t) in enumerate(zip(out, tensors)):
        want = (*t.shape[:lead], recv_capacity, *t.shape[lead + 1:])
        if not isinstance(o, torch.Tensor) or _shape(o) != want or o.dtype != t.dtype or o.device != t.device:
            got = (_shape(o), o.dtype, o.device) if isinstance(o, torch.Tensor) else type(o).__name__
            raise ValueError(f"out[{i}] must be {want} {t.dtype} on {t.device} (recv_capacity rows of tensors[{i}]), "
                             f"got {got}")
    return out


def check_recv_offset(recv_offset, P: int, device: torch.device) -> torch.Tensor:
    """``[P]`` integer tensor on the rows' device; returned as int64."""
    if not isinstance(recv_offset, torch.Tensor) or recv_offset.dtype not in _INT or _shape(recv_offset) != (P,):
        raise ValueError(f"recv_offset must be an int64 [P] = [{P}] tensor, got "
                         f"{_shape(recv_offset) if isinstance(recv_offset, torch.Tensor) else type(recv_offset)}")
    if recv_offset.device != device:
        raise ValueError(f"recv_offset is on {recv_offset.device}, the rows on {device}")
    return recv_offset.long()


def check_capacity(recv_capacity) -> int:
    if isinstance(recv_capacity, bool) or not isinstance(recv_capacity, int) or recv_capacity < 0:
        raise ValueError(f"recv_capacity must be a host int >= 0, got {recv_capacity!r}")
    return recv_capacity


def check_reduce(partials: list[torch.Tensor], acc: list[torch.Tensor], op: str, lead: int) -> None:
    """Partials ``[.., recv_capacity, *f]`` pair with acc ``[.., N, *f]``: same count and trailing shapes."""
    if op not in ("sum", "lse"):
        raise ValueError(f"op must be 'sum' or 'lse', got {op!r}")
    if len(partials) != len(acc):
        raise ValueError(f"partials and acc must pair up, got {len(partials)} partials and {len(acc)} acc")
    for i, (p, a) in enumerate(zip(partials, acc)):
        if p.shape[lead + 1:] != a.shape[lead + 1:]:
            raise ValueError(f"partials[{i}] {_shape(p)} and acc[{i}] {_shape(a)} differ in trailing shape")
        if p.device != a.device:
            raise ValueError(f"partials[{i}] is on {p.device}, acc[{i}] on {a.device}")
    if op == "lse":
        if len(acc) != 2:
            raise ValueError(f"op='lse' takes (out, lse) pairs, got {len(acc)} tensors")
        out, lse = acc
        if out.dim() != lead + 3 or lse.shape != out.shape[:-1]:
            raise ValueError(f"op='lse' needs out [.., N, h, D] and lse [.., N, h], got "
                             f"{_shape(out)} and {_shape(lse)}")
        for name, t in (("partials[1]", partials[1]), ("acc[1]", lse)):
            if not t.dtype.is_floating_point:
                raise ValueError(f"{name} (lse) must be floating point (fp32), got {t.dtype}")


def check_phase(phase) -> str:
    if not isinstance(phase, str) or not phase:
        raise ValueError(f"phase must be a non-empty str, got {phase!r}")
    return phase


def _extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last one in its storage, plus 1 (0 when empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: with its dims sorted by stride, each stride
    must pass the last element the smaller dims reach (a sufficient test: a broadcast dim, stride 0,
    always fails it; exotic interleaved layouts that do not overlap may fail it too)."""
    reach = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _lattice_hit(d: int, dims: list[tuple[int, int]]) -> bool:
    """Whether ``d = sum k_i * stride_i`` with ``|k_i| < size_i`` over ``dims`` [(stride, size)], strides
    descending and each above what the smaller ones reach: then k_i is d / stride_i rounded down or up."""
    if not dims:
        return d == 0
    (stride, size), rest = dims[0], dims[1:]
    reach = sum(st * (sz - 1) for st, sz in rest)
    for k in {d // stride, -(-d // stride)}:
        if abs(k) < size and abs(d - k * stride) <= reach and _lattice_hit(d - k * stride, rest):
            return True
    return False


def _may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b (views of one storage) may share an element: exactly for two views of one
    layout (shape, strides, dtype: each a translate of the other, as two row ranges of one batched
    buffer are), else whether their byte ranges meet."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and not _self_overlapping(a):
        dims = sorted(((st, sz) for sz, st in zip(a.shape, a.stride()) if sz > 1), reverse=True)
        return _lattice_hit(b.storage_offset() - a.storage_offset(), dims)
    start_a, start_b = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    return start_a < start_b + _extent(b) * b.element_size() and start_b < start_a + _extent(a) * a.element_size()


def check_inplace(partials: list[torch.Tensor], acc: list[torch.Tensor], op: str, sum_dtype) -> None:
    """``group_reduce(inplace=True)``: every acc a real tensor the sums can be written into.

    Each acc must have one memory location per element (no broadcast view such as ``neutral_rows``,
    no overlapping strides), no two may overlap, and each must already be the dtype the reduce
    accumulates in, so writing the result back rounds nothing: fp32 out and lse for ``op="lse"``,
    the sum dtype of (acc, partial) for ``op="sum"`` (``sum_dtype(acc, partial)``)."""
    for i, a in enumerate(acc):
        if _self_overlapping(a):
            raise ValueError(f"acc[{i}] cannot be reduced into in place (group_reduce(inplace=True)): shape "
                             f"{_shape(a)} with strides {tuple(a.stride())} has elements that share memory (a "
                             f"broadcast view such as neutral_rows, or expand); pass a tensor of its own or "
                             f"inplace=False")
    if op == "lse":
        for i, name in ((0, "out"), (1, "lse")):
            if acc[i].dtype != torch.float32:
                raise ValueError(f"acc[{i}] ({name}) must be fp32 to be merged into in place, got {acc[i].dtype}: "
                                 f"the merge runs in fp32, and an in-place accumulator is the running one, so a "
                                 f"lower precision would round it at every reduce (pass fp32, or inplace=False for "
                                 f"a new result in acc's dtype)")
    else:
        for i, (p, a) in enumerate(zip(partials, acc)):
            want = sum_dtype(a.dtype, p.dtype)
            if not a.dtype.is_floating_point or want != a.dtype:
                raise ValueError(f"acc[{i}] must be a floating dtype that is its own sum dtype (fp32, fp64) to be "
                                 f"summed into in place, got {a.dtype} with partials[{i}] {p.dtype}: the sums "
                                 f"accumulate in {want}, so a {a.dtype} accumulator would be rounded at every reduce "
                                 f"(pass a {want} accumulator, or inplace=False)")
    if torch.compiler.is_compiling():
        return  # storages are not traced; the graph's functionalization keeps the writes apart anyway
    keys = [a.untyped_storage()._cdata for a in acc]  # the storage itself (meta and fake tensors have one)
    for i, a in enumerate(acc):
        for j in range(i):
            if keys[j] == keys[i] and _may_overlap(acc[j], a):
                raise ValueError(f"acc[{i}] and acc[{j}] may overlap in memory (one storage, offsets "
                                 f"{a.storage_offset()} and {acc[j].storage_offset()}, strides {tuple(a.stride())} "
                                 f"and {tuple(acc[j].stride())}): group_reduce(inplace=True) writes each, so they "
                                 f"must not share elements")
