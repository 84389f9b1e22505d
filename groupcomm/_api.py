"""The two entry points, ``group_cast`` and ``group_reduce``, and ``default_group``.

They check arguments once (host metadata only) and hand over to the group
object, which decides how rows move (see ``__init__`` for the backends).
"""
from __future__ import annotations

import logging

import torch

from ._base import flag_routing
from ._checks import (check_capacity, check_inplace, check_out, check_phase, check_recv_offset, check_reduce,
                      check_send_index, check_split, check_tensors)
from ._reduce import sum_dtype

log = logging.getLogger("groupcomm")


def _lead(group) -> int:
    return 1 if getattr(group, "batched", False) else 0


def _flag(op: str, group, phase: str, split, send_index, n_rows: int, capacity: int, recv_offset=None) -> None:
    batched = send_index.dim() == 2
    ranks = torch.arange(group.size, device=split.device) if batched else \
        torch.full((1,), group.rank, dtype=torch.int64, device=split.device)
    flag_routing(op, phase, split, send_index if batched else send_index[None], n_rows, capacity, ranks,
                 recv_offset)


def group_cast(tensors, send_index: torch.Tensor, split: torch.Tensor, recv_capacity: int, group, *,
               phase: str = "cast", host_split=None, async_op: bool = False, flag_errors: bool = True,
               out=None, recv_offset: torch.Tensor | None = None, host_recv_offset=None):
    """Send rows of the local tensors to the ranks that need them.

    Args:
        tensors: list of ``[N, *f]`` tensors (any dtype, trailing shapes may
            differ, one row count N); they travel packed in one collective.
        send_index: ``[send_cap]`` int64, gather indices into the local rows in
            send order (destination ascending), ``-1`` padding after the last.
        split: ``[P(src), P(dst)]`` int64 device tensor, rows s sends to d; the
            same matrix on every rank.
        recv_capacity: host int, rows of each receive buffer.
        group: ``LocalGroup``, ``TorchGroup`` or ``SymmMemGroup``.
        phase: label for the byte counters and error messages.
        host_split: a ``HostSplits`` (``TorchGroup`` only; others ignore it).
        async_op: return a ``Work`` whose ``wait()`` gives the result.
        flag_errors: on the sync-free backends, record a routing the call cannot
            honour (negative splits, a receive fill past ``recv_capacity``, more
            rows than ``send_index`` holds, indices past the local rows) as a
            device error flag (``gpusolver.check_errors()``); rows that do not
            fit are dropped, never written out of bounds. ``TorchGroup`` also
            raises ``ValueError`` on a fill past a capacity, from its host splits.
        out: receive into these buffers instead of new ones, one ``[recv_capacity, *f]``
            tensor per tensor (same dtype and trailing shape), written in place: only the
            call's rows change, so several calls can share one buffer at their own rows.
            ``TorchGroup`` needs them contiguous.
        recv_offset: ``[P]`` int64 device tensor, the row of each rank's buffer where the
            call's rows start (default 0): on rank r the rows from source s then start
            at ``recv_offset[r] + sum(split[:s, r])``.
        host_recv_offset: ``TorchGroup`` only: this rank's ``recv_offset`` entry as a host
            int, or an object whose ``get()`` gives it (read when the exchange starts);
            without it the entry is read from the device (a sync).

    Returns:
        One ``[recv_capacity, *f]`` buffer per tensor, same dtype (``out`` itself when
        given): on rank r the rows from source s start at row ``sum(split[:s, r])``
        (plus ``recv_offset[r]``), sources ascending; rows past the fill are zero in new
        buffers and untouched in ``out``. ``LocalGroup`` adds a leading rank dim to every
        per-rank tensor.
    """
    lead = _lead(group)
    P = group.size
    phase = check_phase(phase)
    tensors = check_tensors(tensors, "tensors", lead, P)
    split = check_split(split, P, tensors[0].device)
    send_index = check_send_index(send_index, lead, P, tensors[0].device)
    recv_capacity = check_capacity(recv_capacity)
    if out is not None:
        out = check_out(out, tensors, recv_capacity, lead)
    if recv_offset is not None:
        recv_offset = check_recv_offset(recv_offset, P, tensors[0].device)
    if flag_errors:
        _flag("group_cast", group, phase, split, send_index, tensors[0].shape[lead], recv_capacity, recv_offset)
    if out is None and recv_offset is None:
        work = group._cast(tensors, send_index, split, recv_capacity, phase, host_split)
    else:
        if out is None:  # new zero buffers, filled from the offset on
            out = [t.new_zeros(*t.shape[:lead], recv_capacity, *t.shape[lead + 1:]) for t in tensors]
        if recv_offset is None:  # from row 0 on every rank: a host 0 too, so TorchGroup reads nothing back
            recv_offset = torch.zeros(P, dtype=torch.int64, device=tensors[0].device)
            host_recv_offset = 0
        work = group._cast_into(tensors, send_index, split, out, recv_offset, phase, host_split, host_recv_offset)
    return work if async_op else work.wait()


def group_reduce(partials, send_index: torch.Tensor, split: torch.Tensor, acc, group, *, op: str,
                 phase: str = "reduce", host_split=None, deterministic: bool = True, async_op: bool = False,
                 flag_errors: bool = True, consume: bool = False, inplace: bool = False,
                 recv_capacity: int | None = None):
    """Send partial results back to the rows' hosts and reduce them there (reverse of ``group_cast``).

    Args:
        partials: list of ``[recv_capacity, *f]`` tensors in the receive layout
            a cast with the same routing produced.
        send_index, split: the routing of that cast.
        acc: list of ``[N, *f]`` host tensors, paired with ``partials``; row
            ``send_index[p]`` receives the partial of the row sent at position p
            (a row sent to several ranks gets several partials). An entry may be
            a broadcast view (``neutral_rows``): it is made whole only when the result
            is made (on ``wait()`` for an asynchronous reduce).
        op: ``"sum"`` (acc + partials; bf16/fp16 accumulate in fp32) or ``"lse"``
            (``partials = (out [.., h, D], lse [.., h] fp32)``, ``acc = (out, lse)``,
            merged with the log-sum-exp correction; a row whose every lse is
            -inf gives out 0 and lse -inf).
        deterministic: sum destination by destination, no float atomics
            (bit-identical across runs); False allows ``index_add_``. Both
            assume a row is sent to each destination at most once. On CUDA the
            merge runs in fused kernels (``groupcomm._merge``: fp32 in registers,
            only the outputs allocated), in the deterministic order either way.
        flag_errors: as in ``group_cast``.
        consume: hand ``partials`` and ``acc`` over (two lists, emptied here): the group then
            drops each tensor as soon as it has read it, so a caller that keeps no other
            reference has the partials freed once their rows have left (before the sums are
            made) and each acc once its copy in the sum dtype is made. Handed-over partials are
            the group's: the caller must not write them (nor their storage) after the call, so a
            group whose sends outlive ``wait()`` (``TorchGroup``'s p2p) sends them as they are
            instead of from a copy. With ``inplace`` only
            ``partials`` is handed over (emptied); ``acc`` is left as given, its tensors being
            the result.
        inplace: reduce straight into ``acc``: each acc tensor is updated in place and the
            result is those same tensors, so no host-sized result is made (nor merged again by
            the caller). Each acc must be a tensor of its own (no broadcast view such as
            ``neutral_rows``, no overlapping strides, no two overlapping) in the dtype the reduce
            accumulates in: fp32 out and lse for ``"lse"``, fp32 / fp64 for ``"sum"`` (a bf16 /
            fp16 acc is refused: its sums run in fp32). In deterministic mode (and always on the
            fused path) the bits are those of ``inplace=False`` with the same acc (the same terms
            added in the same order). When the write happens:
            ``LocalGroup`` and ``SymmMemGroup`` reduce when the call is made, ``TorchGroup`` in
            the first ``wait()`` of an asynchronous call. The reduce adds to acc as it stands
            then: what is written into acc in between (a later sub-stage merging into the same
            rows) is kept, and the returned rows are merged on top of it. That is exact for an
            associative reduce (a sum, the log-sum-exp merge) up to rounding, and the bits follow
            the program order, so each group is deterministic on its own.
        recv_capacity: the receive capacity of the cast whose rows return, when ``partials``
            hold fewer rows (default: the partials' rows). Only a group that sizes its moves from
            the host copy of the split (``TorchGroup``: it sends the rows this rank received,
            the first of its receive buffer) takes partials of just those rows, at least this
            rank's received rows; the others move whole buffers and refuse a ``recv_capacity``
            other than the partials' rows.

    Returns new tensors shaped and typed like ``acc`` (``acc`` is not modified), or with
    ``inplace`` the ``acc`` tensors themselves, updated.
    """
    lead = _lead(group)
    P = group.size
    phase = check_phase(phase)
    inplace = bool(inplace)
    given = (partials,) if inplace else (partials, acc)  # in place, acc's tensors are the result: kept
    if consume and not all(isinstance(x, list) for x in given):
        what = "partials as a list (it empties it)" if inplace else "partials and acc as lists (it empties them)"
        raise ValueError(f"group_reduce(consume=True) takes {what}, got {type(partials).__name__} and "
                         f"{type(acc).__name__}")
    partials = check_tensors(partials, "partials", lead, P)  # the call's own lists: the backends empty them
    acc = check_tensors(acc, "acc", lead, P)
    if consume:
        for x in given:
            x.clear()
    check_reduce(partials, acc, op, lead)
    capacity = _recv_capacity(recv_capacity, partials[0].shape[lead], group)
    if inplace:
        check_inplace(partials, acc, op, sum_dtype)
    split = check_split(split, P, acc[0].device)
    send_index = check_send_index(send_index, lead, P, acc[0].device)
    if flag_errors:
        _flag("group_reduce", group, phase, split, send_index, acc[0].shape[lead], capacity)
    extra = {} if capacity == partials[0].shape[lead] else {"recv_capacity": capacity}
    work = group._reduce(partials, send_index, split, acc, op, phase, host_split, bool(deterministic), inplace,
                         owned=bool(consume), **extra)
    return work if async_op else work.wait()


def _recv_capacity(recv_capacity, rows: int, group) -> int:
    """``group_reduce``'s receive capacity: the partials' rows, or ``recv_capacity`` where the group
    takes partials of only the rows received."""
    if recv_capacity is None:
        return rows
    if isinstance(recv_capacity, bool) or not isinstance(recv_capacity, int) or recv_capacity < rows:
        raise ValueError(f"group_reduce: recv_capacity must be an int >= the partials' {rows} rows, "
                         f"got {recv_capacity!r}")
    if recv_capacity != rows and not getattr(group, "sizes_from_host", False):
        raise ValueError(f"group_reduce: {type(group).__name__} moves whole receive buffers: partials must "
                         f"hold recv_capacity={recv_capacity} rows, got {rows}")
    return recv_capacity


def default_group(process_group=None):
    """``SymmMemGroup`` when CUDA and symmetric memory serve this group, else ``TorchGroup``.

    Symmetric memory needs an NCCL group whose ranks share one node (peer
    pointers over NVLink); the choice is logged once per call.
    """
    from ._a2av import TorchGroup
    from ._symm_mem import SymmMemGroup, symm_mem_usable

    usable, why = symm_mem_usable(process_group)
    group = SymmMemGroup(process_group) if usable else TorchGroup(process_group)
    log.info("groupcomm: using %s (%s)", type(group).__name__, why)
    return group


def as_group(group):
    """``group`` as a groupcomm group: ``LocalGroup`` / ``TorchGroup`` / ``SymmMemGroup`` pass
    through; a ``torch.distributed`` ``ProcessGroup`` is wrapped the way ``default_group`` does.

    Each call wraps anew (no cache: a wrapper kept here would hold the process group past
    ``destroy_process_group``); a module wraps once when it is built, so its counters persist."""
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return default_group(group)
    size = getattr(group, "size", None)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"group must be a groupcomm group (LocalGroup, TorchGroup, SymmMemGroup, "
                        f"groupcomm.default_group()) or a torch.distributed ProcessGroup, got {type(group).__name__}")
    return group
