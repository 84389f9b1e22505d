"""The CPU reference solver: binary search over a communication threshold K.

Shape legend: G head groups, P ranks, c tokens per chunk.

Host-side by design (numpy, sequential greedy scans): it is the quality
yardstick the device solver is measured against, not a hot-path function.

For each threshold K (bytes; a rank's forward max(send, recv)):

1. **Edges.** Candidate edges send a unit to a helper rank r (see
   ``_reference_edges``): a KV pair edge ``(g, j) -> i`` lets task
   ``(g, i, j)`` run on its query host; a QO pair edge ``(g, i) -> j`` lets it
   run on its key host; a QO row edge ``(g, i) -> r`` ships a whole group-row
   (Q hull plus the KV its tasks need) to r. Edges are scored by benefit per
   byte ``W / C`` and accepted greedily while every touched rank stays within
   K; ranges grow as hulls, exactly as the collectives send them, so the
   accepted ranges bound what any assignment built on them moves.
2. **Assignment.** A task is executable on r when r holds or receives (a
   range covering its need of) both its units. Tasks go in order of
   (executable ranks ascending, area descending, index); each picks, among
   its executable ranks under the load cap ``floor(mu * total / P)``: the
   rank holding both units (i == j), then its head-group affinity rank, then
   the least-loaded rank (lowest index on ties). The affinity rank is where
   the edge step planned the task: its query host unless a QO edge shipped
   it (with the rest of its group-row when a row edge did) to a helper, so
   the tasks of one (head group, query chunk) row stay together and the row
   travels once. A task with no rank under the cap goes to its
   least-loaded executable rank.
3. **Refinement.** Up to ``REFINE_PASSES`` passes move tasks off ranks above
   the cap to executable ranks with room.

K is feasible when every task has an executable rank and imbalance <= mu.
Feasible K lowers the upper bound to the bottleneck actually reached,
infeasible K raises the lower bound; the search stops when
``(hi - lo) / hi <= BRACKET_TOL`` or after ``MAX_ITERATIONS`` thresholds.
Deterministic: stable sorts with index tie-breaks, integer volumes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpusolver.config import SolverConfig
from gpusolver.limits import balanced_load_cap
from gpusolver.problem import BlockAreas
from gpusolver.solver._reference_edges import (HostProblem, candidate_edges, edge_weights, forward_volumes,
                                               loads, select_edges)

__all__ = ["ReferenceResult", "assign", "solve_assignment",
           "MAX_ITERATIONS", "BRACKET_TOL", "REFINE_PASSES", "SHARE_WEIGHT", "SMOOTHING"]

MAX_ITERATIONS = 20   # thresholds tried at most
BRACKET_TOL = 0.01    # stop when (hi - lo) / hi <= this
REFINE_PASSES = 3     # load-refinement passes after the greedy assignment
SHARE_WEIGHT = 1.0    # weight of the owner-load excess a QO edge helps shed
SMOOTHING = 0.01      # credit every edge gets per unit of area it serves

# preference categories of an executable rank (lower is better)
_BOTH_LOCAL, _AFFINITY, _OTHER = range(3)


@dataclass(frozen=True)
class ReferenceResult:
    """Outcome of the reference solve.

    assignment: [G, P, P] int32 on the areas' device, rank computing task
                (g, i, j); -1 for empty tasks (area 0); every non-empty task
                is assigned.
    threshold:  the K (forward bytes per rank) whose greedy produced the
                returned assignment.
    iterations: thresholds tried.
    feasible:   True when the assignment meets imbalance <= mu; otherwise
                it is the best-balanced assignment found.
    bottleneck: forward bottleneck of the assignment, max_r max(send, recv),
                bytes (<= threshold).
    imbalance:  max load / mean load of the assignment (1.0 without work).
    bwd_bottleneck: backward bottleneck of the assignment under the runtime's protocol
                (``CommCost``: dO out and dQ back per QO token, dK, dV back per KV
                token, K and V again without kept buffers), bytes.
    step_bottleneck: bottleneck + bwd_bottleneck, the bytes of a training step. The
                search itself prices the forward only: this is the yardstick's
                figure for the training objective, not its target.
    """

    assignment: torch.Tensor
    threshold: int
    iterations: int
    feasible: bool
    bottleneck: int
    imbalance: float
    bwd_bottleneck: int = 0
    step_bottleneck: int = 0


@dataclass
class _Attempt:
    assign: np.ndarray
    complete: bool
    feasible: bool
    bottleneck: int
    imbalance: float
    K: int


def _host_problem(areas: BlockAreas, config: SolverConfig) -> HostProblem:
    areas.validate()
    if areas.tiles != 1:
        raise ValueError(f"areas have tiles={areas.tiles}; the reference solver places whole chunks: "
                         "pass areas.coarsen() (solve_assignment(..., solver='reference') does)")
    G, P = areas.head_groups, areas.cp_size
    if P != config.cp_size:
        raise ValueError(f"areas has P={P} ranks but config.cp_size={config.cp_size}")
    if G != config.head_groups:
        raise ValueError(f"areas has G={G} head groups but config.head_groups={config.head_groups} "
                         f"(head_group_flatten={config.head_group_flatten}, num_heads_kv={config.num_heads_kv})")
    area = areas.area.detach().cpu().numpy().astype(np.int64)
    qn = areas.q_need.detach().cpu().numpy().astype(np.int64)
    kn = areas.k_need.detach().cpu().numpy().astype(np.int64)
    if (area < 0).any():
        bad = np.argwhere(area < 0)[0]
        raise ValueError(f"area must be >= 0, got {area[tuple(bad)]} at task (g, i, j)={tuple(bad.tolist())}")
    for name, need in (("q_need", qn), ("k_need", kn)):
        ok = (need[..., 0] >= 0) & (need[..., 0] <= need[..., 1]) & (need[..., 1] <= areas.chunk)
        ok &= (area == 0) | (need[..., 1] > need[..., 0])
        if not ok.all():
            bad = tuple(np.argwhere(~ok)[0].tolist())
            raise ValueError(f"{name}[{bad}] = {need[bad].tolist()} must be a non-empty [lo, hi) within "
                             f"[0, chunk={areas.chunk}] for a non-empty task (empty tasks: lo <= hi)")
    cost = config.cost()
    total = int(area.sum())
    cap = balanced_load_cap(total, config.imbalance_tol, P)  # exact: mu * total passes 2^53 on long sequences
    return HostProblem(area=area, q_lo=qn[..., 0], q_hi=qn[..., 1], k_lo=kn[..., 0], k_hi=kn[..., 1],
                       q_tok=cost.q_fwd, o_tok=cost.o_fwd, kv_tok=cost.kv_fwd, cap=cap)


def _executable(prob: HostProblem, ranges: tuple[np.ndarray, ...]) -> np.ndarray:
    """[G, P, P, P(r)] bool: non-empty task (g, i, j) can run on r with the accepted ranges."""
    P = prob.P
    q_lo, q_hi, k_lo, k_hi = ranges  # [G, P(unit), P(r)]
    eye = np.eye(P, dtype=bool)
    q_ok = (eye[None, :, None, :]
            | ((q_lo[:, :, None, :] <= prob.q_lo[..., None]) & (prob.q_hi[..., None] <= q_hi[:, :, None, :])
               & (q_hi > q_lo)[:, :, None, :]))
    k_ok = (eye[None, None, :, :]
            | ((k_lo[:, None, :, :] <= prob.k_lo[..., None]) & (prob.k_hi[..., None] <= k_hi[:, None, :, :])
               & (k_hi > k_lo)[:, None, :, :]))
    return q_ok & k_ok & (prob.area > 0)[..., None]


def _assign_tasks(prob: HostProblem, ranges: tuple[np.ndarray, ...], plan: np.ndarray) -> tuple[np.ndarray, bool]:
    """Steps 2 and 3: greedy placement on executable ranks, then refinement.

    Returns (assign [G, P, P] int64 with -1 for empty and unplaceable tasks,
    complete: every non-empty task placed).
    """
    G, P = prob.G, prob.P
    execm = _executable(prob, ranges)
    assign = np.full((G, P, P), -1, dtype=np.int64)
    flat_exec = execm.reshape(G * P * P, P)
    degree = flat_exec.sum(axis=1)
    area_f = prob.area.reshape(-1)
    tasks = np.flatnonzero(area_f > 0)
    if (degree[tasks] == 0).any():
        return assign, False
    order = tasks[np.lexsort((tasks, -area_f[tasks], degree[tasks]))]
    affinity = plan.reshape(-1).tolist()

    cap = prob.cap
    load = [0] * P
    asg = [-1] * (G * P * P)
    cand_lists = {}
    for t in order.tolist():
        i, j = (t // P) % P, t % P
        a = int(area_f[t])
        aff = affinity[t]
        cands = np.flatnonzero(flat_exec[t]).tolist()
        cand_lists[t] = cands
        best, best_key = -1, None
        for r in cands:
            if r == i == j:
                cat = _BOTH_LOCAL
            elif r == aff:
                cat = _AFFINITY
            else:
                cat = _OTHER
            key = (load[r] + a > cap, cat, load[r], r)
            if best_key is None or key < best_key:
                best, best_key = r, key
        asg[t] = best
        load[best] += a

    _refine(asg, load, cand_lists, area_f, cap, P)
    assign = np.asarray(asg, dtype=np.int64).reshape(G, P, P)
    return assign, True


def _refine(asg: list, load: list, cand_lists: dict, area_f: np.ndarray, cap: int, P: int) -> None:
    """Move tasks off ranks above the cap to executable ranks with room (in place)."""
    for _ in range(REFINE_PASSES):
        over = sorted((r for r in range(P) if load[r] > cap), key=lambda r: (-load[r], r))
        if not over:
            return
        on_rank = {r: [] for r in over}
        for t, r in enumerate(asg):
            if r in on_rank:
                on_rank[r].append(t)
        for r in over:
            # largest tasks first: fewest moves to get under the cap
            for t in sorted(on_rank[r], key=lambda t: (-int(area_f[t]), t)):
                if load[r] <= cap:
                    break
                a = int(area_f[t])
                dest = min((s for s in cand_lists[t] if s != r and load[s] + a <= cap),
                           key=lambda s: (load[s], s), default=-1)
                if dest >= 0:
                    asg[t] = dest
                    load[r] -= a
                    load[dest] += a


def _attempt(prob: HostProblem, edges, owner_load: np.ndarray, prev: np.ndarray | None, K: int) -> _Attempt:
    w = edge_weights(prob, edges, prev, owner_load, SHARE_WEIGHT, SMOOTHING)
    score = w / edges.cost
    order = np.lexsort((np.arange(score.size), -score))
    ranges, plan = select_edges(prob, edges, order, prev, owner_load, K)
    assign, complete = _assign_tasks(prob, ranges, plan)
    if not complete:
        return _Attempt(assign, False, False, 0, float("inf"), K)
    send, recv = forward_volumes(prob, assign)
    bottleneck = int(max(send.max(), recv.max())) if prob.P else 0
    load = loads(prob, assign)
    total = int(prob.area.sum())
    imbalance = float(load.max() * prob.P / total) if total else 1.0
    feasible = int(load.max()) <= prob.cap
    return _Attempt(assign, True, feasible, bottleneck, imbalance, K)


def _upper_threshold(prob: HostProblem, chunk: int) -> int:
    """The all-to-all bound: every unit's whole chunk to every other rank.

    A rank then sends (P - 1) chunks of Q and KV per group as host plus
    (P - 1) chunks of partial O as helper, and receives the mirror image, so
    G (P - 1) c (q + o + kv) bytes bound any edge set: every edge fits.
    """
    return prob.G * (prob.P - 1) * chunk * (prob.q_tok + prob.o_tok + prob.kv_tok)


def assign(areas: BlockAreas, config: SolverConfig) -> ReferenceResult:
    """Solve the assignment of tasks to ranks with the reference greedy.

    areas:  BlockAreas, area [G, P, P] int64, q_need / k_need [G, P, P, 2]
            int64 (chunk-local [lo, hi)); G == config.head_groups and
            P == config.cp_size.
    config: SolverConfig (cp_size, heads, head_dim, dtype, imbalance_tol mu,
            head_group_flatten).

    Returns ReferenceResult (assignment [G, P, P] int32 on areas.area.device,
    -1 for empty tasks). Host-side: reads the areas to numpy.
    """
    prob = _host_problem(areas, config)
    edges = candidate_edges(prob)
    owner = np.where(prob.area > 0, np.arange(prob.P)[None, :, None], -1)
    owner_load = loads(prob, owner)

    best_feasible: _Attempt | None = None
    best_balanced: _Attempt | None = None
    prev = None
    lo, hi = 0, _upper_threshold(prob, areas.chunk)
    K = hi
    iterations = 0
    while iterations < MAX_ITERATIONS:
        att = _attempt(prob, edges, owner_load, prev, K)
        iterations += 1
        if att.complete and (best_balanced is None or att.imbalance < best_balanced.imbalance):
            best_balanced = att
        if att.feasible:
            if best_feasible is None or att.bottleneck < best_feasible.bottleneck:
                best_feasible = att
            prev = att.assign
            hi = min(K, att.bottleneck)
        else:
            lo = K
            if best_feasible is None and iterations == 1:
                break  # infeasible with every edge available: no K will do
        if hi <= 0 or (hi - lo) / hi <= BRACKET_TOL:
            break
        K = (lo + hi) // 2

    chosen = best_feasible or best_balanced
    if chosen is None:  # cannot happen: with every edge, each task runs at its query host
        raise RuntimeError("reference solver found no complete assignment")
    out = torch.as_tensor(chosen.assign.astype(np.int32)).to(areas.area.device)
    from gpusolver.metrics import evaluate  # the metrics' own count: what the plan's collectives move

    bwd = int(evaluate(areas, out, config.cost()).bwd_bottleneck)
    return ReferenceResult(assignment=out, threshold=int(chosen.K), iterations=iterations,
                           feasible=chosen.feasible, bottleneck=chosen.bottleneck, imbalance=chosen.imbalance,
                           bwd_bottleneck=bwd, step_bottleneck=chosen.bottleneck + bwd)


def solve_assignment(areas: BlockAreas, config: SolverConfig) -> torch.Tensor:
    """The reference assignment only: [G, P, P] int32 on areas.area.device, -1 for empty tasks."""
    return assign(areas, config).assignment
