"""CommMeta: ranges, offsets, split sizes and send gather lists (sync-free).

Shape legend: G head groups, P ranks, c tokens per chunk, send_cap rows.
See ``gpusolver.plan.meta`` for the group-major layout and buffer order.
"""
from __future__ import annotations

import torch

from gpusolver.plan.meta import CommMeta
from gpusolver.problem import BlockAreas
from gpusolver.transfers import transfer_ranges


def _recv_offsets(length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exclusive prefix sums over (host, g) per destination.

    length: [G, P(host), P(dest)] int64.
    Returns (offset [G, P(host), P(dest)] int64, total [P(dest)] int64).
    """
    G, P, _ = length.shape
    by_dest = length.permute(2, 1, 0).reshape(P, P * G)  # [dest, (host, g)]
    incl = by_dest.cumsum(dim=1)
    offset = (incl - by_dest).reshape(P, P, G).permute(2, 1, 0).contiguous()
    return offset, incl[:, -1]


def send_index(rng: torch.Tensor, chunk: int, send_capacity: int) -> torch.Tensor:
    """Gather indices into one source's group-major rows, in send order.

    rng: [G, P(dst), 2] int64 chunk-local ranges the source sends.
    Returns [send_capacity] int64: segments ordered by (dst, g), rows of
    segment (dst, g) are ``g * c + lo + t``; -1 after the last row sent.
    """
    G, P = rng.shape[0], rng.shape[1]
    lo = rng[..., 0].transpose(0, 1).reshape(P * G)  # [(dst, g)]
    length = (rng[..., 1] - rng[..., 0]).transpose(0, 1).reshape(P * G)
    ends = length.cumsum(dim=0)
    starts = ends - length
    pos = torch.arange(send_capacity, device=rng.device)
    seg = torch.searchsorted(ends, pos, right=True).clamp_(max=P * G - 1)  # segment holding pos
    g = seg % G
    idx = g * chunk + lo[seg] + pos - starts[seg]
    return torch.where(pos < ends[-1:], idx, -1)


def build_comm_meta(areas: BlockAreas, assignment: torch.Tensor, *,
                    recv_capacity: int, send_capacity: int) -> tuple[CommMeta, torch.Tensor]:
    """CommMeta of an assignment, for all ranks, plus a buffer-overflow flag.

    areas:         BlockAreas (area [G, P, P], q_need / k_need [G, P, P, 2] int64).
    assignment:    [G, P, P] integer, rank of task (g, i, j), -1 for empty tasks.
    recv_capacity: rows of each receive buffer (QO and KV alike), static.
    send_capacity: rows each rank can send per kind, static (length of the send lists).

    Returns (CommMeta, overflow [] bool): overflow is true when some rank
    receives more than ``recv_capacity`` or sends more than ``send_capacity``
    rows of either kind. Sync-free: static shapes, no host reads.
    """
    qo_range, kv_range = transfer_ranges(areas, assignment)
    qo_len = qo_range[..., 1] - qo_range[..., 0]
    kv_len = kv_range[..., 1] - kv_range[..., 0]
    qo_off, qo_rows = _recv_offsets(qo_len)
    kv_off, kv_rows = _recv_offsets(kv_len)
    qo_split, kv_split = qo_len.sum(0), kv_len.sum(0)
    overflow = ((qo_rows > recv_capacity).any() | (kv_rows > recv_capacity).any()
                | (qo_split.sum(1) > send_capacity).any() | (kv_split.sum(1) > send_capacity).any())
    meta = CommMeta(
        qo_range=qo_range, kv_range=kv_range, qo_recv_offset=qo_off, kv_recv_offset=kv_off,
        qo_split=qo_split, kv_split=kv_split,
        qo_recv_rows=qo_rows, kv_recv_rows=kv_rows, chunk=areas.chunk, recv_capacity=recv_capacity,
        send_capacity=send_capacity)
    return meta, overflow
