"""Triton slice-attention kernels (interpreter, fp32) against the torch twin and the dense oracle."""
import inspect

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attn_kernels.flex_attn import kernel, ref
from attn_kernels.reference import flex_attn_reference, slices_to_dense
from tests._testing import assert_close
from tests.attn_kernels._slices import random_slices, ranges


def _inputs(Tq, Tk, HQ, HKV, D, dtype=torch.float32):
    q = torch.randn(Tq, HQ, D, dtype=dtype)
    k = torch.randn(Tk, HKV, D, dtype=dtype)
    v = torch.randn(Tk, HKV, D, dtype=dtype)
    return q, k, v


def _oracle(q, k, v, qr, kr, t, scale, cap, dout, dlse):
    """fp64 dense oracle: out, lse and autograd gradients for the loss <out,dout> + <lse,dlse>."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = flex_attn_reference(*leaves, qr, kr, t, scale, cap)
    loss = (out.double() * dout.double()).sum() + (lse.double().nan_to_num(0.0, 0.0, 0.0) * dlse.double()).sum()
    grads = torch.autograd.grad(loss, leaves)
    return out, lse, grads


def _check(q, k, v, qr, kr, t, scale=0.3, cap=0.0, block=32, atol=2e-5, twin=True):
    dout = torch.randn_like(q)
    dlse = torch.randn(q.shape[:2])
    o_ref, l_ref, g_ref = _oracle(q, k, v, qr, kr, t, scale, cap, dout, dlse)
    o_tri, l_tri = kernel.flex_attn_fwd(q, k, v, qr, kr, t, scale, cap, block_q=block, block_k=block)
    g_tri = kernel.flex_attn_bwd(dout, q, k, v, o_tri, l_tri, dlse, qr, kr, t, scale, cap,
                                 block_q=block, block_k=block)
    assert_close("out", o_ref.to(q.dtype), o_tri, atol=atol, rtol=1e-4)
    assert_close("lse", l_ref, l_tri, atol=atol, rtol=1e-4)
    for name, a, b in zip(("dq", "dk", "dv"), g_ref, g_tri):
        assert not b.isnan().any(), f"{name} has NaN"
        assert_close(name, a.to(b.dtype), b, atol=10 * atol, rtol=1e-3)
    if twin:
        o_twin, l_twin = ref.flex_attn_fwd_ref(q, k, v, qr, kr, t, scale, cap)
        g_twin = ref.flex_attn_bwd_ref(dout, q, k, v, o_tri, l_tri, dlse, qr, kr, t, scale, cap)
        assert_close("out twin", o_twin, o_tri, atol=atol, rtol=1e-4)
        assert_close("lse twin", l_twin, l_tri, atol=atol, rtol=1e-4)
        for name, a, b in zip(("dq twin", "dk twin", "dv twin"), g_twin, g_tri):
            assert_close(name, a, b, atol=10 * atol, rtol=1e-3)
    return o_tri, l_tri, g_tri


def test_launcher_and_twin_share_signatures():
    assert inspect.signature(kernel.flex_attn_fwd) == inspect.signature(ref.flex_attn_fwd_ref)
    assert inspect.signature(kernel.flex_attn_bwd) == inspect.signature(ref.flex_attn_bwd_ref)
    assert inspect.signature(kernel.flex_attn_bwd_from_delta) == inspect.signature(ref.flex_attn_bwd_from_delta_ref)
    assert inspect.signature(kernel.row_delta) == inspect.signature(ref.row_delta_ref)


@pytest.mark.parametrize("attn_type", [0, 1, 2, 3], ids=["full", "causal", "inv_causal", "bi_causal"])
@pytest.mark.parametrize("q_range,k_range", [((5, 67), (3, 88)), ((2, 70), (40, 77))],
                         ids=["q62-k85", "q68-k37"])
def test_mask_types_unaligned(attn_type, q_range, k_range):
    q, k, v = _inputs(70, 90, 4, 2, 32)
    qr, kr, t = ranges([q_range], [k_range], [attn_type])
    o, lse, _ = _check(q, k, v, qr, kr, t)
    # rows outside the q range see nothing
    assert torch.equal(lse[: q_range[0]], torch.full_like(lse[: q_range[0]], float("-inf")))
    assert torch.equal(o[: q_range[0]], torch.zeros_like(o[: q_range[0]]))


@pytest.mark.parametrize("HQ,HKV", [(2, 2), (4, 1)], ids=["mha-2:2", "gqa-4:1"])
@pytest.mark.parametrize("cap", [0.0, 3.0], ids=["nocap", "softcap3"])
def test_heads_and_softcap(HQ, HKV, cap):
    q, k, v = _inputs(63, 63, HQ, HKV, 32)
    qr, kr, t = ranges([[0, 63]], [[0, 63]], [1])
    _check(q, k, v, qr, kr, t, scale=0.5, cap=cap, block=64)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), Tq=st.integers(16, 96), Tk=st.integers(16, 96),
       block=st.sampled_from([32, 64]))
def test_random_slices(seed, Tq, Tk, block):
    qr, kr, t = random_slices(Tq, Tk, seed)
    assert not slices_to_dense(qr, kr, t, Tq, Tk).all()  # generator leaves some entries out
    q, k, v = _inputs(Tq, Tk, 4, 2, 32)
    _check(q, k, v, qr, kr, t, block=block, twin=False)


def test_padding_rows_are_bit_identical():
    q, k, v = _inputs(70, 70, 2, 1, 32)
    qr, kr, t = ranges([[0, 40], [40, 70], [10, 50]], [[0, 40], [0, 30], [50, 70]], [1, 0, 3])
    pad = ranges([[7, 7], [0, 70], [70, 70]], [[0, 70], [12, 12], [0, 0]], [0, 1, 3])
    qr_p, kr_p, t_p = (torch.cat([a[:1], p, a[1:]]) for a, p in zip((qr, kr, t), pad))
    dout, dlse = torch.randn_like(q), torch.randn(70, 2)
    res = []
    for args in ((qr, kr, t), (qr_p, kr_p, t_p)):
        o, lse = kernel.flex_attn_fwd(q, k, v, *args, 0.2, 0.0, block_q=32, block_k=32)
        res.append((o, lse) + kernel.flex_attn_bwd(dout, q, k, v, o, lse, dlse, *args, 0.2, 0.0,
                                                   block_q=32, block_k=32))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *res):
        assert torch.equal(a, b), f"{name} changed with padding rows"


def test_rows_without_keys_give_zero_and_neg_inf():
    q, k, v = _inputs(40, 40, 2, 2, 32)
    # BI_CAUSAL with a q range longer than the k range: empty; plus only dummies
    qr, kr, t = ranges([[0, 30], [5, 5]], [[0, 10], [0, 40]], [3, 0])
    o, lse, g = _check(q, k, v, qr, kr, t)
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.isneginf(lse).all()
    for x in g:
        assert torch.equal(x, torch.zeros_like(x))


def test_fp16_interpreter():
    q, k, v = _inputs(48, 48, 2, 1, 32, dtype=torch.float16)
    qr, kr, t = ranges([[0, 48]], [[0, 48]], [1])
    _check(q, k, v, qr, kr, t, atol=2e-3, twin=False)


@pytest.mark.parametrize("attn_type", [0, 1, 2, 3], ids=["full", "causal", "inv_causal", "bi_causal"])
def test_head_dim_16(attn_type):
    """D = 16 (small models): forward and backward against the oracle and the twin."""
    q, k, v = _inputs(40, 50, 4, 2, 16)
    qr, kr, t = ranges([(3, 37)], [(2, 48)], [attn_type])
    _check(q, k, v, qr, kr, t)
