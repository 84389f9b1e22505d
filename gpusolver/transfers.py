"""What each plan moves: per (unit, destination) token ranges.

A rank that computes several tasks of one unit receives, once, the bounding
interval (hull) of what those tasks need. The collectives send exactly these
ranges, so the volumes that metrics report are the bytes that really move.
"""
from __future__ import annotations

import torch

from gpusolver.problem import BlockAreas


def transfer_ranges(areas: BlockAreas, assignment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ranges each unit sends to each destination rank.

    areas:      BlockAreas with area [G, U, U], q_need / k_need [G, U, U, 2] int64
                (U = P units without tiling, n * P with n tiles per chunk).
    assignment: [G, U, U] integer, the rank computing task (g, i, j); -1 for
                an empty task (area 0). Non-empty tasks must be assigned.

    Returns (qo_range, kv_range), each [G, U, P, 2] int64:
      qo_range[g, i, r] = [lo, hi) unit-local rows of query unit i that rank
      r receives for group g (hull of q_need over the tasks (g, i, *) on r);
      kv_range[g, j, r] likewise for key unit j over tasks (g, *, j) on r.
    Ranges of a unit to its own host (rank u // n), and of units a rank does
    not use, are [0, 0). Sync-free: static shapes, no host reads.
    """
    P = areas.cp_size
    ranks = torch.arange(P, device=assignment.device)
    host = areas.unit_host().view(-1, 1)
    # [G, U(i), U(j), P(r)]: task (g, i, j) runs on r and does real work
    on_rank = (assignment.long()[..., None] == ranks) & (areas.area[..., None] > 0)
    big = areas.chunk + 1

    def hull(need: torch.Tensor, reduce_dim: int) -> torch.Tensor:
        lo = torch.where(on_rank, need[..., 0, None], big).amin(dim=reduce_dim)
        hi = torch.where(on_rank, need[..., 1, None], 0).amax(dim=reduce_dim)
        keep = (hi > lo) & (host != ranks.view(1, P))  # nothing travels to its own host
        return torch.stack((torch.where(keep, lo, 0), torch.where(keep, hi, 0)), dim=-1)

    return hull(areas.q_need, 2), hull(areas.k_need, 1)
