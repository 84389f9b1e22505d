"""Lower bounds on load and on the communication bottleneck (offline, host-side).

``load_lower_bound`` is the trivial bound on the max load; ``ib_lower_bound`` bounds the
InfiniBand bytes per GPU on a cluster (a linear program over the nodes). ``milp_bottleneck``
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

__all__ = ["load_lower_bound", "MilpResult", "milp_bottleneck", "shed_lower_bound", "ib_lower_bound"]

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


def _check_bound_args(areas: BlockAreas, cost: CommCost, mu: float, direction: str) -> None:
    """ValueError naming the argument: cost for other head groups than the areas', mu < 1, or
    an unknown direction."""
    if cost.head_groups != areas.head_groups:
        raise ValueError(f"cost.head_groups={cost.head_groups} must equal areas' G={areas.head_groups}")
    if not mu >= 1.0:
        raise ValueError(f"mu must be >= 1.0, got {mu}")
    if direction not in DIRECTIONS:
        _coeffs(cost, direction)  # raises, naming the directions


def _rows():
    """(add_row, program): ``add_row(entries, lb, ub)`` appends the row ``lb <= sum(v * x[c]) <= ub``
    over ``entries`` [(c, v)] to ``program``, the (rows, cols, vals, lo, hi) lists ``_solve`` takes."""
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add_row(entries, lb, ub):
        for c, v in entries:
            rows.append(len(lo))
            cols.append(c)
            vals.append(float(v))
        lo.append(lb)
        hi.append(ub)

    return add_row, (rows, cols, vals, lo, hi)


def _solve(entries, nvar: int, n_binary: int, objective_cols, time_limit: float, rel_gap: float, pinned=()):
    """HiGHS on ``min sum(x[objective_cols])`` subject to lo <= A x <= hi (``entries``: the
    rows, cols, vals, lo and hi lists), x >= 0, the first ``n_binary`` variables in {0, 1} and
    the ``pinned`` ones 0."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    rows, cols, vals, lo, hi = entries
    A = coo_matrix((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    c_obj = np.zeros(nvar)
    c_obj[list(objective_cols)] = 1.0
    integrality = np.zeros(nvar)
    integrality[:n_binary] = 1
    ub = np.full(nvar, np.inf)
    ub[:n_binary] = 1.0
    ub[list(pinned)] = 0.0
    return milp(c_obj, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
                bounds=Bounds(np.zeros(nvar), ub), options={"time_limit": float(time_limit), "mip_rel_gap": rel_gap})


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
    G, P, U, n = areas.head_groups, areas.cp_size, areas.num_units, areas.tiles
    _check_bound_args(areas, cost, mu, direction)
    if P > MAX_MILP_RANKS:
        raise ValueError(f"milp_bottleneck is for small instances: P={P} > {MAX_MILP_RANKS}")
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

    add_row, program = _rows()

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

    # vq / vk to a unit's own host never appear in a row; pin them to 0
    pinned = [base + i // n for (g, i), base in qo_idx.items()] + [base + j // n for (g, j), base in kv_idx.items()]
    res = _solve(program, nvar, nx, list(z_of.values()), time_limit, 1e-6, pinned)

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


def shed_lower_bound(areas: BlockAreas, cost: CommCost, mu: float = 1.10, direction: str = "step",
                     time_limit: float = 60.0) -> tuple[int, list[int]]:
    """A lower bound on the bottleneck from each rank alone: (max over ranks, [per-rank bound]).

    Any balanced assignment makes a rank r ship enough of its own work to reach the cap, and
    what r ships, keeps or takes in costs r bytes: the Q rows of its own tasks computed
    elsewhere (O or dQ back), the K/V of its key units for every task computed elsewhere, the
    K/V it fetches for its own tasks kept at home with remote keys, the Q of other ranks' tasks
    it takes in. Per rank a small program over the tasks that touch r (HiGHS; binary: where each
    task is, here or not) minimises r's phase volumes, each unit's rows counted once at the
    longest need (a lower bound on the hulls, as in ``milp_bottleneck``); with ``direction=
    "step"`` r's fwd + bwd, which the step's ``max_r fwd_r + max_r bwd_r`` is at least.

    It ignores the other ranks, so it is weaker where several ranks compete for helpers, but
    it is small (G x tasks of one rank) and solves quickly where the whole program may not
    close within its time limit (a measured comparison: CHANGELOG.md, "Design notes"). Any
    size (no task limit); the dual bound is used when a rank's program stops at ``time_limit``.
    """
    _check_bound_args(areas, cost, mu, direction)
    G, P, n = areas.head_groups, areas.cp_size, areas.tiles
    phases = ("fwd", "bwd") if direction == "step" else (direction,)
    area = areas.area.detach().cpu().numpy()
    qn = areas.q_need.detach().cpu().numpy()
    kn = areas.k_need.detach().cpu().numpy()
    cap = math.floor(mu * int(area.sum()) / P + 1e-9)
    nonempty = [tuple(int(x) for x in t) for t in np.argwhere(area > 0)]
    per_rank = []
    for r in range(P):
        # own tasks (query unit on r): x = 1 when computed elsewhere; foreign tasks (keys on r,
        # query elsewhere): x = 1 when computed on r
        own = [t for t in nonempty if t[1] // n == r]
        foreign = [t for t in nonempty if t[1] // n != r and t[2] // n == r]
        tasks = own + foreign
        if not tasks:
            per_rank.append(0)
            continue
        T = len(tasks)
        var = {}  # (kind, g, unit) -> column of that unit's rows: "q" own QO, "qf" foreign QO,
        #                              "k" K/V of r sent out, "kr" remote K/V fetched for kept tasks

        def col(key):
            return var.setdefault(key, T + len(var))

        add_row, program = _rows()

        # load: own work shipped minus foreign work taken in covers r's excess over the cap
        own_load = sum(int(area[t]) for t in own)
        add_row([(t, area[tasks[t]] if t < len(own) else -area[tasks[t]]) for t in range(T)], own_load - cap, np.inf)
        for t, (g, i, j) in enumerate(tasks):
            qlen, klen = int(qn[g, i, j, 1] - qn[g, i, j, 0]), int(kn[g, i, j, 1] - kn[g, i, j, 0])
            is_own = t < len(own)
            if qlen > 0:  # own shipped: r sends its rows; foreign here: r receives them
                add_row([(col(("q" if is_own else "qf", g, i)), 1.0), (t, -qlen)], 0.0, np.inf)
            if klen > 0 and j // n == r:  # computed away from r (own shipped / foreign not here)
                if is_own:
                    add_row([(col(("k", g, j)), 1.0), (t, -klen)], 0.0, np.inf)
                else:
                    add_row([(col(("k", g, j)), 1.0), (t, klen)], klen, np.inf)
            elif klen > 0 and is_own:  # kept on r with remote keys: r fetches them
                add_row([(col(("kr", g, j)), 1.0), (t, klen)], klen, np.inf)
        z = {ph: T + len(var) + k for k, ph in enumerate(phases)}
        nvar = T + len(var) + len(phases)
        for ph in phases:
            q_send, q_recv, kv_send, kv_recv = _coeffs(cost, ph)  # as the host of a unit
            # r hosts "q" and "k" units (host factors) and helps "qf" and "kr" units (reversed)
            send_f = {"q": q_send, "qf": q_recv, "k": kv_send, "kr": kv_recv}
            recv_f = {"q": q_recv, "qf": q_send, "k": kv_recv, "kr": kv_send}
            for factor in (send_f, recv_f):
                add_row([(c, factor[key[0]]) for key, c in var.items() if factor[key[0]]] + [(z[ph], -1.0)],
                        -np.inf, 0.0)
        res = _solve(program, nvar, T, list(z.values()), time_limit, 1e-9)
        if res.status == 2:  # r cannot shed enough at all: no balanced assignment exists
            per_rank.append(0)
            continue
        dual = getattr(res, "mip_dual_bound", None)
        bound = dual if dual is not None and np.isfinite(dual) else 0.0
        per_rank.append(max(0, math.ceil(bound - 1e-6 * max(1.0, abs(bound)))))
    return max(per_rank), per_rank


def ib_lower_bound(areas: BlockAreas, cost: CommCost, ranks_per_node: int, mu: float = 1.10,
                   direction: str = "fwd") -> float:
    """A lower bound on the InfiniBand bytes per GPU of any assignment with max load <= mu * mean,
    on nodes of ``ranks_per_node`` (bytes; the largest over GPUs of max(sent, received) to other
    nodes, per phase, ``direction`` "fwd", "bwd" or "step" = fwd + bwd).

    A linear program over the nodes, not the ranks, so it is small at any P (thousands of tasks
    at P = 64 solve in seconds) and holds for every transport and solver:

        x[t, n] >= 0, sum_n x[t, n] = 1         task t = (i, j), all head groups alike, on node n
        sum_t area_t * x[t, n] <= mu * L * total / P     (each of n's L ranks at most mu x mean)
        yq[i, n] >= |q_need(t)| * x[t, n]       for each task t of query unit i, n not i's node
        yk[j, n] >= |k_need(t)| * x[t, n]       likewise for key unit j
        L * z >= node n's IB bytes out, and in  (the ``_coeffs`` prices on y, times G)

    Each (unit, node) pays its rows once, whichever of the node's ranks use them (what relay
    transport reaches; direct transport moves at least as much), at least each task's need (the
    hull a plan sends is at least that), and a node's bytes spread at best evenly over its L
    NICs. Every whole-task assignment within mu is a point (x in {0, 1}), so the optimum bounds
    them all from below. By the head groups' symmetry the program over all groups has an optimum
    with every group alike: it is solved once, the groups summed. Whole chunks only (``tiles``
    1): a tiled plan may split a block's work unevenly over its rows.
    """
    _check_bound_args(areas, cost, mu, direction)
    P, L, G = areas.cp_size, ranks_per_node, areas.head_groups
    if areas.tiles != 1:
        raise ValueError(f"ib_lower_bound: whole-chunk tasks only (areas.tiles must be 1, got {areas.tiles})")
    if isinstance(L, bool) or not isinstance(L, int) or L < 1 or P % L:
        raise ValueError(f"ranks_per_node must be a positive int dividing cp_size {P}, got {L!r}")
    N = P // L
    area = areas.area.detach().cpu().double().sum(0).numpy()                    # [P, P], groups summed
    qlen = (areas.q_need[0, ..., 1] - areas.q_need[0, ..., 0]).detach().cpu().numpy()
    klen = (areas.k_need[0, ..., 1] - areas.k_need[0, ..., 0]).detach().cpu().numpy()
    node = np.arange(P) // L
    tasks = [(int(i), int(j)) for i, j in np.argwhere(area > 0)]
    T = len(tasks)
    # columns: x[t, n] | yq[i, n] | yk[j, n] | z per phase; y in MB keeps HiGHS's numbers near 1
    yq = lambda i, n: T * N + i * N + n  # noqa: E731
    yk = lambda j, n: T * N + P * N + j * N + n  # noqa: E731
    phases = ("fwd", "bwd") if direction == "step" else (direction,)
    z = {ph: T * N + 2 * P * N + k for k, ph in enumerate(phases)}
    nvar = T * N + 2 * P * N + len(phases)
    add_row, program = _rows()

    for t in range(T):
        add_row([(t * N + n, 1.0) for n in range(N)], 1.0, 1.0)
    cap = mu * L * area.sum() / P
    for n in range(N):
        add_row([(t * N + n, area[i, j] / cap) for t, (i, j) in enumerate(tasks)], -np.inf, 1.0)
    for t, (i, j) in enumerate(tasks):
        for n in range(N):
            if n != node[i] and qlen[i, j] > 0:
                add_row([(t * N + n, qlen[i, j]), (yq(i, n), -1.0)], -np.inf, 0.0)
            if n != node[j] and klen[i, j] > 0:
                add_row([(t * N + n, klen[i, j]), (yk(j, n), -1.0)], -np.inf, 0.0)
    MB = 1e6
    for ph in phases:
        q_send, q_recv, kv_send, kv_recv = (G * f / MB for f in _coeffs(cost, ph))  # as the unit's host
        for n in range(N):
            out, into = {}, {}
            for y, there, back in ((yq, q_send, q_recv), (yk, kv_send, kv_recv)):
                for u in range(P):
                    for m in range(N):
                        if m == node[u] or n not in (node[u], m):
                            continue
                        # n hosts u (sends there, takes back), or n is the node u crosses to
                        send, take = (there, back) if node[u] == n else (back, there)
                        out[y(u, m)], into[y(u, m)] = send, take
            for side in (out, into):
                add_row([(c, v) for c, v in side.items() if v] + [(z[ph], -float(L))], -np.inf, 0.0)
    pinned = [y(u, node[u]) for u in range(P) for y in (yq, yk)]  # a unit never crosses to its own node
    res = _solve(program, nvar, 0, list(z.values()), 60.0, 1e-9, pinned)
    if res.status != 0:
        raise RuntimeError(f"ib_lower_bound: the program did not solve ({res.message})")
    return max(0.0, float(res.fun)) * MB
