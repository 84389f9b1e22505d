"""The "shed" start: each overloaded rank ships whole QO units, a few head groups at a time.

A rank far above the cap (a long document inside its chunk) must ship much of
its work. Shipping a unit costs its query rows, and the unit's keys on that
rank once per helper: a helper that takes several units of one head group
pays for those keys once. So the cheapest way to shed a large excess is a few
*pieces*, each the best few units of one head group, rather than one unit of
many groups, and single moves from owner-computes do not find it: the first
unit of a group to leave pays the keys alone, so it always looks dearer than
the first unit of another group (the mask where it matters: CHANGELOG.md,
"Design notes").

Per source rank s above the cap and head group g, s's units are ranked by
area per needed query row; a piece is a prefix of that ranking, priced as its
query rows plus the hull of the keys of s it needs (forward bytes). The start
takes m pieces of k1 units from the m cheapest groups (per byte of area) and
one more piece of k2 units from the next group, the cheapest choice of
(k1, m, k2) that covers the excess (all of s's work when nothing does). The
pieces then go to the ranks below the cap, largest piece first onto the
largest headroom, by next fit (the helpers' headrooms laid end to end, each
piece to the helper whose share holds the point where the piece starts), so
a helper may end over the cap by up to one piece; the moves balance from
there.

Whole-tensor torch ops over static shapes, no host reads: every path (torch,
triton, persistent) computes this start the same way, once per solve.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import _BIG, Tasks


def hull_length(lo: torch.Tensor, hi: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """Length of the hull of the valid [lo, hi) intervals along ``dim`` (0 where none is valid)."""
    lo = torch.where(valid, lo, _BIG).amin(dim)
    hi = torch.where(valid, hi, 0).amax(dim)
    return (hi - lo).clamp(min=0)


def shed_start(tasks: Tasks, cap: torch.Tensor) -> torch.Tensor:
    """[T] int64, the start rank of each task (see the module docstring); ``cap`` is the
    largest balanced load ([] int64)."""
    G, P, U, n, dev = tasks.G, tasks.P, tasks.U, tasks.tiles, tasks.area.device
    area = tasks.area.view(G, P, n, U)  # [g, s, unit of s, key unit]
    valid = tasks.valid.view(G, P, n, U)
    load = area.sum((0, 2, 3))  # [P] owner-computes loads
    excess = (load - cap).clamp(min=0)
    # units of each (g, s), best area per needed query row first
    unit_area = area.sum(3)  # [G, P, n]
    rows = hull_length(tasks.qlo.view(G, P, n, U), tasks.qhi.view(G, P, n, U), valid, 3)
    ratio = unit_area.double() / rows.clamp(min=1).double()
    rank_of = torch.sort(-ratio, dim=2, stable=True).indices  # [G, P, n] unit positions, best first
    piece_area = unit_area.gather(2, rank_of).cumsum(2)  # [G, P, k]: the first k + 1 units
    piece_rows = rows.gather(2, rank_of).cumsum(2)
    # keys of s the piece needs: per key unit of s, the hull over the piece's units' tasks
    own = lambda t: torch.diagonal(t.view(G, P, n, P, n), dim1=1, dim2=3).permute(0, 3, 1, 2)  # noqa: E731
    k_valid = own(tasks.valid)
    by_rank = rank_of[..., None].expand(G, P, n, n)
    klo = torch.where(k_valid, own(tasks.klo), _BIG).gather(2, by_rank)
    khi = torch.where(k_valid, own(tasks.khi), 0).gather(2, by_rank)
    key_rows = (khi.cummax(2).values - klo.cummin(2).values).clamp(min=0).sum(3)  # [G, P, k]
    piece_cost = piece_rows * tasks.q + key_rows * tasks.kv  # [G, P, k] forward bytes the source sends

    # choose (k1, m, k2) per source: m pieces of k1 units from the cheapest groups, one of k2 after
    order = torch.sort((piece_cost.double() / piece_area.clamp(min=1).double()), dim=0, stable=True).indices
    a1 = piece_area.gather(0, order)  # [G, P, n]: groups in each (s, k1)'s order
    c1 = piece_cost.gather(0, order)
    zero = torch.zeros((1, P, n), dtype=torch.int64, device=dev)
    cum_a, cum_c = torch.cat((zero, a1.cumsum(0))), torch.cat((zero, c1.cumsum(0)))  # [G+1, P, n]: m groups
    # the remainder group (the (m+1)-th of the order) with k2 units, k2 = 0 for none
    nxt = torch.cat((order, order[-1:]))  # [G+1, P, n] (m = G has no next group: k2 = 0 only)
    rem_a = piece_area.permute(1, 0, 2)[torch.arange(P, device=dev)[None, :, None], nxt]  # [G+1, P, n1, n2]
    rem_c = piece_cost.permute(1, 0, 2)[torch.arange(P, device=dev)[None, :, None], nxt]
    has_next = (torch.arange(G + 1, device=dev) < G).view(G + 1, 1, 1, 1)
    pad = torch.zeros((G + 1, P, n, 1), dtype=torch.int64, device=dev)
    rem_a = torch.cat((pad, torch.where(has_next, rem_a, 0)), 3)  # [G+1, P, n(k1), n+1(k2)]
    rem_c = torch.cat((pad, torch.where(has_next, rem_c, _BIG // 4)), 3)
    tot_a = cum_a[..., None] + rem_a
    tot_c = cum_c[..., None] + rem_c
    covers = tot_a >= excess.view(1, P, 1, 1)
    # cheapest cover, else the most area (ties: the first in (m, k1, k2) order)
    key = torch.where(covers, tot_c, _BIG // 2 + (tot_a.amax() - tot_a))
    pick = key.permute(1, 0, 2, 3).reshape(P, -1).argmin(1)  # [P]
    m, k1, k2 = pick // (n * (n + 1)), (pick // (n + 1)) % n, pick % (n + 1)

    # units each (g, s) ships: its group's place in the order decides the prefix length
    src = excess > 0
    order_s = order.gather(2, k1.view(1, P, 1).expand(G, P, 1))[..., 0]  # [G, P] groups in s's order
    place = torch.empty_like(order_s).scatter_(0, order_s, torch.arange(G, device=dev)[:, None].expand(G, P))
    count = torch.where(place < m, k1 + 1, torch.where(place == m, k2, 0))  # units shipped
    count = torch.where(src, count, 0)  # [G, P]
    shipped = torch.where(count > 0, piece_area.gather(2, (count - 1).clamp(min=0)[..., None])[..., 0], 0)

    # pieces onto the helpers by next fit: largest piece first, largest headroom first
    room = torch.where(src, 0, (cap - load).clamp(min=0))  # [P]
    by_room = torch.sort(-room, stable=True).indices
    fill = room[by_room].cumsum(0)
    flat = shipped.reshape(-1)
    by_size = torch.sort(-flat, stable=True).indices
    begins = flat[by_size].cumsum(0) - flat[by_size]
    slot = torch.searchsorted(fill, begins, right=True).clamp(max=P - 1)
    helper = torch.empty_like(flat).scatter_(0, by_size, by_room[slot]).view(G, P)

    # each task: on its piece's helper when its unit ships, else on its query host
    pos = torch.empty_like(rank_of).scatter_(2, rank_of, torch.arange(n, device=dev).expand(G, P, n))
    ships = pos < count[..., None]  # [G, P, n] by unit
    start = torch.where(ships, helper[..., None], torch.arange(P, device=dev).view(1, P, 1))
    return start[..., None].expand(G, P, n, U).reshape(-1)
