"""Host-side (numpy) pieces of the reference solver: volumes and edge selection.

Shape legend: G head groups, P ranks, c tokens per chunk, E candidate edges.

Ranges are kept per (unit, destination) as flat ``[G * P * P]`` arrays indexed
``(g * P + u) * P + r``: unit ``u`` (a query chunk for QO, a key chunk for KV)
of group ``g`` sent to rank ``r``; ``hi <= lo`` means nothing travels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Edge kinds. Each edge sends one unit to a helper rank r and names the tasks
# it serves (the tasks that become executable on r through it):
EDGE_KV_PAIR = 0  # KV unit (g, j) -> r: serves task (g, r, j), whose QO is local on r
EDGE_QO_PAIR = 1  # QO unit (g, i) -> r: serves task (g, i, r), whose KV is local on r
EDGE_QO_ROW = 2   # QO unit (g, i) -> r plus the KV its row needs: serves tasks (g, i, *)


@dataclass(frozen=True)
class HostProblem:
    """The solve's inputs as numpy arrays.

    area:         [G, P, P] int64.
    q_lo, q_hi:   [G, P, P] int64, needed query rows [lo, hi) of task (g, i, j).
    k_lo, k_hi:   [G, P, P] int64, needed key columns of task (g, i, j).
    q_tok, o_tok, kv_tok: forward bytes per token of Q (host -> helper),
                  partial O + lse (helper -> host), K and V (host -> helper).
    cap:          max load allowed on a rank, floor(mu * total / P).
    """

    area: np.ndarray
    q_lo: np.ndarray
    q_hi: np.ndarray
    k_lo: np.ndarray
    k_hi: np.ndarray
    q_tok: int
    o_tok: int
    kv_tok: int
    cap: int

    @property
    def G(self) -> int:
        return self.area.shape[0]

    @property
    def P(self) -> int:
        return self.area.shape[1]


def forward_volumes(prob: HostProblem, assign: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Forward bytes each rank sends and receives under an assignment.

    assign: [G, P, P] int, rank of task (g, i, j) (-1 for empty tasks).
    Returns (send, recv), each [P] int64. A rank computing several tasks of a
    unit receives the hull of their needs once (as ``transfer_ranges``).
    """
    P = prob.P
    ranks = np.arange(P)
    on = (assign[..., None] == ranks) & (prob.area[..., None] > 0)  # [G, P(i), P(j), P(r)]
    big = np.iinfo(np.int64).max

    def hull_len(lo, hi, axis):
        h_lo = np.where(on, lo[..., None], big).min(axis=axis)
        h_hi = np.where(on, hi[..., None], 0).max(axis=axis)
        n = np.maximum(h_hi - h_lo, 0)  # [G, P(unit), P(r)]
        n[:, ranks, ranks] = 0  # nothing travels to the unit's own host
        return n

    nq = hull_len(prob.q_lo, prob.q_hi, 2)
    nk = hull_len(prob.k_lo, prob.k_hi, 1)
    q_out, q_in = nq.sum(axis=(0, 2)), nq.sum(axis=(0, 1))
    k_out, k_in = nk.sum(axis=(0, 2)), nk.sum(axis=(0, 1))
    send = q_out * prob.q_tok + q_in * prob.o_tok + k_out * prob.kv_tok
    recv = q_out * prob.o_tok + q_in * prob.q_tok + k_in * prob.kv_tok
    return send.astype(np.int64), recv.astype(np.int64)


def loads(prob: HostProblem, assign: np.ndarray) -> np.ndarray:
    """[P] int64: summed area of the tasks on each rank."""
    nonempty = prob.area > 0
    out = np.zeros(prob.P, dtype=np.int64)
    np.add.at(out, assign[nonempty], prob.area[nonempty].astype(np.int64))  # int64: exact past 2^53
    return out


@dataclass(frozen=True)
class EdgeSet:
    """Every candidate edge of a problem, independent of K.

    kind, g, u, r: [E] int64 — edge kind, group, unit (host rank), helper rank.
    unlock:        [E] float64 — area of the tasks the edge serves.
    cost:          [E] float64 — forward bytes the edge moves on its own
                   (both directions, both endpoints' per-token bytes).
    row_q:         [G, P, 2] int64 — hull of q needs over each row's tasks.
    row_js:        per (g, i) flat index, the list of (j, k_lo, k_hi) of the
                   row's non-empty tasks (host lists for the sequential scan).
    """

    kind: np.ndarray
    g: np.ndarray
    u: np.ndarray
    r: np.ndarray
    unlock: np.ndarray
    cost: np.ndarray
    row_q: np.ndarray
    row_js: list


def candidate_edges(prob: HostProblem) -> EdgeSet:
    """Build the pair edges of every off-diagonal non-empty task and the row edges."""
    G, P = prob.G, prob.P
    area = prob.area
    nonempty = area > 0
    offdiag = nonempty & ~np.eye(P, dtype=bool)[None]
    # pair edges of task (g, i, j), i != j: KV (g, j) -> i and QO (g, i) -> j
    tg, ti, tj = np.nonzero(offdiag)
    t_area = area[tg, ti, tj].astype(np.float64)
    kv_cost = (prob.k_hi - prob.k_lo)[tg, ti, tj] * float(prob.kv_tok)
    qo_cost = (prob.q_hi - prob.q_lo)[tg, ti, tj] * float(prob.q_tok + prob.o_tok)

    big = np.iinfo(np.int64).max
    row_lo = np.where(nonempty, prob.q_lo, big).min(axis=2)
    row_hi = np.where(nonempty, prob.q_hi, 0).max(axis=2)
    has_row = row_hi > row_lo
    row_q = np.stack((np.where(has_row, row_lo, 0), np.where(has_row, row_hi, 0)), axis=-1)
    row_area = area.sum(axis=2).astype(np.float64)  # [G, P]
    row_js = [[] for _ in range(G * P)]
    for g, i, j in zip(*np.nonzero(nonempty)):
        row_js[g * P + i].append((int(j), int(prob.k_lo[g, i, j]), int(prob.k_hi[g, i, j])))
    # row edge (g, i) -> r, r != i: Q hull plus, for every j != r, the KV need
    # of task (g, i, j) (a helper already holding KV (g, j) gets it for free)
    kv_len = (prob.k_hi - prob.k_lo) * nonempty  # [G, P(i), P(j)]
    kv_row = kv_len.sum(axis=2)[..., None] - kv_len  # [G, P(i), P(r)]: all j but j == r
    rg, ri, rr = np.nonzero((row_area[..., None] > 0) & ~np.eye(P, dtype=bool)[None])
    row_cost = ((row_q[rg, ri, 1] - row_q[rg, ri, 0]) * float(prob.q_tok + prob.o_tok)
                + kv_row[rg, ri, rr] * float(prob.kv_tok))

    n_pair, n_row = tg.size, rg.size
    kind = np.concatenate((np.full(n_pair, EDGE_KV_PAIR), np.full(n_pair, EDGE_QO_PAIR), np.full(n_row, EDGE_QO_ROW)))
    return EdgeSet(
        kind=kind,
        g=np.concatenate((tg, tg, rg)),
        u=np.concatenate((tj, ti, ri)),
        r=np.concatenate((ti, tj, rr)),
        unlock=np.concatenate((t_area, t_area, row_area[rg, ri])),
        cost=np.maximum(np.concatenate((kv_cost, qo_cost, row_cost)), 1.0),
        row_q=row_q,
        row_js=row_js,
    )


def edge_weights(prob: HostProblem, edges: EdgeSet, prev: np.ndarray | None, owner_load: np.ndarray,
                 share_weight: float, smoothing: float) -> np.ndarray:
    """Benefit W of every edge.

    prev:       [G, P, P] int, the last feasible assignment, or None.
    owner_load: [P] int64, loads when every task runs on its query host.

    W = A_prev + A_unlock * f: A_prev is the area of the edge's tasks that
    ``prev`` placed on the edge's helper rank; for a KV pair edge f = 1 (it
    lets a task run on its query host, the default home); for QO edges
    f = share_weight * over(host) * room(helper) + smoothing, where over is
    the fraction of the host's owner load above the mean (the area that cannot
    stay home) and room the helper's owner-load deficit as a fraction of the
    mean. Returns W [E] float64.
    """
    P = prob.P
    if prev is None:
        a_prev = np.zeros(edges.kind.size)
    else:
        on_r = np.where(prev == np.arange(P)[None, None, :], prob.area, 0)  # task (g, i, j) on rank j
        on_i = np.where(prev == np.arange(P)[None, :, None], prob.area, 0)  # task (g, i, j) on rank i
        on_any = (prev[..., None] == np.arange(P)) * prob.area[..., None]   # [G, P, P, P(r)]
        row_on = on_any.sum(axis=2)  # [G, P(i), P(r)]
        a_prev = np.select(
            [edges.kind == EDGE_KV_PAIR, edges.kind == EDGE_QO_PAIR],
            [on_i[edges.g, edges.r, edges.u], on_r[edges.g, edges.u, edges.r]],
            row_on[edges.g, edges.u, edges.r]).astype(np.float64)
    mean = max(owner_load.sum() / P, 1.0)
    over = np.maximum(owner_load - mean, 0) / np.maximum(owner_load, 1)
    room = np.maximum(mean - owner_load, 0) / mean
    f = np.where(edges.kind == EDGE_KV_PAIR, 1.0, share_weight * over[edges.u] * room[edges.r] + smoothing)
    return a_prev + edges.unlock * f


def select_edges(prob: HostProblem, edges: EdgeSet, order: np.ndarray, prev: np.ndarray | None,
                 owner_load: np.ndarray, K: float) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Greedy edge acceptance in ``order`` under the per-rank budget K (bytes).

    The scan keeps a plan: a rank for every task (initially its query host)
    and the planned loads. An edge is considered only when it is useful: the
    last feasible assignment ``prev`` placed one of its tasks on its helper
    (those tasks are re-planned there), or a task it serves is not yet
    executable anywhere, or (QO edges) it sheds load: the host's planned load
    is above the mean and the helper stays within the cap after taking the
    tasks still planned on the host (they are re-planned to the helper). It
    is accepted when, with the range growths it causes (hulls, as the
    collectives send them), every touched rank keeps send <= K and recv <= K.

    Returns ((q_lo, q_hi, k_lo, k_hi), plan): accepted ranges, each
    [G, P(unit), P(r)] int64 with hi <= lo where nothing travels, and
    plan [G, P, P] int64, the planned rank of each task (-1 for empty tasks).
    """
    G, P = prob.G, prob.P
    n = G * P * P
    q_tok, o_tok, kv_tok = prob.q_tok, prob.o_tok, prob.kv_tok
    area_np = prob.area.reshape(-1)
    area_f = area_np.tolist()
    tq_lo, tq_hi = prob.q_lo.reshape(-1).tolist(), prob.q_hi.reshape(-1).tolist()
    tk_lo, tk_hi = prob.k_lo.reshape(-1).tolist(), prob.k_hi.reshape(-1).tolist()
    prev_f = [-1] * n if prev is None else prev.reshape(-1).tolist()
    send, recv = [0] * P, [0] * P
    qlo, qhi, klo, khi = [0] * n, [0] * n, [0] * n, [0] * n
    # a task is "placed" once some accepted edge (or locality) makes it executable
    diag = np.zeros((G, P, P), dtype=bool)
    diag[:, np.arange(P), np.arange(P)] = True
    placed = ((area_np == 0) | diag.reshape(-1)).tolist()
    open_in_row = (~np.asarray(placed)).reshape(G * P, P).sum(axis=1).tolist()
    plan = np.where(prob.area > 0, np.arange(P)[None, :, None], -1).reshape(-1).tolist()
    pload = owner_load.astype(np.float64).tolist()
    mean, cap = float(owner_load.sum()) / P, prob.cap
    kinds, gs, us, rs = edges.kind.tolist(), edges.g.tolist(), edges.u.tolist(), edges.r.tolist()
    row_tasks = [tuple(row * P + j for j, _, _ in js) for row, js in enumerate(edges.row_js)]

    def grow(lo, hi, a, b):
        if hi <= lo:
            return a, b, b - a
        nlo, nhi = min(lo, a), max(hi, b)
        return nlo, nhi, (nhi - nlo) - (hi - lo)

    def mark(t):
        if not placed[t]:
            placed[t] = True
            open_in_row[t // P] -= 1

    def replan(ts, r):
        for t in ts:
            pload[plan[t]] -= area_f[t]
            pload[r] += area_f[t]
            plan[t] = r

    for e in order.tolist():
        kind, g, u, r = kinds[e], gs[e], us[e], rs[e]
        f = (g * P + u) * P + r  # range (unit u -> rank r)
        if kind == EDGE_KV_PAIR:
            t = (g * P + r) * P + u  # task (g, r, u)
            if placed[t] and prev_f[t] != r:
                continue
            nlo, nhi, dn = grow(klo[f], khi[f], tk_lo[t], tk_hi[t])
            if send[u] + dn * kv_tok > K or recv[r] + dn * kv_tok > K:
                continue
            send[u] += dn * kv_tok
            recv[r] += dn * kv_tok
            klo[f], khi[f] = nlo, nhi
            mark(t)
            if prev_f[t] == r:
                replan((t,), r)
            continue
        if kind == EDGE_QO_PAIR:
            ts = (f,)  # task (g, u, r)
        else:
            row = g * P + u
            ts = row_tasks[row]
        served = [t for t in ts if prev_f[t] == r or not placed[t]]
        # shed: tasks still planned on an above-mean host, largest first,
        # while the helper stays within the cap and the host above the mean
        shed, room, excess = [], cap - pload[r], pload[u] - mean
        if excess > 0 and room > 0:
            for t in sorted((t for t in ts if plan[t] == u), key=lambda t: (-area_f[t], t)):
                if excess <= 0:
                    break
                if area_f[t] <= room:
                    shed.append(t)
                    room -= area_f[t]
                    excess -= area_f[t]
        if shed:
            served = sorted(set(served) | set(shed))
        if not served:
            continue
        a, b = min(tq_lo[t] for t in served), max(tq_hi[t] for t in served)
        nlo, nhi, dn = grow(qlo[f], qhi[f], a, b)
        d_send = {u: dn * q_tok, r: dn * o_tok}
        d_recv = {u: dn * o_tok, r: dn * q_tok}
        growths = []
        for t in served:
            j = t % P
            if j == r:
                continue
            fk = (g * P + j) * P + r
            klo_n, khi_n, dk = grow(klo[fk], khi[fk], tk_lo[t], tk_hi[t])
            if dk:
                growths.append((fk, klo_n, khi_n))
                d_send[j] = d_send.get(j, 0) + dk * kv_tok
                d_recv[r] += dk * kv_tok
        if any(send[x] + d > K for x, d in d_send.items()) or any(recv[x] + d > K for x, d in d_recv.items()):
            continue
        for x, d in d_send.items():
            send[x] += d
        for x, d in d_recv.items():
            recv[x] += d
        qlo[f], qhi[f] = nlo, nhi
        for fk, a, b in growths:
            klo[fk], khi[fk] = a, b
        for t in served:
            mark(t)
        replan([t for t in served if prev_f[t] == r or t in shed], r)

    shape = (G, P, P)
    ranges = tuple(np.asarray(x, dtype=np.int64).reshape(shape) for x in (qlo, qhi, klo, khi))
    return ranges, np.asarray(plan, dtype=np.int64).reshape(shape)
