"""The two entry points, ``group_cast`` and ``group_reduce``, and ``default_group``.

They check arguments once (host metadata only) and hand over to the group
object, which decides how rows move (see ``__init__`` for the backends).
"""
from __future__ import annotations

import logging
import weakref

import torch

from ._base import flag_routing
from ._checks import check_capacity, check_phase, check_reduce, check_send_index, check_split, check_tensors

log = logging.getLogger("groupcomm")


def _lead(group) -> int:
    return 1 if getattr(group, "batched", False) else 0


def _flag(op: str, group, phase: str, split, send_index, n_rows: int, capacity: int) -> None:
    batched = send_index.dim() == 2
    ranks = torch.arange(group.size, device=split.device) if batched else \
        torch.full((1,), group.rank, dtype=torch.int64, device=split.device)
    flag_routing(op, phase, split, send_index if batched else send_index[None], n_rows, capacity, ranks)


def group_cast(tensors, send_index: torch.Tensor, split: torch.Tensor, recv_capacity: int, group, *,
               phase: str = "cast", host_split=None, async_op: bool = False, flag_errors: bool = True):
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

    Returns:
        One ``[recv_capacity, *f]`` buffer per tensor, same dtype: on rank r the
        rows from source s start at row ``sum(split[:s, r])``, sources
        ascending; rows past the fill are zero. ``LocalGroup`` adds a leading
        rank dim to every per-rank tensor.
    """
    lead = _lead(group)
    P = group.size
    phase = check_phase(phase)
    tensors = check_tensors(tensors, "tensors", lead, P)
    split = check_split(split, P, tensors[0].device)
    send_index = check_send_index(send_index, lead, P, tensors[0].device)
    recv_capacity = check_capacity(recv_capacity)
    if flag_errors:
        _flag("group_cast", group, phase, split, send_index, tensors[0].shape[lead], recv_capacity)
    work = group._cast(tensors, send_index, split, recv_capacity, phase, host_split)
    return work if async_op else work.wait()


def group_reduce(partials, send_index: torch.Tensor, split: torch.Tensor, acc, group, *, op: str,
                 phase: str = "reduce", host_split=None, deterministic: bool = True, async_op: bool = False,
                 flag_errors: bool = True):
    """Send partial results back to the rows' hosts and reduce them there (reverse of ``group_cast``).

    Args:
        partials: list of ``[recv_capacity, *f]`` tensors in the receive layout
            a cast with the same routing produced.
        send_index, split: the routing of that cast.
        acc: list of ``[N, *f]`` host tensors, paired with ``partials``; row
            ``send_index[p]`` receives the partial of the row sent at position p
            (a row sent to several ranks gets several partials).
        op: ``"sum"`` (acc + partials; bf16/fp16 accumulate in fp32) or ``"lse"``
            (``partials = (out [.., h, D], lse [.., h] fp32)``, ``acc = (out, lse)``,
            merged with the log-sum-exp correction; a row whose every lse is
            -inf gives out 0 and lse -inf).
        deterministic: sum destination by destination, no float atomics
            (bit-identical across runs); False allows ``index_add_``. Both
            assume a row is sent to each destination at most once.
        flag_errors: as in ``group_cast``.

    Returns new tensors shaped and typed like ``acc`` (``acc`` is not modified).
    """
    lead = _lead(group)
    P = group.size
    phase = check_phase(phase)
    partials = check_tensors(partials, "partials", lead, P)
    acc = check_tensors(acc, "acc", lead, P)
    check_reduce(partials, acc, op, lead)
    split = check_split(split, P, acc[0].device)
    send_index = check_send_index(send_index, lead, P, acc[0].device)
    if flag_errors:
        _flag("group_reduce", group, phase, split, send_index, acc[0].shape[lead], partials[0].shape[lead])
    work = group._reduce(partials, send_index, split, acc, op, phase, host_split, bool(deterministic))
    return work if async_op else work.wait()


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




# one wrapper per process group (weak: a destroyed group takes its wrapper with it)
_wrapped: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def as_group(group):
    """``group`` as a groupcomm group: ``LocalGroup`` / ``TorchGroup`` / ``SymmMemGroup`` pass
    through; a ``torch.distributed`` ``ProcessGroup`` is wrapped the way ``default_group`` does
    (once per process group, so its byte counters persist across calls)."""
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        wrapped = _wrapped.get(group)
        if wrapped is None:
            wrapped = _wrapped[group] = default_group(group)
        return wrapped
    size = getattr(group, "size", None)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"group must be a groupcomm group (LocalGroup, TorchGroup, SymmMemGroup, "
                        f"groupcomm.default_group()) or a torch.distributed ProcessGroup, got {type(group).__name__}")
    return group
