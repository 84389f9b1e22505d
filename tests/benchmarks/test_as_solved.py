"""The benchmarks measure the plan a user's default config gives: ``_common.cached_assignment`` and
``build_as_solved`` solve and build as ``gpusolver.solve`` does, the memory budget resolved
(``capacity.keep_for_budget``)."""
from gpusolver import SolverConfig, solve
from gpusolver.areas import block_areas
from gpusolver.capacity import keep_for_budget
from gpusolver.plan.build import build_plan
from gpusolver.problem import split_kept_room
from gpusolver.topology import h200_hgx
from tests.benchmarks._load import load_bench


def test_cached_plans_are_the_ones_solve_gives(tmp_path):
    common = load_bench("_common.py")
    P, c = 16, 64
    config = SolverConfig(cp_size=P, topology=h200_hgx)
    mask = common.make_mask("causal", P, 0, c)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    resolved = keep_for_budget(config, c)
    # the default budget's room is part of the Q buffer's bytes, which each rank splits by its own
    # fills, so a plan built as keeping everything moves fewer backward bytes than the layer runs
    # wherever a rank's fills pass the room
    assert resolved.keep_forward_buffers is True and resolved.kept_q_rows > 0 and resolved.kept_kv_rows == 0
    assert resolved.kept_per_rank
    # its solve prices every kind as kept (the kept rows are the built plan's): the cached name of keeping
    # everything, which a budget that casts a kind again whole does not share
    path = common.plan_cache_path(tmp_path, "causal", P, 0, c, config)
    assert path.name == common.plan_cache_path(tmp_path, "causal", P, 0, c, config.replaced(memory_budget=None)).name
    assert common.keep_tag(config.replaced(keep_forward_buffers="kv"), c) == "_keepkv"

    asg, seconds = common.cached_assignment(mask, areas, config, path)
    plan = common.build_as_solved(mask, areas, asg, config)
    user = solve(mask, config, impl="torch")
    assert seconds is not None and path.exists()
    assert (asg == user.assignment).all()
    assert plan.cost == user.cost and plan.cost.kept_q_rows == resolved.kept_q_rows
    assert (plan.pair_bytes("bwd") == user.pair_bytes("bwd")).all()
    again, seconds = common.cached_assignment(mask, areas, config, path)
    assert seconds is None and (again == asg).all()
    # built as given, the plan would price a backward that receives nothing again; built as solved,
    # the rows past each rank's share of the room
    given = build_plan(mask, areas, asg, config)
    assert given.cost.kept_q_rows is None and given.cost.kept_kv_rows is None and not given.cost.kept_per_rank
    cost = plan.cost
    room = cost.kept_q_rows * cost.q_fwd + cost.kept_kv_rows * cost.kv_fwd  # both within their buffers here
    kq, kk = split_kept_room(plan.comm.qo_recv_rows.long(), plan.comm.kv_recv_rows.long(), room,
                             cost.q_fwd, cost.kv_fwd)
    past = int((plan.comm.qo_recv_rows - kq).sum()) * cost.q_fwd + int((plan.comm.kv_recv_rows - kk).sum()) * cost.kv_fwd
    assert int(plan.pair_bytes("bwd").sum()) - int(given.pair_bytes("bwd").sum()) == past
