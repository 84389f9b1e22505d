"""CommMeta: ranges, offsets, split sizes and send gather lists (sync-free).

Shape legend: G head groups, P ranks, c tokens per chunk, n sub-chunk tiles
per chunk, U = n * P units, send_cap rows. See ``gpusolver.plan.meta`` for the
group-major layout and buffer order.
"""
from __future__ import annotations

import torch

from gpusolver.capacity import BufferRows
from gpusolver.plan.gather import send_index  # noqa: F401  (callers import it from here too)
from gpusolver.plan.meta import CommMeta
from gpusolver.problem import BlockAreas
from gpusolver.transfers import transfer_ranges


def _recv_offsets(length: torch.Tensor, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exclusive prefix sums over (host, g, tile) per destination (and per leading stage).

    length: [*S, G, U(unit), P(dest)] int64, unit u = tile u % n of host u // n.
    Returns (offset [*S, G, U, P(dest)] int64, total [*S, P(dest)] int64).
    """
    *lead, G, U, P = length.shape
    k = len(lead)
    perm = tuple(range(k)) + tuple(k + d for d in (3, 1, 0, 2))
    # [.., dest, (host, g, tile)]
    by_dest = length.reshape(*lead, G, P, tiles, P).permute(perm).reshape(*lead, P, U * G)
    incl = by_dest.cumsum(dim=-1)
    back = tuple(range(k)) + tuple(k + d for d in (2, 1, 3, 0))
    offset = (incl - by_dest).reshape(*lead, P, P, G, tiles).permute(back).reshape(*lead, G, U, P).contiguous()
    return offset, incl[..., -1]


def transfer_stages(areas: BlockAreas, assignment: torch.Tensor, task_stage: torch.Tensor,
                    moved: torch.Tensor, kind: str) -> torch.Tensor:
    """``[G, U(unit), P(dest), 2]`` int64 (first, last) sub-stage using each transfer; 0 when nothing travels.

    The unit's rows travel in the cast of the first sub-stage on dest that uses them,
    and (QO out, dQ, dK / dV) return in the reduce after the last one.
    task_stage: [G, U, U] int32 (``gpusolver.plan.stages``); moved: [G, U, P] bool.
    """
    P = areas.cp_size
    ranks = torch.arange(P, device=assignment.device)
    on_rank = (assignment.long()[..., None] == ranks) & (areas.area[..., None] > 0)   # [G, U(i), U(j), P]
    st = task_stage.long()[..., None]
    dim = 2 if kind == "qo" else 1
    first = torch.where(on_rank, st, 1 << 30).amin(dim=dim)
    last = torch.where(on_rank, st, 0).amax(dim=dim)
    return torch.stack((torch.where(moved, first, 0), torch.where(moved, last, 0)), dim=-1)


def stage_routing(length: torch.Tensor, stage: torch.Tensor, num_stages: int,
                  tiles: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sub-stages of one kind: stage s's rows in (host, g, tile) order, and where they start when
    the stages are laid end to end in one buffer (stage s after stages 1..s-1).

    length: [G, U, P] int64 rows of each transfer; stage: [G, U, P] int64 in 1..S (0: none).
    Returns (offset [G, U, P] int64 of the transfer within its stage's rows, split [S, P(src), P(dst)],
    base [S, P(dst)] int64: the row where stage s's rows start on dest).
    """
    G, U, P = length.shape
    s = torch.arange(1, num_stages + 1, device=length.device).view(-1, 1, 1, 1)
    per = length[None] * (stage[None] == s)                                   # [S, G, U, P]
    offset, rows = _recv_offsets(per, tiles)
    pick = (stage - 1).clamp(min=0)[None]
    split = per.sum(1).view(num_stages, P, tiles, P).sum(2)
    return offset.gather(0, pick)[0], split, rows.cumsum(0) - rows


def shared_offset(offset: torch.Tensor, stage: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``[G, U, P]`` int64: a transfer's start in dest's one buffer shared by the sub-stages (its
    offset within its stage, ``stage_routing``, plus the stage's base row on dest)."""
    dest = torch.arange(base.shape[1], device=base.device)
    return offset + base[(stage - 1).clamp(min=0), dest]


def chunk_local(rng: torch.Tensor, areas: BlockAreas) -> torch.Tensor:
    """Unit-local ranges [G, U, P, 2] -> rows of the host's chunk (tile u % n starts at
    (u % n) * unit tokens); empty ranges stay [0, 0)."""
    if areas.tiles == 1:
        return rng
    start = (torch.arange(areas.num_units, device=rng.device) % areas.tiles) * areas.chunk
    moved = rng[..., 1] > rng[..., 0]
    return torch.where(moved[..., None], rng + start.view(1, -1, 1, 1), 0)


def build_comm_meta(areas: BlockAreas, assignment: torch.Tensor, *,
                    buffers: BufferRows, task_stage: torch.Tensor | None = None,
                    num_stages: int = 1) -> tuple[CommMeta, torch.Tensor]:
    """CommMeta of an assignment, for all ranks, plus a buffer-overflow flag.

    areas:         BlockAreas (area [G, U, U], q_need / k_need [G, U, U, 2] int64; U = P
                   without tiling).
    assignment:    [G, U, U] integer, rank of task (g, i, j), -1 for empty tasks.
    buffers:       BufferRows, each rank's receive rows (one QO and one KV buffer, shared by
                   the sub-stages) and send rows (the length of the send lists) per kind, static.
    task_stage:    [G, U, U] int32 sub-stage of each task (``gpusolver.plan.stages``);
                   required when ``num_stages > 1``.
    num_stages:    S, remote sub-stages (host int).

    Returns (CommMeta, overflow [] bool): overflow is true when some rank
    receives more rows of a kind (over all sub-stages) than its buffer holds, or sends
    more rows of a kind than its send list holds. Sync-free: static shapes, no host reads.
    """
    n, P = areas.tiles, areas.cp_size
    qo_range, kv_range = (chunk_local(r, areas) for r in transfer_ranges(areas, assignment))
    qo_len = qo_range[..., 1] - qo_range[..., 0]
    kv_len = kv_range[..., 1] - kv_range[..., 0]
    by_source = lambda length: length.sum(0).view(P, n, P).sum(1)  # noqa: E731
    qo_split, kv_split = by_source(qo_len), by_source(kv_len)
    qo_rows, kv_rows = qo_split.sum(0), kv_split.sum(0)
    if num_stages == 1:
        qo_off, _ = _recv_offsets(qo_len, n)
        kv_off, _ = _recv_offsets(kv_len, n)
        stage_kw = {}
    else:
        if task_stage is None:
            raise ValueError(f"num_stages={num_stages} needs the task_stage of the assignment")
        qo_st = transfer_stages(areas, assignment, task_stage, qo_len > 0, "qo")
        kv_st = transfer_stages(areas, assignment, task_stage, kv_len > 0, "kv")
        qo_off, qo_cast, qo_base = stage_routing(qo_len, qo_st[..., 0], num_stages, n)
        kv_off, kv_cast, kv_base = stage_routing(kv_len, kv_st[..., 0], num_stages, n)
        qo_off, kv_off = shared_offset(qo_off, qo_st[..., 0], qo_base), shared_offset(kv_off, kv_st[..., 0], kv_base)
        qo_ret_off, qo_ret, _ = stage_routing(qo_len, qo_st[..., 1], num_stages, n)
        kv_ret_off, kv_ret, _ = stage_routing(kv_len, kv_st[..., 1], num_stages, n)
        stage_kw = dict(num_stages=num_stages, qo_stage=qo_st, kv_stage=kv_st, qo_stage_split=qo_cast,
                        kv_stage_split=kv_cast, qo_return_split=qo_ret, kv_return_split=kv_ret,
                        qo_return_offset=qo_ret_off, kv_return_offset=kv_ret_off, qo_stage_base=qo_base,
                        kv_stage_base=kv_base)
    # the sub-stages share one receive buffer per kind: a rank's whole fill must fit, as with one stage
    overflow = ((qo_rows > buffers.qo_recv).any() | (kv_rows > buffers.kv_recv).any()
                | (qo_split.sum(1) > buffers.qo_send).any() | (kv_split.sum(1) > buffers.kv_send).any())
    meta = CommMeta(
        qo_range=qo_range, kv_range=kv_range, qo_recv_offset=qo_off, kv_recv_offset=kv_off,
        qo_split=qo_split, kv_split=kv_split,
        qo_recv_rows=qo_rows, kv_recv_rows=kv_rows, chunk=areas.rank_tokens, qo_recv_capacity=buffers.qo_recv,
        kv_recv_capacity=buffers.kv_recv, qo_send_capacity=buffers.qo_send, kv_send_capacity=buffers.kv_send,
        tiles=n, **stage_kw)
    return meta, overflow

