"""Load bound, the MILP bottleneck bound and the per-rank shed bound on tiny instances (brute
force as oracle)."""
import itertools
import math

import pytest
import torch

from gpusolver.bounds import load_lower_bound, milp_bottleneck, shed_lower_bound
from gpusolver.metrics import check_assignment, evaluate, owner_computes_assignment
from gpusolver.problem import BlockAreas, CommCost
from tests.gpusolver.test_metrics import areas_from_dense


def doc_causal(S: int, doc_lens: list[int]) -> torch.Tensor:
    """[S, S] bool: causal attention inside each packed document."""
    dense = torch.zeros(S, S, dtype=torch.bool)
    start = 0
    for n in doc_lens:
        dense[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    assert start == S
    return dense


def window(S: int, w: int) -> torch.Tensor:
    q = torch.arange(S)[:, None]
    k = torch.arange(S)[None, :]
    return (k <= q) & (k > q - w)


def brute_force_best(areas: BlockAreas, cost: CommCost, mu: float, direction: str):
    """Smallest exact bottleneck over every assignment meeting mu (None if none does)."""
    tasks = [tuple(t) for t in (areas.area > 0).nonzero().tolist()]
    P = areas.cp_size
    cap = math.floor(mu * int(areas.area.sum()) / P + 1e-9)
    best = None
    for ranks in itertools.product(range(P), repeat=len(tasks)):
        asg = torch.full(areas.area.shape, -1, dtype=torch.int32)
        for (g, i, j), r in zip(tasks, ranks):
            asg[g, i, j] = r
        m = evaluate(areas, asg, cost)
        if int(m.load.max()) > cap:
            continue
        b = int(getattr(m, f"{direction}_bottleneck"))
        best = b if best is None else min(best, b)
    return best


def assert_meets_mu(areas, asg, mu):
    load = torch.zeros(areas.cp_size, dtype=torch.int64)
    for (g, i, j) in (areas.area > 0).nonzero().tolist():
        load[asg[g, i, j]] += areas.area[g, i, j]
    assert int(load.max()) * areas.cp_size <= mu * int(areas.area.sum()) + 1e-9


def test_load_lower_bound():
    area = torch.zeros(1, 3, 3, dtype=torch.int64)
    area[0, 0, 0], area[0, 1, 0], area[0, 2, 2] = 2, 3, 5  # total 10 -> ceil(10/3) = 4 < 5
    areas = BlockAreas(area, torch.zeros(1, 3, 3, 2, dtype=torch.int64), torch.zeros(1, 3, 3, 2, dtype=torch.int64), 4)
    assert load_lower_bound(areas) == 5
    area[0, 2, 2] = 1  # total 6 -> 2, largest 3
    assert load_lower_bound(areas) == 3
    area[0, 1, 0] = 2  # total 5 -> ceil(5/3) = 2 = largest
    assert load_lower_bound(areas) == 2


CASES = [  # (name, dense [G, S, S], P)
    ("causal_P2_G1", torch.ones(1, 8, 8, dtype=torch.bool).tril(), 2),
    ("docs_P3_G1", doc_causal(12, [5, 7])[None], 3),
    ("full_P2_G2", torch.ones(2, 8, 8, dtype=torch.bool), 2),
    ("docs_window_P2_G2", torch.stack([doc_causal(8, [3, 5]), window(8, 3)]), 2),
]


# (direction, keep_forward_buffers): the forward, the backward under both protocols, and the
# training step's sum fwd + bwd (two bottleneck variables)
PASSES = [("fwd", True), ("bwd", True), ("bwd", False), ("step", True)]
PASS_IDS = ["fwd", "bwd-kept", "bwd-recast", "step"]


@pytest.mark.parametrize("direction,keep", PASSES, ids=PASS_IDS)
@pytest.mark.parametrize("name,dense,P", CASES, ids=[c[0] for c in CASES])
def test_milp_against_brute_force(name, dense, P, direction, keep):
    areas = areas_from_dense(dense, P)
    G = areas.head_groups
    cost = CommCost(4 * G, 2 * G, 2, 2, G, keep_forward_buffers=keep)
    mu = 1.5
    res = milp_bottleneck(areas, cost, mu=mu, direction=direction, time_limit=10.0)
    best = brute_force_best(areas, cost, mu, direction)
    shed, per_rank = shed_lower_bound(areas, cost, mu=mu, direction=direction, time_limit=10.0)
    assert len(per_rank) == P and shed == max(per_rank) >= 0
    if best is None:
        assert res.status == "infeasible" and res.lower_bound is None
        return
    assert shed <= best  # each rank alone: a lower bound too
    assert res.status == "optimal"
    check_assignment(areas, res.assignment)
    assert_meets_mu(areas, res.assignment, mu)
    exact = int(getattr(evaluate(areas, res.assignment, cost), f"{direction}_bottleneck"))
    assert res.bottleneck == exact
    assert 0 <= res.lower_bound <= best <= res.bottleneck
    assert res.gap == pytest.approx(0.0 if exact == 0 else (exact - res.lower_bound) / exact)
    if name.startswith("full"):  # every need is the whole chunk: hull == longest need, the MILP is exact
        assert res.lower_bound == best == res.bottleneck


@pytest.mark.parametrize("direction,keep", PASSES, ids=PASS_IDS)
def test_milp_on_tiles_against_brute_force(direction, keep):
    # 2 ranks, 2 tiles each (units of 2 tokens): a tile lives on rank u // 2, so tasks
    # between tiles of one rank move nothing, and the bound covers tiled plans
    dense = doc_causal(8, [3, 5])[None]
    areas = areas_from_dense(dense, 4).as_tiles(2)
    cost = CommCost(4, 2, 2, 2, 1, keep_forward_buffers=keep)
    mu = 1.2
    res = milp_bottleneck(areas, cost, mu=mu, direction=direction, time_limit=10.0)
    best = brute_force_best(areas, cost, mu, direction)
    assert res.status == "optimal" and res.assignment.shape == (1, 4, 4)
    check_assignment(areas, res.assignment)
    assert_meets_mu(areas, res.assignment, mu)
    assert 0 <= res.lower_bound <= best <= res.bottleneck
    # whole chunks of the same mask cannot do better than the tiles
    whole = milp_bottleneck(areas.coarsen(), cost, mu=mu, direction=direction, time_limit=10.0)
    assert whole.status == "optimal" and best <= whole.bottleneck


@pytest.mark.parametrize("P,G", [(3, 1), (4, 2)])
def test_milp_below_owner_computes(P, G):
    S = 6 * P
    dense = torch.stack([doc_causal(S, [S // 2 - 1, S // 2 + 1]), window(S, 5)][:G])
    areas = areas_from_dense(dense, P)
    owner = evaluate(areas, owner_computes_assignment(areas), CommCost(8 * G, 2 * G, 2, 2, G))
    mu = float(owner.imbalance) + 1e-6  # owner-computes meets this mu
    for direction, keep in PASSES:
        cost = CommCost(8 * G, 2 * G, 2, 2, G, keep_forward_buffers=keep)
        owner = evaluate(areas, owner_computes_assignment(areas), cost)
        res = milp_bottleneck(areas, cost, mu=mu, direction=direction, time_limit=10.0)
        assert res.status == "optimal"
        assert_meets_mu(areas, res.assignment, mu)
        assert res.lower_bound <= int(getattr(owner, f"{direction}_bottleneck"))
        assert res.lower_bound <= res.bottleneck
    # a tight mu keeps a valid, balanced assignment (or says infeasible)
    res = milp_bottleneck(areas, CommCost(8 * G, 2 * G, 2, 2, G), mu=1.10, time_limit=10.0)
    if res.status != "infeasible":
        assert_meets_mu(areas, res.assignment, 1.10)
        assert res.lower_bound <= res.bottleneck


def test_milp_backward_kv_is_one_way():
    # causal, P=2, c=4, any balance (mu=2): rank 1 needs all of KV chunk 0 (4 tokens) or all of
    # QO chunk 1 travels to rank 0. hq=2, hkv=1, D=2, b=2: kv_fwd = 8, q_bwd = 24 kept / 32 re-cast.
    # Owner-computes is optimal in both protocols: kept, rank 1 sends dK, dV (32) and rank 0 sends
    # nothing; re-cast, rank 0 also sends K, V (32) again, a separate direction, so still 32.
    areas = areas_from_dense(torch.ones(1, 8, 8, dtype=torch.bool).tril(), 2)
    for keep, sends in ((True, [0, 32]), (False, [32, 32])):
        cost = CommCost(2, 1, 2, 2, 1, keep_forward_buffers=keep)
        res = milp_bottleneck(areas, cost, mu=2.0, direction="bwd", time_limit=10.0)
        assert res.status == "optimal" and res.lower_bound == res.bottleneck == 32
        m = evaluate(areas, res.assignment, cost)
        assert m.to_dict()["bwd_send"] == sends and m.to_dict()["bwd_recv"] == sends[::-1]


def test_milp_infeasible_and_trivial():
    # a single task cannot be split: max load = total > 1.1 * total / 2
    dense = torch.zeros(1, 8, 8, dtype=torch.bool)
    dense[0, 5, 1] = True
    cost = CommCost(2, 1, 2, 2, 1)
    res = milp_bottleneck(areas_from_dense(dense, 2), cost)
    assert res.status == "infeasible" and res.lower_bound is None and res.assignment is None
    res = milp_bottleneck(areas_from_dense(torch.zeros(1, 8, 8, dtype=torch.bool), 2), cost)
    assert res.status == "optimal" and res.lower_bound == 0 and res.bottleneck == 0
    assert int((res.assignment != -1).sum()) == 0


def test_milp_rejects_large_or_bad_input():
    def full(G, P, c=2):
        return BlockAreas(torch.ones(G, P, P, dtype=torch.int64),
                          torch.tensor([0, 1]).expand(G, P, P, 2).clone(),
                          torch.tensor([0, 1]).expand(G, P, P, 2).clone(), c)

    with pytest.raises(ValueError, match="P=9"):
        milp_bottleneck(full(1, 9), CommCost(2, 1, 2, 2, 1))
    with pytest.raises(ValueError, match="512 non-empty tasks > max_tasks=256"):
        milp_bottleneck(full(8, 8), CommCost(8, 8, 2, 2, 8))
    with pytest.raises(ValueError, match="4 non-empty tasks > max_tasks=3"):
        milp_bottleneck(full(1, 2), CommCost(2, 1, 2, 2, 1), max_tasks=3)
    with pytest.raises(ValueError, match="direction"):
        milp_bottleneck(full(1, 2), CommCost(2, 1, 2, 2, 1), direction="both")
    with pytest.raises(ValueError, match="head_groups"):
        milp_bottleneck(full(1, 2), CommCost(4, 2, 2, 2, 2))


def test_step_bound_is_below_the_device_plans_step():
    # the training objective's plan is one assignment the MILP ranges over, so its fwd + bwd is at
    # least the bound; on full documents every need is the whole chunk and the bound is exact
    from gpusolver.config import SolverConfig
    from gpusolver.solver.device import solve_device

    P, G = 3, 1
    for dense in (doc_causal(24, [10, 14])[None], torch.ones(1, 24, 24, dtype=torch.bool)):
        areas = areas_from_dense(dense, P)
        config = SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=G, head_dim=8, head_group_flatten=False,
                              chunk_tiles=1, imbalance_tol=1.5)
        cost = config.cost()
        res = solve_device(areas, config, impl="torch")
        assert bool(res.balanced)
        plan = evaluate(areas, res.assignment, cost)
        bound = milp_bottleneck(areas, cost, mu=1.5, direction="step", time_limit=10.0)
        assert bound.status == "optimal" and bound.lower_bound <= bound.bottleneck
        assert bound.lower_bound <= int(plan.step_bottleneck) == int(res.fwd_bottleneck + res.bwd_bottleneck)


def test_shed_bound_on_tiles_against_brute_force():
    dense = doc_causal(8, [3, 5])[None]
    areas = areas_from_dense(dense, 4).as_tiles(2)
    cost = CommCost(4, 2, 2, 2, 1)
    bound, _ = shed_lower_bound(areas, cost, mu=1.2, direction="step", time_limit=10.0)
    assert 0 < bound <= brute_force_best(areas, cost, 1.2, "step")


def test_shed_bound_on_a_quality_mask():
    """Packed full documents, P = 8, 8K tokens per rank (the quality benchmark's seed 2): the rank
    holding a 7,392-token document alone bounds the step at 210.2 MB, above the whole program's
    60 s bound (209.7) and below the device plan (211.0)."""
    from gpusolver.areas import block_areas
    from gpusolver.config import SolverConfig
    from gpusolver.masks import packed_documents
    from gpusolver.solver.device import solve_device

    config = SolverConfig(cp_size=8, chunk_tiles=1, auto_tiles=False)
    areas = block_areas(packed_documents(8 * 8192, seed=2, causal=False), 8, config.head_groups, impl="torch")
    bound, per_rank = shed_lower_bound(areas, config.cost(), mu=config.imbalance_tol)
    assert bound == per_rank[6] == 210_166_574
    plan = solve_device(areas, config, impl="torch")
    assert bound <= int(evaluate(areas, plan.assignment, config.cost()).step_bottleneck)
