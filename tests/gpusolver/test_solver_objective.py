"""The device solver's objective (a training step's bytes, or the forward's) and its buffers."""
import pytest
from hypothesis import given, settings, strategies as st

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import causal_mask, packed_documents, sliding_window_mask
from gpusolver.metrics import evaluate, owner_computes_assignment
from gpusolver.plan import BUFFER_OVERFLOW, build_plan
from gpusolver.solver.device import Strategy, solve_device
from tests._testing import assert_close
from tests._threads import one_torch_thread  # noqa: F401 - autouse, module scope
from tests.gpusolver.test_plan import _random_mask

_SMALL = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),
          Strategy((float("inf"),), units_per_rank=1, bundle_dests=2, task_order="rows"))


def _max_rows(mask, areas, assignment, config) -> int:
    """The most rows any rank receives or sends, of either kind, in the plan's own CommMeta."""
    m = build_plan(mask, areas, assignment, config).comm
    return max(int(m.qo_recv_rows.max()), int(m.kv_recv_rows.max()), int(m.qo_split.sum(1).max()),
               int(m.kv_split.sum(1).max()))


def test_result_reports_both_phases_and_their_sum():
    P, G = 4, 2
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G)
    areas = block_areas(packed_documents(1024 * P, seed=4), P, G, impl="torch")
    res = solve_device(areas, config, impl="torch")
    m = evaluate(areas, res.assignment, config.cost())
    assert bool(res.balanced)
    assert int(res.fwd_bottleneck) == int(m.fwd_bottleneck) and int(res.bwd_bottleneck) == int(m.bwd_bottleneck)
    assert int(res.objective) == int(m.step_bottleneck) == int(m.fwd_bottleneck) + int(m.bwd_bottleneck)
    fwd_only = solve_device(areas, SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, objective="forward"),
                            impl="torch")
    assert int(fwd_only.objective) == int(fwd_only.fwd_bottleneck)


def test_never_worse_than_owner_computes_when_it_is_balanced():
    """A sliding window: the same work per query, so owner-computes is balanced already."""
    P, G = 4, 2
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G)
    mask = sliding_window_mask(256 * P, 64)
    areas = block_areas(mask, P, G, impl="torch")
    owner = evaluate(areas, owner_computes_assignment(areas), config.cost())
    assert owner.imbalance.item() <= config.imbalance_tol
    res = solve_device(areas, config, impl="torch")
    m = evaluate(areas, res.assignment, config.cost())
    assert bool(res.balanced) and int(m.step_bottleneck) <= int(owner.step_bottleneck)


def test_a_plan_the_free_solve_would_overflow_stays_within_the_buffers():
    """Causal documents at P = 6: owner-computes moves at most 700 rows a rank; the solve with
    room for every plan moves 768 on some rank; with 700-row buffers every move stays within."""
    P, G = 6, 2
    mask = packed_documents(256 * P, seed=2, causal=True)
    areas = block_areas(mask, P, G, impl="torch")
    free = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G)
    rows = _max_rows(mask, areas, owner_computes_assignment(areas), free)
    assert rows == 700 and _max_rows(mask, areas, solve_device(areas, free, impl="torch").assignment, free) > rows
    capped = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, max_recv_rows=rows)
    res = solve_device(areas, capped, impl="torch")
    plan = build_plan(mask, areas, res.assignment, capped)
    assert not int(plan.status) & BUFFER_OVERFLOW


@settings(max_examples=10, deadline=None)
@given(data=st.data(), P=st.integers(2, 5), c=st.integers(2, 6), G=st.integers(1, 2), grouped=st.booleans(),
       rows=st.integers(1, 12), objective=st.sampled_from(["training", "forward"]))
def test_buffers_hold_whenever_the_start_fits(data, P, c, G, grouped, rows, objective):
    """Receive and send capacities are hard limits: when owner-computes fits the buffers, so does the plan."""
    mask = _random_mask(data, P * c, G, grouped)
    areas = block_areas(mask, P, G, impl="torch")
    config = SolverConfig(cp_size=P, num_heads_q=2 * G, num_heads_kv=G, max_recv_rows=rows, objective=objective)
    owner = build_plan(mask, areas, owner_computes_assignment(areas), config)
    res = solve_device(areas, config, rounds=6, impl="torch")
    plan = build_plan(mask, areas, res.assignment, config)
    if not int(owner.status) & BUFFER_OVERFLOW:
        assert not int(plan.status) & BUFFER_OVERFLOW


@pytest.mark.parametrize("impl", ["triton", "persistent"])
def test_paths_equal_with_buffers_and_the_training_objective(impl):
    """Buffers smaller than owner-computes needs (the capacity checks bind), training objective."""
    P, G = 3, 2
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, max_recv_rows=160)
    areas = block_areas(causal_mask(64 * P), P, G, impl="torch")
    ref = solve_device(areas, config, rounds=3, strategies=_SMALL, impl="torch", restart_every=2)
    res = solve_device(areas, config, rounds=3, strategies=_SMALL, impl=impl, restart_every=2)
    for name in ("assignment", "balanced", "fwd_bottleneck", "bwd_bottleneck", "objective", "variant"):
        assert_close(name, getattr(ref, name), getattr(res, name))


def test_objective_is_checked():
    with pytest.raises(ValueError, match="objective"):
        SolverConfig(cp_size=2, objective="backward")


@settings(max_examples=6, deadline=None)
@given(data=st.data(), P=st.integers(2, 5), c=st.integers(2, 6), G=st.integers(1, 2),
       rows=st.tuples(*(st.integers(1, 12) for _ in range(4))), objective=st.sampled_from(["training", "forward"]))
def test_each_buffer_holds_whenever_the_start_fits(data, P, c, G, rows, objective):
    """The four capacities (QO / KV receive, QO / KV send) are hard limits each: when owner-computes
    fits them, so does the plan."""
    mask = _random_mask(data, P * c, G, False)
    areas = block_areas(mask, P, G, impl="torch")
    config = SolverConfig(cp_size=P, num_heads_q=2 * G, num_heads_kv=G, objective=objective,
                          **dict(zip(("max_qo_recv_rows", "max_kv_recv_rows", "max_qo_send_rows", "max_kv_send_rows"),
                                     rows)))
    owner = build_plan(mask, areas, owner_computes_assignment(areas), config)
    res = solve_device(areas, config, rounds=6, impl="torch")
    plan = build_plan(mask, areas, res.assignment, config)
    assert plan.comm.buffers.as_tuple() == rows
    if not int(owner.status) & BUFFER_OVERFLOW:
        assert not int(plan.status) & BUFFER_OVERFLOW and bool(res.fits)


@pytest.mark.parametrize("impl", ["triton", "persistent"])
def test_paths_equal_with_per_kind_buffers(impl):
    """QO and KV buffers of different sizes, the KV receive one below what owner-computes needs: the
    kernels read each kind's own capacity as the twin does."""
    P, G = 3, 2
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, max_qo_recv_rows=96, max_kv_recv_rows=160,
                          max_qo_send_rows=128, max_kv_send_rows=140)
    areas = block_areas(causal_mask(64 * P), P, G, impl="torch")
    ref = solve_device(areas, config, rounds=3, strategies=_SMALL, impl="torch", restart_every=2)
    res = solve_device(areas, config, rounds=3, strategies=_SMALL, impl=impl, restart_every=2)
    for name in ("assignment", "balanced", "fwd_bottleneck", "bwd_bottleneck", "objective", "variant", "fits"):
        assert_close(name, getattr(ref, name), getattr(res, name))
