"""The time-aware imbalance bound (``SolverConfig.imbalance_auto``): candidates, weights, the choice.

The solve runs once per candidate bound and keeps the lowest modelled step; the choice must equal
that of separate solves at each bound, be the same on the torch and Triton paths, and leave the
default solve untouched.
"""
import dataclasses

import pytest
import torch

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import packed_documents
from gpusolver.solver import balance
from gpusolver.solver.core import _BIG
from gpusolver.solver.device import Strategy, solve_device
from gpusolver.step_model import time_weights
from gpusolver.topology import Topology, h200_hgx
from tests._threads import one_torch_thread  # noqa: F401 - autouse, module scope

_SMALL = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),)
_KW = dict(rounds=3, strategies=_SMALL, restart_every=2)


def _nodes(attn_tflops=400.0):
    return Topology(ranks_per_node=2, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=attn_tflops)


def _case(topology, objective="training", P=4, tokens=128, seed=1):
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2, head_dim=8, dtype=torch.float16, chunk_tiles=1,
                          topology=topology, imbalance_auto=True, objective=objective)
    return block_areas(packed_documents(tokens * P, seed=seed, causal=True), P, 2, impl="torch"), config


def test_candidate_tols():
    assert balance.candidate_tols(1.10) == pytest.approx((1.10, 1.06, 1.04, 1.02))
    assert balance.candidate_tols(1.10)[0] == 1.10  # the bound itself first: it wins ties
    assert balance.candidate_tols(1.0) == (1.0,)


def test_time_weights():
    """An entry's forward FLOPs (4 D hq) at the attention rate, plus the backward's (2.5 x) with the
    training objective, in 1/16 NVLink byte-times; an objective byte weighs 16."""
    config = SolverConfig(cp_size=16, topology=h200_hgx)
    fwd_entry_s = 4 * 128 * 8 / 400e12
    assert time_weights(config, 16 * 8192) == (round(3.5 * fwd_entry_s * 450e9 * 16), 16, 0)
    forward = dataclasses.replace(config, objective="forward")
    assert time_weights(forward, 16 * 8192) == (round(fwd_entry_s * 450e9 * 16), 16, 0)
    w_area, w_byte, shift = time_weights(config, 1 << 26)  # past int64 unshifted: both terms shift
    assert shift > 0 and w_area * config.head_groups * (1 << 52) >> shift < 1 << 62
    with pytest.raises(ValueError, match="topology"):
        time_weights(SolverConfig(cp_size=16), 16 * 8192)
    # the rates of a topology given apart: the same weights as the config's own
    assert time_weights(SolverConfig(cp_size=16), 16 * 8192, h200_hgx) == time_weights(config, 16 * 8192)


def test_config_errors():
    with pytest.raises(ValueError, match="imbalance_auto=True needs a topology"):
        SolverConfig(cp_size=16, imbalance_auto=True)
    with pytest.raises(TypeError, match="imbalance_auto must be a bool, got str 'yes'"):
        SolverConfig(cp_size=16, topology=h200_hgx, imbalance_auto="yes")
    assert not SolverConfig(cp_size=16).imbalance_auto  # opt-in


@pytest.mark.parametrize("attn_tflops", [400.0, 0.01])
def test_choice_is_the_lowest_modelled_step(attn_tflops):
    """The chosen plan is the candidate solve of the lowest modelled step, bit for bit; with compute
    far dearer than bytes (0.01 TFLOP/s) that is the least loaded balanced candidate."""
    areas, config = _case(_nodes(attn_tflops))
    auto = solve_device(areas, config, impl="torch", **_KW)
    tols = balance.candidate_tols(config.imbalance_tol)
    weights = time_weights(config, areas.chunk * areas.num_units)
    singles = [solve_device(areas, dataclasses.replace(config, imbalance_tol=mu, imbalance_auto=False),
                            impl="torch", **_KW) for mu in tols]
    keys = [int(balance.modelled_step(r, areas.area, weights, 4)) for r in singles]
    assert min(keys) < _BIG  # some candidate is balanced
    k = keys.index(min(keys))
    assert float(auto.imbalance_tol) == tols[k]
    assert torch.equal(auto.assignment, singles[k].assignment) and torch.equal(auto.objective, singles[k].objective)
    assert bool(auto.balanced)
    if attn_tflops < 1:
        loads = [int(balance.max_load(areas.area, r.assignment, 4)) for r, key in zip(singles, keys) if key < _BIG]
        assert int(balance.max_load(areas.area, auto.assignment, 4)) == min(loads)


def test_no_usable_candidate_keeps_the_bound_itself():
    """Every candidate unbalanced (modelled as _BIG): the first, the upper bound's solve, is kept."""
    areas, config = _case(_nodes())
    fixed = solve_device(areas, dataclasses.replace(config, imbalance_auto=False), impl="torch", **_KW)
    unbalanced = dataclasses.replace(fixed, balanced=torch.tensor(False))
    other = dataclasses.replace(unbalanced, assignment=torch.zeros_like(fixed.assignment))
    weights = time_weights(config, areas.chunk * areas.num_units)
    got = balance.choose([unbalanced, other], (1.1, 1.05), areas.area, weights, 4)
    assert torch.equal(got.assignment, fixed.assignment) and float(got.imbalance_tol) == 1.1


def test_default_solve_reports_no_bound():
    areas, config = _case(_nodes())
    assert solve_device(areas, dataclasses.replace(config, imbalance_auto=False), impl="torch",
                        **_KW).imbalance_tol is None


def test_auto_meta_device():
    """No host reads: the time-aware solve and its choice run on meta tensors."""
    areas, config = _case(_nodes(), objective="forward")
    meta = dataclasses.replace(areas, **{f: getattr(areas, f).to("meta") for f in ("area", "q_need", "k_need")})
    res = solve_device(meta, config, impl="torch", rounds=1, strategies=_SMALL, restart_every=0)
    assert res.assignment.device.type == "meta" and res.imbalance_tol.device.type == "meta"


def test_compile_op_carries_imbalance_auto():
    """The custom op ``solve`` uses under torch.compile solves with the time-aware bound too."""
    from gpusolver.ops import solve_assignment_op, solve_op_options

    areas, config = _case(_nodes(0.01), objective="forward", tokens=64)
    op = solve_assignment_op(areas.area, areas.q_need, areas.k_need, areas.chunk, 4, 1, 8, 2, 8, torch.float16,
                             config.imbalance_tol, "torch", *solve_op_options(config))
    assert torch.equal(op, solve_device(areas, config, impl="torch").assignment)


def test_auto_triton_equals_torch():
    """The Triton path's time-aware solve equals the torch one in every field (slow tier: four
    interpreted solves; the choice itself is the same torch code on both paths, and the fast tier
    checks it against separate solves: test_choice_is_the_lowest_modelled_step)."""
    areas, config = _case(_nodes(), objective="forward", tokens=64)
    kw = dict(rounds=1, strategies=(Strategy((float("inf"),), units_per_rank=2, bundle_dests=2),),
              restart_every=0)
    ref, tri = solve_device(areas, config, impl="torch", **kw), solve_device(areas, config, impl="triton", **kw)
    for f in dataclasses.fields(ref):
        assert torch.equal(getattr(ref, f.name), getattr(tri, f.name)), f.name
