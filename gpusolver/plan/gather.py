"""Send lists as gather indices: which local rows a rank sends, in send order (sync-free).

Its own module so that ``CommMeta`` (a dataclass in ``plan.meta``) and the
builders in ``plan.comm_meta`` / ``plan.sparse`` share it without importing
each other. See ``gpusolver.plan.meta`` for the group-major layout.
"""
from __future__ import annotations

import torch


def send_index(rng: torch.Tensor, chunk: int, send_capacity: int) -> torch.Tensor:
    """Gather indices into one source's group-major rows, in send order.

    rng: [..., G, n, P(dst), 2] int64 chunk-local ranges of the source's n tiles
         (or [G, P(dst), 2] without tiling); leading dims are independent send lists
         (sources, stages), all built by the same few ops.
    Returns [..., send_capacity] int64: segments ordered by (dst, g, tile), rows of
    segment (dst, g, tile) are ``g * c + lo + t``; -1 after the last row sent.
    """
    if rng.dim() == 3:
        rng = rng[:, None]
    lead = rng.shape[:-4]
    G, n, P = rng.shape[-4], rng.shape[-3], rng.shape[-2]
    S = P * G * n
    rng = rng.reshape(-1, G, n, P, 2)
    B = rng.shape[0]
    lo = rng[..., 0].permute(0, 3, 1, 2).reshape(B, S)  # [b, (dst, g, tile)]
    length = (rng[..., 1] - rng[..., 0]).permute(0, 3, 1, 2).reshape(B, S)
    ends = length.cumsum(dim=1)
    starts = ends - length
    pos = torch.arange(send_capacity, device=rng.device).expand(B, send_capacity).contiguous()
    seg = torch.searchsorted(ends, pos, right=True).clamp_(max=S - 1)  # segment holding pos
    # g * chunk + lo + (pos - start) of the segment, in place: a list is S x a capacity of int64
    # (tens of MB at real shapes), so the few full-size temporaries are what its build costs
    idx = seg.div(n, rounding_mode="floor").remainder_(G).mul_(chunk)
    idx.add_(lo.gather(1, seg)).add_(pos).sub_(starts.gather(1, seg))
    return idx.masked_fill_(pos >= ends[:, -1:], -1).reshape(*lead, send_capacity)


def return_gather(comm, kind: str, rank: int, cap: int | None = None) -> torch.Tensor:
    """``[S, cap]`` int64 rows of ``rank``'s receive buffer of ``kind`` (shared by the sub-stages, cap
    that kind's receive rows, or the first ``cap`` positions) that make reduce s's buffer, in its
    (host, g, tile) order; -1 past the fill."""
    G, U, P = comm.qo_recv_offset.shape
    n, S = comm.tiles, comm.num_stages
    cap = comm.buffers.recv(kind) if cap is None else cap
    rng = (comm.qo_range if kind == "qo" else comm.kv_range)[:, :, rank]            # [G, U, 2]
    stage = (comm.qo_stage if kind == "qo" else comm.kv_stage)[:, :, rank]         # [G, U, 2]
    cast_off = (comm.qo_recv_offset if kind == "qo" else comm.kv_recv_offset)[:, :, rank]
    order = lambda x: x.reshape(G, P, n).permute(1, 0, 2).reshape(-1)  # noqa: E731  (host, g, tile)
    length = order(rng[..., 1] - rng[..., 0])
    base = order(cast_off)
    last = order(stage[..., 1])
    s = torch.arange(1, S + 1, device=length.device)[:, None]
    per = length[None] * (last[None] == s)                                          # [S, M]
    ends = per.cumsum(dim=1)
    starts = ends - per
    pos = torch.arange(cap, device=length.device).expand(S, cap).contiguous()
    seg = torch.searchsorted(ends, pos, right=True).clamp_(max=length.numel() - 1)
    idx = base[seg].add_(pos).sub_(starts.gather(1, seg))  # in place, as send_index
    return idx.masked_fill_(pos >= ends[:, -1:], -1)
