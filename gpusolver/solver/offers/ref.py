"""Torch twin of the offers step: each source's offered QO units and its destination window.

``offers(tasks, st, cap, ...)`` is the reference the Triton ``offers_triton``
(kernel.py) equals entry for entry.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import State, Tasks


def offers(tasks: Tasks, st: State, cap, units_per_rank: int, n_dests: int, dests_per_variant=None):
    """Each source's offered QO units and its destination window.

    ``cap``: 0-dim or [B, 1], the largest load a destination may take.
    Returns (unit [B, P, K] heaviest units on each source, headroom [B, P]
    = cap - load, dests [B, P, D]: a window of the ranks with most headroom;
    the e-th most loaded source starts its window e*D_b/2 places down the list,
    so sources spread over the light ranks). ``dests_per_variant`` [B] int64
    (each <= D) narrows variant b's window to D_b ranks; its other slots
    repeat the first, which prices the same move twice and changes nothing.
    """
    G, P = tasks.G, tasks.P
    B, dev = st.rank.shape[0], st.rank.device
    K, D = min(units_per_rank, G * tasks.U), min(n_dests, P)
    ranks = torch.arange(P, device=dev)
    ua = torch.zeros((B, G * tasks.U * (P + 1)), dtype=torch.int64, device=dev)
    ua = ua.scatter_add(1, tasks.qo_unit * (P + 1) + st.rank, tasks.area.expand(B, -1))
    ua = ua.view(B, G * tasks.U, P + 1)[..., :P].transpose(1, 2)  # [B, P(s), G*U]
    # heaviest first, ties by unit index: a top-k over keys made unique by the index (topk's
    # own tie order is unspecified), much faster than a stable sort; a unit's area is at most
    # U * chunk^2, so the keys fit in int64 unless the chunks are huge
    GU = G * tasks.U
    if tasks.U * tasks.chunk ** 2 * GU < 1 << 62:
        rev = GU - 1 - torch.arange(GU, device=dev)
        unit = GU - 1 - (ua * GU + rev).topk(K, dim=2).values % GU  # [B, P, K]
    else:
        unit = torch.sort(-ua, dim=2, stable=True).indices[..., :K].contiguous()
    headroom = cap - st.load  # [B, P]
    by_room = torch.sort(-headroom, dim=1, stable=True).indices  # [B, P]
    n_light = (headroom > 0).sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    e = torch.empty_like(by_room).scatter_(1, torch.sort(-st.load, dim=1, stable=True).indices,
                                            ranks.expand(B, -1))  # load rank of each source
    slot = torch.arange(D, device=dev)
    width = torch.full((B, 1, 1), D, dtype=torch.int64, device=dev) if dests_per_variant is None \
        else dests_per_variant.view(B, 1, 1)
    window = ((e[..., None] * width) // 2) + torch.where(slot < width, slot, 0)  # [B, P, D]
    dests = by_room.gather(1, (window % n_light[..., None]).view(B, -1)).view(B, P, D)
    return unit, headroom, dests

