"""The fused row merge: a group_reduce's returned partials merged into the host's rows in one kernel.

The torch path (``_reduce``) sums into an fp32 accumulator of every host row and converts each
window of returned rows to fp32 first (at real shapes 3x the bytes of the host's out). Here a
Triton kernel reads the host's rows and their partials through a slot table and keeps the fp32
sums in registers: the only memory it writes is its outputs.

The slot table ``slots [B, N, P]`` int32 (``slot_table``): ``slots[b, n, d]`` is the send position
p of rank b (a row of its ``ret``) that went to destination d with host row ``send_index[b, p]
= n``, -1 where row n was not sent to d. A row goes to each destination at most once (what
``group_reduce`` assumes), so the table is dense and static-shape, built by one scatter (each
real entry written once: the same table on every run) with no host read. The kernels visit
the host's own row, then d = 0, 1, ..., P - 1: the torch path's deterministic order, so both
add the same terms in the same order.

Ops (``torch.library.custom_op`` with a fake that makes the outputs only, so the merge traces
on meta and under ``torch.compile``):

- ``groupcomm::merge_lse(out [B, N, h, D], lse [B, N, h], out_p [B, C, h, D], lse_p [B, C, h],
  slots, use_triton) -> (out in out's dtype, lse in lse's dtype)``;
- ``groupcomm::merge_sum(acc [B, N, *f], ret [B, C, *f], slots, use_triton) -> [B, N, *f]`` in
  acc's dtype (fp32 inside);
- in place (``group_reduce(inplace=True)``), the same merges written into the accumulator
  itself, which is the kernels' output (``mutates_args``; the fakes return None and allocate
  nothing): ``groupcomm::merge_lse_(out, lse, out_p, lse_p, slots, use_triton) -> None`` (out
  and lse fp32) and ``groupcomm::merge_sum_(acc, ret, slots, use_triton) -> None``. Why that is
  safe with the output aliasing the input: ``_merge_kernel``'s docstring. The partials must not
  share memory with the accumulator (in a group_reduce they come back in buffers of their own).

``use_triton`` False runs the torch twins ``merge_lse_ref`` / ``merge_sum_ref`` (and
``merge_lse_ref_`` / ``merge_sum_ref_`` in place: the twin's result copied over; P gathers of
N rows: a reference, not a memory saver). The out-of-place ops never modify their inputs.

``fused_reduce(mode)`` chooses where ``reduce_rows`` uses the ops: ``None`` (the default) on
CUDA tensors only; True everywhere (meta: the fakes; CPU: the kernels under
``TRITON_INTERPRET=1``); False never.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

_NEG_INF = float("-inf")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MODE: bool | None = None


def set_fused_reduce(mode: bool | None) -> None:
    """Where ``group_reduce`` merges with the fused kernels: None on CUDA only (the default), True
    always (CPU needs ``TRITON_INTERPRET=1``), False never (the torch path)."""
    global _MODE
    if mode is not None and not isinstance(mode, bool):
        raise ValueError(f"fused_reduce: mode must be None, True or False, got {mode!r}")
    _MODE = mode


@contextmanager
def fused_reduce(mode: bool | None):
    """``set_fused_reduce(mode)`` inside the ``with`` block, the previous mode restored after."""
    prev = _MODE
    set_fused_reduce(mode)
    try:
        yield
    finally:
        set_fused_reduce(prev)


def use_fused(acc: list[torch.Tensor], ret: list[torch.Tensor]) -> bool:
    """Whether this reduce goes through the fused ops: the mode allows it and every tensor is
    fp16 / bf16 / fp32 (the kernels sum in fp32; other dtypes take the torch path)."""
    if _MODE is False or not all(t.dtype in _FLOATS for t in (*acc, *ret)):
        return False
    return _MODE is True or acc[0].is_cuda


def slot_table(send_index: torch.Tensor, dest: torch.Tensor, N: int, P: int) -> torch.Tensor:
    """``slots [B, N, P]`` int32 of send_index / dest ``[B, C]`` (see the module docstring); the
    positions skipped (dest or send_index out of range) are written to one scratch entry."""
    B, C = send_index.shape
    ok = (dest >= 0) & (dest < P) & (send_index >= 0) & (send_index < N)
    base = torch.arange(B, device=dest.device, dtype=torch.int64)[:, None] * N
    at = torch.where(ok, (base + send_index) * P + dest, torch.full_like(dest, B * N * P))
    table = torch.full((B * N * P + 1,), -1, dtype=torch.int32, device=dest.device)
    pos = torch.arange(C, device=dest.device, dtype=torch.int32).expand(B, C)
    table.scatter_(0, at.reshape(-1), pos.reshape(-1))
    return table[:-1].view(B, N, P)


def _gather(rows: torch.Tensor, slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows[b, slots[b, n, k]] ``[B, N, *f]``, its mask ``[B, N]``): the partial from destination k."""
    ok = slots[:, :, k] >= 0
    b = torch.arange(slots.shape[0], device=slots.device)[:, None]
    return rows[b, slots[:, :, k].clamp(min=0).long()], ok


def merge_lse_ref(out: torch.Tensor, lse: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor,
                  slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of the lse kernel (same signature, same order of the fp32 sums)."""
    P = slots.shape[2]
    parts = [_gather(lse_p, slots, k) for k in range(P)]
    lk = [torch.where(ok[..., None], x.float(), torch.full_like(x, _NEG_INF, dtype=torch.float32))
          for x, ok in parts]
    l0 = lse.float()
    m = l0
    for x in lk:
        m = torch.maximum(m, x)
    m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)
    s = torch.exp(l0 - m)
    for x in lk:
        s = s + torch.exp(x - m)
    lse_new = m + torch.log(s)
    safe = torch.where(lse_new == _NEG_INF, torch.zeros_like(lse_new), lse_new)
    acc = torch.exp(l0 - safe)[..., None] * out.float()
    for k, x in enumerate(lk):
        o, ok = _gather(out_p, slots, k)
        acc = acc + torch.where(ok[..., None, None], torch.exp(x - safe)[..., None] * o.float(), 0.0)
    return acc.to(out.dtype), lse_new.to(lse.dtype)


def merge_sum_ref(acc: torch.Tensor, ret: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Torch twin of the sum kernel: acc plus its partials in destination order, fp32 inside."""
    total = acc.to(torch.float32, copy=True)  # never the input itself: an op output must not alias it
    for k in range(slots.shape[2]):
        x, ok = _gather(ret, slots, k)
        total = total + torch.where(ok.view(*ok.shape, *([1] * (x.dim() - 2))), x.float(), 0.0)
    return total.to(acc.dtype)


def merge_lse_ref_(out: torch.Tensor, lse: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """Torch twin of the in-place lse merge: ``merge_lse_ref``'s result written over (out, lse)."""
    o, l_ = merge_lse_ref(out, lse, out_p, lse_p, slots)
    out.copy_(o)
    lse.copy_(l_)


def merge_sum_ref_(acc: torch.Tensor, ret: torch.Tensor, slots: torch.Tensor) -> None:
    """Torch twin of the in-place sum: ``merge_sum_ref``'s result written over acc."""
    acc.copy_(merge_sum_ref(acc, ret, slots))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_triton(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda and not _interpreting():
        raise ValueError(f"groupcomm::{name}: the fused kernel on {t.device} needs TRITON_INTERPRET=1; "
                         f"use fused_reduce(None) or fused_reduce(False) for the torch path")


@torch.library.custom_op("groupcomm::merge_lse", mutates_args=())
def merge_lse_op(out: torch.Tensor, lse: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor,
                 slots: torch.Tensor, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, N, h, D], lse [B, N, h], out_p [B, C, h, D], lse_p [B, C, h], slots [B, N, P] int32
    -> merged (out [B, N, h, D] in out's dtype, lse [B, N, h] in lse's dtype)."""
    if not use_triton:
        return merge_lse_ref(out, lse, out_p, lse_p, slots)
    _check_triton(out, "merge_lse")
    from ._merge_kernel import merge_lse_into  # triton is imported when a kernel first runs, as the put's
    out_new, lse_new = torch.empty_like(out, memory_format=torch.contiguous_format), \
        torch.empty_like(lse, memory_format=torch.contiguous_format)
    merge_lse_into(out, lse, out_p, lse_p, slots, out_new, lse_new, gpu=not _interpreting())
    return out_new, lse_new


@merge_lse_op.register_fake
def merge_lse_fake(out: torch.Tensor, lse: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor,
                   slots: torch.Tensor, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(out, memory_format=torch.contiguous_format),
            torch.empty_like(lse, memory_format=torch.contiguous_format))


@torch.library.custom_op("groupcomm::merge_sum", mutates_args=())
def merge_sum_op(acc: torch.Tensor, ret: torch.Tensor, slots: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """acc [B, N, *f], ret [B, C, *f], slots [B, N, P] int32 -> acc + partials [B, N, *f] in acc's dtype."""
    if not use_triton:
        return merge_sum_ref(acc, ret, slots)
    _check_triton(acc, "merge_sum")
    from ._merge_kernel import merge_sum_into
    out = torch.empty_like(acc, memory_format=torch.contiguous_format)
    merge_sum_into(acc, ret, slots, out, gpu=not _interpreting())
    return out


@merge_sum_op.register_fake
def merge_sum_fake(acc: torch.Tensor, ret: torch.Tensor, slots: torch.Tensor, use_triton: bool) -> torch.Tensor:
    return torch.empty_like(acc, memory_format=torch.contiguous_format)


@torch.library.custom_op("groupcomm::merge_lse_", mutates_args=("out", "lse"))
def merge_lse_inplace_op(out: torch.Tensor, lse: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor,
                         slots: torch.Tensor, use_triton: bool) -> None:
    """``merge_lse`` written into out [B, N, h, D] fp32 and lse [B, N, h] fp32 (any strides): the
    kernel's outputs are its accumulator inputs. A D dim that is not contiguous is merged in a
    contiguous copy and copied back."""
    if not use_triton:
        merge_lse_ref_(out, lse, out_p, lse_p, slots)
        return
    _check_triton(out, "merge_lse_")
    from ._merge_kernel import merge_lse_into
    dst = out if out.shape[-1] == 1 or out.stride(-1) == 1 else out.contiguous()
    merge_lse_into(dst, lse, out_p, lse_p, slots, dst, lse, gpu=not _interpreting(), inplace=True)
    if dst is not out:
        out.copy_(dst)


@merge_lse_inplace_op.register_fake
def merge_lse_inplace_fake(out: torch.Tensor, lse: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor,
                           slots: torch.Tensor, use_triton: bool) -> None:
    return None


@torch.library.custom_op("groupcomm::merge_sum_", mutates_args=("acc",))
def merge_sum_inplace_op(acc: torch.Tensor, ret: torch.Tensor, slots: torch.Tensor, use_triton: bool) -> None:
    """``merge_sum`` written into acc [B, N, *f] (any strides): the kernel's output is its accumulator
    input. Rows whose ``*f`` values are not one contiguous run are merged in a contiguous copy and
    copied back."""
    if not use_triton:
        merge_sum_ref_(acc, ret, slots)
        return
    _check_triton(acc, "merge_sum_")
    from ._merge_kernel import merge_sum_into, rows_are_flat
    dst = acc if rows_are_flat(acc) else acc.contiguous()
    merge_sum_into(dst, ret, slots, dst, gpu=not _interpreting(), inplace=True)
    if dst is not acc:
        acc.copy_(dst)


@merge_sum_inplace_op.register_fake
def merge_sum_inplace_fake(acc: torch.Tensor, ret: torch.Tensor, slots: torch.Tensor, use_triton: bool) -> None:
    return None


def fused_reduce_rows(acc: list, ret: list, send_index: torch.Tensor, dest: torch.Tensor, op: str,
                      P: int, inplace: bool = False) -> list[torch.Tensor]:
    """``reduce_rows`` through the fused ops; ``acc`` and ``ret`` are emptied as there (each pair
    dropped once merged, so a consumed tensor is freed before the next one's output is made).
    ``inplace``: the in-place ops, into acc's tensors, which are returned."""
    B, N = acc[0].shape[:2]
    slots = slot_table(send_index, dest, N, P)
    use_triton = acc[0].device.type != "meta"  # meta: the fake; the flag only picks the real impl
    if op == "lse":
        (out, lse), (out_p, lse_p) = acc, ret
        acc.clear()
        ret.clear()
        if inplace:
            merge_lse_inplace_op(out, lse, out_p, lse_p, slots, use_triton)
            return [out, lse]
        return list(merge_lse_op(out, lse, out_p, lse_p, slots, use_triton))
    outs = []
    for i in range(len(acc)):
        a, r = acc[i], ret[i]
        acc[i] = ret[i] = None
        if inplace:
            merge_sum_inplace_op(a, r, slots, use_triton)
            outs.append(a)
        else:
            outs.append(merge_sum_op(a, r, slots, use_triton))
        del a, r
    return outs
