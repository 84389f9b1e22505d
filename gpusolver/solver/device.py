"""The device solver: parallel scored moves from owner-computes.

Every operation is a whole-tensor op over static shapes and the loop runs a
fixed number of rounds, so the solve runs on any device without host reads
(it runs on ``device="meta"``) and can be captured in a CUDA graph.

The algorithm (DESIGN.md, "The solver", family 2):

* Start from owner-computes: every task on its query host (no Q/O traffic,
  usually unbalanced).
* ``B`` variants run side by side, one per communication threshold ``T_b``
  (a ladder of multiples of owner-computes' bottleneck; the last unbounded).
* **Balance phase** (some rank above ``mu x mean``): every overloaded rank
  offers its heaviest QO units; a move ships one unit's tasks from the source
  to a destination as a *bundle*, taking the unit's tasks in order of area
  while they fit the destination's headroom (a prefix sum), so the unit's
  query rows travel once for as much work as possible. Its exact marginal
  cost is the growth of the destination's hull of the unit's rows plus the
  growth of its hull of each task's key columns, in bytes. Bundles are scored
  by added bytes per unit of area; the source and destination must stay
  under ``T_b``.
* **Bottleneck phase** (balanced): single-task moves that lower the volume
  of the bottleneck rank without pushing any rank they touch (query host, key
  host, source, destination) to the bottleneck; the cost of a move counts
  what it frees at the source (the hull of the unit's other tasks there).
* Selection is by segmented arg-mins: each source proposes its best move,
  each destination accepts proposals in score order while its load and
  volume stay within limits (a prefix sum per destination).
* Each variant keeps its best state over the rounds (balanced first, then the
  lowest forward bottleneck); the best variant wins.

All volumes are forward bytes in int64; ties break by index, so the result
is bit-identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpusolver.config import SolverConfig
from gpusolver.problem import BlockAreas

# Threshold ladder, as multiples of owner-computes' forward bottleneck; inf = unbounded.
DEFAULT_THRESHOLD_SCALES = (1.0, 1.5, 2.0, 3.0, float("inf"))
# Rounds of moves. Each round every source proposes one move.
DEFAULT_ROUNDS = 40
# Heaviest QO units each overloaded rank offers per round (balance phase).
DEFAULT_UNITS_PER_RANK = 4
# Destinations considered per bundle: the ranks with the most headroom.
DEFAULT_BUNDLE_DESTS = 8
# Candidate tasks each rank offers per round (bottleneck phase).
DEFAULT_TASKS_PER_RANK = 8
# mu is compared in integer arithmetic with this many parts per unit.
_MU_SCALE = 1 << 20
_BIG = 1 << 60


@dataclass(frozen=True)
class DeviceSolveResult:
    """assignment: [G, P, P] int32 (-1 empty task); balanced: 0-dim bool;
    fwd_bottleneck: 0-dim int64 bytes of the chosen state; variant: 0-dim int64."""

    assignment: torch.Tensor
    balanced: torch.Tensor
    fwd_bottleneck: torch.Tensor
    variant: torch.Tensor


class _Tasks:
    """Flat task arrays [T], T = G * P * P, in (g, i, j) order, plus static tables."""

    def __init__(self, areas: BlockAreas, config: SolverConfig):
        G, P = areas.head_groups, areas.cp_size
        dev = areas.area.device
        self.G, self.P, self.T = G, P, G * P * P
        idx = torch.arange(self.T, device=dev)
        self.g = idx // (P * P)
        self.i = (idx // P) % P
        self.j = idx % P
        self.area = areas.area.reshape(-1)
        self.valid = self.area > 0
        self.qlo, self.qhi = areas.q_need.reshape(-1, 2).unbind(-1)
        self.klo, self.khi = areas.k_need.reshape(-1, 2).unbind(-1)
        self.qo_unit = self.g * P + self.i  # [T] index of QO unit (g, i)
        self.kv_unit = self.g * P + self.j  # [T] index of KV unit (g, j)
        cost = config.cost()
        self.q, self.o, self.kv = cost.q_fwd, cost.o_fwd, cost.kv_fwd
        # tasks of each QO unit ordered by area (descending, then j): [G*P, P] task ids
        by_area = torch.sort(-areas.area.reshape(G * P, P), dim=1, stable=True).indices
        self.unit_tasks = torch.arange(G * P, device=dev)[:, None] * P + by_area
        # bottleneck-phase candidate priority: bytes to ship a task alone per unit area
        alone = ((self.qhi - self.qlo) * (self.q + self.o) + (self.khi - self.klo) * self.kv).double()
        prescore = torch.where(self.valid, alone / self.area.clamp(min=1).double(), float("inf"))
        self.pre_rank = torch.empty_like(idx)
        self.pre_rank[torch.sort(prescore, stable=True).indices] = idx


@dataclass
class _State:
    """Per-variant quantities of one assignment A [B, T+1] (column T is a dummy)."""

    rank: torch.Tensor  # [B, T], P for empty tasks
    q_lo: torch.Tensor  # [B, G*P, P] hull of each QO unit's rows at each rank
    q_hi: torch.Tensor
    k_lo: torch.Tensor  # [B, G*P, P] hull of each KV unit's columns at each rank
    k_hi: torch.Tensor
    qlen: torch.Tensor  # [B, G*P, P] tokens that travel (0 at the host)
    klen: torch.Tensor
    send: torch.Tensor  # [B, P] forward bytes
    recv: torch.Tensor
    vol: torch.Tensor  # [B, P] max(send, recv)
    bottleneck: torch.Tensor  # [B]
    load: torch.Tensor  # [B, P]


def _scatter_hull(tasks: _Tasks, rank, lo, hi, unit):
    """Hull [lo, hi) of the needs of each (unit, rank): [B, G*P, P] each."""
    B, P = rank.shape[0], tasks.P
    key = unit * (P + 1) + rank
    n = tasks.G * P * (P + 1)
    h_lo = torch.full((B, n), _BIG, dtype=torch.int64, device=rank.device)
    h_hi = torch.zeros((B, n), dtype=torch.int64, device=rank.device)
    h_lo = h_lo.scatter_reduce(1, key, lo.expand(B, -1), "amin")
    h_hi = h_hi.scatter_reduce(1, key, hi.expand(B, -1), "amax")
    return h_lo.view(B, -1, P + 1)[..., :P], h_hi.view(B, -1, P + 1)[..., :P]


def _state(tasks: _Tasks, A: torch.Tensor) -> _State:
    G, P, T = tasks.G, tasks.P, tasks.T
    rank = A[:, :T]
    B = rank.shape[0]
    q_lo, q_hi = _scatter_hull(tasks, rank, tasks.qlo, tasks.qhi, tasks.qo_unit)
    k_lo, k_hi = _scatter_hull(tasks, rank, tasks.klo, tasks.khi, tasks.kv_unit)
    ranks = torch.arange(P, device=A.device)
    at_host = (torch.arange(G * P, device=A.device) % P)[:, None] == ranks
    qlen = torch.where(at_host, 0, (q_hi - q_lo).clamp(min=0))
    klen = torch.where(at_host, 0, (k_hi - k_lo).clamp(min=0))
    q4, k4 = qlen.view(B, G, P, P), klen.view(B, G, P, P)  # [B, G, host, dest]
    q_out, q_in = q4.sum(dim=(1, 3)), q4.sum(dim=(1, 2))
    k_out, k_in = k4.sum(dim=(1, 3)), k4.sum(dim=(1, 2))
    send = q_out * tasks.q + q_in * tasks.o + k_out * tasks.kv
    recv = q_in * tasks.q + q_out * tasks.o + k_in * tasks.kv
    vol = torch.maximum(send, recv)
    load = torch.zeros((B, P + 1), dtype=torch.int64, device=A.device)
    load = load.scatter_add(1, rank, tasks.area.expand(B, -1))[:, :P]
    return _State(rank, q_lo, q_hi, k_lo, k_hi, qlen, klen, send, recv, vol, vol.amax(1), load)


def _union_growth(cur_lo, cur_hi, lo, hi):
    """Tokens a hull [cur_lo, cur_hi) grows by when [lo, hi) joins it (lo < hi)."""
    cur_len = (cur_hi - cur_lo).clamp(min=0)
    u_lo = torch.where(cur_len > 0, torch.minimum(cur_lo, lo), lo)
    u_hi = torch.where(cur_len > 0, torch.maximum(cur_hi, hi), hi)
    return (u_hi - u_lo) - cur_len


@dataclass
class _Proposals:
    """One proposed move per (variant, source rank): [B, P] each, tasks [B, P, M]."""

    ok: torch.Tensor  # bool
    score: torch.Tensor  # float64, lower is better
    dest: torch.Tensor  # int64
    area: torch.Tensor  # int64 area moved
    dest_send: torch.Tensor  # int64 bytes added to the destination's send
    dest_recv: torch.Tensor
    tasks: torch.Tensor  # [B, P, M] task ids to move, T (dummy) where unused


def _bundle_proposals(tasks: _Tasks, st: _State, cap, excess, limit, units_per_rank, n_dests) -> _Proposals:
    """Balance phase: ship a prefix of one QO unit's tasks from each overloaded source."""
    G, P, T = tasks.G, tasks.P, tasks.T
    B, dev = st.rank.shape[0], st.rank.device
    K, D = min(units_per_rank, G * P), min(n_dests, P)
    # area of each QO unit on each rank, and each source's heaviest units
    ua = torch.zeros((B, G * P * (P + 1)), dtype=torch.int64, device=dev)
    ua = ua.scatter_add(1, tasks.qo_unit * (P + 1) + st.rank, tasks.area.expand(B, -1))
    ua = ua.view(B, G * P, P + 1)[..., :P].transpose(1, 2)  # [B, P(s), G*P]
    unit = torch.topk(ua, K, dim=2, sorted=True).indices  # [B, P, K]
    # destinations: the D ranks with the most headroom (ties by rank)
    headroom = cap - st.load  # [B, P]
    dests = torch.sort(-headroom, dim=1, stable=True).indices[:, :D]  # [B, D]

    # the unit's tasks on the source, by area: [B, P(s), K, P(order)]
    tid = tasks.unit_tasks[unit]
    s = torch.arange(P, device=dev).view(1, P, 1, 1)
    mine = st.rank.gather(1, tid.view(B, -1)).view(B, P, K, P) == s
    t_area = torch.where(mine, tasks.area[tid], 0)
    after = torch.cumsum(t_area, 3)
    before = after - t_area
    # include a task while the bundle still fits the destination and the source is still over
    room = headroom.gather(1, dests).view(B, 1, 1, D, 1)
    inc = mine[:, :, :, None] & (after[:, :, :, None] <= room) & (before < excess.view(B, P, 1, 1))[:, :, :, None]
    area = torch.where(inc, t_area[:, :, :, None], 0).sum(-1)  # [B, P, K, D]

    # query rows the destination must receive (hull growth; nothing when it is the host)
    i_of = unit % P  # [B, P, K]
    qlo_t, qhi_t = tasks.qlo[tid][:, :, :, None], tasks.qhi[tid][:, :, :, None]
    b_lo = torch.where(inc, qlo_t, _BIG).amin(-1)
    b_hi = torch.where(inc, qhi_t, 0).amax(-1)
    d_idx = dests.view(B, 1, 1, D)
    cur = (unit * P)[..., None] + d_idx  # index into [B, G*P*P] hull tables
    q_grow = _union_growth(st.q_lo.reshape(B, -1).gather(1, cur.view(B, -1)).view(B, P, K, D),
                           st.q_hi.reshape(B, -1).gather(1, cur.view(B, -1)).view(B, P, K, D), b_lo, b_hi)
    q_grow = torch.where((area > 0) & (d_idx != i_of[..., None]), q_grow, 0)
    # key columns of each included task (hull growth of KV unit (g, j) at the destination)
    kv_unit = tasks.kv_unit[tid]  # [B, P, K, P]
    kcur = (kv_unit * P)[:, :, :, None, :] + d_idx[..., None]  # [B, P, K, D, P]
    k_grow = _union_growth(st.k_lo.reshape(B, -1).gather(1, kcur.view(B, -1)).view(kcur.shape),
                           st.k_hi.reshape(B, -1).gather(1, kcur.view(B, -1)).view(kcur.shape),
                           tasks.klo[tid][:, :, :, None], tasks.khi[tid][:, :, :, None])
    j_of = tasks.j[tid][:, :, :, None]
    k_grow = torch.where(inc & (j_of != d_idx[..., None]), k_grow, 0).sum(-1)  # [B, P, K, D]

    added = q_grow * (tasks.q + tasks.o) + k_grow * tasks.kv
    dest_send = q_grow * tasks.o
    dest_recv = q_grow * tasks.q + k_grow * tasks.kv
    host = i_of[..., None].expand(-1, -1, -1, D)
    host_send = st.send.gather(1, host.reshape(B, -1)).view(B, P, K, D) + q_grow * tasks.q
    host_recv = st.recv.gather(1, host.reshape(B, -1)).view(B, P, K, D) + q_grow * tasks.o
    d_send = st.send.gather(1, dests).view(B, 1, 1, D) + dest_send
    d_recv = st.recv.gather(1, dests).view(B, 1, 1, D) + dest_recv
    lim = limit.view(B, 1, 1, 1)
    ok = ((area > 0) & (excess.view(B, P, 1, 1) > 0) & (d_idx != s)
          & (torch.maximum(host_send, host_recv).double() <= lim)
          & (torch.maximum(d_send, d_recv).double() <= lim))
    score = torch.where(ok, added.double() / area.clamp(min=1).double(), float("inf"))

    best = score.view(B, P, K * D).argmin(-1, keepdim=True)  # [B, P, 1], first on ties
    pick = lambda x: x.reshape(B, P, K * D).gather(2, best).squeeze(2)  # noqa: E731
    k_best, d_best = best.squeeze(2) // D, best.squeeze(2) % D
    moved = inc.view(B, P, K * D, P).gather(2, best[..., None].expand(-1, -1, 1, P)).squeeze(2)
    tid_best = tid.gather(2, k_best.view(B, P, 1, 1).expand(-1, -1, 1, P)).squeeze(2)
    return _Proposals(ok=pick(ok), score=pick(score), dest=dests.gather(1, d_best),
                      area=pick(area), dest_send=pick(dest_send), dest_recv=pick(dest_recv),
                      tasks=torch.where(moved, tid_best, T))


def _exclusive_hull_len(A, s, rows, skip, lo, hi):
    """Hull length of a unit's other tasks on the source rank.

    A: [B, T+1]; rows: [B, N, P] task ids of the unit's tasks; skip: [B, N, P]
    True at the candidate itself; s: [B, N] source rank. Returns [B, N].
    """
    B, N, P = rows.shape
    mine = (A.gather(1, rows.view(B, -1)).view(B, N, P) == s[..., None]) & ~skip
    h_lo = torch.where(mine, lo[rows], _BIG).amin(-1)
    h_hi = torch.where(mine, hi[rows], 0).amax(-1)
    return (h_hi - h_lo).clamp(min=0)


def _task_proposals(tasks: _Tasks, st: _State, A, cap, n_cands) -> _Proposals:
    """Bottleneck phase: single-task moves that lower the bottleneck rank's volume."""
    G, P, T = tasks.G, tasks.P, tasks.T
    B, dev = st.rank.shape[0], st.rank.device
    K = min(n_cands, T)
    rank = st.rank
    bn = st.vol.argmax(1)  # [B], first rank at the bottleneck
    # candidates: tasks on each rank that touch the bottleneck rank first, cheapest first
    involved = ((rank == bn[:, None]) | ((tasks.i == bn[:, None]) & (rank != tasks.i))
                | ((tasks.j == bn[:, None]) & (rank != tasks.j)))
    order = torch.sort((rank * 2 + (~involved).long()) * T + tasks.pre_rank, dim=1, stable=True).indices
    count = torch.zeros((B, P + 1), dtype=torch.int64, device=dev)
    count = count.scatter_add(1, rank, torch.ones_like(rank))[:, :P]
    slot = torch.arange(K, device=dev)
    pos = (torch.cumsum(count, 1) - count)[:, :, None] + slot  # [B, P, K]
    cand_ok = slot < count[:, :, None]
    cand = torch.where(cand_ok, order.gather(1, pos.clamp(max=T - 1).view(B, -1)).view(B, P, K), T)
    ct = cand.clamp(max=T - 1)
    cg, ci, cj, carea = tasks.g[ct], tasks.i[ct], tasks.j[ct], tasks.area[ct]
    cand_ok = cand_ok & tasks.valid[ct]
    ranks = torch.arange(P, device=dev)
    s = ranks.view(1, P, 1).expand(B, P, K)
    d = ranks.view(1, 1, 1, P)

    # what the destination must receive
    qu, ku = tasks.qo_unit[ct], tasks.kv_unit[ct]
    at_d = lambda h, u: h.reshape(B, -1).gather(1, ((u * P)[..., None] + d).reshape(B, -1)).view(B, P, K, P)  # noqa: E731
    n_qa = _union_growth(at_d(st.q_lo, qu), at_d(st.q_hi, qu), tasks.qlo[ct][..., None], tasks.qhi[ct][..., None])
    n_qa = torch.where(d == ci[..., None], 0, n_qa)
    n_ka = _union_growth(at_d(st.k_lo, ku), at_d(st.k_hi, ku), tasks.klo[ct][..., None], tasks.khi[ct][..., None])
    n_ka = torch.where(d == cj[..., None], 0, n_ka)
    # what leaving the source frees
    qo_rows = (cg * P + ci)[..., None] * P + ranks  # tasks (g, i, *)
    kv_rows = (cg * P * P + cj)[..., None] + ranks * P  # tasks (g, *, j)
    s_flat = s.reshape(B, P * K)
    q_excl = _exclusive_hull_len(A, s_flat, qo_rows.view(B, -1, P), (ranks == cj[..., None]).view(B, -1, P),
                                 tasks.qlo, tasks.qhi).view(B, P, K)
    k_excl = _exclusive_hull_len(A, s_flat, kv_rows.view(B, -1, P), (ranks == ci[..., None]).view(B, -1, P),
                                 tasks.klo, tasks.khi).view(B, P, K)
    q_cur = st.qlen.reshape(B, -1).gather(1, (qu * P + s).view(B, -1)).view(B, P, K)
    k_cur = st.klen.reshape(B, -1).gather(1, (ku * P + s).view(B, -1)).view(B, P, K)
    m_qf = torch.where(s == ci, 0, q_cur - q_excl)[..., None]
    m_kf = torch.where(s == cj, 0, k_cur - k_excl)[..., None]

    # byte deltas at the four touched ranks (query host, key host, source, destination)
    dq, dk = n_qa - m_qf, n_ka - m_kf
    full = (B, P, K, P)
    roles = ((ci[..., None].expand(full), dq * tasks.q, dq * tasks.o),
             (cj[..., None].expand(full), dk * tasks.kv, torch.zeros_like(dk)),
             (s[..., None].expand(full), (-m_qf * tasks.o).expand(full), (-(m_qf * tasks.q + m_kf * tasks.kv)).expand(full)),
             (d.expand(full), n_qa * tasks.o, n_qa * tasks.q + n_ka * tasks.kv))
    new_max = torch.zeros(full, dtype=torch.int64, device=dev)
    bn_new = torch.zeros(full, dtype=torch.int64, device=dev)
    bn_touched = torch.zeros(full, dtype=torch.bool, device=dev)
    for rx, _, _ in roles:
        sx = st.send.gather(1, rx.reshape(B, -1)).view(full)
        vx = st.recv.gather(1, rx.reshape(B, -1)).view(full)
        for ry, dsy, dry in roles:
            same = ry == rx
            sx = sx + torch.where(same, dsy, 0)
            vx = vx + torch.where(same, dry, 0)
        new_x = torch.maximum(sx, vx)
        new_max = torch.maximum(new_max, new_x)
        at_bn = rx == bn.view(B, 1, 1, 1)
        bn_touched = bn_touched | at_bn
        bn_new = torch.where(at_bn, new_x, bn_new)

    bnv = st.bottleneck.view(B, 1, 1, 1)
    ok = ((st.load.view(B, 1, 1, P) + carea[..., None] <= cap) & (d != s[..., None]) & cand_ok[..., None]
          & bn_touched & (bn_new < bnv) & (new_max < bnv))
    added = dq * (tasks.q + tasks.o) + dk * tasks.kv
    score = torch.where(ok, new_max.double() / bnv.clamp(min=1).double() + 1e-12 * added.double(), float("inf"))
    best = score.view(B, P, K * P).argmin(-1, keepdim=True)
    pick = lambda x: x.expand(full).reshape(B, P, K * P).gather(2, best).squeeze(2)  # noqa: E731
    k_best = best.squeeze(2) // P
    return _Proposals(ok=pick(ok), score=pick(score), dest=best.squeeze(2) % P,
                      area=carea.gather(2, k_best[..., None]).squeeze(2),
                      dest_send=pick(roles[3][1]), dest_recv=pick(roles[3][2]),
                      tasks=cand.gather(2, k_best[..., None]))


def _accept(prop: _Proposals, st: _State, cap, limit) -> torch.Tensor:
    """Each destination accepts proposals in score order while load and volume fit: [B, P] bool."""
    B, P = prop.ok.shape
    dev = prop.ok.device
    # global position of each proposal by score (stable: source index breaks ties)
    pos = torch.empty((B, P), dtype=torch.int64, device=dev)
    pos.scatter_(1, torch.sort(prop.score, dim=1, stable=True).indices, torch.arange(P, device=dev).expand(B, -1))
    order = torch.sort(torch.where(prop.ok, prop.dest * P + pos, _BIG), dim=1, stable=True).indices
    d_sorted = torch.where(prop.ok, prop.dest, P).gather(1, order)
    new_seg = torch.cat((torch.ones_like(d_sorted[:, :1], dtype=torch.bool), d_sorted[:, 1:] != d_sorted[:, :-1]), 1)
    seg_start = torch.cummax(torch.where(new_seg, torch.arange(P, device=dev).expand(B, -1), 0), 1).values

    def running(x):  # running sum of x within each destination's segment
        csum = torch.cumsum(torch.where(prop.ok, x, 0).gather(1, order), 1)
        return csum - torch.where(seg_start > 0, csum.gather(1, (seg_start - 1).clamp(min=0)), 0)

    pad = torch.zeros_like(st.load[:, :1])
    at_d = lambda t: torch.cat((t, pad), 1).gather(1, d_sorted)  # noqa: E731
    lim = limit[:, None]
    fits = ((at_d(st.load) + running(prop.area) <= cap)
            & ((at_d(st.send) + running(prop.dest_send)).double() <= lim)
            & ((at_d(st.recv) + running(prop.dest_recv)).double() <= lim))
    return torch.zeros_like(prop.ok).scatter(1, order, fits) & prop.ok


def _merge(balance: torch.Tensor, a: _Proposals, b: _Proposals, dummy: int) -> _Proposals:
    """Per variant, the balance-phase proposals where ``balance``, else the others."""
    m = max(a.tasks.shape[2], b.tasks.shape[2])
    ta = torch.nn.functional.pad(a.tasks, (0, m - a.tasks.shape[2]), value=dummy)
    tb = torch.nn.functional.pad(b.tasks, (0, m - b.tasks.shape[2]), value=dummy)
    sel = balance.view(-1, 1)
    return _Proposals(*(torch.where(sel, x, y) for x, y in
                        ((a.ok, b.ok), (a.score, b.score), (a.dest, b.dest), (a.area, b.area),
                         (a.dest_send, b.dest_send), (a.dest_recv, b.dest_recv))),
                      tasks=torch.where(sel[..., None], ta, tb))


def solve_device(areas: BlockAreas, config: SolverConfig, *,
                 rounds: int = DEFAULT_ROUNDS,
                 threshold_scales: tuple[float, ...] = DEFAULT_THRESHOLD_SCALES,
                 units_per_rank: int = DEFAULT_UNITS_PER_RANK,
                 bundle_dests: int = DEFAULT_BUNDLE_DESTS,
                 tasks_per_rank: int = DEFAULT_TASKS_PER_RANK) -> DeviceSolveResult:
    """Assign every task to a rank, on the device of ``areas``, without host reads.

    areas:  BlockAreas (area [G, P, P] int64, q_need/k_need [G, P, P, 2] int64).
    config: SolverConfig (P, heads, D, dtype, imbalance_tol).
    Returns a DeviceSolveResult; ``assignment`` is [G, P, P] int32.
    """
    G, P = areas.head_groups, areas.cp_size
    if P != config.cp_size:
        raise ValueError(f"areas are for P={P} ranks but config.cp_size={config.cp_size}")
    if G != config.head_groups:
        raise ValueError(f"areas have G={G} head groups but config.head_groups={config.head_groups}")
    if rounds < 0 or not threshold_scales:
        raise ValueError(f"need rounds >= 0 and at least one threshold scale, got {rounds}, {threshold_scales}")
    tasks = _Tasks(areas, config)
    T, dev = tasks.T, areas.area.device
    B = len(threshold_scales)
    mu_num = int(round(config.imbalance_tol * _MU_SCALE))
    cap = (mu_num * tasks.area.sum()) // (P * _MU_SCALE)  # largest balanced load
    finite = torch.tensor([s if s != float("inf") else 0.0 for s in threshold_scales], dtype=torch.float64, device=dev)
    unbounded = torch.tensor([s == float("inf") for s in threshold_scales], device=dev)

    # owner-computes start; column T is a dummy that absorbs writes of unused slots
    A = torch.where(tasks.valid, tasks.i, P).expand(B, T)
    A = torch.cat((A, torch.full((B, 1), P, dtype=torch.int64, device=dev)), dim=1)
    best_A = A.clone()
    best_key = torch.full((B,), _BIG, dtype=torch.int64, device=dev)
    threshold = None
    for rnd in range(rounds + 1):
        st = _state(tasks, A)
        if threshold is None:  # round 0 is owner-computes, the ladder's base
            threshold = torch.where(unbounded, float(_BIG), finite * st.bottleneck[0].double() + 1.0)
        max_load = st.load.amax(1)
        balanced = max_load <= cap
        # balanced beats unbalanced, then the lower bottleneck (or the lower max load)
        key = torch.where(balanced, st.bottleneck, _BIG // 2 + max_load)
        better = key < best_key
        best_key = torch.where(better, key, best_key)
        best_A = torch.where(better[:, None], A, best_A)
        if rnd == rounds:
            break
        excess = st.load - cap
        balance = ~balanced
        prop = _merge(balance,
                      _bundle_proposals(tasks, st, cap, excess, threshold, units_per_rank, bundle_dests),
                      _task_proposals(tasks, st, A, cap, tasks_per_rank), T)
        limit = torch.where(balance, threshold, st.bottleneck.double() - 1)
        keep = _accept(prop, st, cap, limit)
        moving = torch.where(keep[..., None], prop.tasks, T)
        A = A.scatter(1, moving.view(B, -1), prop.dest[..., None].expand_as(moving).reshape(B, -1))

    winner = best_key.argmin()
    ok = best_key[winner] < _BIG // 2
    assignment = torch.where(tasks.valid, best_A[winner, :T], -1).view(G, P, P).to(torch.int32)
    return DeviceSolveResult(assignment=assignment, balanced=ok,
                             fwd_bottleneck=torch.where(ok, best_key[winner], -1), variant=winner)
