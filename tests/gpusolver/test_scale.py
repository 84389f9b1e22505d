"""At scale: 16M-token sequences balance, every solver path agrees there, and the limits refuse the rest.

The solve costs what P and G set, not S, so these are real sizes (S = 2^22 to
2^24, areas near 2^51): they catch integer overflow and fp64 rounding that
small masks never reach. The Triton paths run under the interpreter (about
0.1 s per bundle-kernel program at P = 8, whatever S), so they get one narrow
strategy and a few rounds: 8 programs a round instead of the default
portfolio's 1024.
"""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpusolver.areas import block_areas
from gpusolver.areas.ref import slice_block_terms
from gpusolver.config import SolverConfig
from gpusolver.limits import (MAX_CHUNK_TILES, MAX_CP_SIZE, MAX_HEAD_DIM, MAX_HEAD_GROUPS, MAX_HEADS_Q,
                              MAX_IMBALANCE_TOL, MAX_PLAN_ROWS, MAX_SEQLEN, balanced_load_cap,
                              check_problem_limits)
from gpusolver.masks import (AttnSlices, causal_mask, full_mask, packed_document_lengths, sliding_window_mask,
                             varlen_causal_mask, varlen_full_mask)
from gpusolver.metrics import evaluate
from gpusolver.plan import build_plan
from gpusolver.plan.build import plan_capacities
from gpusolver.solve import solve
from gpusolver.solver.device import Strategy, solve_device
from gpusolver.solver.reference import assign as reference_assign
from tests._threads import one_torch_thread  # noqa: F401 - autouse, module scope

S24 = 1 << 24
_INF = float("inf")


def _check_balanced(areas, config, res):
    """The device result is balanced within mu, by its own flag, in floats and in exact integers."""
    m = evaluate(areas, res.assignment, config.cost())
    total = int(areas.area.sum())
    busy = areas.area > 0
    assert ((res.assignment >= 0) & (res.assignment < config.cp_size))[busy].all()
    assert (res.assignment[~busy] == -1).all()
    assert bool(res.balanced)
    assert float(m.imbalance) <= config.imbalance_tol
    assert int(m.load.max()) <= balanced_load_cap(total, config.imbalance_tol, config.cp_size)
    assert int(m.load.sum()) == total
    assert int(res.fwd_bottleneck) == int(m.fwd_bottleneck)
    return m


# P = 128 once (causal): the overflow this guards against grows with S, not P, and one default
# solve at P = 128 costs about 50 s of CPU here
@pytest.mark.parametrize("kind,P", [("causal", 8), ("causal", 64), ("causal", 128), ("full", 8), ("full", 64)],
                         ids=["causal-P8", "causal-P64", "causal-P128", "full-P8", "full-P64"])
def test_one_sequence_of_2_24_tokens_balances(kind, P):
    config = SolverConfig(cp_size=P)  # GQA 64:8, G = 8
    mask = (causal_mask if kind == "causal" else full_mask)(S24)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    G = config.head_groups
    assert int(areas.area.sum()) == G * (S24 * (S24 + 1) // 2 if kind == "causal" else S24 * S24)
    _check_balanced(areas, config, solve_device(areas, config, impl="torch"))


@pytest.mark.parametrize("P", [8, 32], ids=lambda P: f"P{P}")
@pytest.mark.parametrize("kind", ["causal", "full"])
def test_reference_balances_one_sequence_of_2_24_tokens(kind, P):
    config = SolverConfig(cp_size=P)
    areas = block_areas((causal_mask if kind == "causal" else full_mask)(S24), P, config.head_groups, impl="torch")
    ref = reference_assign(areas, config)
    m = evaluate(areas, ref.assignment, config.cost())
    assert ref.feasible and float(m.imbalance) <= config.imbalance_tol
    assert int(m.load.max()) <= balanced_load_cap(int(areas.area.sum()), config.imbalance_tol, P)
    assert ref.bottleneck == int(m.fwd_bottleneck)


def _packed_with_a_1m_document(S: int) -> list[int]:
    short = packed_document_lengths(S - (1 << 20), seed=0)  # histogram documents, all far below 1M
    return short[:len(short) // 2] + [1 << 20] + short[len(short) // 2:]


def _piece_area(q, k, t) -> torch.Tensor:
    """Valid entries of single-type slices [..., 2], [..., 2], [...] over their own rectangle."""
    qs, qe, ks, ke, t = q[..., 0].long(), q[..., 1].long(), k[..., 0].long(), k[..., 1].long(), t.long()
    return slice_block_terms(qs, qe, ks, ke, t, qs, qe, ks, ke)[0]


@pytest.mark.parametrize("P,causal", [(8, True), (32, True), (8, False)],
                         ids=["causal-P8", "causal-P32", "full-P8"])
def test_packed_documents_with_a_1m_document(P, causal):
    S = 1 << 22
    lengths = _packed_with_a_1m_document(S)
    mask = (varlen_causal_mask if causal else varlen_full_mask)(lengths)
    config = SolverConfig(cp_size=P)
    plan = solve(mask, config, impl="torch")  # validates the mask and the plan's status on CPU
    assert int(plan.status) == 0
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    _check_balanced(areas, config, solve_device(areas, config, impl="torch"))
    # the int32 CalcMeta covers the mask exactly: piece areas sum to the total, rows stay in range
    calc, comm, G, c = plan.calc, plan.comm, config.head_groups, S // P
    assert int(_piece_area(calc.q_ranges, calc.k_ranges, calc.attn_type).sum()) == int(areas.area.sum())
    for rows, recv in ((calc.q_ranges, comm.qo_recv_rows), (calc.k_ranges, comm.kv_recv_rows)):
        assert int(rows.min()) >= 0
        assert (rows.amax(dim=(1, 2, 3)).long() <= G * c + recv).all()


@pytest.mark.parametrize("impl", ["triton", "persistent"])
def test_every_path_equals_torch_at_2_24_tokens(impl):
    # one narrow strategy, 4 rounds with a restart at round 2: balanced, and bit-identical to torch
    P = 8
    config = SolverConfig(cp_size=P)
    areas = block_areas(causal_mask(S24), P, config.head_groups, impl="torch")
    kw = dict(strategies=(Strategy((_INF,), units_per_rank=1, bundle_dests=4),), rounds=4, restart_every=2)
    ref = solve_device(areas, config, impl="torch", **kw)
    tri = solve_device(areas, config, impl=impl, **kw)
    _check_balanced(areas, config, ref)
    for name in ("assignment", "balanced", "fwd_bottleneck", "variant"):
        assert torch.equal(getattr(tri, name), getattr(ref, name)), name


def test_triton_areas_equal_torch_at_2_24_tokens():
    # few slices: the interpreted kernel walks every slice in every program
    docs = [1, (1 << 20) + 1, 5_000_011, 77]
    masks = [causal_mask(S24), sliding_window_mask(S24, (1 << 20) + 3),
             varlen_full_mask(docs + [S24 - sum(docs)]), varlen_causal_mask([S24 - sum(docs)] + docs)]
    for mask in masks:
        for P in (8, 32):
            ref = block_areas(mask, P, 1, impl="torch")
            tri = block_areas(mask, P, 1, impl="triton")
            for name in ("area", "q_need", "k_need"):
                assert torch.equal(getattr(tri, name), getattr(ref, name)), (name, P)


def _scaled(mask: AttnSlices, k: int) -> AttnSlices:
    """Every range of ``mask`` times k (documents k times longer, windows k times wider)."""
    return AttnSlices(mask.q_ranges * k, mask.k_ranges * k, mask.attn_type,
                      mask.total_seqlen_q * k, mask.total_seqlen_k * k)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data(), P=st.sampled_from([2, 4, 8]), c=st.sampled_from([16, 64, 128]),
       kind=st.sampled_from(["causal", "full", "window"]), k=st.integers(2, 1 << 10))
def test_scaling_a_mask_keeps_it_balanced(data, P, c, kind, k):
    S = P * c
    if kind == "window":
        mask = sliding_window_mask(S, data.draw(st.integers(1, S), label="window"))
    else:
        cuts = sorted(data.draw(st.lists(st.integers(1, S - 1), max_size=6, unique=True), label="cuts"))
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [S])]
        mask = (varlen_causal_mask if kind == "causal" else varlen_full_mask)(lengths)
    config = SolverConfig(cp_size=P)
    small = block_areas(mask, P, config.head_groups, impl="torch")
    if not bool(solve_device(small, config, impl="torch").balanced):
        return
    big = block_areas(_scaled(mask, k), P, config.head_groups, impl="torch")
    _check_balanced(big, config, solve_device(big, config, impl="torch"))


@pytest.mark.parametrize("field,value,limit", [
    ("cp_size", MAX_CP_SIZE + 1, "MAX_CP_SIZE"),
    ("num_heads_q", MAX_HEADS_Q + 8, "MAX_HEADS_Q"),
    ("num_heads_kv", 2 * MAX_HEAD_GROUPS, "MAX_HEAD_GROUPS"),
    ("head_dim", MAX_HEAD_DIM + 1, "MAX_HEAD_DIM"),
    ("chunk_tiles", MAX_CHUNK_TILES + 1, "MAX_CHUNK_TILES"),
    ("imbalance_tol", MAX_IMBALANCE_TOL + 0.5, "MAX_IMBALANCE_TOL"),
])
def test_config_past_a_limit_names_it(field, value, limit):
    kw = {"cp_size": 8, field: value}
    if field == "num_heads_kv":
        kw["num_heads_q"] = value  # Hq stays a multiple of Hkv
    with pytest.raises(ValueError, match=f"{field}={value} is past the supported {limit}"):
        SolverConfig(**kw)


def test_limits_themselves_are_supported():
    config = SolverConfig(cp_size=MAX_CP_SIZE, num_heads_q=MAX_HEADS_Q, num_heads_kv=MAX_HEAD_GROUPS,
                          head_dim=MAX_HEAD_DIM, chunk_tiles=MAX_CHUNK_TILES, imbalance_tol=MAX_IMBALANCE_TOL)
    assert config.check_seqlen(MAX_SEQLEN) == MAX_SEQLEN // MAX_CP_SIZE
    check_problem_limits(MAX_SEQLEN, MAX_CP_SIZE, MAX_HEAD_GROUPS, MAX_CHUNK_TILES)


def test_sequence_past_max_seqlen_names_it():
    config = SolverConfig(cp_size=8)
    with pytest.raises(ValueError, match="MAX_SEQLEN"):
        config.check_seqlen(MAX_SEQLEN + 8)
    with pytest.raises(ValueError, match="MAX_SEQLEN"):
        solve(causal_mask(MAX_SEQLEN + 8), config)  # refused before any work
    areas = block_areas(causal_mask(64), 8, config.head_groups, impl="torch")
    with pytest.raises(ValueError, match="MAX_SEQLEN"):  # areas of a longer sequence than the limit
        solve_device(dataclasses.replace(areas, chunk=MAX_SEQLEN // 8 + 1), config)


@pytest.mark.parametrize("args,limit", [
    ((MAX_SEQLEN + 1, 8, 8, 1), "MAX_SEQLEN"), ((1024, MAX_CP_SIZE + 1, 8, 1), "MAX_CP_SIZE"),
    ((1024, 8, MAX_HEAD_GROUPS + 1, 1), "MAX_HEAD_GROUPS"), ((1024, 8, 8, MAX_CHUNK_TILES + 1), "MAX_CHUNK_TILES"),
])
def test_problem_past_a_limit_names_it(args, limit):
    with pytest.raises(ValueError, match=limit):
        check_problem_limits(*args)


def test_plan_rows_past_int32_name_the_limit():
    # G * c + the worst-case receive buffer G * c * (P - 1) = G * S rows index an int32 CalcMeta
    config = SolverConfig(cp_size=8, num_heads_q=MAX_HEAD_GROUPS, num_heads_kv=MAX_HEAD_GROUPS)
    c = (1 << 24) // 8
    with pytest.raises(ValueError, match="MAX_PLAN_ROWS"):
        plan_capacities(config, 1, c)
    # the rows a plan really receives fit: a capacity below the limit is accepted
    recv = MAX_PLAN_ROWS - config.head_groups * c
    assert plan_capacities(dataclasses.replace(config, max_recv_rows=recv), 1, c)[1].largest_recv == recv
    # build_plan refuses the same before building anything
    mask = causal_mask(1 << 24)
    areas = block_areas(mask, 8, 1, impl="torch").expand_groups(config.head_groups)
    asg = torch.where(areas.area > 0, torch.arange(8, dtype=torch.int32).view(1, 8, 1), -1)
    with pytest.raises(ValueError, match="MAX_PLAN_ROWS"):
        build_plan(mask, areas, asg, config)


def test_mask_past_int32_names_it():
    with pytest.raises(ValueError, match="int32"):
        causal_mask(1 << 31)
