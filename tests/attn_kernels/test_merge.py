"""The out/lse merge: Triton kernel vs torch twin vs a direct softmax over the concatenated keys."""
import inspect

import pytest
import torch

from attn_kernels import merge_out_lse, merge_out_lse_
from attn_kernels.merge import merge_out_lse_ref, merge_out_lse_triton
from attn_kernels.reference import dense_attn
from tests._testing import assert_close

T, H, D, TK = 37, 3, 32, 50


def _parts(dtype=torch.float32):
    """Two attention parts over disjoint key halves, with rows empty in a, in b, and in both."""
    q = torch.randn(T, H, D, dtype=torch.float64)
    k = torch.randn(TK, H, D, dtype=torch.float64)
    v = torch.randn(TK, H, D, dtype=torch.float64)
    mask = torch.rand(T, TK) < 0.6
    mask[:4, :25] = False  # rows 0-3: part a empty
    mask[2:6, 25:] = False  # rows 4-5: part b empty; rows 2-3: both empty
    out_a, lse_a = dense_attn(q, k[:25], v[:25], mask[:, :25])
    out_b, lse_b = dense_attn(q, k[25:], v[25:], mask[:, 25:])
    out, lse = dense_attn(q, k, v, mask)
    return (out_a.to(dtype), lse_a, out_b.to(dtype), lse_b), (out, lse)


def test_twin_signature():
    assert inspect.signature(merge_out_lse_triton) == inspect.signature(merge_out_lse_ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_merge_equals_softmax_over_all_keys(backend, dtype):
    parts, (out, lse) = _parts(dtype)
    out_m, lse_m = merge_out_lse(*parts, backend=backend)
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    assert out_m.dtype == dtype and lse_m.dtype == torch.float32
    assert_close("lse", lse, lse_m, atol=1e-5)
    assert_close("out", out.to(dtype), out_m, atol=atol)
    assert torch.isneginf(lse_m[2:4]).all() and torch.equal(out_m[2:4], torch.zeros_like(out_m[2:4]))


def test_triton_matches_twin_and_inplace():
    parts, _ = _parts()
    ref = merge_out_lse_ref(*parts)
    tri = merge_out_lse_triton(*parts)
    assert_close("out", ref[0], tri[0])
    assert_close("lse", ref[1], tri[1])
    for backend in ("torch", "triton"):
        acc_o, acc_l = parts[0].clone(), parts[1].clone()
        merge_out_lse_(acc_o, acc_l, parts[2], parts[3], backend=backend)
        assert_close(f"inplace out {backend}", ref[0], acc_o)
        assert_close(f"inplace lse {backend}", ref[1], acc_l)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype_b", [torch.float16, torch.bfloat16])
def test_inplace_merges_a_lower_precision_part_into_fp32(backend, dtype_b):
    """A pipelined layer's fp32 running sums take each stage's out in the activation dtype."""
    parts, _ = _parts()
    o_b = parts[2].to(dtype_b)
    ref = merge_out_lse_ref(parts[0], parts[1], o_b.float(), parts[3])
    acc_o, acc_l = parts[0].clone(), parts[1].clone()
    merge_out_lse_(acc_o, acc_l, o_b, parts[3], backend=backend)
    assert acc_o.dtype == torch.float32
    assert_close("out", ref[0], acc_o, atol=1e-6)
    assert_close("lse", ref[1], acc_l, atol=1e-6)
    with pytest.raises(ValueError, match="out_b is torch.float16 but out_a"):  # the copying merge still matches dtypes
        merge_out_lse(parts[0], parts[1], parts[2].half(), parts[3])


def test_merge_gradients_match_softmax_over_all_keys():
    q = torch.randn(T, H, D, dtype=torch.float64)
    k = torch.randn(TK, H, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(TK, H, D, dtype=torch.float64)
    mask = torch.rand(T, TK) < 0.6
    mask[:3, :25] = False
    w_o, w_l = torch.randn(T, H, D), torch.randn(T, H)

    def loss(o, lse):
        return (o.double() * w_o).sum() + (lse.double() * w_l).nan_to_num(0.0, 0.0, 0.0).sum()

    out_a, lse_a = dense_attn(q, k[:25], v[:25], mask[:, :25])
    out_b, lse_b = dense_attn(q, k[25:], v[25:], mask[:, 25:])
    g_tri = torch.autograd.grad(loss(*merge_out_lse(out_a.float(), lse_a, out_b.float(), lse_b)), k)[0]
    g_ref = torch.autograd.grad(loss(*dense_attn(q, k, v, mask)), k)[0]
    assert_close("dk", g_ref, g_tri, atol=1e-4)


def test_meta_and_validation():
    o, lse = (torch.empty(T, H, D, device="meta"), torch.empty(T, H, device="meta"))
    out_m, lse_m = merge_out_lse(o, lse, o, lse)
    assert out_m.shape == (T, H, D) and lse_m.shape == (T, H)
    merge_out_lse_(o, lse, o, lse)
    with pytest.raises(ValueError, match="lse_b must be fp32"):
        merge_out_lse(o, lse, o, lse.half())
    with pytest.raises(ValueError, match="lse_a must be"):
        merge_out_lse(o, lse[:3], o, lse)
