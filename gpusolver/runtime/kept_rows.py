"""A receive buffer kept in part: its first R rows held from the forward, the rest cast again.

The KV buffer (``SolverConfig.kept_kv_rows``: ``bwd.kv`` casts the rest) or the QO buffer
(``kept_q_rows``: Q of the rest travels again beside dO in ``bwd.qo``); the rule is the same.

Shape legend: n = G * c local group-major rows, cap = the plan's receive rows of the kind, R = the
kept rows (``0 <= R < cap``), ``[B, ...]`` the leading rank dim of a
``LocalGroup`` (``lead = 1``; absent for one rank).

The forward keeps rows ``[0, n + R)`` of the KV operands ``X = [local rows | receive buffer]``
(``keep_prefix``). The backward builds a fresh ``n + cap`` row operand (``whole_operands``): the
local rows, the kept buffer rows ``[0, R)``, and the rows past them cast again (``tail_cast``):
each forward cast restricted to the rows it put at ``>= R`` (``groupcomm.tail_routing``).

The rule needs no host read. With one remote stage the cast's rows start at row 0 of every
buffer, so its tail starts at its own row R. With S sub-stages cast s's rows start at row
``base[d] = kv_stage_base[s][d]`` of rank d's buffer (a device tensor): its tail starts at its own
row ``max(R - base[d], 0)`` and lands at buffer row ``max(base[d], R)``; a cast whose rows all lie
below R moves nothing. ``gpusolver.plan.schedule.op_pair_bytes`` prices the same tails.
"""
from __future__ import annotations

import torch

from gpusolver.runtime.operands import Operands, rows
from groupcomm import TorchGroup, Work, group_cast, host_splits, tail_routing

__all__ = ["keep_prefix", "whole_operands", "tail_cast", "with_tail"]


def keep_prefix(x: list[torch.Tensor], lead: int, n: int, kept_rows: int) -> tuple[torch.Tensor, ...]:
    """Copies of rows ``[0, n + kept_rows)`` of each operand in ``x`` (K, V: ``[B?, n + cap, h, D]``):
    what the forward keeps, so the operands themselves can go. An operand whose rows are all kept
    (a ``TorchGroup`` buffer at a fill within ``kept_rows``) is kept itself: a copy would hold the
    same rows twice until the operand goes."""
    return tuple(t if n + kept_rows >= t.shape[lead] else rows(t, lead, 0, n + kept_rows).clone() for t in x)


def whole_operands(kept, cap: int, lead: int, n: int, kept_rows: int) -> Operands:
    """The backward's KV operands ``[B?, n + cap, h, D]`` from the kept ``[B?, n + kept_rows, h, D]``
    ones: their local and kept rows copied in, the rest zero until ``tail_cast`` fills it."""
    ops = Operands([rows(t, lead, 0, n) for t in kept], cap, lead, zero=True)
    for x, t in zip(ops.x, kept):
        rows(x, lead, n, kept_rows).copy_(rows(t, lead, n, kept_rows))
    return ops


class _HostTailOffset:
    """``TorchGroup``: this rank's first row of a sub-stage's tail in the rows past the kept ones,
    ``max(base - kept_rows, 0)``, from the host ``base`` (``pipelined.RankFill`` of the casts before it) when the
    exchange starts."""

    def __init__(self, base, kept_rows: int):
        self.base, self.kept_rows = base, kept_rows

    def get(self) -> int:
        return max(self.base.get() - self.kept_rows, 0)


def tail_cast(tensors, send_index: torch.Tensor, split: torch.Tensor, kept_rows: int, out: list[torch.Tensor],
              group, *, phase: str, ranks: tuple[int, ...], batched: bool, base: torch.Tensor | None = None,
              host_base=None):
    """Start the cast ``(send_index, split)`` of ``tensors`` restricted to the receive rows ``>= kept_rows``
    of each rank's buffer, into ``out``: those rows of the buffers (``[B?, cap - kept_rows, h, D]`` each,
    row 0 is buffer row ``kept_rows``). Its Work.

    send_index: ``[send_cap]`` (``[P, send_cap]`` batched) int64; split: ``[P, P]`` int64.
    base: ``[P]`` int64, the buffer row where the cast's rows start on each rank (a sub-stage's
    ``CommMeta.stage_base``); None: row 0. host_base: ``TorchGroup``, with ``base``: an object whose
    ``get()`` is this rank's entry (read when the exchange starts, no sync).
    """
    index = send_index if batched else send_index[None]
    ranks_t = torch.tensor(ranks, dtype=torch.int64, device=index.device)
    if base is None:
        first, offset, host_offset = kept_rows, None, None
    else:  # per destination: the cast's own first tail row, and where the tail lands past the kept rows
        first = (kept_rows - base).clamp(min=0)
        offset = (base - kept_rows).clamp(min=0)
        host_offset = None if host_base is None else _HostTailOffset(host_base, kept_rows)
    split, index = tail_routing(split, index, ranks_t, first)
    index = index if batched else index[0]
    # TorchGroup: the tail's split is another host copy, made here (the layer's first ones were made ahead)
    host = host_splits(split) if isinstance(group, TorchGroup) else None
    lead = 1 if batched else 0
    return group_cast(list(tensors), index, split, out[0].shape[lead], group, phase=phase, host_split=host,
                      async_op=True, flag_errors=False, out=list(out), recv_offset=offset,
                      host_recv_offset=host_offset)


def with_tail(work: Work, tail: Work) -> Work:
    """One Work for a cast and the tail cast started beside it (dO and Q past the kept rows): its
    ``wait()`` waits for both, so a stage that needs the cast's rows has the tail's too."""
    return Work(lambda: work.wait() + tail.wait())
