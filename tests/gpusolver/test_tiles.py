"""Sub-chunk tiles: units of c / n tokens, coarse-to-fine solves, plans and errors."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import causal_mask, packed_documents, sliding_window_mask
from gpusolver.metrics import evaluate
from gpusolver.ops import solve_assignment_compiled
from gpusolver.plan import build_plan
from gpusolver.solve import solve_assignment
from gpusolver.solver.device import Strategy, solve_device
from gpusolver.solver.reference import assign as reference_assign
from tests._testing import assert_close
from tests.gpusolver.test_plan import _check_plan, _config, _random_mask


@settings(max_examples=15, deadline=None)
@given(data=st.data(), P=st.integers(1, 3), c=st.integers(1, 4), tiles=st.sampled_from([2, 3, 4]),
       G=st.integers(1, 2), grouped=st.booleans())
def test_coarsen_equals_areas_at_fewer_tiles(data, P, c, tiles, G, grouped):
    mask = _random_mask(data, P * c * tiles, G, grouped)
    fine = block_areas(mask, P, G, impl="torch", tiles=tiles)
    assert fine.area.shape == (G, P * tiles, P * tiles) and fine.chunk == c and fine.rank_tokens == c * tiles
    for fewer in [t for t in range(1, tiles) if tiles % t == 0]:
        direct = block_areas(mask, P, G, impl="torch", tiles=fewer)
        coarse = fine.coarsen() if fewer == 1 else fine.coarsen(fewer)
        assert coarse.tiles == fewer and coarse.chunk == direct.chunk
        for name in ("area", "q_need", "k_need"):
            assert torch.equal(getattr(coarse, name), getattr(direct, name)), (fewer, name)


def test_coarsen_rejects_a_tile_count_that_does_not_divide():
    fine = block_areas(causal_mask(64), 2, 1, impl="torch", tiles=4)
    for bad in (0, 3, 8, 2.0):
        with pytest.raises(ValueError, match="tiles must be a positive int dividing 4"):
            fine.coarsen(bad)


def test_refine_keeps_loads_and_never_moves_more():
    P, n = 4, 2
    config = SolverConfig(cp_size=P)
    mask = packed_documents(1024 * P, seed=5)
    whole = block_areas(mask, P, config.head_groups, impl="torch")
    fine = block_areas(mask, P, config.head_groups, impl="torch", tiles=n)
    coarse_asg = solve_device(whole, config).assignment
    asg = fine.refine(coarse_asg)
    assert asg.shape == fine.area.shape and asg.dtype == torch.int32
    assert torch.equal(asg[fine.area == 0], torch.full_like(asg[fine.area == 0], -1))
    tiled = evaluate(fine, asg, config.cost())
    untiled = evaluate(whole, coarse_asg, config.cost())
    assert torch.equal(tiled.load, untiled.load)
    # a tile's hull lies inside the chunk's hull: tiles never move more rows than whole chunks
    assert int(tiled.fwd_bottleneck) <= int(untiled.fwd_bottleneck)


@pytest.mark.parametrize("P,n", [(2, 4), (4, 2)])
def test_tiled_solve_valid_and_no_worse_than_whole_chunks(P, n):
    config = SolverConfig(cp_size=P, chunk_tiles=n)
    mask = causal_mask(512 * P)
    fine = block_areas(mask, P, config.head_groups, impl="torch", tiles=n)
    res = solve_device(fine, config)
    asg = res.assignment
    busy = fine.area > 0
    assert asg.shape == fine.area.shape and ((asg >= 0) & (asg < P))[busy].all() and (asg[~busy] == -1).all()
    m = evaluate(fine, asg, config.cost())
    whole_cfg = SolverConfig(cp_size=P)
    whole = block_areas(mask, P, whole_cfg.head_groups, impl="torch")
    untiled = evaluate(whole, solve_device(whole, whole_cfg).assignment, whole_cfg.cost())
    assert bool(res.balanced) and m.imbalance.item() <= config.imbalance_tol
    assert int(res.fwd_bottleneck) == int(m.fwd_bottleneck) <= int(untiled.fwd_bottleneck)
    if n % 2 == 0:  # n tiles start from the plan at n / 2 tiles, so never end above it
        half_cfg = SolverConfig(cp_size=P, chunk_tiles=n // 2)
        half = block_areas(mask, P, half_cfg.head_groups, impl="torch", tiles=n // 2)
        assert int(res.fwd_bottleneck) <= int(solve_device(half, half_cfg).fwd_bottleneck)
    again = solve_device(fine, config)
    assert torch.equal(again.assignment, asg)  # deterministic


def test_tiled_random_masks_give_valid_plans():
    gen = torch.Generator().manual_seed(0)
    for P, n, G in ((2, 2, 1), (3, 2, 2)):
        S = P * n * 6
        mask = sliding_window_mask(S, int(torch.randint(2, S, (1,), generator=gen)))
        config = _config(P, G, chunk_tiles=n)
        areas = block_areas(mask, P, G, impl="torch", tiles=n)
        asg = solve_device(areas, config, rounds=6).assignment
        _check_plan(mask, areas, asg, build_plan(mask, areas, asg, config))


def test_tiled_solve_on_meta_fake_and_through_ops():
    P, n = 4, 2
    config = SolverConfig(cp_size=P, chunk_tiles=n)
    mask = packed_documents(512 * P, seed=1, pad_to=48)
    G, U = config.head_groups, P * n
    areas = block_areas(mask, P, G, impl="torch", tiles=n)
    # shapes do not depend on the rounds or the portfolio: a short solve proves no host reads
    short = dict(rounds=2, strategies=(Strategy((float("inf"),), units_per_rank=2, bundle_dests=2),))
    on_meta = solve_device(areas.to("meta"), config, **short)
    assert on_meta.assignment.device.type == "meta" and on_meta.assignment.shape == (G, U, U)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert solve_device(areas, config, **short).assignment.shape == (G, U, U)
    eager = solve_device(areas, config)
    real = build_plan(mask, areas, eager.assignment, config)
    meta = lambda t: t.to("meta")  # noqa: E731
    mask_m = type(mask)(meta(mask.q_ranges), meta(mask.k_ranges), meta(mask.attn_type), mask.total_seqlen_q,
                        mask.total_seqlen_k)
    plan = build_plan(mask_m, areas.to("meta"), on_meta.assignment, config)
    assert plan.comm.qo_range.shape == real.comm.qo_range.shape == (G, U, P, 2)
    assert plan.calc.q_ranges.shape == real.calc.q_ranges.shape and plan.status.device.type == "meta"
    assert_close("assignment via ops", eager.assignment, solve_assignment_compiled(mask, config, impl="torch"))


def test_reference_solver_with_tiles_places_whole_chunks():
    P, n = 4, 2
    config = SolverConfig(cp_size=P, chunk_tiles=n)
    mask = packed_documents(512 * P, seed=2)
    fine = block_areas(mask, P, config.head_groups, impl="torch", tiles=n)
    asg = solve_assignment(fine, config, solver="reference")
    whole_cfg = SolverConfig(cp_size=P)
    whole = block_areas(mask, P, whole_cfg.head_groups, impl="torch")
    assert torch.equal(asg, fine.refine(reference_assign(whole, whole_cfg).assignment))
    with pytest.raises(ValueError, match="tiles=2; the reference solver places whole chunks"):
        reference_assign(fine, config)


def test_tile_errors_name_the_argument():
    with pytest.raises(ValueError, match="chunk_tiles must be a positive int"):
        SolverConfig(cp_size=2, chunk_tiles=0)
    config = SolverConfig(cp_size=2, chunk_tiles=4)
    with pytest.raises(ValueError, match=r"total_seqlen=12 must be divisible by cp_size \* chunk_tiles=2 \* 4"):
        config.check_seqlen(12)
    mask = causal_mask(16)
    with pytest.raises(ValueError, match="tiles must be a positive int"):
        block_areas(mask, 2, tiles=0)
    areas = block_areas(mask, 2, config.head_groups, impl="torch", tiles=2)
    with pytest.raises(ValueError, match="areas have tiles=2 per chunk but config.chunk_tiles=4"):
        solve_device(areas, config)
    with pytest.raises(ValueError, match="tiles=2 but the config has"):
        build_plan(mask, areas, areas.refine(torch.zeros(8, 2, 2, dtype=torch.int32)), config)
    with pytest.raises(ValueError, match="as_tiles takes untiled areas, got tiles=2"):
        areas.as_tiles(2)
    with pytest.raises(ValueError, match="tiles must be a positive int dividing the unit count"):
        type(areas)(areas.area, areas.q_need, areas.k_need, areas.chunk, 3)


@pytest.fixture
def one_thread():
    """Small tensor ops: one thread is faster than two fighting for 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_auto_tiles_are_the_fewest_that_balance(one_thread):
    """One KV head, P = 4: a sliding window leaves whole chunks at 1.157 and 2 tiles balance it
    (auto stops there, below its cap of 4); causal documents balance with whole chunks, and auto
    returns that plan, refined to the cap's tiles (the static shape)."""
    from gpusolver.solve import solve

    config = SolverConfig(cp_size=4, num_heads_q=8, num_heads_kv=1)  # chunk_tiles="auto", the default
    assert config.auto_tiles and config.chunk_tiles == 1 and config.tiles_for(1024).chunk_tiles == 4
    assert config.tiles_for(1000).chunk_tiles == 2  # halved until it divides c = 250
    assert SolverConfig(cp_size=4).tiles_for(1024).chunk_tiles == 1  # G = 8: whole chunks
    window = sliding_window_mask(1024, 300)
    one = solve_device(block_areas(window, 4, 1, impl="torch"), SolverConfig(cp_size=4, num_heads_q=8,
                                                                             num_heads_kv=1, chunk_tiles=1))
    assert not bool(one.balanced)
    capped = config.tiles_for(1024)
    res = solve_device(block_areas(window, 4, 1, impl="torch", tiles=4), capped)
    assert bool(res.balanced) and int(res.tiles) == 2 and res.assignment.shape == (1, 16, 16)
    plan = solve(window, config)
    assert plan.assignment.shape == (1, 16, 16) and plan.metrics.imbalance.item() <= config.imbalance_tol
    docs = packed_documents(1024, seed=1)
    areas = block_areas(docs, 4, 1, impl="torch", tiles=4)
    auto = solve_device(areas, capped)
    whole = solve_device(areas.coarsen(), SolverConfig(cp_size=4, num_heads_q=8, num_heads_kv=1, chunk_tiles=1))
    assert int(auto.tiles) == 1 and bool(whole.balanced)
    assert torch.equal(auto.assignment, areas.refine(whole.assignment))
