"""The device solver: parallel scored moves from owner-computes.

Every operation is a whole-tensor op over static shapes and the loop runs a
fixed number of rounds, so the solve runs on any device without host reads
(it runs on ``device="meta"``) and can be captured in a CUDA graph.

The algorithm (DESIGN.md, "The solver", family 2):

* Start from owner-computes: every task on its query host (no Q/O traffic,
  usually unbalanced). With sub-chunk tiles (``chunk_tiles`` n > 1, units of
  c / n tokens, unit u on rank u // n) start instead from the plan solved for
  whole chunks: tile moves then refine it (coarse to fine).
* Every round, each source rank offers its heaviest QO units; a *bundle
  move* ships a prefix of one unit's tasks (in one of three task orders:
  largest first, fewest needed query rows first, or smallest first) to one
  destination: as much as fits the destination's headroom, so the unit's rows
  travel once for as much work as possible. Its exact marginal cost, in bytes
  at each rank it touches (query host, source, destination, key hosts), is
  what it adds to the destination's hulls of the unit's rows and of each
  task's key columns, and what it frees at the source.
* **Balance phase** (some rank above ``mu x mean``): moves off overloaded
  ranks, scored by added bytes per unit of area, every touched rank under the
  variant's threshold. A variant stuck with no move may, for one round, fill
  destinations to just below its maximum load (chains instead of swaps).
* **Bottleneck phase** (balanced): moves that lower the bottleneck rank's
  volume without pushing any touched rank to the bottleneck.
* Selection by segmented arg-mins and prefix sums: each offered unit picks its
  best (destination, size); each destination accepts proposals in score order
  while its load and volume fit; each source stops once its excess is covered.
* Local search below P = 32: sideways bottleneck-phase moves (the bottleneck
  stays, every touched rank stays below it, the total bytes fall), and at
  rounds 8 and 16 a restart from the best state with the bottleneck rank's
  moves undone. Below P = 8 the balance phase may also ship a unit's first
  task alone.
* A portfolio of strategies (search width, task order, threshold) runs as
  variants side by side; each keeps its best state over the rounds (balanced
  first, then the lowest forward bottleneck) and the best variant wins.

All volumes are forward bytes in int64; ties break by index, so the result
is bit-identical on every rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from gpusolver.config import SolverConfig
from gpusolver.limits import balanced_load_cap, check_problem_limits
from gpusolver.problem import BlockAreas

# Rounds of moves; measured quality stops changing after about 20.
DEFAULT_ROUNDS = 24
# Below LARGE_P ranks the bottleneck phase also takes sideways moves, and every
# RESTART_EVERY rounds (8 and 16 of 24) each variant restarts from its best
# state with its bottleneck rank's moves undone. Measured on the benchmark
# masks (seeds 0-5): both lower the P = 8 and 16 medians and raise none; at
# P = 64 they cost quality (balancing still runs past round 8 there).
RESTART_EVERY = 8
# Below SINGLES_P ranks the balance phase may also ship a unit's first task alone (without it,
# only the prefix that covers the source's excess). Measured on the grid of
# benchmarks/solver_sweep.py (48 masks per P), masks above the reference's bytes with / without:
# P = 2: 0 / 1, P = 4: 3 / 9, P = 6: 6 / 8, but P = 8: 4 / 2; on the quality benchmark's masks
# it raised one P = 32 and one P = 64 mask by 11-15 %.
SINGLES_P = 8
# The torch path runs the whole portfolio as one batch below this many ranks (measured side
# by side: 2.5x faster at P = 8, 1.1-1.3x with tiles there; the same at P = 16, slower at 32).
TORCH_BATCH_RANKS = 16
# mu is compared in integer arithmetic with this many parts per unit.
_MU_SCALE = 1 << 20
_BIG = 1 << 60
# Unit-local token positions stay below this, so the torch proposals price the [.., D, U]
# key hulls in int32 (half the memory traffic of int64), with it as the empty-hull bound.
_TOKEN_LIMIT = 1 << 30
# A bundle's key-hull growth is at most one unit per task, so the whole sequence (U units)
# bounds its running sum: below this, that sum is int32 too.
_SEQUENCE_LIMIT = 1 << 31


@dataclass(frozen=True)
class DeviceSolveResult:
    """assignment: [G, U, U] int32 (-1 empty task; U = P untiled); balanced: 0-dim bool;
    fwd_bottleneck: 0-dim int64 bytes of the chosen state; variant: 0-dim int64."""

    assignment: torch.Tensor
    balanced: torch.Tensor
    fwd_bottleneck: torch.Tensor
    variant: torch.Tensor


class _Tasks:
    """Flat task arrays [T], T = G * U * U, in (g, i, j) order, plus static tables.

    U = n * P units per group (n sub-chunk tiles per rank); unit u lives on rank u // n.
    """

    def __init__(self, areas: BlockAreas, config: SolverConfig):
        G, P, U, n = areas.head_groups, areas.cp_size, areas.num_units, areas.tiles
        check_problem_limits(areas.chunk * U, P, G, n)
        # within MAX_SEQLEN every token position stays below _TOKEN_LIMIT and every bundle sum
        # below _SEQUENCE_LIMIT, so the int32 fast paths hold
        dev = areas.area.device
        self.G, self.P, self.U, self.T = G, P, U, G * U * U
        idx = torch.arange(self.T, device=dev)
        self.g = idx // (U * U)
        self.i = (idx // U) % U
        self.j = idx % U
        self.area = areas.area.reshape(-1)
        self.valid = self.area > 0
        self.qlo, self.qhi = areas.q_need.reshape(-1, 2).unbind(-1)
        self.klo, self.khi = areas.k_need.reshape(-1, 2).unbind(-1)
        self.qo_unit = self.g * U + self.i  # [T] index of QO unit (g, i)
        self.kv_unit = self.g * U + self.j  # [T] index of KV unit (g, j)
        # rank holding each task's query unit and its key unit [T] (untiled: the unit index itself)
        self.q_host, self.k_host = (self.i, self.j) if n == 1 else (self.i // n, self.j // n)
        self.tiles = n
        self.chunk = areas.chunk  # tokens per unit
        cost = config.cost()
        self.q, self.o, self.kv = cost.q_fwd, cost.o_fwd, cost.kv_fwd
        # the tasks of each QO unit in the orders a bundle may take them (TASK_ORDERS):
        # [3, G*U, U] task ids; "area": largest first; "rows": fewest needed query rows first
        # (then largest), so the rows a bundle ships grow as slowly as possible; "small":
        # smallest first, so a small excess is covered by the smallest task that covers it
        area = areas.area.reshape(G * U, U)
        q_len = (areas.q_need[..., 1] - areas.q_need[..., 0]).reshape(G * U, U)
        by_area = torch.sort(-area, dim=1, stable=True).indices
        # two stable sorts, not one product key: q_len * max area passes 2^63 on long sequences
        by_rows = by_area.gather(1, torch.sort(q_len.gather(1, by_area), dim=1, stable=True).indices)
        by_small = torch.sort(torch.where(area > 0, area, _BIG), dim=1, stable=True).indices  # empty last
        self.unit_tasks = torch.arange(G * U, device=dev)[:, None] * U + torch.stack((by_area, by_rows, by_small))

    @functools.cached_property
    def unit_pos(self) -> torch.Tensor:
        """[2, G*U, U] position of key unit j in each QO unit's task order (``unit_tasks``
        inverted); built on first use (the torch proposals read it, the kernels do not)."""
        pos = torch.empty_like(self.unit_tasks)
        return pos.scatter_(2, self.unit_tasks % self.U, torch.arange(self.U, device=pos.device).expand_as(pos))

    @functools.cached_property
    def unit_host(self) -> torch.Tensor:
        """[G*U] rank holding each QO / KV unit index g*U + u; built on first use (the kernels
        compute it in place, so their paths launch nothing for it)."""
        host = torch.arange(self.G * self.U, device=self.area.device) % self.U
        return host if self.tiles == 1 else host // self.tiles


@dataclass
class _State:
    """Per-variant quantities of one assignment A [B, T+1] (column T is a dummy)."""

    rank: torch.Tensor  # [B, T], P for empty tasks
    q_lo: torch.Tensor  # [B, G*U, P] hull of each QO unit's rows at each rank
    q_hi: torch.Tensor
    k_lo: torch.Tensor  # [B, G*U, P] hull of each KV unit's columns at each rank
    k_hi: torch.Tensor
    qlen: torch.Tensor  # [B, G*U, P] tokens that travel (0 at the host)
    klen: torch.Tensor
    kcount: torch.Tensor  # [B, G*U, P] tasks of each KV unit on each rank
    send: torch.Tensor  # [B, P] forward bytes
    recv: torch.Tensor
    vol: torch.Tensor  # [B, P] max(send, recv)
    bottleneck: torch.Tensor  # [B]
    load: torch.Tensor  # [B, P]


def _scatter_hull(tasks: _Tasks, rank, lo, hi, unit):
    """Hull [lo, hi) of the needs of each (unit, rank): [B, G*U, P] each."""
    B, P = rank.shape[0], tasks.P
    key = unit * (P + 1) + rank
    n = tasks.G * tasks.U * (P + 1)
    h_lo = torch.full((B, n), _BIG, dtype=torch.int64, device=rank.device)
    h_hi = torch.zeros((B, n), dtype=torch.int64, device=rank.device)
    h_lo = h_lo.scatter_reduce(1, key, lo.expand(B, -1), "amin")
    h_hi = h_hi.scatter_reduce(1, key, hi.expand(B, -1), "amax")
    return h_lo.view(B, -1, P + 1)[..., :P], h_hi.view(B, -1, P + 1)[..., :P]


def _state(tasks: _Tasks, A: torch.Tensor) -> _State:
    G, P, U, T = tasks.G, tasks.P, tasks.U, tasks.T
    rank = A[:, :T]
    B = rank.shape[0]
    q_lo, q_hi = _scatter_hull(tasks, rank, tasks.qlo, tasks.qhi, tasks.qo_unit)
    k_lo, k_hi = _scatter_hull(tasks, rank, tasks.klo, tasks.khi, tasks.kv_unit)
    ranks = torch.arange(P, device=A.device)
    at_host = tasks.unit_host[:, None] == ranks
    qlen = torch.where(at_host, 0, (q_hi - q_lo).clamp(min=0))
    klen = torch.where(at_host, 0, (k_hi - k_lo).clamp(min=0))
    n = tasks.tiles
    q4, k4 = qlen.view(B, G, P, n, P), klen.view(B, G, P, n, P)  # [B, G, host, tile, dest]
    q_out, q_in = q4.sum(dim=(1, 3, 4)), q4.sum(dim=(1, 2, 3))
    k_out, k_in = k4.sum(dim=(1, 3, 4)), k4.sum(dim=(1, 2, 3))
    send = q_out * tasks.q + q_in * tasks.o + k_out * tasks.kv
    recv = q_in * tasks.q + q_out * tasks.o + k_in * tasks.kv
    vol = torch.maximum(send, recv)
    load = torch.zeros((B, P + 1), dtype=torch.int64, device=A.device)
    load = load.scatter_add(1, rank, tasks.area.expand(B, -1))[:, :P]
    kcount = torch.zeros((B, G * U * (P + 1)), dtype=torch.int64, device=A.device)
    kcount = kcount.scatter_add(1, tasks.kv_unit * (P + 1) + rank, tasks.valid.long().expand(B, -1))
    kcount = kcount.view(B, G * U, P + 1)[..., :P]
    return _State(rank, q_lo, q_hi, k_lo, k_hi, qlen, klen, kcount, send, recv, vol, vol.amax(1), load)


def _union_growth(cur_lo, cur_hi, lo, hi):
    """Tokens a hull [cur_lo, cur_hi) grows by when [lo, hi) joins it (lo < hi).

    An empty hull is (``_BIG``, 0) (``_scatter_hull``; (``_TOKEN_LIMIT``, 0) in int32), so the
    hull formula needs no branch for it: max(0, hi) - min(_BIG, lo) = hi - lo. The kernels'
    twin branches on it instead.
    """
    out = torch.maximum(cur_hi, hi)
    out -= torch.minimum(cur_lo, lo)
    return out.sub_((cur_hi - cur_lo).clamp_(min=0))


@dataclass
class _Proposals:
    """Proposed moves: [B, N] each, tasks [B, N, M] (M task slots, T = unused)."""

    ok: torch.Tensor  # bool
    score: torch.Tensor  # float64, lower is better
    dest: torch.Tensor  # int64
    source: torch.Tensor  # int64
    area: torch.Tensor  # int64 area moved
    dest_send: torch.Tensor  # int64 change of the destination's send (< 0 when it stops shipping K/V)
    dest_recv: torch.Tensor
    tasks: torch.Tensor  # [B, P, M] task ids to move, T (dummy) where unused


def _offers(tasks: _Tasks, st: _State, cap, units_per_rank: int, n_dests: int, dests_per_variant=None):
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
    # own tie order is unspecified), 10x faster than a stable sort; a unit's area is at most
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


def _busiest_key_host(send, key_host, elsewhere, kv_delta, tiles: int):
    """The largest send of a key host other than the touched ranks after a move, 0 if none.

    send: [B, P]; key_host, elsewhere, kv_delta: [..., M] per moved task (key_host broadcastable).
    With one tile per rank each task's key unit has its own host; with n tiles up to n of a
    bundle's tasks share one, and their deltas add up.
    """
    B, P = send.shape
    lead = (B,) + (1,) * (elsewhere.dim() - 2)
    if tiles == 1:
        j_send = send.gather(1, key_host.expand(B, *key_host.shape[1:]).reshape(B, -1)).view(key_host.shape)
        return torch.where(elsewhere, j_send + kv_delta, 0).amax(-1)
    idx = key_host.expand_as(elsewhere)
    per_host = torch.zeros(elsewhere.shape[:-1] + (P,), dtype=torch.int64, device=send.device)
    per_host = per_host.scatter_add(-1, idx, torch.where(elsewhere, kv_delta, 0))
    hit = torch.zeros_like(per_host).scatter_add(-1, idx, elsewhere.long()) > 0
    return torch.where(hit, send.view(*lead, P) + per_host, 0).amax(-1)


def _at_cut(running: torch.Tensor, cut: torch.Tensor, empty: int, suffix: bool = False) -> torch.Tensor:
    """Read ``running`` [..., U] (prefix values along a unit's order, or suffix values with
    ``suffix``) at ``cut`` [..., C] in 0..U: the value over positions [0, cut) (or [cut, U)),
    ``empty`` where that range is empty. A 4-D ``running`` [B, P, K, U] is shared by every
    destination of a 5-D ``cut`` [B, P, K, D, C]."""
    # read the last position inside the range (the first with ``suffix``), clamped, then blank
    # empty ranges: no padded copy of ``running``
    U = running.shape[-1]
    at, empty_range = (cut.clamp(max=U - 1), cut == U) if suffix else ((cut - 1).clamp(min=0), cut == 0)
    if running.dim() == cut.dim():
        value = running.gather(-1, at)
    else:
        value = running.gather(-1, at.flatten(-2)).view(cut.shape)
    return value.masked_fill_(empty_range, empty)


def _bundle_proposals(tasks: _Tasks, st: _State, cap, excess, balance, threshold,
                      units_per_rank, n_dests, dests_per_variant=None, order_per_variant=None,
                      sideways: bool = False, singles: bool = False) -> _Proposals:
    """Ship a prefix of one QO unit's tasks (by area) from each source to one destination.

    Balance phase (``balance`` [B] True): overloaded sources, the prefix stops
    once the source's excess is covered, every touched rank stays under the
    threshold, scored by added bytes per area. Bottleneck phase: any source,
    the prefix is one task or all that fit the destination, the bottleneck
    rank must go down and no touched rank may reach the bottleneck; scored by
    the touched ranks' new maximum. With ``sideways`` (host bool) a move that
    leaves the bottleneck as it is, keeps every touched rank below it and
    lowers the total bytes is also allowed, ranked after every move that
    lowers the bottleneck (score + 1); the total falls strictly, so no cycles.
    With ``singles`` (host bool) the balance phase also offers the one-task bundle.

    Both sizes take the source's tasks among the first ``cut`` positions of the
    unit's order, so every sum over a bundle is a running sum read at its cut,
    and the tasks of one key host sit at known positions (``_Tasks.unit_pos``).
    """
    G, P, U, T, n = tasks.G, tasks.P, tasks.U, tasks.T, tasks.tiles
    B, dev = st.rank.shape[0], st.rank.device
    K, D = min(units_per_rank, G * U), min(n_dests, P)
    ranks = torch.arange(P, device=dev)
    upos = torch.arange(U, device=dev)
    unit, headroom, dests = _offers(tasks, st, cap, units_per_rank, n_dests, dests_per_variant)
    u_host = tasks.unit_host[unit]  # [B, P, K] query host of each offered unit

    # the unit's tasks in the variant's order: [B, P(s), K, U(position)]; mine = on the source
    order_b = torch.zeros((B,), dtype=torch.int64, device=dev) if order_per_variant is None else order_per_variant
    tid = tasks.unit_tasks[order_b.view(B, 1, 1), unit]
    s4 = ranks.view(1, P, 1, 1)
    mine = st.rank.gather(1, tid.view(B, -1)).view(B, P, K, U) == s4
    t_area = tasks.area[tid] * mine
    after = torch.cumsum(t_area, 3)
    before = after - t_area
    first = (torch.cumsum(mine, 3) == 0).sum(3)  # [B, P, K] position of the first task here, U if none
    first_at = first.clamp(max=U - 1)[..., None]
    j_t = tasks.k_host[tid]  # key host of each task
    # each unit also considers: the key host of its heaviest task here (no K/V to ship for it),
    # the unit's own host (moving home frees the transfer) and the other rank holding most of
    # the unit's rows (merging two helpers of one unit saves one transfer)
    key_host = j_t.gather(3, first_at) * (first < U)[..., None]  # [B, P, K, 1]
    home = u_host[..., None]
    held = st.qlen.gather(1, unit.view(B, -1, 1).expand(-1, -1, P).reshape(B, -1, P)).view(B, P, K, P)
    held = torch.where(ranks.view(1, P, 1, 1) == ranks, -1, held)  # not the source itself
    holder = held.argmax(3, keepdim=True)
    dests = torch.cat((dests[:, :, None, :].expand(B, P, K, D), key_host, home, holder), 3)  # [B, P, K, D1]
    D1 = D + 3
    # each size ships the source's tasks before a cut of the order, [B, P, K, D1, 2(size)]:
    # size 0 = the first task here if it fits the destination (bottleneck phase, or ``singles``);
    # size 1 = while the running area fits (and, balancing, until the excess is covered)
    room = headroom.gather(1, dests.view(B, -1)).view(B, P, K, D1)
    fits = torch.searchsorted(after, room, right=True)  # positions whose running area fits
    over = torch.where(balance.view(B, 1, 1), (before < excess.view(B, P, 1, 1)).sum(3), U)
    cut1 = torch.minimum(fits, over[..., None])
    single_ok = ~balance.view(B, 1, 1, 1) | singles
    cut0 = torch.where(single_ok & (fits > first[..., None]), first[..., None] + 1, 0)
    cut = torch.stack((cut0, cut1), 4)
    area = _at_cut(after, cut, 0)  # [B, P, K, D1, 2]
    shape = area.shape

    i_of = u_host[..., None, None]  # [B, P, K, 1, 1] query host
    d_of = dests.view(B, P, K, D1, 1)
    s_of = ranks.view(1, P, 1, 1, 1)
    gather_at = lambda table, idx: table.reshape(B, -1).gather(1, idx.reshape(B, -1)).view(idx.shape)  # noqa: E731

    # query rows: growth of the destination's hull, and what the source frees when it is not the host
    lo_here = torch.where(mine, tasks.qlo[tid], _BIG)
    hi_here = tasks.qhi[tid] * mine
    b_lo = _at_cut(lo_here.cummin(3).values, cut, _BIG)
    b_hi = _at_cut(hi_here.cummax(3).values, cut, 0)
    at_d = (unit * P)[..., None, None] + d_of
    q_grow = _union_growth(gather_at(st.q_lo, at_d.expand(shape)), gather_at(st.q_hi, at_d.expand(shape)), b_lo, b_hi)
    q_grow = torch.where((area > 0) & (d_of != i_of), q_grow, 0)
    # the unit's tasks that stay on the source: those at or after the cut
    r_lo = _at_cut(lo_here.flip(3).cummin(3).values.flip(3), cut, _BIG, suffix=True)
    r_hi = _at_cut(hi_here.flip(3).cummax(3).values.flip(3), cut, 0, suffix=True)
    q_cur = gather_at(st.qlen, (unit * P)[..., None, None] + s_of).expand(shape)
    q_free = torch.where((area > 0) & (s_of != i_of), q_cur - (r_hi - r_lo).clamp(min=0), 0)

    # key columns of each task here: growth at the destination (none when the destination is
    # the key host), freed at the source
    kv_u = tasks.kv_unit[tid]  # [B, P, K, U]
    kd = (kv_u * P)[:, :, :, None, :] + d_of  # [B, P, K, D1, U]
    k_lo32, k_hi32 = st.k_lo.clamp(max=_TOKEN_LIMIT).int(), st.k_hi.int()  # int32, empty = (_TOKEN_LIMIT, 0)
    not_d = j_t[:, :, :, None, :] != d_of  # [B, P, K, D1, U] the destination is not the key host
    kg_t = _union_growth(gather_at(k_lo32, kd), gather_at(k_hi32, kd),
                         tasks.klo[tid].int()[:, :, :, None, :], tasks.khi[tid].int()[:, :, :, None, :])
    kg_t *= mine[:, :, :, None, :] & not_d  # [B, P, K, D1, U]
    # a KV unit's columns leave the source only with its last task there (a lower bound of
    # what is freed: a unit shared with tasks that stay is counted as not shrinking)
    k_cur = gather_at(st.klen, kv_u * P + s4)
    sole = gather_at(st.kcount, kv_u * P + s4) == 1
    kf_t = k_cur * (mine & sole)  # [B, P, K, U]

    # token change (k_grow - k_free) of the bundle's tasks whose key host is the source, the
    # query host, the bottleneck rank or the destination, in one pass (the n positions of each
    # key host in the unit's order): [B, P, K, 4, D1, 2] sum and any
    bn = st.vol.argmax(1).view(B, 1, 1, 1)
    per_unit = torch.cat((ranks.view(1, P, 1, 1).expand(B, P, K, 1), u_host[..., None], bn.expand(B, P, K, 1)), 3)
    hosts = torch.cat((per_unit[..., None].expand(B, P, K, 3, D1), dests[:, :, :, None, :]), 3)  # [B, P, K, 4, D1]
    pos = tasks.unit_pos[order_b.view(B, 1, 1, 1, 1, 1), unit[..., None, None, None],
                         hosts[..., None] * n + torch.arange(n, device=dev)]  # [B, P, K, 4, D1, n]
    flat = pos.flatten(3)
    inc = mine.gather(3, flat).view(pos.shape)[..., None, :] & (pos[..., None, :] < cut[:, :, :, None, :, :, None])
    delta = (kg_t[:, :, :, None].expand(B, P, K, 4, D1, U).gather(5, pos)
             - kf_t.gather(3, flat).view(pos.shape))
    tok_on, any_on = (delta[..., None, :] * inc).sum(-1).unbind(3), inc.any(-1).unbind(3)
    kv_to_src = tok_on[0] * tasks.kv
    kv_to_host = torch.where(i_of != s_of, tok_on[1] * tasks.kv, 0)
    # the destination as key host: it no longer sends the K/V it ships to the source alone
    kv_to_dest = tok_on[3] * tasks.kv
    # the busiest key host other than the touched ranks after the move
    if n == 1:
        # one task per key host: its send plus its own change, for the tasks whose key host is
        # neither the source, the query host nor the destination; a prefix maximum per cut
        base = st.send.gather(1, j_t.view(B, -1)).view(B, P, K, U) - kf_t * tasks.kv
        other = mine & (j_t != s4) & (j_t != u_host[..., None])
        val = torch.add(base[:, :, :, None, :], kg_t, alpha=tasks.kv)  # [B, P, K, D1, U] int64
        elsewhere = other[:, :, :, None, :] & not_d
        at_first = first_at[:, :, :, None, :].expand(B, P, K, D1, 1)
        kvh0 = (val.gather(4, at_first) * elsewhere.gather(4, at_first)).squeeze(4) * (cut0 > 0)
        kvh1 = val.mul_(elsewhere & (upos < cut1[..., None])).amax(-1)
        kvh_max = torch.stack((kvh0, kvh1), 4)
    else:
        # up to n tasks per key host: their changes add up (``_busiest_key_host``)
        inc = mine[:, :, :, None, None, :] & (upos < cut[..., None])  # [B, P, K, D1, 2, U]
        kv_delta = inc * ((kg_t - kf_t[:, :, :, None, :]) * tasks.kv)[:, :, :, :, None, :]
        j6 = j_t[:, :, :, None, None, :]
        elsewhere = inc & (j6 != s_of[..., None]) & (j6 != i_of[..., None]) & (j6 != d_of[..., None])
        kvh_max = _busiest_key_host(st.send, j6, elsewhere, kv_delta, n)
    k_grow = _at_cut(kg_t.cumsum(4, dtype=torch.int32), cut, 0).long()  # [B, P, K, D1, 2] bundle tokens
    k_free = _at_cut(kf_t.cumsum(3), cut, 0)

    # byte deltas of the three touched ranks (the query host may be the source or the destination)
    dq = q_grow - q_free
    h_ds, h_dr = dq * tasks.q, dq * tasks.o
    s_ds, s_dr = -q_free * tasks.o, -q_free * tasks.q - k_free * tasks.kv
    dest_send = q_grow * tasks.o
    dest_recv = q_grow * tasks.q + k_grow * tasks.kv
    s_is_h, d_is_h = s_of == i_of, d_of == i_of
    at = lambda t, r: gather_at(t, r.expand(shape))  # noqa: E731
    host_send = (at(st.send, i_of) + h_ds + torch.where(s_is_h, s_ds + kv_to_src, kv_to_host)
                 + torch.where(d_is_h, dest_send, 0))
    host_recv = at(st.recv, i_of) + h_dr + torch.where(s_is_h, s_dr, 0) + torch.where(d_is_h, dest_recv, 0)
    src_send = st.send.view(B, P, 1, 1, 1) + s_ds + kv_to_src + torch.where(s_is_h, h_ds, 0)
    src_recv = st.recv.view(B, P, 1, 1, 1) + s_dr + torch.where(s_is_h, h_dr, 0)
    d_send = at(st.send, d_of) + dest_send + torch.where(d_is_h, h_ds, 0) + kv_to_dest
    d_recv = at(st.recv, d_of) + dest_recv + torch.where(d_is_h, h_dr, 0)
    new_max = torch.maximum(torch.maximum(torch.maximum(host_send, host_recv), torch.maximum(src_send, src_recv)),
                            torch.maximum(torch.maximum(d_send, d_recv), kvh_max))
    added = dq * (tasks.q + tasks.o) + (k_grow - k_free) * tasks.kv

    bal = balance.view(B, 1, 1, 1, 1)
    bnv = st.bottleneck.view(B, 1, 1, 1, 1)
    bn = bn.view(B, 1, 1, 1, 1)
    # the bottleneck rank as a key host of moved tasks (not otherwise touched)
    to_bn, any_bn = tok_on[2], any_on[2]
    bn_is_j = any_bn & (bn != s_of) & (bn != i_of) & (bn != d_of)
    bn_as_j = torch.maximum(at(st.send, bn) + to_bn * tasks.kv, at(st.recv, bn))
    bn_new = torch.where(s_of == bn, torch.maximum(src_send, src_recv),
                         torch.where(i_of == bn, torch.maximum(host_send, host_recv),
                                     torch.where(d_of == bn, torch.maximum(d_send, d_recv),
                                                 torch.where(bn_is_j, bn_as_j, bnv))))
    ok_bal = (excess.view(B, P, 1, 1, 1) > 0) & (new_max.double() <= threshold.view(B, 1, 1, 1, 1))
    ok_bn = (bn_new < bnv) & (new_max < bnv)
    side = ~ok_bn & (bn_new <= bnv) & (new_max < bnv) & (added < 0) & sideways
    ok_bn = ok_bn | side
    ok = (area > 0) & (d_of != s_of) & torch.where(bal, ok_bal, ok_bn)
    score = torch.where(bal, added.double() / area.clamp(min=1).double(),
                        new_max.double() / bnv.clamp(min=1).double()
                        + 1e-12 * (added.double() / bnv.clamp(min=1).double()) + side.double())
    score = torch.where(ok, score, float("inf"))

    # each offered unit proposes its best (destination, size): proposals [B, P*K]
    n_opts = D1 * 2
    best = score.view(B, P, K, n_opts).argmin(-1, keepdim=True)  # first on ties
    pick = lambda x: x.expand(shape).reshape(B, P, K, n_opts).gather(3, best).reshape(B, P * K)  # noqa: E731
    moved = mine & (upos < cut.reshape(B, P, K, n_opts).gather(3, best))
    d_best = dests.gather(3, best // 2)  # [B, P, K, 1]
    return _Proposals(ok=pick(ok), score=pick(score), dest=d_best.reshape(B, P * K),
                      source=ranks.view(P, 1).expand(P, K).reshape(1, -1).expand(B, -1),
                      area=pick(area), dest_send=pick(dest_send + kv_to_dest), dest_recv=pick(dest_recv),
                      tasks=torch.where(moved, tid, T).view(B, P * K, U))


def _segment_running_sum(key: torch.Tensor, order_key: torch.Tensor, values: list[torch.Tensor]):
    """Sort proposals by ``order_key``; for each value, its running sum within runs of equal ``key``.

    Returns (order, [running sums in sorted order]).
    """
    B, N = key.shape
    order = torch.sort(order_key, dim=1, stable=True).indices
    k_sorted = key.gather(1, order)
    idx = torch.arange(N, device=key.device).expand(B, -1)
    new_seg = torch.cat((torch.ones_like(k_sorted[:, :1], dtype=torch.bool), k_sorted[:, 1:] != k_sorted[:, :-1]), 1)
    seg_start = torch.cummax(torch.where(new_seg, idx, 0), 1).values
    sums = []
    for v in values:
        csum = torch.cumsum(v.gather(1, order), 1)
        sums.append(csum - torch.where(seg_start > 0, csum.gather(1, (seg_start - 1).clamp(min=0)), 0))
    return order, sums


def _accept(prop: _Proposals, st: _State, dest_cap, limit, excess, balance) -> torch.Tensor:
    """Which proposals to apply: [B, N] bool.

    Each destination accepts proposals in score order while its load and
    volume stay within limits; then, while balancing, each source keeps its
    accepted proposals in score order until its excess is covered.
    """
    B, N = prop.ok.shape
    P = st.load.shape[1]
    dev = prop.ok.device
    pos = torch.empty((B, N), dtype=torch.int64, device=dev)  # score order, index breaks ties
    pos.scatter_(1, torch.sort(prop.score, dim=1, stable=True).indices, torch.arange(N, device=dev).expand(B, -1))
    ok = prop.ok
    dest = torch.where(ok, prop.dest, P)
    zero = lambda x: torch.where(ok, x, 0)  # noqa: E731
    order, (r_area, r_send, r_recv) = _segment_running_sum(
        dest, dest * N + pos, [zero(prop.area), zero(prop.dest_send), zero(prop.dest_recv)])
    pad = torch.zeros_like(st.load[:, :1])
    d_sorted = dest.gather(1, order)
    at_d = lambda t: torch.cat((t, pad), 1).gather(1, d_sorted)  # noqa: E731
    lim = limit[:, None]
    fits = ((at_d(st.load) + r_area <= dest_cap) & ((at_d(st.send) + r_send).double() <= lim)
            & ((at_d(st.recv) + r_recv).double() <= lim))
    ok = ok & torch.zeros_like(ok).scatter(1, order, fits)
    # source side: stop once the excess is covered (balance phase only)
    src = torch.where(ok, prop.source, P)
    order, (r_src,) = _segment_running_sum(src, src * N + pos, [torch.where(ok, prop.area, 0)])
    a_sorted = torch.where(ok, prop.area, 0).gather(1, order)
    need = torch.cat((excess, pad), 1).gather(1, src.gather(1, order))
    keep = (r_src - a_sorted < need) | ~balance[:, None]
    return ok & torch.zeros_like(ok).scatter(1, order, keep)


def _accept_apply(A: torch.Tensor, prop: _Proposals, st: _State, dest_cap, limit, excess, balance):
    """``_accept`` and the moves it accepts, as the round loop applies them (torch twin).

    A: [B, T+1] int64 assignment (column T is a dummy). Other arguments as
    ``accept_triton``. Returns (A_next [B, T+1] int64: each kept proposal's
    tasks on its destination, stuck [B] bool: balancing and nothing kept).
    The dummy column of A_next is unspecified (the scatter parks unused task
    slots there); columns [0, T) are what the twins agree on.
    """
    B, T = A.shape[0], A.shape[1] - 1
    keep = _accept(prop, st, dest_cap, limit, excess, balance)
    stuck = balance & ~keep.any(1)
    moving = torch.where(keep[..., None], prop.tasks, T)
    A = A.scatter(1, moving.view(B, -1), prop.dest[..., None].expand_as(moving).reshape(B, -1))
    return A, stuck


def _track(A: torch.Tensor, st: _State, cap: torch.Tensor, stuck: torch.Tensor, threshold: torch.Tensor,
          best_A: torch.Tensor, best_key: torch.Tensor):
    """Keep each variant's best state and set the round's limits (torch twin, the round loop's own lines).

    A, best_A: [B, T+1] int64 assignments (current, best so far).
    st:        _State of A; reads load [B, P] and bottleneck [B] int64.
    cap:       0-dim int64, the largest balanced load.
    stuck:     [B] bool, balancing variants that found no move last round.
    threshold: [B] fp64, balance-phase limit on any touched rank's bytes.
    best_key:  [B] int64 (balanced first, then the lower bottleneck).
    Returns (best_A [B, T+1] int64, best_key [B] int64, excess [B, P] int64,
    balance [B] bool, dest_cap [B, 1] int64, limit [B] fp64).
    """
    B = A.shape[0]
    max_load = st.load.amax(1)
    balanced = max_load <= cap
    key = torch.where(balanced, st.bottleneck, _BIG // 2 + max_load)
    better = key < best_key
    best_key = torch.where(better, key, best_key)
    best_A = torch.where(better[:, None], A, best_A)
    excess = st.load - cap
    balance = ~balanced
    dest_cap = torch.where(stuck, max_load - 1, cap).view(B, 1)
    limit = torch.where(balance, threshold, st.bottleneck.double() - 1)
    return best_A, best_key, excess, balance, dest_cap, limit


@dataclass(frozen=True)
class Strategy:
    """One batch of variants run side by side.

    threshold_scales: balance-phase limits on every touched rank's volume, as
                      multiples of the start's forward bottleneck (one
                      variant each; inf = unbounded).
    units_per_rank:   QO units each source offers per round.
    bundle_dests:     destinations (by headroom) each unit is priced against.
    task_order:       the order a bundle takes a unit's tasks in: "area"
                      (largest first), "rows" (fewest needed query rows
                      first: off-diagonal tasks that need a few rows travel
                      without the unit's full chunk) or "small" (smallest
                      first: a source a little above the cap sheds one small
                      task, e.g. to the rank holding its keys, where "area"
                      could only ship its largest).
    start:            the assignment the variants start from: "owner"
                      (owner-computes) or "transpose" (``_transpose_start``:
                      rows with many remote key columns go to their head
                      group's rank of an aligned block of G ranks, as in
                      Ulysses). A solve given a start (the tiled refine)
                      starts every variant there.
    """

    threshold_scales: tuple[float, ...] = (3.0, float("inf"))
    units_per_rank: int = 4
    bundle_dests: int = 8
    task_order: str = "area"
    start: str = "owner"

    def __post_init__(self):
        if self.task_order not in TASK_ORDERS:
            raise ValueError(f"task_order must be one of {TASK_ORDERS}, got {self.task_order!r}")
        if self.start not in STARTS:
            raise ValueError(f"start must be one of {STARTS}, got {self.start!r}")
        if not self.threshold_scales or self.units_per_rank < 1 or self.bundle_dests < 1:
            raise ValueError(f"a strategy needs threshold scales and positive widths, got {self}")


TASK_ORDERS = ("area", "rows", "small")
STARTS = ("owner", "transpose")
IMPLS = ("torch", "triton", "persistent", "auto")


# Batches that differ in how widely they search and in the order bundles take
# a unit's tasks, chosen by measurement: every single strategy of a grid
# (threshold scale 1.05..inf, 1..16 units, 4..64 destinations, both orders,
# 24..48 rounds) was run on the benchmark masks (packed documents, causal and
# full, P = 8..64, seeds 0-2), portfolios were picked greedily within the
# torch path's time budget, and checked on seeds 3-5: the medians of the
# device / reference forward bottleneck are equal or lower in every cell on
# both seed sets. More rounds than 24 changed nothing at P <= 16. The fifth
# and sixth strategies are there for balance alone: on a wider sweep (P = 4..16,
# 2K..8K tokens per rank, G = 4 and 8, both kinds, 4 seeds: 144 masks) the
# first four leave two masks above mu that the reference balances, and only a
# finite threshold or a narrow rows-first window balances them; with all six,
# none is left. Each portfolio has a strategy that starts transposed
# (Strategy.start): on documents that span many ranks owner-computes gathers
# K/V from all of them, and no sequence of single moves leaves that state
# cheaply. Measured (seeds 0-5): full documents at P = 64 drop from a median
# of 0.90x the reference to 0.74x, and no other median of P = 32 and 64
# rises; one full-attention sequence over P = 64 ranks from 4.2x USP's bytes
# to 1.0x. Below P = 32 a narrow window does as well on one long sequence
# (P = 16) at a third of the cost of the widest; from P = 32 up the wide one
# wins on full documents. The last strategy below P = 32, smallest task
# first, came from the small-P sweep (benchmarks/solver_sweep.py, 192 masks):
# there a rank just above the cap whose unit's largest task fits no rank could
# only move that task, and the worst mask (P = 6) ended at 2.07x the
# reference; with it, 1.30x at worst, the P = 8 median 0.849 -> 0.839, 17
# masks lower and none higher (a variant more never raises a mask); on the
# quality masks (P = 8, 16, seeds 0-5) no median moves by more than 0.01. It
# costs 15-30 % more torch time at P = 8 and 16 (side by side; a 16-wide
# window, no better on any of the 192 masks, costs more at P = 16). From
# P = 32 up a smallest-first strategy (4 units on 32 destinations, or 1 on
# 64) lowers no median of the quality masks (seeds 0-2) and would cost a third
# more time.
_INF = float("inf")
DEFAULT_STRATEGIES = (Strategy((_INF,), units_per_rank=16, bundle_dests=16),
                      Strategy((_INF,), units_per_rank=16, bundle_dests=8, task_order="rows"),
                      Strategy((_INF,), units_per_rank=1, bundle_dests=8),
                      Strategy((_INF,), units_per_rank=2, bundle_dests=16, task_order="rows"),
                      Strategy((3.0,), units_per_rank=4, bundle_dests=8),
                      Strategy((_INF,), units_per_rank=1, bundle_dests=4, task_order="rows"),
                      Strategy((_INF,), units_per_rank=4, bundle_dests=8, start="transpose"),
                      Strategy((_INF,), units_per_rank=16, bundle_dests=8, task_order="small"))
# From P = 32 up: wide destination windows win (full documents), and three
# strategies keep the torch path at P = 64 to seconds on 2 CPU cores.
LARGE_P = 32
LARGE_P_STRATEGIES = (Strategy((_INF,), units_per_rank=4, bundle_dests=32),
                      Strategy((_INF,), units_per_rank=1, bundle_dests=64, task_order="rows"),
                      Strategy((_INF,), units_per_rank=4, bundle_dests=32, start="transpose"))


def default_strategies(cp_size: int) -> tuple[Strategy, ...]:
    """The portfolio ``solve_device`` runs for a CP group of ``cp_size`` ranks."""
    return LARGE_P_STRATEGIES if cp_size >= LARGE_P else DEFAULT_STRATEGIES


def default_local_search(cp_size: int) -> tuple[bool, int, bool]:
    """(sideways, restart_every, singles) ``solve_device`` uses for ``cp_size`` ranks (see
    RESTART_EVERY and SINGLES_P)."""
    small = cp_size < LARGE_P
    return small, (RESTART_EVERY if small else 0), cp_size < SINGLES_P


def _variants(strategies: tuple[Strategy, ...], G: int, P: int, tiles: int = 1):
    """The variants of a portfolio: ([(scale, units, window, order index, start index)] host
    tuples, K, D).

    K = unit slots per source and D = window width of the widest variant; each
    variant's own counts are clipped to them.
    """
    K = min(max(st.units_per_rank for st in strategies), G * P * tiles)
    D = min(max(st.bundle_dests for st in strategies), P)
    variants = [(x, min(st.units_per_rank, K), min(st.bundle_dests, D), TASK_ORDERS.index(st.task_order),
                 STARTS.index(st.start)) for st in strategies for x in st.threshold_scales]
    return variants, K, D


def _variant_tables(variants, dev) -> torch.Tensor:
    """[3, B] int64 per-variant task order, window width and units offered.

    Built from device fills: a tensor made from a host list is a host-to-device
    copy on a GPU, which a CUDA graph cannot capture.
    """
    fill = _fills(torch.int64, dev)
    return torch.cat([fill(v[k]) for k in (3, 2, 1) for v in variants]).view(3, len(variants))


def _variant_scales(variants, dev) -> torch.Tensor:
    """[B] fp64 threshold scale of each variant (inf = unbounded)."""
    fill = _fills(torch.float64, dev)
    return torch.cat([fill(float(v[0])) for v in variants])


def _fills(dtype, dev):
    """A function giving a 1-element ``dtype`` tensor of a value, one fill per distinct value
    (each fill is a launch on a GPU)."""
    made = {}

    def fill(v):
        if v not in made:
            made[v] = torch.full((1,), v, dtype=dtype, device=dev)
        return made[v]
    return fill


def _transpose_start(tasks: _Tasks) -> torch.Tensor:
    """The "transpose" start: [T] int64, the start rank of each task (torch twin of
    ``kernels_start.transpose_start_triton``).

    A QO unit (g, u) whose tasks need more remote key tokens than its own rows,
    priced in forward bytes (K/V there against Q there and O back), starts with
    all its tasks on rank b + g % s, where b = G * (host // G) is the first rank
    of the aligned block holding the unit and s = min(G, P - b) its size:
    within a block every rank computes one head group of every such row, as
    Ulysses does. Other units start on their query host. Long documents make
    owner-computes gather all G groups' K/V from every rank they span;
    transposed, a rank receives G - 1 rows of its head group from its block
    and only that group's K/V, which costs less once a document spans more
    than 1 + (q + o) / kv ranks (9 for GQA 64:8).
    """
    G, U = tasks.G, tasks.U
    remote = tasks.valid & (tasks.k_host != tasks.q_host)
    kv_tokens = torch.where(remote, tasks.khi - tasks.klo, 0).view(G * U, U).sum(1)
    q_lo = torch.where(tasks.valid, tasks.qlo, _BIG).view(G * U, U).amin(1)
    q_hi = torch.where(tasks.valid, tasks.qhi, 0).view(G * U, U).amax(1)
    flip = kv_tokens * tasks.kv > (q_hi - q_lo).clamp(min=0) * (tasks.q + tasks.o)
    host = tasks.unit_host  # [G*U] rank of each QO unit
    block = (host // G) * G
    target = block + (tasks.g.view(G * U, U)[:, 0] % (tasks.P - block).clamp(max=G))
    return torch.where(flip, target, host)[tasks.qo_unit]


def _variant_starts(tasks: _Tasks, variants, start: torch.Tensor | None = None, transpose_fn=None):
    """The start rank of each task for ``variants``: ``start`` ([T], shared) when given, None
    when every variant starts from owner-computes, else [B, T] int64 (``transpose_fn``,
    default ``_transpose_start``, for "transpose" variants; the query host for the others)."""
    if start is not None:
        return start
    kinds = [v[4] for v in variants]
    if not any(kinds):
        return None
    transposed = (transpose_fn or _transpose_start)(tasks)
    return torch.stack([transposed if k else tasks.q_host for k in kinds])


def _restart(tasks: _Tasks, best_A: torch.Tensor, vol: torch.Tensor) -> torch.Tensor:
    """The restart state: ``best_A`` [B, T+1] with every task on its bottleneck rank, or hosted
    there, back on its query host. vol: [B, P] int64 bytes of ``best_A``; the bottleneck is
    the first rank of largest volume. Returns [B, T+1] int64."""
    P, T = tasks.P, tasks.T
    bn = vol.argmax(1, keepdim=True)  # [B, 1], first on ties
    home = torch.where(tasks.valid, tasks.q_host, P)
    back = (best_A[:, :T] == bn) | (home == bn)
    return torch.cat((torch.where(back, home, best_A[:, :T]), best_A[:, T:]), 1)


def coarser_tiles(tiles: int) -> int:
    """The tiles per chunk a tiled solve starts from: half of an even count, else 1."""
    return tiles // 2 if tiles % 2 == 0 else 1


def _run_variants(tasks: _Tasks, cap: torch.Tensor, strategies: tuple[Strategy, ...], rounds: int,
                  state_fn=None, propose_fn=None, accept_apply_fn=None, track_fn=None,
                  sideways: bool = False, restart_every: int = 0, start: torch.Tensor | None = None,
                  start_fn=None, singles: bool = False):
    """Run the variants of ``strategies`` side by side: best (A [B, T+1], key [B]).

    ``start`` ([T] int64, the rank of each non-empty task) is the assignment every
    variant starts from and round 0's state; by default each variant starts as its
    strategy says (``_variant_starts``; ``start_fn`` computes the "transpose" start).
    ``sideways`` allows sideways bottleneck-phase moves, ``singles`` one-task bundles
    while balancing (``_bundle_proposals``).
    With ``restart_every = R > 0``, at rounds R, 2R, ... (before the last) each
    variant restarts from its best state with its bottleneck rank's moves
    undone (``_restart``): an iterated local search, since the moves settle
    within a few rounds.

    The four steps of a round default to the torch functions (``_state``,
    ``_bundle_proposals``, ``_accept_apply``, ``_track``); the Triton path
    passes its kernels' launchers, which are bit-equal twins.

    The strategies' search widths become per-variant limits inside one batch
    (units beyond a variant's count are not proposed; its destination window
    is narrowed to its own width). A variant's result does not depend on the
    batch it runs in: proposals keep their relative order, and a narrowed
    window only repeats a destination already priced first.
    """
    state_fn, propose_fn = state_fn or _state, propose_fn or _bundle_proposals
    accept_apply_fn, track_fn = accept_apply_fn or _accept_apply, track_fn or _track
    P, T, dev = tasks.P, tasks.T, tasks.area.device
    variants, K, D = _variants(strategies, tasks.G, P, tasks.tiles)
    B = len(variants)
    order_b, dests_b, units_b = _variant_tables(variants, dev).unbind(0)
    offered = (torch.arange(P * K, device=dev) % K)[None, :] < units_b[:, None]  # [B, P*K]
    # the start (owner-computes unless given or transposed); column T is a dummy that absorbs
    # writes of unused slots
    starts = _variant_starts(tasks, variants, start, start_fn)
    A = torch.where(tasks.valid, tasks.q_host if starts is None else starts, P).expand(B, T)
    A = torch.cat((A, torch.full((B, 1), P, dtype=torch.int64, device=dev)), dim=1)
    best_A = A.clone()
    best_key = torch.full((B,), _BIG, dtype=torch.int64, device=dev)
    threshold = None
    stuck = torch.zeros((B,), dtype=torch.bool, device=dev)
    for rnd in range(rounds + 1):
        st = state_fn(tasks, A)
        if threshold is None:  # round 0, each variant's start, is the base of its threshold
            scale = _variant_scales(variants, dev)
            threshold = torch.where(scale == _INF, float(_BIG), st.bottleneck.double() * scale + 1.0)
        best_A, best_key, excess, balance, dest_cap, limit = track_fn(A, st, cap, stuck, threshold, best_A, best_key)
        if rnd == rounds:
            break
        if restart_every > 0 and rnd > 0 and rnd % restart_every == 0:
            # only balanced variants restart: undoing the bottleneck rank's moves of a variant
            # still balancing throws its balancing away (a 128K-token causal pack at P = 8
            # ended at 1.139 with every variant restarting, balanced with this rule)
            again = (best_key < _BIG // 2)[:, None]
            A = torch.where(again, _restart(tasks, best_A, state_fn(tasks, best_A).vol), A)
            stuck = stuck & ~again[:, 0]
            st = state_fn(tasks, A)
            best_A, best_key, excess, balance, dest_cap, limit = track_fn(A, st, cap, stuck, threshold,
                                                                          best_A, best_key)
        prop = propose_fn(tasks, st, dest_cap, excess, balance, threshold, K, D, dests_b, order_b, sideways,
                          singles)
        prop = replace(prop, ok=prop.ok & offered)
        A, stuck = accept_apply_fn(A, prop, st, dest_cap, limit, excess, balance)
    return best_A, best_key


def solve_device(areas: BlockAreas, config: SolverConfig, *, rounds: int = DEFAULT_ROUNDS,
                 strategies: tuple[Strategy, ...] | None = None, impl: str = "auto",
                 workers: int | None = None, sideways: bool | None = None,
                 restart_every: int | None = None, singles: bool | None = None) -> DeviceSolveResult:
    """Assign every task to a rank, on the device of ``areas``, without host reads.

    areas:      BlockAreas (area [G, U, U] int64, q_need/k_need [G, U, U, 2] int64; U = P,
                or n * P with ``config.chunk_tiles = n`` sub-chunk tiles: then the areas at
                ``coarser_tiles(n)`` tiles are solved first and that plan is refined).
    config:     SolverConfig (P, heads, D, dtype, imbalance_tol, chunk_tiles).
    rounds:     rounds of moves per variant (static).
    strategies: batches of variants (default: ``default_strategies(P)``); the best state wins.
    impl:       "torch"; "triton" (a few kernels per round, solver/kernels*.py); "persistent"
                (one kernel for all rounds, solver/kernels_rounds.py); or "auto" (triton on CUDA).
    workers:    programs per variant of the persistent kernel (None: 1 off CUDA, on CUDA as
                many as keep every variant's programs resident, ``default_workers``).
    sideways, restart_every, singles: the local search's extras (None:
                ``default_local_search(P)``); see ``_run_variants``.
    Returns a DeviceSolveResult; ``assignment`` is [G, U, U] int32 and
    ``variant`` indexes the variants of all strategies in order.
    """
    G, P = areas.head_groups, areas.cp_size
    if P != config.cp_size:
        raise ValueError(f"areas are for P={P} ranks but config.cp_size={config.cp_size}")
    if G != config.head_groups:
        raise ValueError(f"areas have G={G} head groups but config.head_groups={config.head_groups}")
    if areas.tiles != config.chunk_tiles:
        raise ValueError(f"areas have tiles={areas.tiles} per chunk but config.chunk_tiles={config.chunk_tiles}")
    strategies = default_strategies(P) if strategies is None else tuple(strategies)
    if rounds < 0 or not strategies or not all(st.threshold_scales for st in strategies):
        raise ValueError(f"need rounds >= 0 and strategies with threshold scales, got {rounds}, {strategies}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    default_sideways, default_restart, default_singles = default_local_search(P)
    sideways = default_sideways if sideways is None else bool(sideways)
    singles = default_singles if singles is None else bool(singles)
    restart_every = default_restart if restart_every is None else restart_every
    if restart_every < 0:
        raise ValueError(f"restart_every must be >= 0 (0: never), got {restart_every}")
    start = None
    if areas.tiles > 1:
        # coarse to fine: solve at half the tiles (whole chunks for an odd count) first, then
        # refine that plan with tile moves; each level keeps its best state, so n tiles never
        # end above n / 2 tiles or whole chunks
        coarse_tiles = coarser_tiles(areas.tiles)
        coarse = solve_device(areas.coarsen(coarse_tiles), replace(config, chunk_tiles=coarse_tiles),
                              rounds=rounds, strategies=strategies, impl=impl, workers=workers,
                              sideways=sideways, restart_every=restart_every, singles=singles)
        start = areas.refine(coarse.assignment).reshape(-1).long()
    tasks = _Tasks(areas, config)
    cap = balanced_load_cap(tasks.area.sum(), config.imbalance_tol, P, _MU_SCALE)  # largest balanced load
    if impl == "persistent":
        from gpusolver.solver.kernels_rounds import default_workers, solve_rounds_persistent
        from gpusolver.solver.kernels_start import transpose_start_triton

        variants, K, D = _variants(strategies, G, P, areas.tiles)
        dev = areas.area.device
        if workers is None:
            workers = default_workers(len(variants), P * K, dev)
        best_A, best_key = solve_rounds_persistent(tasks, cap, _variant_tables(variants, dev),
                                                   _variant_scales(variants, dev), K, D, rounds, workers,
                                                   sideways, restart_every,
                                                   start=_variant_starts(tasks, variants, start,
                                                                         transpose_start_triton),
                                                   singles=singles)
    elif impl == "triton" or (impl == "auto" and areas.area.is_cuda):
        # fused kernels for the two heaviest steps; one batch for the whole portfolio (fewest launches)
        from gpusolver.solver.kernels import bundle_proposals_triton, state_triton
        from gpusolver.solver.kernels_accept import accept_apply_triton, track_triton
        from gpusolver.solver.kernels_start import transpose_start_triton

        best_A, best_key = _run_variants(tasks, cap, strategies, rounds, state_triton, bundle_proposals_triton,
                                         accept_apply_triton, track_triton, sideways, restart_every, start,
                                         transpose_start_triton, singles)
    else:
        # torch (CPU): with few ranks each op is small and its dispatch dominates, so the portfolio
        # runs as one batch; from TORCH_BATCH_RANKS up, one batch per strategy, so narrow strategies
        # do not pay for the widest one (either way each variant's result is the same)
        batches = (strategies,) if P < TORCH_BATCH_RANKS else tuple((st,) for st in strategies)
        runs = [_run_variants(tasks, cap, batch, rounds, sideways=sideways, restart_every=restart_every,
                              start=start, singles=singles) for batch in batches]
        best_A = torch.cat([a for a, _ in runs])
        best_key = torch.cat([k for _, k in runs])

    winner = best_key.argmin().view(1)  # first best variant; index_select keeps it on device
    key = best_key.index_select(0, winner)[0]
    ok = key < _BIG // 2
    U = tasks.U
    assignment = torch.where(tasks.valid, best_A.index_select(0, winner)[0, :tasks.T], -1).view(G, U, U)
    return DeviceSolveResult(assignment=assignment.to(torch.int32), balanced=ok,
                             fwd_bottleneck=torch.where(ok, key, -1), variant=winner[0])
