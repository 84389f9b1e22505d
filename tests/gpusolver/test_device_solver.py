"""The device solver: sync-free, static shapes, deterministic, valid and balanced plans."""
import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import causal_mask, packed_documents, varlen_causal_mask
from gpusolver.metrics import evaluate, owner_computes_assignment
from gpusolver.plan import IMBALANCED, build_plan
from gpusolver.solve import solve, solve_assignment
from gpusolver.solver.device import solve_device
from gpusolver.solver.reference import assign as reference_assign
from tests._testing import assert_close
from tests.gpusolver.test_plan import _check_plan, _config as _plan_config, _random_mask


def _config(P, G=2, **kw):
    return _plan_config(P, G, **kw)  # the byte costs _check_plan recomputes with


def _check_assignment(areas, asg):
    P = areas.cp_size
    assert asg.shape == areas.area.shape and asg.dtype == torch.int32
    busy = areas.area > 0
    assert ((asg >= 0) & (asg < P))[busy].all(), "a non-empty task has no rank"
    assert (asg[~busy] == -1).all(), "an empty task was assigned"


@settings(max_examples=12, deadline=None)
@given(data=st.data(), P=st.integers(2, 5), c=st.integers(2, 6), G=st.integers(1, 2), grouped=st.booleans())
def test_random_masks_give_valid_plans(data, P, c, G, grouped):
    mask = _random_mask(data, P * c, G, grouped)
    areas = block_areas(mask, P, G, impl="torch")
    res = solve_device(areas, _config(P, G), rounds=8)
    _check_assignment(areas, res.assignment)
    plan = build_plan(mask, areas, res.assignment, _config(P, G))
    _check_plan(mask, areas, res.assignment, plan)
    m = evaluate(areas, res.assignment, _config(P, G).cost())
    if bool(res.balanced):
        assert int(res.fwd_bottleneck) == int(m.fwd_bottleneck)
        assert m.load.max().item() <= 1.10 * m.load.double().mean().item() + 1e-6


@pytest.mark.parametrize("P", [2, 4, 8])
def test_packed_documents_balanced_and_no_worse_than_owner_when_balanced(P):
    config = SolverConfig(cp_size=P)
    mask = packed_documents(2048 * P, seed=P)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    res = solve_device(areas, config)
    _check_assignment(areas, res.assignment)
    m = evaluate(areas, res.assignment, config.cost())
    ref = reference_assign(areas, config)
    if ref.feasible:  # the device solver balances wherever the reference does
        assert bool(res.balanced) and m.imbalance.item() <= config.imbalance_tol + 1e-9
    owner = evaluate(areas, owner_computes_assignment(areas), config.cost())
    if owner.imbalance.item() <= config.imbalance_tol:  # owner-computes is a candidate it starts from
        assert m.fwd_bottleneck.item() <= owner.fwd_bottleneck.item()


def test_balances_a_long_causal_document():
    P = 4
    config = _config(P, G=4)
    mask = causal_mask(64 * P)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    owner = evaluate(areas, owner_computes_assignment(areas), config.cost())
    assert owner.imbalance.item() > 1.5
    res = solve_device(areas, config)
    m = evaluate(areas, res.assignment, config.cost())
    assert bool(res.balanced) and m.imbalance.item() <= 1.10


def test_deterministic():
    P = 4
    config = SolverConfig(cp_size=P)
    areas = block_areas(packed_documents(2048 * P, seed=3), P, config.head_groups, impl="torch")
    first = solve_device(areas, config)
    for _ in range(2):
        again = solve_device(areas, config)
        assert torch.equal(first.assignment, again.assignment)
        assert torch.equal(first.fwd_bottleneck, again.fwd_bottleneck)


def test_runs_on_meta_and_shapes_depend_only_on_config():
    P = 4
    config = SolverConfig(cp_size=P)
    areas = block_areas(packed_documents(1024 * P, seed=0), P, config.head_groups, impl="torch")
    res = solve_device(areas.to("meta"), config)
    assert res.assignment.device.type == "meta"
    assert res.assignment.shape == (config.head_groups, P, P)
    other = block_areas(varlen_causal_mask([100, 3000, 996]), P, config.head_groups, impl="torch")
    assert solve_device(other, config).assignment.shape == res.assignment.shape


def test_runs_under_fake_tensor_mode():
    P = 4
    config = SolverConfig(cp_size=P)
    areas = block_areas(packed_documents(1024 * P, seed=0), P, config.head_groups, impl="torch")
    with FakeTensorMode(allow_non_fake_inputs=True):
        res = solve_device(areas, config)
        assert res.assignment.shape == (config.head_groups, P, P)


def test_whole_solve_runs_on_meta():
    P = 4
    config = SolverConfig(cp_size=P)
    mask = packed_documents(1024 * P, seed=1, pad_to=64)
    meta = type(mask)(mask.q_ranges.to("meta"), mask.k_ranges.to("meta"), mask.attn_type.to("meta"),
                      mask.total_seqlen_q, mask.total_seqlen_k)
    plan = solve(meta, config, areas_impl="torch")
    real = solve(mask, config, areas_impl="torch")
    assert plan.calc.q_ranges.device.type == "meta"
    assert plan.calc.q_ranges.shape == real.calc.q_ranges.shape
    assert plan.comm.send_index("qo", 1).shape == real.comm.send_index("qo", 1).shape
    assert plan.comm.send_index("qo", 1).device.type == "meta"


def test_triton_and_torch_areas_give_identical_plans():
    P = 3
    config = _config(P, G=2)
    mask = varlen_causal_mask([5, 13, 9, 3, 6])  # S = 36, chunk 12
    a = solve(mask, config, areas_impl="torch")
    b = solve(mask, config, areas_impl="triton")
    assert_close("assignment", a.assignment, b.assignment)
    assert_close("q_ranges", a.calc.q_ranges, b.calc.q_ranges)
    assert_close("qo_send_index", a.comm.send_index("qo", 1), b.comm.send_index("qo", 1))


def test_solve_reports_imbalance_it_cannot_fix():
    # one block holds all the work: no assignment of whole tasks can balance it (whole chunks: with
    # chunk_tiles="auto" tiles would split the block)
    P = 2
    config = _config(P, G=1, head_group_flatten=False, chunk_tiles=1)
    mask = varlen_causal_mask([16])  # causal over both chunks: blocks (0,0), (1,0), (1,1)
    with pytest.warns(UserWarning, match="imbalance_tol"):
        plan = solve(mask, config.replaced(imbalance_tol=1.0))
    assert int(plan.status) & IMBALANCED


def test_solve_names_the_buffers_when_they_hold_the_balance_back():
    """Balanced with the default buffers; with buffers of 8 rows no helper can take the rows of chunk 0's
    one long document, owner-computes (nothing travels) is the plan within them, and the warning names
    the knobs."""
    P = 4
    config = _config(P, G=2, chunk_tiles=1)
    mask = varlen_causal_mask([32] + [8] * 12)  # chunk 0: one causal document; chunks 1-3: four short ones
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not int(solve(mask, config).status) & IMBALANCED
    with pytest.warns(UserWarning, match=r"within its receive and send buffers.*max_recv_rows.*chunk_tiles"):
        plan = solve(mask, config.replaced(max_recv_rows=8))
    assert int(plan.status) & IMBALANCED and plan.metrics.imbalance.item() > config.imbalance_tol


def test_solver_choice_and_errors():
    P = 2
    config = _config(P, G=1)
    areas = block_areas(causal_mask(8 * P), P, 1, impl="torch")
    ref = solve_assignment(areas, config, solver="reference")
    _check_assignment(areas, ref)
    with pytest.raises(ValueError, match="solver must be one of"):
        solve_assignment(areas, config, solver="magic")
    with pytest.raises(ValueError, match="cp_size"):
        solve_device(areas, _config(4, G=1))
    with pytest.raises(ValueError, match="head_groups"):
        solve_device(areas, _config(P, G=2))
    with pytest.raises(ValueError, match="past the supported MAX_SEQLEN"):  # int32 token arithmetic
        solve_device(dataclasses.replace(areas, chunk=1 << 30), config)


def test_invalid_mask_values_flagged_without_host_reads():
    from gpusolver.masks import AttnSlices
    from gpusolver.plan import INVALID_MASK

    P = 2
    config = _config(P, G=1)
    good = varlen_causal_mask([6, 10])
    assert not bool(good.value_error())
    bad = AttnSlices(torch.tensor([[0, 6], [6, 17]], dtype=torch.int32), good.k_ranges, good.attn_type, 16, 16)
    assert bool(bad.value_error())  # q range ends past S
    meta = AttnSlices(bad.q_ranges.to("meta"), bad.k_ranges.to("meta"), bad.attn_type.to("meta"), 16, 16)
    assert meta.value_error().device.type == "meta"  # computed on device, no host read
    flipped = AttnSlices(good.q_ranges, good.k_ranges, torch.tensor([1, 7], dtype=torch.int32), 16, 16)
    plan = solve(flipped, config, validate=False)
    assert int(plan.status) & INVALID_MASK
    with pytest.raises(ValueError, match="INVALID_MASK"):
        plan.validate()


def test_a_variant_does_not_depend_on_its_batch():
    # the Triton path (and the torch path below TORCH_BATCH_RANKS) runs the whole portfolio as one
    # batch, the torch path from there one batch per strategy
    from gpusolver.solver import core, device, strategies as strat
    from gpusolver.solver.bundle import ref as bundle_ref
    from gpusolver.solver.state import ref as state_ref

    P = 4
    config = SolverConfig(cp_size=P)
    areas = block_areas(packed_documents(2048 * P, seed=5), P, config.head_groups, impl="torch")
    tasks = core.Tasks(areas, config)
    cap = (int(round(config.imbalance_tol * core._MU_SCALE)) * tasks.area.sum()) // (P * core._MU_SCALE)
    portfolio = strat.DEFAULT_STRATEGIES
    merged_A, merged_key = device.run_variants(tasks, cap, portfolio, 6, state_ref.state, bundle_ref.bundle_proposals)
    runs = [device.run_variants(tasks, cap, (s,), 6, state_ref.state, bundle_ref.bundle_proposals) for s in portfolio]
    assert_close("keys", torch.cat([k for _, k in runs]), merged_key)
    assert_close("assignments", torch.cat([a for a, _ in runs]), merged_A)


def test_chain_moves_balance_when_no_single_move_fits():
    # packed causal documents, P = 8, seed 2: after the first moves the last overloaded rank holds
    # only tasks larger than any other rank's headroom; a chain of moves (a destination briefly
    # over the cap sheds a smaller task) still balances it
    P = 8
    config = SolverConfig(cp_size=P)
    areas = block_areas(packed_documents(8192 * P, seed=2), P, config.head_groups, impl="torch")
    res = solve_device(areas, config)
    m = evaluate(areas, res.assignment, config.cost())
    assert bool(res.balanced) and m.imbalance.item() <= config.imbalance_tol


@pytest.mark.parametrize("tokens_per_rank,causal,seed", [(4096, True, 2), (2048, False, 3)])
def test_balances_masks_the_reference_balances(tokens_per_rank, causal, seed):
    """Two packed-document masks (P = 8, GQA 32:4) where a portfolio without a finite threshold
    and a narrow rows-first window stayed above mu while the reference balanced."""
    from gpusolver.solver.reference import assign

    P = 8
    config = SolverConfig(cp_size=P, num_heads_q=32, num_heads_kv=4)
    areas = block_areas(packed_documents(tokens_per_rank * P, seed=seed, causal=causal), P, config.head_groups,
                        impl="torch")
    ref = evaluate(areas, assign(areas, config).assignment, config.cost())
    res = solve_device(areas, config, impl="torch")
    dev = evaluate(areas, res.assignment, config.cost())
    assert ref.imbalance.item() <= config.imbalance_tol
    assert bool(res.balanced) and dev.imbalance.item() <= config.imbalance_tol


def test_a_light_task_moves_to_its_key_host():
    """Two ranks, full documents: one document crosses the chunk border, so under owner-computes
    rank 0 gathers 906 key columns from rank 1 for 48 query rows (and rank 1 sends them). Moving
    such a task to rank 1 ships 48 rows of Q and O instead; it also lowers what rank 1 sends,
    which the destination's price must count, or no move ever looks better than the start."""
    P = 2
    config = SolverConfig(cp_size=P, num_heads_q=32, num_heads_kv=4)
    areas = block_areas(packed_documents(4096 * P, seed=0, causal=False), P, config.head_groups, impl="torch")
    assert areas.k_need[0, 0, 1].tolist() == [0, 906] and areas.q_need[0, 0, 1].tolist() == [4048, 4096]
    cost = config.cost()
    owner = evaluate(areas, owner_computes_assignment(areas), cost)
    ref = evaluate(areas, reference_assign(areas, config).assignment, cost)
    res = solve_device(areas, config)
    dev = evaluate(areas, res.assignment, cost)
    assert bool(res.balanced) and float(dev.imbalance) <= config.imbalance_tol
    assert int(dev.fwd_bottleneck) <= int(ref.fwd_bottleneck) < int(owner.fwd_bottleneck)
    assert bool((res.assignment[:, 0, 1] == 1).any()), "no cross task moved to its key host"


def test_a_rank_just_above_the_cap_sheds_its_small_task():
    """P = 6, causal documents, GQA 32:4: rank 4 is 0.18 M above the cap and each of its units
    holds a 2.1 M diagonal task and a 0.83 M task whose keys live on rank 3, and both need all
    the unit's rows. Largest first, or fewest rows first, a bundle can only ship the diagonal
    task, which fits no rank, so the solve chained moves and ended at 2.07x the reference;
    smallest first ships the small task to rank 3, its key host."""
    from gpusolver.solver.device import Strategy

    P = 6
    config = SolverConfig(cp_size=P, num_heads_q=32, num_heads_kv=4)
    areas = block_areas(packed_documents(2048 * P, seed=1, causal=True), P, config.head_groups, impl="torch")
    assert areas.area[0, 4, 3:5].tolist() == [831488, 2098176]
    assert areas.q_need[0, 4, 3].tolist() == areas.q_need[0, 4, 4].tolist() == [0, 2048]
    cost = config.cost()
    ref = evaluate(areas, reference_assign(areas, config).assignment, cost)
    inf = float("inf")
    largest = solve_device(areas, config, strategies=(Strategy((inf,), units_per_rank=16, bundle_dests=16),))
    smallest = solve_device(areas, config, strategies=(Strategy((inf,), units_per_rank=16, bundle_dests=16,
                                                                task_order="small"),))
    assert int(largest.assignment[:, 4, 3].eq(3).sum()) == 0  # the small task never reaches its key host
    assert int(smallest.assignment[:, 4, 3].eq(3).sum()) >= 1
    assert bool(smallest.balanced)
    assert int(smallest.fwd_bottleneck) < 0.7 * int(largest.fwd_bottleneck)
    res = solve_device(areas, config)  # the default portfolio holds the smallest-first strategy
    dev = evaluate(areas, res.assignment, cost)
    assert bool(res.balanced) and int(dev.fwd_bottleneck) <= 1.25 * int(ref.fwd_bottleneck)


def test_task_orders_are_permutations_in_their_order():
    from gpusolver.solver.core import Tasks as _Tasks
    from gpusolver.solver.strategies import TASK_ORDERS

    P, G = 4, 2
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G)
    areas = block_areas(varlen_causal_mask([100, 60 * P - 100, 4 * P]), P, G, impl="torch")
    tasks = _Tasks(areas, config)
    U = tasks.U
    assert tasks.unit_tasks.shape == (len(TASK_ORDERS), G * U, U)
    area = tasks.area[tasks.unit_tasks]  # [orders, G*U, U] areas in each order
    rows = (tasks.qhi - tasks.qlo)[tasks.unit_tasks]
    assert torch.equal(torch.sort(tasks.unit_tasks % U, dim=2).values, torch.arange(U).expand_as(tasks.unit_tasks))
    assert torch.equal(tasks.unit_tasks // U, torch.arange(G * U)[None, :, None].expand_as(tasks.unit_tasks))
    busy = area > 0
    by = {name: k for k, name in enumerate(TASK_ORDERS)}
    assert (area[by["area"], :, 1:] <= area[by["area"], :, :-1]).all()  # largest first
    small, small_busy = area[by["small"]], busy[by["small"]]
    assert (small_busy[:, 1:] <= small_busy[:, :-1]).all()  # empty tasks last
    assert ((small[:, 1:] >= small[:, :-1]) | ~small_busy[:, 1:]).all()  # then smallest first
    r, a, b = rows[by["rows"]], area[by["rows"]], busy[by["rows"]]
    later = b[:, 1:] & b[:, :-1]  # fewest rows first among non-empty tasks, ties by largest
    assert ((r[:, 1:] > r[:, :-1]) | ((r[:, 1:] == r[:, :-1]) & (a[:, 1:] <= a[:, :-1])))[later].all()
    assert bool((area[by["small"]] != area[by["area"]]).any())
