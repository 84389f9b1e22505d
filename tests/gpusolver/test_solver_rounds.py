"""The persistent round-loop kernel equals the torch round loop exactly (interpreter on CPU)."""
from dataclasses import replace

import pytest
import torch

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import causal_mask, packed_documents
from gpusolver.metrics import owner_computes_assignment
from gpusolver.solver import core, device, strategies as strat
from gpusolver.solver.bundle import kernel as bundle_kernel
from gpusolver.solver.device import Strategy, solve_device
from gpusolver.solver.rounds import solve_rounds_persistent
from tests._testing import assert_close

_STRATEGIES = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),
               Strategy((1.5,), units_per_rank=1, bundle_dests=2, task_order="rows"))
_ROWS_FIRST = (Strategy((float("inf"),), units_per_rank=2, bundle_dests=4, task_order="rows"),)
_SMALL_FIRST = (Strategy((float("inf"),), units_per_rank=2, bundle_dests=4, task_order="small"),)


def _problem(P, G, kind, seed=0, tiles=1):
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, chunk_tiles=tiles)
    mask = packed_documents(512 * P, seed=seed) if kind == "packed" else causal_mask(64 * P)
    areas = block_areas(mask, P, G, impl="torch", tiles=tiles)
    tasks = core.Tasks(areas, config)
    cap = (int(round(config.imbalance_tol * core._MU_SCALE)) * tasks.area.sum()) // (P * core._MU_SCALE)
    return config, areas, tasks, cap


@pytest.mark.parametrize("P,G,kind,seed,rounds,sideways,restart_every,singles,extra", [
    (4, 2, "packed", 0, 3, False, 0, False, ()), (3, 1, "causal", 0, 2, True, 0, False, ()),
    (3, 4, "packed", 6, 8, True, 2, False, ()),  # the restarts (balanced variants only) change this result
    (2, 8, "packed", 2, 2, True, 0, True, _ROWS_FIRST),  # one-task balance bundles change this one's
    (3, 2, "packed", 1, 3, True, 0, False, _SMALL_FIRST),
    # the smallest instances of the first, third and fifth cases above (the fast tier's; the
    # larger ones are in the slow tier): the same flags, and each still changes the result by
    # them (a restart, smallest first) and moves a task
    (3, 2, "packed", 0, 2, False, 0, False, ()),  # no sideways; D = 3: two destination tiles of 2
    (2, 4, "packed", 7, 3, True, 2, False, ()),  # a restart after round 2 changes this result
    (2, 2, "packed", 2, 2, True, 0, False, _SMALL_FIRST),
])
def test_every_variant_equals_the_torch_loop(P, G, kind, seed, rounds, sideways, restart_every, singles, extra,
                                              monkeypatch):
    """Best assignment and key of every variant, not only the winner's (destinations in tiles of 2)."""
    monkeypatch.setattr(bundle_kernel, "_DEST_TILE", 2)
    _, _, tasks, cap = _problem(P, G, kind, seed)
    strategies = _STRATEGIES + extra
    ref_A, ref_key = device.run_variants(tasks, cap, strategies, rounds, sideways=sideways,
                                          restart_every=restart_every, singles=singles)
    if restart_every:
        plain_A, _ = device.run_variants(tasks, cap, strategies, rounds, sideways=sideways, singles=singles)
        assert not torch.equal(plain_A[:, :tasks.T], ref_A[:, :tasks.T]), "the restart changed nothing here"
    if singles:
        plain_A, _ = device.run_variants(tasks, cap, strategies, rounds, sideways=sideways,
                                          restart_every=restart_every)
        assert not torch.equal(plain_A[:, :tasks.T], ref_A[:, :tasks.T]), "singles changed nothing here"
    if extra == _SMALL_FIRST:  # smallest first (last variant) ends elsewhere than largest first (variant 1)
        assert not torch.equal(ref_A[-1, :tasks.T], ref_A[1, :tasks.T])
    variants, K, D = strat.variants(strategies, tasks.G, P)
    A, key = solve_rounds_persistent(tasks, cap, strat.variant_tables(variants, "cpu"),
                                     strat.variant_scales(variants, "cpu"), K, D, rounds, 1, sideways,
                                     restart_every, singles=singles)
    assert_close("best_key", ref_key, key)
    assert_close("best_A", ref_A[:, :tasks.T], A[:, :tasks.T])
    assert bool((ref_A[:, :tasks.T] != torch.where(tasks.valid, tasks.i, P)).any()), "no variant moved a task"


def test_solve_persistent_equals_torch():
    """The whole solve (both rules of the training objective) at its smallest moving instance:
    P = 3, two rounds; a task moves and the winner is the third variant, not the first."""
    config, areas, _, _ = _problem(3, 2, "packed")
    ref = solve_device(areas, config, rounds=2, strategies=_STRATEGIES, impl="torch")
    per = solve_device(areas, config, rounds=2, strategies=_STRATEGIES, impl="persistent")
    for name in ("assignment", "balanced", "fwd_bottleneck", "variant"):
        assert_close(name, getattr(ref, name), getattr(per, name))
    assert int(ref.variant) == 2 and bool(ref.balanced)
    assert bool((ref.assignment != owner_computes_assignment(areas)).any()), "no task moved"


def test_persistent_runs_on_meta():
    config, areas, _, _ = _problem(4, 2, "packed")
    res = solve_device(areas.to("meta"), config, rounds=3, strategies=_STRATEGIES, impl="persistent")
    assert res.assignment.device.type == "meta" and res.assignment.shape == (2, 4, 4)
    assert res.assignment.dtype == torch.int32


@pytest.mark.parametrize("impl", ["triton", "persistent"])
def test_tiled_solve_equals_torch(impl):
    """Two tiles per rank: the chunks' solve, then the tiles' from its refined plan, on each path."""
    config, areas, _, _ = _problem(2, 1, "causal", tiles=2)
    strategies = (Strategy((float("inf"),), units_per_rank=2, bundle_dests=4),
                  Strategy((float("inf"),), units_per_rank=1, bundle_dests=2, task_order="rows"))
    ref = solve_device(areas, config, rounds=2, strategies=strategies, impl="torch")
    res = solve_device(areas, config, rounds=2, strategies=strategies, impl=impl)
    for name in ("assignment", "balanced", "fwd_bottleneck", "variant"):
        assert_close(name, getattr(ref, name), getattr(res, name))
    coarse = solve_device(areas.coarsen(), replace(config, chunk_tiles=1), rounds=2, strategies=strategies,
                          impl="torch")
    assert res.assignment.shape == (1, 4, 4) and bool(res.balanced) and not bool(coarse.balanced)
    assert not torch.equal(res.assignment, areas.refine(coarse.assignment)), "no tile moved"


def test_persistent_start_equals_the_torch_loop():
    """A given start assignment (random ranks) on a tiled problem, with a restart sending tasks
    back to their query hosts (u // tiles): every variant's best state and key."""
    _, _, tasks, cap = _problem(2, 1, "packed", seed=2, tiles=2)
    strategies = (Strategy((float("inf"),), units_per_rank=1, bundle_dests=2),
                  Strategy((1.5,), units_per_rank=1, bundle_dests=2, task_order="rows"))
    start = torch.randint(0, 2, (tasks.T,), generator=torch.Generator().manual_seed(0))
    rounds, restart_every = 3, 2
    ref_A, ref_key = device.run_variants(tasks, cap, strategies, rounds, sideways=True,
                                          restart_every=restart_every, start=start)
    plain_A, _ = device.run_variants(tasks, cap, strategies, rounds, sideways=True, start=start)
    own_A, _ = device.run_variants(tasks, cap, strategies, rounds, sideways=True, restart_every=restart_every)
    assert not torch.equal(own_A[:, :tasks.T], ref_A[:, :tasks.T]), "the start changed nothing"
    assert not torch.equal(plain_A[:, :tasks.T], ref_A[:, :tasks.T]), "the restart changed nothing"
    variants, K, D = strat.variants(strategies, tasks.G, tasks.P, tiles=2)
    A, key = solve_rounds_persistent(tasks, cap, strat.variant_tables(variants, "cpu"),
                                     strat.variant_scales(variants, "cpu"), K, D, rounds, 1, True,
                                     restart_every, start=start.int())
    assert_close("best_key", ref_key, key)
    assert_close("best_A", ref_A[:, :tasks.T], A[:, :tasks.T])


def test_persistent_runs_tiled_on_meta():
    config, areas, _, _ = _problem(4, 2, "packed", tiles=2)
    res = solve_device(areas.to("meta"), config, rounds=3, strategies=_STRATEGIES, impl="persistent")
    assert res.assignment.device.type == "meta" and res.assignment.shape == (2, 8, 8)


def test_start_is_checked():
    _, _, tasks, cap = _problem(3, 1, "causal")
    variants, K, D = strat.variants(_STRATEGIES, tasks.G, tasks.P)
    args = (tasks, cap, strat.variant_tables(variants, "cpu"), strat.variant_scales(variants, "cpu"), K, D, 1)
    for bad in (torch.zeros(tasks.T + 1, dtype=torch.int64), torch.zeros(tasks.T)):
        with pytest.raises(ValueError, match="start"):
            solve_rounds_persistent(*args, start=bad)


def test_workers_are_checked():
    config, areas, _, _ = _problem(3, 1, "causal")
    with pytest.raises(ValueError, match="workers=2"):
        solve_device(areas, config, rounds=1, strategies=_STRATEGIES, impl="persistent", workers=2)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        solve_device(areas, config, rounds=1, strategies=_STRATEGIES, impl="persistent", workers=0)


def test_solve_plans_are_identical_on_both_paths(monkeypatch):
    """The whole layer solve (default rounds; a one-strategy portfolio to keep the interpreter quick)."""
    from gpusolver import solve
    from gpusolver.masks import varlen_causal_mask

    monkeypatch.setattr(device, "default_strategies", lambda P, relays=False: _STRATEGIES[:1])
    # whole chunks: the auto-tile chain's levels have their own path test (test_tiled_solve_equals_torch)
    config = SolverConfig(cp_size=3, num_heads_q=8, num_heads_kv=2, chunk_tiles=1)
    mask = varlen_causal_mask([5, 13, 9, 3, 6])  # S = 36, chunk 12
    a = solve(mask, config, impl="torch")
    b = solve(mask, config, impl="persistent")
    assert_close("assignment", a.assignment, b.assignment)
    assert_close("status", a.status, b.status)
    for name in ("q_ranges", "k_ranges", "attn_type"):
        assert_close(name, getattr(a.calc, name), getattr(b.calc, name))
    for rank in range(3):
        for kind in ("qo", "kv"):
            assert_close(f"{kind} send_index rank {rank}", a.comm.send_index(kind, rank), b.comm.send_index(kind, rank))
