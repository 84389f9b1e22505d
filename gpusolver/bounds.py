"""Lower bounds on load and on the communication bottleneck (offline, host-side).

``load_lower_bound`` is the trivial bound on the max load. ``milp_bottleneck``
solves a mixed-integer program (``scipy.optimize.milp``, HiGHS) whose optimum
is a valid lower bound on the smallest bottleneck any balanced assignment can
reach under hull semantics, for small instances (P <= 8, a few hundred tasks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gpusolver.metrics import evaluate
from gpusolver.problem import BlockAreas, CommCost

__all__ = ["load_lower_bound", "MilpResult", "milp_bottleneck"]

MAX_MILP_RANKS = 8
MAX_MILP_TASKS = 256


def load_lower_bound(areas: BlockAreas) -> int:
    """max(ceil(total / P), largest task): no assignment has a smaller max load."""
    area = areas.area.detach().cpu()
    total = int(area.sum())
    largest = int(area.max()) if area.numel() else 0
    return max(-(-total // areas.cp_size), largest)


@dataclass(frozen=True)
class MilpResult:
    """Outcome of ``milp_bottleneck`` (host values).

    lower_bound: int bytes, a valid lower bound on the optimal bottleneck
                 under the load constraint (the MILP's proven dual bound);
                 None when infeasible or nothing was proven.
    assignment:  [G, U, U] int32 CPU tensor (U = P untiled), the MILP's best assignment (-1 for
                 empty tasks); None when it found none.
    bottleneck:  int bytes, that assignment's exact bottleneck by ``evaluate``
                 (an upper bound on the optimum); None without an assignment.
    status:      "optimal", "time_limit" (incumbent not proven optimal),
                 "infeasible" (mu too tight for any assignment of whole
                 tasks), or "no_solution" (time limit before any incumbent).
    gap:         (bottleneck - lower_bound) / bottleneck, 0.0 when both are 0;
                 None when either is missing.
    mip_gap:     HiGHS's own relative gap of the MILP, or None.
    """

    lower_bound: int | None
    assignment: torch.Tensor | None
    bottleneck: int | None
    status: str
    gap: float | None
    mip_gap: float | None


def _coeffs(cost: CommCost, direction: str) -> tuple[int, int, int, int]:
    """(host send, host recv) per QO token, (host send, host recv) per KV token; a helper
    receives what the host sends and sends what it receives. The backward's KV factors are
    asymmetric (nothing out when buffers are kept, dK and dV back), as the forward's are."""
    if direction == "fwd":
        return cost.q_fwd, cost.o_fwd, cost.kv_fwd, 0
    if direction == "bwd":
        return cost.q_bwd, cost.dq_bwd, cost.kv_bwd, cost.dkv_bwd
    raise ValueError(f"direction must be 'fwd', 'bwd' or 'step', got {direction!r}")


DIRECTIONS = ("fwd", "bwd", "step")


def milp_bottleneck(areas: BlockAreas, cost: CommCost, mu: float = 1.10, direction: str = "fwd",
                    time_limit: float = 30.0, max_tasks: int = MAX_MILP_TASKS) -> MilpResult:
    """Exact-ish minimum of the forward, backward or step bottleneck under max load <= mu * mean.

    areas:      BlockAreas with P <= 8 and at most ``max_tasks`` non-empty tasks
                (ValueError above); whole chunks or sub-chunk tiles (unit u
                on rank u // tiles), so the bound also covers tiled plans.
    cost:       CommCost with ``cost.head_groups == G``.
    mu:         balance tolerance; infeasible when mu is too tight for whole
                tasks (e.g. one task larger than mu * total / P): then the
                status is "infeasible" and no bound is returned.
    direction:  "fwd", "bwd", or "step": the training step's ``fwd + bwd`` (each phase's
                bottleneck its own variable, their sum minimised), what the device solver
                minimises with ``SolverConfig(objective="training")``.
    time_limit: seconds for HiGHS.
    max_tasks:  refuse larger programs (their bound is weak within any time limit).

    The program, over non-empty tasks t = (g, i, j) and ranks r (h(u): the rank of unit u):

        x[t, r] in {0, 1},  sum_r x[t, r] = 1
        sum_t area_t * x[t, r] <= floor(mu * total / P)        (loads are ints)
        vq[(g, i), r] >= qlen_t * x[t, r]   for tasks of QO unit (g, i), r != h(i)
        vk[(g, j), r] >= klen_t * x[t, r]   for tasks of KV unit (g, j), r != h(j)
        send_r <= z,  recv_r <= z,  minimise z
        (step: fwd send_r, fwd recv_r <= z_f, bwd send_r, bwd recv_r <= z_b, minimise z_f + z_b)

    with send_r / recv_r the CommCost byte factors of ``direction`` applied to
    the vq, vk a rank hosts or receives as helper (see ``metrics``), each unit
    kind's host-send and host-recv factors priced separately: the backward
    follows ``cost.keep_forward_buffers``. A rank really
    receives the hull of its tasks' needs, which is at least the longest
    need, so vq, vk under-estimate the volume: the optimum is a valid lower
    bound on the true optimal bottleneck, and ``evaluate`` of the returned
    assignment is an upper bound. They coincide when needs nest (e.g. all
    blocks full).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    G, P, U, n = areas.head_groups, areas.cp_size, areas.num_units, areas.tiles
    if cost.head_groups != G:
        raise ValueError(f"cost.head_groups={cost.head_groups} must equal areas' G={G}")
    if P > MAX_MILP_RANKS:
        raise ValueError(f"milp_bottleneck is for small instances: P={P} > {MAX_MILP_RANKS}")
    if not mu >= 1.0:
        raise ValueError(f"mu must be >= 1.0, got {mu}")
    if direction not in DIRECTIONS:
        _coeffs(cost, direction)  # raises, naming the directions
    phases = ("fwd", "bwd") if direction == "step" else (direction,)
    factors = {ph: _coeffs(cost, ph) for ph in phases}
    scale = math.gcd(*(f for fs in factors.values() for f in fs))  # units of `scale` bytes: smaller coefficients

    area = areas.area.detach().cpu().numpy()
    qn = areas.q_need.detach().cpu().numpy()
    kn = areas.k_need.detach().cpu().numpy()
    tasks = [tuple(int(x) for x in t) for t in np.argwhere(area > 0)]
    T = len(tasks)
    if T > max_tasks:
        raise ValueError(f"milp_bottleneck is for small instances: {T} non-empty tasks > max_tasks={max_tasks}")
    empty = torch.full((G, U, U), -1, dtype=torch.int32)
    if T == 0:
        return MilpResult(0, empty, 0, "optimal", 0.0, 0.0)
    total = int(area.sum())
    cap = math.floor(mu * total / P + 1e-9)

    # variable layout: x[t, r] | vq[(g, i), r] | vk[(g, j), r] | z per phase
    nx = T * P
    qo_units = sorted({(g, i) for g, i, _ in tasks})
    kv_units = sorted({(g, j) for g, _, j in tasks})
    qo_idx = {u: nx + k * P for k, u in enumerate(qo_units)}
    kv_idx = {u: nx + (len(qo_units) + k) * P for k, u in enumerate(kv_units)}
    iz0 = nx + (len(qo_units) + len(kv_units)) * P
    z_of = {ph: iz0 + k for k, ph in enumerate(phases)}
    nvar = iz0 + len(phases)

    rows, cols, vals, lo, hi = [], [], [], [], []
    nrow = 0

    def add_row(entries, lb, ub):
        nonlocal nrow
        for col, val in entries:
            rows.append(nrow)
            cols.append(col)
            vals.append(val)
        lo.append(lb)
        hi.append(ub)
        nrow += 1

    for t in range(T):  # each task on exactly one rank
        add_row([(t * P + r, 1.0) for r in range(P)], 1.0, 1.0)
    for r in range(P):  # balance
        add_row([(t * P + r, float(area[g, i, j])) for t, (g, i, j) in enumerate(tasks)], -np.inf, float(cap))
    for t, (g, i, j) in enumerate(tasks):  # v >= need length * x, only for remote ranks
        qlen, klen = float(qn[g, i, j, 1] - qn[g, i, j, 0]), float(kn[g, i, j, 1] - kn[g, i, j, 0])
        for r in range(P):
            if r != i // n and qlen > 0:
                add_row([(qo_idx[(g, i)] + r, 1.0), (t * P + r, -qlen)], 0.0, np.inf)
            if r != j // n and klen > 0:
                add_row([(kv_idx[(g, j)] + r, 1.0), (t * P + r, -klen)], 0.0, np.inf)
    for ph in phases:  # send_r - z <= 0, recv_r - z <= 0 per phase
        q_host_send, q_host_recv, kv_host_send, kv_host_recv = (f // scale for f in factors[ph])
        iz = z_of[ph]
        for r in range(P):
            send, recv = [], []
            for unit_idx, host_send, host_recv in ((qo_idx, q_host_send, q_host_recv),
                                                   (kv_idx, kv_host_send, kv_host_recv)):
                for (g, u), base in unit_idx.items():
                    for d in range(P):
                        if u // n == r and d != r:    # r hosts the unit, helper d computes some of it
                            send.append((base + d, float(host_send)))
                            recv.append((base + d, float(host_recv)))
                        elif u // n != r and d == r:  # r is the helper: the host's directions reversed
                            send.append((base + d, float(host_recv)))
                            recv.append((base + d, float(host_send)))
            add_row(send + [(iz, -1.0)], -np.inf, 0.0)
            add_row(recv + [(iz, -1.0)], -np.inf, 0.0)

    A = coo_matrix((vals, (rows, cols)), shape=(nrow, nvar)).tocsr()
    c_obj = np.zeros(nvar)
    c_obj[list(z_of.values())] = 1.0
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    ub = np.full(nvar, np.inf)
    ub[:nx] = 1.0
    # vq / vk to a unit's own host never appear in a row; pin them to 0
    for (g, i), base in qo_idx.items():
        ub[base + i // n] = 0.0
    for (g, j), base in kv_idx.items():
        ub[base + j // n] = 0.0
    res = milp(c_obj, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nvar), ub),
               options={"time_limit": float(time_limit), "mip_rel_gap": 1e-6})

    if res.status == 2:
        return MilpResult(None, None, None, "infeasible", None, None)
    dual = getattr(res, "mip_dual_bound", None)
    lower = None
    if dual is not None and np.isfinite(dual):
        # volumes are ints, so the optimum is >= ceil(dual); the slack absorbs solver tolerance
        lower = max(0, math.ceil(dual * scale - 1e-6 * max(1.0, abs(dual * scale))))
    if res.x is None:
        return MilpResult(lower, None, None, "no_solution", None, None)

    choice = res.x[:nx].reshape(T, P).argmax(axis=1)
    asg = empty.clone()
    for t, (g, i, j) in enumerate(tasks):
        asg[g, i, j] = int(choice[t])
    m = evaluate(areas, asg.to(areas.area.device), cost)
    exact = int(m.fwd_bottleneck + m.bwd_bottleneck) if direction == "step" else int(getattr(m, f"{direction}_bottleneck"))
    if lower is None:
        lower = 0
    lower = min(lower, exact)
    gap = 0.0 if exact == 0 else (exact - lower) / exact
    status = "optimal" if res.status == 0 else "time_limit"
    mip_gap = getattr(res, "mip_gap", None)
    return MilpResult(lower, asg, exact, status, gap, None if mip_gap is None else float(mip_gap))
