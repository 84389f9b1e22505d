"""Numerical edges (docs/numerics.md, the numerics contract): rows with no key, empty masks, large logits in
fp16 and bf16, softcap, merges where every lse is -inf, and P = 1.

bf16 runs on the torch path only: the Triton interpreter computes bf16 wrongly (it refuses it).
"""
import pytest
import torch

from attn_kernels import flex_attn, merge_out_lse, merge_out_lse_
from attn_kernels.reference import dense_attn, slices_to_dense
from gpusolver import SolverConfig, block_areas, solve
from gpusolver.masks import causal_mask, varlen_causal_mask
from gpusolver.runtime import DynamicCPAttention, dist_attn, shard, unshard
from groupcomm import LocalGroup, group_reduce
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import make_config, make_inputs, reference, tight_plan
from tests.reliability._cases import D, quiet, slices

# Large logits: the backward exponentiates the scores of masked-out (future) entries too and then
# selects 0 for them (tl.where), so numpy in the interpreter warns of an inf that never reaches a result
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

NEG_INF = float("-inf")
BACKENDS = ["torch", "triton"]


def _ranges(rows):
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _grads(q, k, v, sl, backend, softcap=0.0, scale=None):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flex_attn(*leaves, *sl, scale, softcap, backend=backend)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g)
    dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))
    torch.autograd.backward((out, lse), (dout, dlse))
    return out.detach(), lse.detach(), *(x.grad for x in leaves)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_rows_without_keys(backend, dtype):
    """Rows [8, 24) attend nothing (covered by no slice, or by slices whose keys are empty)."""
    q, k, v = (torch.randn(40, h, D).to(dtype) for h in (4, 2, 2))
    sl = _ranges([(0, 8, 0, 8, 1), (8, 16, 3, 3, 0), (24, 40, 0, 40, 0), (16, 24, 30, 20, 3)][:3]
                 + [(16, 24, 5, 5, 1)])
    out, lse, dq, dk, dv = _grads(q, k, v, sl, backend)
    assert torch.equal(out[8:24], torch.zeros_like(out[8:24])) and torch.isneginf(lse[8:24]).all()
    assert torch.equal(dq[8:24], torch.zeros_like(dq[8:24]))
    for t in (out, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert torch.isfinite(lse[:8]).all() and torch.isfinite(lse[24:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_empty_masks(backend):
    """A mask of padding rows only: out 0, lse -inf, zero grads, in the kernel and the whole layer."""
    q, k, v = (torch.randn(32, h, D) for h in (2, 1, 1))
    sl = _ranges([(0, 0, 0, 0, 0), (5, 5, 0, 32, 1), (0, 32, 7, 7, 3)])
    out, lse, dq, dk, dv = _grads(q, k, v, sl, backend)
    assert torch.isneginf(lse).all()
    for t in (out, dq, dk, dv):
        assert torch.equal(t, torch.zeros_like(t))


def test_empty_mask_through_solve_and_the_layer():
    P, c, Hq, Hkv = 4, 8, 2, 2
    S = P * c
    mask = slices([(0, 0, 0, 0, 0), (3, 3, 1, 9, 1)], S)
    config = make_config(P, Hq, Hkv)
    areas = block_areas(mask, P, config.head_groups)
    assert int(areas.area.sum()) == 0
    for solver in ("reference", "device"):
        with quiet():
            plan = solve(mask, config, solver=solver)            # validates: nothing may fail
        assert int(plan.status) == 0 and int(plan.metrics.load.sum()) == 0
        assert not torch.isnan(plan.metrics.imbalance).any()
        group = LocalGroup(P)
        q, k, v = (shard(x, group).requires_grad_() for x in make_inputs(S, Hq, Hkv)[:3])
        out, lse = dist_attn(q, k, v, plan, group)
        (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
        assert torch.isneginf(lse).all()
        for t in (out, q.grad, k.grad, v.grad):
            assert torch.equal(t, torch.zeros_like(t))


def _large_logit_inputs(dtype, scale=100.0):
    """Scores of about +-1e4 before scaling (softmax_scale 1): exp would overflow any dtype."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(48, 2, D, generator=g) * scale / D ** 0.5).to(dtype)
    k = (torch.randn(48, 1, D, generator=g) * scale / D ** 0.5 * 3).to(dtype)
    v = torch.randn(48, 1, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float16), ("triton", torch.float16),
                                           ("torch", torch.bfloat16), ("triton", torch.float32)],
                         ids=["torch-fp16", "triton-fp16", "torch-bf16", "triton-fp32"])
@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["plain", "softcap30"])
def test_large_logits(backend, dtype, softcap):
    q, k, v = _large_logit_inputs(dtype)
    sl = _ranges([(0, 48, 0, 48, 1), (0, 0, 0, 0, 0)])
    out, lse, dq, dk, dv = _grads(q, k, v, sl, backend, softcap=softcap, scale=1.0)
    for t in (out, lse, dq, dk, dv):
        assert torch.isfinite(t).all()
    # the same inputs (as rounded to dtype) in fp64 through the dense oracle
    dense = slices_to_dense(*sl, 48, 48)
    ref_out, ref_lse = dense_attn(q.double(), k.double(), v.double(), dense, 1.0, softcap)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert_close("out", ref_out.float(), out.float(), atol=tol, rtol=tol)
    assert_close("lse", ref_lse, lse, atol=tol, rtol=tol)
    assert lse.abs().max() > 1e3 if softcap == 0 else lse.abs().max() < 100


def test_softcap_matches_the_reference_in_both_paths():
    q, k, v = (torch.randn(40, h, D) * 4 for h in (4, 2, 2))
    sl = _ranges([(0, 20, 0, 20, 1), (20, 40, 0, 40, 0), (0, 0, 0, 0, 0)])
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = dense_attn(*leaves, slices_to_dense(*sl, 40, 40), None, 5.0)
    g = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    torch.autograd.backward((out, lse), (dout.double(), dlse))
    ref = (out, lse, *(x.grad for x in leaves))
    for backend in BACKENDS:
        got = _grads(q, k, v, sl, backend, softcap=5.0)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ref, got):
            assert_close(f"{backend} {name}", a.float(), b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_where_every_lse_is_minus_inf(backend):
    T, H = 8, 2
    out_a, out_b = torch.randn(T, H, D), torch.randn(T, H, D)
    lse_a = torch.full((T, H), NEG_INF)
    lse_b = torch.full((T, H), NEG_INF)
    lse_b[:3] = torch.randn(3, H)                          # rows 3.. are empty in both parts
    leaves = [x.clone().requires_grad_() for x in (out_a, lse_a, out_b, lse_b)]
    out, lse = merge_out_lse(*leaves, backend=backend)
    assert torch.isneginf(lse[3:]).all() and torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert_close("one-sided rows", out_b[:3], out[:3], atol=1e-6, rtol=1e-6)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for x in leaves:
        assert not torch.isnan(x.grad).any()
        assert torch.equal(x.grad[3:], torch.zeros_like(x.grad[3:]))
    acc, acc_lse = out_a.clone(), lse_a.clone()
    merge_out_lse_(acc, acc_lse, out_a, lse_a.clone(), backend=backend)
    assert torch.equal(acc, torch.zeros_like(acc)) and torch.isneginf(acc_lse).all()


def test_group_reduce_lse_where_every_lse_is_minus_inf():
    P = 2
    split = torch.tensor([[0, 2], [1, 0]])
    index = torch.tensor([[0, 1, -1], [2, -1, -1]])
    parts = [torch.randn(P, 3, 2, 4), torch.full((P, 3, 2), NEG_INF)]
    acc = [torch.randn(P, 3, 2, 4), torch.full((P, 3, 2), NEG_INF)]
    out, lse = group_reduce(parts, index, split, acc, LocalGroup(P), op="lse")
    assert torch.isneginf(lse).all() and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("solver", ["reference", "device"])
def test_one_rank(solver):
    """P = 1: nothing travels, the layer equals dense attention, the module and the solver agree."""
    S, Hq, Hkv = 40, 4, 2
    mask = varlen_causal_mask([13, 20, 7])
    config = make_config(1, Hq, Hkv)
    plan = solve(mask, config, solver=solver)
    assert int(plan.status) == 0 and int(plan.comm.qo_split.sum()) == int(plan.comm.kv_split.sum()) == 0
    assert float(plan.metrics.imbalance) == 1.0
    group = LocalGroup(1)
    inputs = make_inputs(S, Hq, Hkv)
    q, k, v = (shard(x, group).requires_grad_() for x in inputs[:3])
    out, lse = dist_attn(q, k, v, plan, group)
    torch.autograd.backward((out, lse), (shard(inputs[3], group), shard(inputs[4], group)))
    ref = reference(mask, *inputs)
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad)):
        assert_close(name, ref[name], unshard(got.detach(), group), atol=1e-5, rtol=1e-5)
    attn = DynamicCPAttention(group, config, solver=solver)
    assert_close("module", out.detach(), attn(q.detach(), k.detach(), v.detach(), mask))
    for traffic in group.traffic("fwd.kv"):
        assert int(traffic.sum()) == 0
