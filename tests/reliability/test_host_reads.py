"""No host reads on the hot path, path by path: counted on real tensors (the Triton paths in the
interpreter) with the benchmarks' counter, which sees ``.item()``-like ops, device-to-host copies and
``.tolist()`` / ``.numpy()``; and every path once more on ``device="meta"``, where any read fails.

The solver's three paths are counted in ``tests/benchmarks/test_benchmarks_smoke.py``.
"""

import pytest
import torch

from attn_kernels import flex_attn, flex_attn_backward, merge_out_lse, row_delta
from gpusolver import SolverConfig, block_areas
from gpusolver.masks import varlen_causal_mask
from gpusolver.plan import build_plan
from gpusolver.runtime import dist_attn, shard
from gpusolver.runtime.dist_attn import plan_digest
from groupcomm import LocalGroup
from tests.gpusolver.runtime._cases import make_config, make_inputs, tight_plan
from tests.reliability._cases import D, clean_flags, qkv, quiet



def _ranges(device="cpu"):
    rows = torch.tensor([[0, 24, 0, 24, 1], [24, 48, 0, 48, 0], [0, 0, 0, 0, 0]], dtype=torch.int32)
    return tuple(x.contiguous().to(device) for x in (rows[:, 0:2], rows[:, 2:4], rows[:, 4]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_read_nothing(counter, backend):
    q, k, v = qkv(48, 48)
    sl = _ranges()
    with clean_flags(), counter() as c:
        out, lse = flex_attn(q, k, v, *sl, backend=backend, validate=False)       # the flags run too
        delta = row_delta(torch.ones_like(out), out, backend=backend)
        flex_attn_backward(torch.ones_like(out), q, k, v, lse, delta, *sl, backend=backend, validate=False)
        merge_out_lse(out, lse, out, lse, backend=backend)
    assert c.host_reads == 0, c.by_op
    if backend == "triton":
        assert c.triton_launches > 0


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_areas_plan_and_layer_read_nothing(counter, impl):
    P, c, Hq, Hkv = 2, 24, 4, 2
    S = P * c
    mask = varlen_causal_mask([20, 14, 14])
    config = make_config(P, Hq, Hkv)
    with quiet():
        plan, tight = tight_plan(mask, config)
    group = LocalGroup(P, impl=impl)
    q, k, v = (shard(x, group).requires_grad_() for x in make_inputs(S, Hq, Hkv)[:3])
    with clean_flags(), counter() as cnt:
        areas = block_areas(mask, P, config.head_groups, impl=impl)
        rebuilt = build_plan(mask, areas, plan.assignment, tight)
        plan_digest(rebuilt)
        out, lse = dist_attn(q, k, v, rebuilt, group, validate=False)     # sync-free: flags, no reads
        (out.sum() + lse.sum()).backward()
    assert cnt.host_reads == 0, cnt.by_op
    assert torch.equal(rebuilt.assignment, plan.assignment)


def test_every_path_runs_on_meta():
    """Any host read fails on meta: the kernels' launchers, the Triton areas, the plan, the layer."""
    P, c, Hq, Hkv = 2, 24, 4, 2
    S = P * c
    q, k, v = (torch.empty(48, h, D, device="meta") for h in (2, 1, 1))
    sl = _ranges("meta")
    for backend in ("torch", "triton"):
        out, lse = flex_attn(q, k, v, *sl, backend=backend, validate=False)
        assert out.shape == q.shape and lse.shape == (48, 2)
        merge_out_lse(out, lse, out, lse, backend=backend)
    mask = varlen_causal_mask([20, 14, 14], device="meta")
    config = make_config(P, Hq, Hkv)
    for impl in ("torch", "triton"):
        areas = block_areas(mask, P, config.head_groups, impl=impl)
        assert areas.area.device.type == "meta" and areas.area.shape == (2, P, P)
        assignment = torch.zeros(2, P, P, dtype=torch.int32, device="meta")
        plan = build_plan(mask, areas, assignment, config)
        group = LocalGroup(P, impl=impl)
        qs, ks, vs = (torch.empty(P, c, h, D, device="meta", requires_grad=True) for h in (Hq, Hkv, Hkv))
        out, lse = dist_attn(qs, ks, vs, plan, group, validate=False)
        (out.sum() + lse.sum()).backward()
        assert qs.grad.shape == qs.shape
    assert SolverConfig  # the solver's own meta runs: tests/gpusolver/test_device_solver.py
