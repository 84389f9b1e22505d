"""Send lists as gather indices: which local rows a rank sends, in send order (sync-free).

Its own module so that ``CommMeta`` (a dataclass in ``plan.meta``) and the
builders in ``plan.comm_meta`` / ``plan.sparse`` share it without importing
each other. See ``gpusolver.plan.meta`` for the group-major layout.
"""
from __future__ import annotations

import torch


def send_index(rng: torch.Tensor, chunk: int, send_capacity: int) -> torch.Tensor:
    """Gather indices into one source's group-major rows, in send order.

    rng: [G, n, P(dst), 2] int64 chunk-local ranges of the source's n tiles
         (or [G, P(dst), 2] without tiling).
    Returns [send_capacity] int64: segments ordered by (dst, g, tile), rows of
    segment (dst, g, tile) are ``g * c + lo + t``; -1 after the last row sent.
    """
    if rng.dim() == 3:
        rng = rng[:, None]
    G, n, P = rng.shape[0], rng.shape[1], rng.shape[2]
    S = P * G * n
    lo = rng[..., 0].permute(2, 0, 1).reshape(S)  # [(dst, g, tile)]
    length = (rng[..., 1] - rng[..., 0]).permute(2, 0, 1).reshape(S)
    ends = length.cumsum(dim=0)
    starts = ends - length
    pos = torch.arange(send_capacity, device=rng.device)
    seg = torch.searchsorted(ends, pos, right=True).clamp_(max=S - 1)  # segment holding pos
    g = seg // n % G
    idx = g * chunk + lo[seg] + pos - starts[seg]
    return torch.where(pos < ends[-1:], idx, -1)
