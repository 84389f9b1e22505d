"""The device solver: parallel scored moves from owner-computes.

Every operation is a whole-tensor op over static shapes and the loop runs a
fixed number of rounds, so the solve runs on any device without host reads
(it runs on ``device="meta"``) and can be captured in a CUDA graph.

The algorithm (DESIGN.md, "The solver", family 2):

* Start from owner-computes: every task on its query host (no Q/O traffic,
  usually unbalanced).
* A batch of ``B`` variants runs side by side, one per communication
  threshold ``T_b`` (a ladder of multiples of owner-computes' bottleneck,
  the last one unbounded).
* Each round, every rank offers ``K`` candidate tasks and every candidate is
  scored against every destination rank with the exact marginal cost of the
  move: what it adds to the destination's hull of the task's QO and KV units
  and what it frees at the source (the hull of the unit's other tasks there),
  in bytes at the four ranks it touches (query host, key host, source,
  destination).
* While a rank is over ``mu x mean`` (balance phase) moves off overloaded
  ranks are chosen by least added bytes per unit of area, subject to every
  touched rank staying under ``T_b``; once balanced (bottleneck phase) moves
  are chosen that lower the volume of the bottleneck rank without pushing any
  touched rank up to the bottleneck.
* Selection is by segmented arg-min: each candidate task picks its best
  destination, each destination accepts its best incoming candidate, and each
  source keeps its accepted moves up to its excess load (a prefix sum).
* The best state of each variant is tracked over the rounds (balanced first,
  then the lowest forward bottleneck), and the best variant wins.

All volumes are forward bytes, integers; ties break by index, so the result
is bit-identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpusolver.config import SolverConfig
from gpusolver.problem import BlockAreas

# Threshold ladder, as multiples of owner-computes' forward bottleneck; inf = unbounded.
DEFAULT_THRESHOLD_SCALES = (1.0, 1.25, 1.5, 2.0, float("inf"))
# Candidate tasks each rank offers per round.
DEFAULT_CANDIDATES_PER_RANK = 16
# Rounds of moves; each round moves at most one task into each rank.
DEFAULT_ROUNDS = 48
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
    """Flat task arrays [T], T = G * P * P, in (g, i, j) order."""

    def __init__(self, areas: BlockAreas):
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


class _Bytes:
    """Forward bytes per token: Q out, O (+lse) back, K+V out."""

    def __init__(self, config: SolverConfig):
        c = config.cost()
        self.q, self.o, self.kv = c.q_fwd, c.o_fwd, c.kv_fwd


def _hulls(tasks: _Tasks, rank: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hull [lo, hi) of the needs of each (unit, rank): [B, G*P, P] each.

    rank: [B, T] with P for tasks that are empty (a dummy column, dropped).
    A unit's range at its own host is not cleared here (callers mask it).
    """
    B, P = rank.shape[0], tasks.P
    key = unit * (P + 1) + rank  # [B, T]
    n = tasks.G * P * (P + 1)
    h_lo = torch.full((B, n), _BIG, dtype=torch.int64, device=rank.device)
    h_hi = torch.zeros((B, n), dtype=torch.int64, device=rank.device)
    h_lo = h_lo.scatter_reduce(1, key, lo.expand(B, -1), "amin")
    h_hi = h_hi.scatter_reduce(1, key, hi.expand(B, -1), "amax")
    h_lo = h_lo.view(B, tasks.G * P, P + 1)[..., :P]
    h_hi = h_hi.view(B, tasks.G * P, P + 1)[..., :P]
    return h_lo, h_hi


def _hull_len(h_lo: torch.Tensor, h_hi: torch.Tensor, P: int) -> torch.Tensor:
    """Token count of each (unit, rank) hull, 0 at the unit's host: [B, G*P, P]."""
    host = torch.arange(h_lo.shape[1], device=h_lo.device) % P
    at_host = host[:, None] == torch.arange(P, device=h_lo.device)
    return torch.where(at_host, 0, (h_hi - h_lo).clamp(min=0))


def _rank_volumes(qlen: torch.Tensor, klen: torch.Tensor, G: int, P: int,
                  by: _Bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward send and receive bytes per rank, [B, P] int64 each."""
    B = qlen.shape[0]
    q4 = qlen.view(B, G, P, P)  # [B, G, host, dest]
    k4 = klen.view(B, G, P, P)
    q_host = q4.sum(dim=(1, 3))  # tokens each host ships out
    q_dest = q4.sum(dim=(1, 2))  # tokens each destination takes in
    k_host = k4.sum(dim=(1, 3))
    k_dest = k4.sum(dim=(1, 2))
    send = q_host * by.q + q_dest * by.o + k_host * by.kv
    recv = q_dest * by.q + q_host * by.o + k_dest * by.kv
    return send, recv


def _exclusive_hull(A: torch.Tensor, s: torch.Tensor, rows: torch.Tensor, skip: torch.Tensor,
                    lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Length of the hull of a unit's other tasks on the candidate's source rank.

    A: [B, T+1] ranks; rows: [B, N, P] task indices of the unit's tasks;
    skip: [B, N, P] True at the candidate itself; s: [B, N] source rank.
    Returns [B, N] int64.
    """
    B, N, P = rows.shape
    r = A.gather(1, rows.view(B, -1)).view(B, N, P)
    mine = (r == s[..., None]) & ~skip
    h_lo = torch.where(mine, lo[rows], _BIG).amin(-1)
    h_hi = torch.where(mine, hi[rows], 0).amax(-1)
    return (h_hi - h_lo).clamp(min=0)


def _union_growth(cur_lo, cur_hi, lo, hi):
    """Tokens a hull [cur_lo, cur_hi) grows by when [lo, hi) joins it."""
    cur_len = (cur_hi - cur_lo).clamp(min=0)
    u_lo = torch.where(cur_len > 0, torch.minimum(cur_lo, lo), lo)
    u_hi = torch.where(cur_len > 0, torch.maximum(cur_hi, hi), hi)
    return (u_hi - u_lo) - cur_len


def solve_device(areas: BlockAreas, config: SolverConfig, *,
                 rounds: int = DEFAULT_ROUNDS,
                 candidates_per_rank: int = DEFAULT_CANDIDATES_PER_RANK,
                 threshold_scales: tuple[float, ...] = DEFAULT_THRESHOLD_SCALES) -> DeviceSolveResult:
    """Assign every task to a rank, on the device of ``areas``, without host reads.

    areas:  BlockAreas (area [G, P, P] int64, q_need/k_need [G, P, P, 2] int64).
    config: SolverConfig (P, heads, D, dtype, imbalance_tol).
    Returns a DeviceSolveResult; ``assignment`` is [G, P, P] int32.
    """
    tasks = _Tasks(areas)
    G, P, T = tasks.G, tasks.P, tasks.T
    if P != config.cp_size:
        raise ValueError(f"areas are for P={P} ranks but config.cp_size={config.cp_size}")
    if G != config.head_groups:
        raise ValueError(f"areas have G={G} head groups but config.head_groups={config.head_groups}")
    by = _Bytes(config)
    dev = areas.area.device
    B = len(threshold_scales)
    K = min(candidates_per_rank, G * P * P)
    mu_num = int(round(config.imbalance_tol * _MU_SCALE))

    total = tasks.area.sum()
    # load <= mu * total / P, in integers: load * P * SCALE <= mu_num * total
    cap_lhs_scale = P * _MU_SCALE
    cap = (mu_num * total) // cap_lhs_scale  # largest balanced load

    # Static per-task candidate priority: bytes to ship the task alone per unit area.
    alone = ((tasks.qhi - tasks.qlo) * (by.q + by.o) + (tasks.khi - tasks.klo) * by.kv).double()
    prescore = torch.where(tasks.valid, alone / tasks.area.clamp(min=1).double(), float("inf"))
    pre_rank = torch.empty_like(tasks.g)
    pre_rank[torch.sort(prescore, stable=True).indices] = torch.arange(T, device=dev)

    # A has one dummy column at T that absorbs writes of invalid candidates.
    A = torch.where(tasks.valid, tasks.i, P).expand(B, T)
    A = torch.cat((A, torch.full((B, 1), P, dtype=torch.int64, device=dev)), dim=1)
    bidx = torch.arange(B, device=dev)[:, None]
    ranks = torch.arange(P, device=dev)

    best_A = A.clone()
    best_key = torch.full((B,), _BIG, dtype=torch.int64, device=dev)
    scales = torch.tensor([s if s != float("inf") else 0.0 for s in threshold_scales],
                          dtype=torch.float64, device=dev)
    unbounded = torch.tensor([s == float("inf") for s in threshold_scales], device=dev)
    threshold = None

    # task index tables for exclusive hulls: the tasks of the candidate's QO unit (over j)
    # and of its KV unit (over i)
    j_row = ranks  # [P]
    for rnd in range(rounds + 1):
        rank = A[:, :T]
        q_lo_h, q_hi_h = _hulls(tasks, rank, tasks.qlo, tasks.qhi, tasks.qo_unit)
        k_lo_h, k_hi_h = _hulls(tasks, rank, tasks.klo, tasks.khi, tasks.kv_unit)
        qlen = _hull_len(q_lo_h, q_hi_h, P)
        klen = _hull_len(k_lo_h, k_hi_h, P)
        send, recv = _rank_volumes(qlen, klen, G, P, by)
        vol = torch.maximum(send, recv)  # [B, P]
        bottleneck = vol.amax(1)  # [B]
        load = torch.zeros((B, P + 1), dtype=torch.int64, device=dev)
        load = load.scatter_add(1, rank, tasks.area.expand(B, -1))[:, :P]
        max_load = load.amax(1)
        balanced = max_load <= cap

        if threshold is None:  # round 0 is owner-computes: the ladder's base
            base = bottleneck[0].double()
            threshold = torch.where(unbounded, float(_BIG), scales * base + 1.0)

        # Keep the best state of each variant: balanced beats unbalanced, then lower bottleneck.
        key = torch.where(balanced, bottleneck, _BIG // 2 + max_load)
        better = key < best_key
        best_key = torch.where(better, key, best_key)
        best_A = torch.where(better[:, None], A, best_A)
        if rnd == rounds:
            break

        over = load > cap  # [B, P]
        phase_balance = over.any(1)  # [B]
        bn_rank = vol.argmax(1)  # [B], first rank at the bottleneck

        # --- candidates: K tasks per source rank, by phase-dependent priority ---
        involved = ((rank == bn_rank[:, None])
                    | ((tasks.i == bn_rank[:, None]) & (rank != tasks.i))
                    | ((tasks.j == bn_rank[:, None]) & (rank != tasks.j)))
        tier = torch.where(phase_balance[:, None], 0, (~involved).long())
        sort_key = (rank * 2 + tier) * T + pre_rank
        order = torch.sort(sort_key, dim=1, stable=True).indices  # [B, T]
        count = torch.zeros((B, P + 1), dtype=torch.int64, device=dev)
        count = count.scatter_add(1, rank, torch.ones_like(rank))[:, :P]
        start = torch.cumsum(count, 1) - count
        slot = torch.arange(K, device=dev)
        pos = start[:, :, None] + slot  # [B, P, K]
        cand_ok = slot < count[:, :, None]
        cand = torch.where(cand_ok, order.gather(1, pos.clamp(max=T - 1).view(B, -1)).view(B, P, K), T)
        ct = cand.clamp(max=T - 1)  # safe gather index; masked by cand_ok
        cg, ci, cj = tasks.g[ct], tasks.i[ct], tasks.j[ct]
        carea = tasks.area[ct]
        s = ranks.view(1, P, 1).expand(B, P, K)
        cand_ok = cand_ok & tasks.valid[ct]

        # --- exact marginal cost of moving candidate (b, s, k) to each destination d ---
        d = ranks.view(1, 1, 1, P)
        qu, ku = tasks.qo_unit[ct], tasks.kv_unit[ct]  # [B, P, K]
        q_lo_d = q_lo_h.gather(1, qu.view(B, -1, 1).expand(-1, -1, P).reshape(B, -1, P)).view(B, P, K, P)
        q_hi_d = q_hi_h.gather(1, qu.view(B, -1, 1).expand(-1, -1, P).reshape(B, -1, P)).view(B, P, K, P)
        k_lo_d = k_lo_h.gather(1, ku.view(B, -1, 1).expand(-1, -1, P).reshape(B, -1, P)).view(B, P, K, P)
        k_hi_d = k_hi_h.gather(1, ku.view(B, -1, 1).expand(-1, -1, P).reshape(B, -1, P)).view(B, P, K, P)
        n_qa = _union_growth(q_lo_d, q_hi_d, tasks.qlo[ct][..., None], tasks.qhi[ct][..., None])
        n_qa = torch.where(d == ci[..., None], 0, n_qa)
        n_ka = _union_growth(k_lo_d, k_hi_d, tasks.klo[ct][..., None], tasks.khi[ct][..., None])
        n_ka = torch.where(d == cj[..., None], 0, n_ka)

        # what leaving the source frees: current hull length minus the hull of the unit's other tasks
        qo_rows = (cg * P + ci)[..., None] * P + j_row  # tasks (g, i, *): [B, P, K, P]
        kv_rows = (cg * P * P + cj)[..., None] + j_row * P  # tasks (g, *, j)
        s_flat = s.reshape(B, P * K)
        q_excl = _exclusive_hull(A, s_flat, qo_rows.view(B, P * K, P),
                                 (j_row == cj[..., None]).view(B, P * K, P), tasks.qlo, tasks.qhi).view(B, P, K)
        k_excl = _exclusive_hull(A, s_flat, kv_rows.view(B, P * K, P),
                                 (j_row == ci[..., None]).view(B, P * K, P), tasks.klo, tasks.khi).view(B, P, K)
        q_cur_s = qlen.view(B, -1).gather(1, (qu * P + s).view(B, -1)).view(B, P, K)
        k_cur_s = klen.view(B, -1).gather(1, (ku * P + s).view(B, -1)).view(B, P, K)
        m_qf = torch.where(s == ci, 0, q_cur_s - q_excl)[..., None]  # [B, P, K, 1]
        m_kf = torch.where(s == cj, 0, k_cur_s - k_excl)[..., None]

        # byte deltas at the four touched ranks (they may coincide)
        dq = n_qa - m_qf
        dk = n_ka - m_kf
        roles_rank = (ci[..., None].expand(-1, -1, -1, P), cj[..., None].expand(-1, -1, -1, P),
                      s[..., None].expand(-1, -1, -1, P), d.expand(B, P, K, P))
        roles_send = (dq * by.q, dk * by.kv, n_qa * by.o, (-m_qf * by.o).expand(-1, -1, -1, P))
        roles_recv = (dq * by.o, torch.zeros_like(dk), n_qa * by.q + n_ka * by.kv,
                      (-(m_qf * by.q + m_kf * by.kv)).expand(-1, -1, -1, P))
        new_max = torch.zeros((B, P, K, P), dtype=torch.int64, device=dev)
        bn_new = torch.zeros((B, P, K, P), dtype=torch.int64, device=dev)
        bn_touched = torch.zeros((B, P, K, P), dtype=torch.bool, device=dev)
        for x in range(4):
            rx = roles_rank[x]
            sx = send.gather(1, rx.reshape(B, -1)).view(B, P, K, P)
            vx = recv.gather(1, rx.reshape(B, -1)).view(B, P, K, P)
            for y in range(4):
                same = roles_rank[y] == rx
                sx = sx + torch.where(same, roles_send[y], 0)
                vx = vx + torch.where(same, roles_recv[y], 0)
            new_x = torch.maximum(sx, vx)
            new_max = torch.maximum(new_max, new_x)
            at_bn = rx == bn_rank.view(B, 1, 1, 1)
            bn_touched = bn_touched | at_bn
            bn_new = torch.where(at_bn, new_x, bn_new)

        load_d = load.view(B, 1, 1, P)
        fits = (load_d + carea[..., None] <= cap) & (d != s[..., None]) & cand_ok[..., None]
        added = dq * (by.q + by.o) + dk * by.kv  # total bytes the move adds
        # balance phase: least added bytes per area, every touched rank under T
        ok_bal = fits & over[:, :, None, None] & (new_max.double() <= threshold.view(B, 1, 1, 1))
        score_bal = added.double() / carea[..., None].clamp(min=1).double()
        # bottleneck phase: the bottleneck rank goes down and no touched rank reaches it
        bnv = bottleneck.view(B, 1, 1, 1)
        ok_bn = fits & bn_touched & (bn_new < bnv) & (new_max < bnv)
        score_bn = new_max.double() / bnv.clamp(min=1).double() + 1e-9 * added.double()
        pb = phase_balance.view(B, 1, 1, 1)
        ok = torch.where(pb, ok_bal, ok_bn)
        score = torch.where(ok, torch.where(pb, score_bal, score_bn), float("inf"))

        # --- selection by segmented arg-mins ---
        best_score, best_d = score.min(-1)  # each candidate's best destination, [B, P, K]
        dest_send = roles_send[2].gather(3, best_d[..., None]).squeeze(3)  # bytes the move adds at d
        dest_recv = roles_recv[2].gather(3, best_d[..., None]).squeeze(3)
        has = torch.isfinite(best_score)
        # global order of all candidates by score (stable: index tie-break)
        flat_score = best_score.view(B, -1)
        rank_pos = torch.empty_like(flat_score, dtype=torch.int64)
        rank_pos.scatter_(1, torch.sort(flat_score, dim=1, stable=True).indices,
                          torch.arange(P * K, device=dev).expand(B, -1))
        rank_pos = torch.where(has.view(B, -1), rank_pos, _BIG).view(B, P, K)
        # each source proposes its best candidate (one move per source per round, so the
        # next round prices the source's remaining tasks against the units it just shipped)
        pick = rank_pos.argmin(-1, keepdim=True)  # [B, P, 1]
        prop = has.gather(2, pick).squeeze(2)  # [B, P]
        prop_d = best_d.gather(2, pick).squeeze(2)
        prop_area = carea.gather(2, pick).squeeze(2)
        prop_pos = rank_pos.gather(2, pick).squeeze(2)
        prop_task = cand.gather(2, pick).squeeze(2)
        prop_send = dest_send.gather(2, pick).squeeze(2)
        prop_recv = dest_recv.gather(2, pick).squeeze(2)
        # each destination accepts proposals in score order while they fit under the cap
        order_d = torch.sort(torch.where(prop, prop_d * (P * K) + prop_pos, _BIG), dim=1, stable=True).indices
        d_sorted = torch.where(prop, prop_d, P).gather(1, order_d)
        a_sorted = torch.where(prop, prop_area, 0).gather(1, order_d)
        seg_start = torch.cummax(torch.where(
            torch.cat((torch.ones_like(d_sorted[:, :1], dtype=torch.bool), d_sorted[:, 1:] != d_sorted[:, :-1]), 1),
            torch.arange(P, device=dev).expand(B, -1), 0), 1).values

        def in_segment(x):  # running sum of x within each destination's segment
            csum = torch.cumsum(x, 1)
            return csum - torch.where(seg_start > 0, csum.gather(1, (seg_start - 1).clamp(min=0)), 0)

        pad = torch.zeros_like(load[:, :1])
        at_d = lambda t: torch.cat((t, pad), 1).gather(1, d_sorted)  # noqa: E731
        limit = torch.where(phase_balance, threshold, bottleneck.double() - 1)[:, None]
        s_sorted = torch.where(prop, prop_send, 0).gather(1, order_d)
        r_sorted = torch.where(prop, prop_recv, 0).gather(1, order_d)
        fits_sorted = ((at_d(load) + in_segment(a_sorted) <= cap)
                       & ((at_d(send) + in_segment(s_sorted)).double() <= limit)
                       & ((at_d(recv) + in_segment(r_sorted)).double() <= limit))
        keep = torch.zeros_like(prop).scatter(1, order_d, fits_sorted) & prop
        A = A.scatter(1, torch.where(keep, prop_task, T), torch.where(keep, prop_d, P))

    winner = best_key.argmin()
    best = best_A[winner, :T]
    assignment = torch.where(tasks.valid, best, -1).view(G, P, P).to(torch.int32)
    return DeviceSolveResult(assignment=assignment, balanced=best_key[winner] < _BIG // 2,
                             fwd_bottleneck=torch.where(best_key[winner] < _BIG // 2, best_key[winner], -1),
                             variant=winner)
