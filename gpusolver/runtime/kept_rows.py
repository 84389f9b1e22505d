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

Kept per rank (``SolverConfig.kept_per_rank``, ``KeptRoom``): one room of ``units`` rows of a K
row's size (``hkv * D`` elements; a Q row is ``g = hq / hkv`` of them, a K, V row 2), which rank r
splits by its own fills (``problem.split_kept_room``): its first ``kq[r]`` Q rows from the room's
front, then its first ``kk[r]`` K rows and ``kk[r]`` V rows. Every rank computes every rank's
``kq``, ``kk`` from the plan's fills (``CommMeta.qo_recv_rows``, ``kv_recv_rows``), so the tails
take them as ``[P]`` first rows, with no host read; the room's shape is static, and it is written
(``pack_room``) and read back (``unpack_room``) with index ops at per-rank offsets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpusolver.problem import room_size, split_kept_room
from gpusolver.runtime.operands import WINDOW_MIN_ELEMENTS, Operands, row_windows, rows
from groupcomm import TorchGroup, Work, group_cast, host_splits, tail_routing

__all__ = ["keep_prefix", "whole_operands", "tail_cast", "with_tail", "KeptRoom", "kept_room", "pack_room",
           "unpack_room"]


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
    """``TorchGroup``: the buffer row where this rank's tail of a cast lands, ``max(base, kept)``,
    from the host ``base`` (``pipelined.RankFill`` of the casts before it, or None: row 0) and
    ``kept`` (an int, or an object whose ``get()`` is this rank's kept rows) when the exchange starts,
    at most the buffer's ``rows`` (a buffer at this rank's fill may hold fewer rows than are kept:
    then its tail is empty)."""

    def __init__(self, base, kept, rows: int):
        self.base, self.kept, self.rows = base, kept, rows

    def get(self) -> int:
        kept = self.kept.get() if hasattr(self.kept, "get") else int(self.kept)
        return min(max(0 if self.base is None else self.base.get(), kept), self.rows)


def tail_cast(tensors, send_index: torch.Tensor, split: torch.Tensor, kept_rows, out: list[torch.Tensor],
              group, *, phase: str, ranks: tuple[int, ...], batched: bool, base: torch.Tensor | None = None,
              host_base=None, host_kept=None):
    """Start the cast ``(send_index, split)`` of ``tensors`` restricted to the receive rows ``>= kept_rows``
    of each rank's buffer, into ``out``: the whole buffers (``[B?, cap, h, D]`` each), whose rows below
    the kept ones it leaves as they are. Its Work.

    send_index: ``[send_cap]`` (``[P, send_cap]`` batched) int64; split: ``[P, P]`` int64.
    kept_rows: an int (every rank's) or ``[P]`` int64 (each rank's, ``KeptRoom``).
    base: ``[P]`` int64, the buffer row where the cast's rows start on each rank (a sub-stage's
    ``CommMeta.stage_base``); None: row 0. host_base: ``TorchGroup``, with ``base``: an object whose
    ``get()`` is this rank's entry (read when the exchange starts, no sync). host_kept:
    ``TorchGroup`` with ``[P]`` kept rows: likewise this rank's entry of them.
    """
    index = send_index if batched else send_index[None]
    device = index.device
    ranks_t = torch.tensor(ranks, dtype=torch.int64, device=device)
    P = split.shape[0]
    kept = kept_rows if isinstance(kept_rows, torch.Tensor) else torch.full((P,), kept_rows, dtype=torch.int64,
                                                                            device=device)
    start = torch.zeros(P, dtype=torch.int64, device=device) if base is None else base
    # per destination: the cast's own first tail row, and the buffer row where the tail lands
    first, offset = (kept - start).clamp(min=0), torch.maximum(start, kept)
    split, index = tail_routing(split, index, ranks_t, first)
    index = index if batched else index[0]
    host_offset = None
    lead = 1 if batched else 0
    if isinstance(group, TorchGroup):
        if isinstance(kept_rows, torch.Tensor) and host_kept is None:
            raise ValueError("tail_cast on TorchGroup with per-rank kept_rows needs host_kept (this rank's, "
                             "from the host splits): reading the device tensor would sync")
        host_offset = _HostTailOffset(host_base, kept_rows if host_kept is None else host_kept, out[0].shape[lead])
    # TorchGroup: the tail's split is another host copy, made here (the layer's first ones were made ahead)
    host = host_splits(split) if isinstance(group, TorchGroup) else None
    return group_cast(list(tensors), index, split, out[0].shape[lead], group, phase=phase, host_split=host,
                      async_op=True, flag_errors=False, out=list(out), recv_offset=offset,
                      host_recv_offset=host_offset)


@dataclass(frozen=True)
class KeptRoom:
    """What each rank keeps of its receive buffers with ``kept_per_rank``: a room of ``units`` rows of
    ``hkv * D`` elements, Q rows ``g`` units each, K, V rows 2 (module docstring).

    kept_q, kept_kv: ``[P]`` int64, every rank's kept Q and K, V rows. host: ``TorchGroup``: an
    object whose ``get(kind)`` is this rank's kept rows of ``kind`` ("qo", "kv"), from the host
    copy of the splits its casts read (no sync); else None.
    """

    units: int
    g: int
    kept_q: torch.Tensor
    kept_kv: torch.Tensor
    host: object = None

    def kept(self, kind: str) -> torch.Tensor:
        return self.kept_q if kind == "qo" else self.kept_kv

    def host_kept(self, kind: str):
        """``tail_cast``'s ``host_kept`` for ``kind``: None off ``TorchGroup``."""
        return None if self.host is None else _HostKind(self.host, kind)

    def units_here(self) -> int:
        """The room's rows on this rank: ``units`` on a static-shape group; on ``TorchGroup`` the
        units its own kept rows take (``kq * g + 2 * kk``, host ints), as its buffers hold its fill."""
        if self.host is None:
            return self.units
        return self.host.get("qo") * self.g + 2 * self.host.get("kv")


class _HostKept:
    """``TorchGroup``: this rank's kept rows per kind from its host fills (``pipelined.RankFill``)."""

    def __init__(self, fill_q, fill_kv, units: int, g: int):
        self.fill_q, self.fill_kv, self.units, self.g = fill_q, fill_kv, units, g

    def get(self, kind: str) -> int:
        kept_q, kept_kv = split_kept_room(self.fill_q.get(), self.fill_kv.get(), self.units, self.g, 2)
        return kept_q if kind == "qo" else kept_kv


class _HostKind:
    def __init__(self, host: _HostKept, kind: str):
        self.host, self.kind = host, kind

    def get(self) -> int:
        return self.host.get(self.kind)


def kept_room(comm, q_rows: int, kv_rows: int, g: int, host_fill=None) -> KeptRoom:
    """The ``KeptRoom`` of a plan's ``comm`` (``CommMeta``) keeping ``q_rows`` Q rows' and ``kv_rows``
    K, V rows' bytes (each at most its buffer), ``g = Hq / Hkv``. host_fill: ``TorchGroup``: this
    rank's (QO, KV) fills, objects with ``get()`` (``pipelined.RankFill``)."""
    units = room_size(q_rows, kv_rows, g, 2, comm.qo_recv_capacity, comm.kv_recv_capacity)
    kept_q, kept_kv = split_kept_room(comm.qo_recv_rows.long(), comm.kv_recv_rows.long(), units, g, 2)
    host = None if host_fill is None else _HostKept(host_fill[0], host_fill[1], units, g)
    return KeptRoom(units, g, kept_q, kept_kv, host)


ROOM_WINDOWS = 4  # the room is packed and unpacked in at most this many unit windows


def _windows(total: int, units: torch.Tensor):
    """``operands.row_windows`` over ``total`` units of ``units`` (``[B, rows, h, D]``): a gather's
    temporary is a window of units, never the whole room beside the room."""
    return row_windows(total, units.shape[0] * math.prod(units.shape[2:]), ROOM_WINDOWS, WINDOW_MIN_ELEMENTS)


def _gather_units(src: torch.Tensor, src_rows: int, src_first: int, out_rows: int, shift: torch.Tensor,
                  lo: torch.Tensor, hi: torch.Tensor, start: int = 0) -> torch.Tensor | None:
    """``[B, out_rows, h, D]``: row i of batch b is ``src[b, src_first + u + shift[b]]`` of unit
    ``u = start + i`` where ``lo[b] <= u < hi[b]``, else zero. src: ``[B, src_rows, h, D]`` contiguous;
    shift, lo, hi: ``[B]``. None when ``src`` has no rows past ``src_first`` (nothing to read)."""
    B, avail = src.shape[0], src_rows - src_first
    if avail <= 0 or out_rows == 0:
        return None
    u = torch.arange(start, start + out_rows, device=src.device)
    rel = (u[None] + shift[:, None]).clamp(0, avail - 1)
    idx = (torch.arange(B, device=src.device)[:, None] * src_rows + src_first + rel).reshape(-1)
    got = src.reshape(B * src_rows, *src.shape[2:]).index_select(0, idx).view(B, out_rows, *src.shape[2:])
    ok = (u[None] >= lo[:, None]) & (u[None] < hi[:, None])
    return got.masked_fill_(~ok[:, :, None, None], 0)


def _as_units(x: torch.Tensor, lead: int, g: int) -> torch.Tensor:
    """``[B, rows * g, h / g, D]`` view of ``[B?, rows, h, D]`` (a Q row as ``g`` K-row-sized units)."""
    x = x if lead else x.unsqueeze(0)
    return x.view(x.shape[0], x.shape[1] * g, x.shape[2] // g, x.shape[3])  # a view: the caller may write it


def pack_room(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, room: KeptRoom, ranks: tuple[int, ...],
              n: int, lead: int) -> torch.Tensor:
    """The room ``[B?, units, hkv, D]`` from the forward's operands ``X = [local rows | buffer]``
    (``[B?, n + cap, h, D]``): of each rank its first ``kq`` Q rows then its first ``kk`` K and ``kk``
    V rows, zero past them."""
    idx = torch.tensor(ranks, dtype=torch.int64, device=room.kept_q.device)
    kq, kk = room.kept_q.index_select(0, idx) * room.g, room.kept_kv.index_select(0, idx)
    q_units, k_rows, v_rows = _as_units(xq.contiguous(), lead, room.g), _as_units(xk.contiguous(), lead, 1), \
        _as_units(xv.contiguous(), lead, 1)
    units = room.units_here()
    pool = k_rows.new_zeros(k_rows.shape[0], units, *k_rows.shape[2:])
    zero = torch.zeros_like(kq)
    for src, first, shift, lo, hi in ((q_units, n * room.g, zero, zero, kq),
                                      (k_rows, n, -kq, kq, kq + kk),
                                      (v_rows, n, -(kq + kk), kq + kk, kq + 2 * kk)):
        for start, width in _windows(units, src):
            got = _gather_units(src, src.shape[1], first, width, shift, lo, hi, start)
            if got is not None:  # the kinds' unit ranges are disjoint and zero elsewhere: added, each lands
                pool.narrow(1, start, width).add_(got)
            del got
    return pool if lead else pool[0]


def unpack_room(pool: torch.Tensor, ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, room: KeptRoom,
                ranks: tuple[int, ...], cap_q: int, cap_k: int, lead: int) -> tuple[Operands, Operands]:
    """The backward's whole operands ``Xq = [ql | QO buffer]`` and ``Xk, Xv`` from the local rows and
    the room (``pack_room``): each rank's kept rows in place, zero past them until ``tail_cast`` lands
    the rest."""
    idx = torch.tensor(ranks, dtype=torch.int64, device=room.kept_q.device)
    kq, kk = room.kept_q.index_select(0, idx) * room.g, room.kept_kv.index_select(0, idx)
    n = ql.shape[lead]
    Xq = Operands([ql], cap_q, lead, zero=True)
    Xkv = Operands([kl, vl], cap_k, lead, zero=True)
    units = pool if lead else pool.unsqueeze(0)
    here = units.shape[1]  # the room's units (on TorchGroup this rank's own)
    zero = torch.zeros_like(kq)
    for x, rows_, shift, hi, per in ((Xq.x[0], min(cap_q * room.g, here), zero, kq, room.g),
                                     (Xkv.x[0], min(cap_k, here), kq, kk, 1),
                                     (Xkv.x[1], min(cap_k, here), kq + kk, kk, 1)):
        dest = _as_units(rows(x, lead, n, x.shape[lead] - n), lead, per)
        for start, width in _windows(rows_, units):
            got = _gather_units(units, here, 0, width, shift, zero, hi, start)
            if got is not None:
                dest.narrow(1, start, width).copy_(got)
            del got
    return Xq, Xkv


def with_tail(work: Work, tail: Work) -> Work:
    """One Work for a cast and the tail cast started beside it (dO and Q past the kept rows): its
    ``wait()`` waits for both, so a stage that needs the cast's rows has the tail's too."""
    return Work(lambda: work.wait() + tail.wait())
