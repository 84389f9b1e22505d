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
    """Exclusive prefix sums over (host, g, tile) per destination.

    length: [G, U(unit), P(dest)] int64, unit u = tile u % n of host u // n.
    Returns (offset [G, U, P(dest)] int64, total [P(dest)] int64).
    """
    G, U, P = length.shape
    by_dest = length.view(G, P, tiles, P).permute(3, 1, 0, 2).reshape(P, U * G)  # [dest, (host, g, tile)]
    incl = by_dest.cumsum(dim=1)
    offset = (incl - by_dest).reshape(P, P, G, tiles).permute(2, 1, 3, 0).reshape(G, U, P).contiguous()
    return offset, incl[:, -1]


def chunk_local(rng: torch.Tensor, areas: BlockAreas) -> torch.Tensor:
    """Unit-local ranges [G, U, P, 2] -> rows of the host's chunk (tile u % n starts at
    (u % n) * unit tokens); empty ranges stay [0, 0)."""
    if areas.tiles == 1:
        return rng
    start = (torch.arange(areas.num_units, device=rng.device) % areas.tiles) * areas.chunk
    moved = rng[..., 1] > rng[..., 0]
    return torch.where(moved[..., None], rng + start.view(1, -1, 1, 1), 0)


def build_comm_meta(areas: BlockAreas, assignment: torch.Tensor, *,
                    buffers: BufferRows) -> tuple[CommMeta, torch.Tensor]:
    """CommMeta of an assignment, for all ranks, plus a buffer-overflow flag.

    areas:         BlockAreas (area [G, U, U], q_need / k_need [G, U, U, 2] int64; U = P
                   without tiling).
    assignment:    [G, U, U] integer, rank of task (g, i, j), -1 for empty tasks.
    buffers:       BufferRows, each rank's receive rows and send rows (the length of the
                   send lists) per kind, static.

    Returns (CommMeta, overflow [] bool): overflow is true when some rank
    receives or sends more rows of a kind than its buffer holds. Sync-free:
    static shapes, no host reads.
    """
    n, P = areas.tiles, areas.cp_size
    qo_range, kv_range = (chunk_local(r, areas) for r in transfer_ranges(areas, assignment))
    qo_len = qo_range[..., 1] - qo_range[..., 0]
    kv_len = kv_range[..., 1] - kv_range[..., 0]
    qo_off, qo_rows = _recv_offsets(qo_len, n)
    kv_off, kv_rows = _recv_offsets(kv_len, n)
    by_source = lambda length: length.sum(0).view(P, n, P).sum(1)  # noqa: E731
    qo_split, kv_split = by_source(qo_len), by_source(kv_len)
    overflow = ((qo_rows > buffers.qo_recv).any() | (kv_rows > buffers.kv_recv).any()
                | (qo_split.sum(1) > buffers.qo_send).any() | (kv_split.sum(1) > buffers.kv_send).any())
    meta = CommMeta(
        qo_range=qo_range, kv_range=kv_range, qo_recv_offset=qo_off, kv_recv_offset=kv_off,
        qo_split=qo_split, kv_split=kv_split,
        qo_recv_rows=qo_rows, kv_recv_rows=kv_rows, chunk=areas.rank_tokens, qo_recv_capacity=buffers.qo_recv,
        kv_recv_capacity=buffers.kv_recv, qo_send_capacity=buffers.qo_send, kv_send_capacity=buffers.kv_send,
        tiles=n)
    return meta, overflow
