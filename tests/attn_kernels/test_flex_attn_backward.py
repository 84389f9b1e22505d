"""The backward from a row delta: row_delta, flex_attn_backward, and the partial-keys identity the runtime uses."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from attn_kernels import flex_attn, flex_attn_backward, merge_out_lse, row_delta
from attn_kernels.flex_attn import kernel, ref
from attn_kernels.reference import slices_to_dense
from tests._testing import assert_close
from tests.attn_kernels._slices import random_slices, ranges, split_keys

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _inputs(Tq, Tk, HQ, HKV, D, dtype=torch.float32, device="cpu"):
    q = torch.randn(Tq, HQ, D, dtype=dtype, device=device)
    k = torch.randn(Tk, HKV, D, dtype=dtype, device=device)
    v = torch.randn(Tk, HKV, D, dtype=dtype, device=device)
    return q, k, v


# Every type straddles the cut at key 40, with shared query rows and rows that see no key.
_STRADDLE = ranges([[0, 20], [0, 30], [20, 40], [40, 48]], [[10, 60], [60, 64], [24, 64], [10, 64]], [1, 0, 3, 2])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("HQ,HKV,cap", [(4, 2, 0.0), (2, 2, 5.0)], ids=["gqa-4:2", "mha-2:2-softcap5"])
def test_backward_from_delta_equals_autograd(backend, dtype, HQ, HKV, cap):
    dtype = DTYPES[dtype]
    q, k, v = _inputs(50, 70, HQ, HKV, 32, dtype)
    qr, kr, t = random_slices(50, 70, seed=3)
    w_o, w_l = torch.randn(50, HQ, 32, dtype=dtype), torch.randn(50, HQ)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flex_attn(*leaves, qr, kr, t, softmax_scale=0.3, softcap=cap, backend=backend)
    ((out.float() * w_o.float()).sum() + (lse * w_l).nan_to_num(0.0, 0.0, 0.0).sum()).backward()
    ref_grads = [x.grad for x in leaves]

    delta = row_delta(w_o, out.detach(), w_l, backend=backend)
    tri_grads = flex_attn_backward(w_o, q, k, v, lse.detach(), delta, qr, kr, t, 0.3, cap, backend=backend)
    for name, a, b in zip(("dq", "dk", "dv"), ref_grads, tri_grads):
        assert b.dtype == dtype
        assert_close(name, a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("mask,m", [("straddle", 40), ("random", 23)], ids=["straddle-cut40", "random-cut23"])
def test_parts_with_final_lse_and_delta_sum_to_whole(backend, dtype, mask, m):
    """Two forwards over the keys [0, m) and [m, Tk), merged; each part's backward from the FINAL lse and delta."""
    dtype = DTYPES[dtype]
    Tq, Tk, HQ, HKV = 50, 64, 4, 2
    # seed 13: the cut at 23 goes through CAUSAL, BI_CAUSAL and FULL slices
    qr, kr, t = _STRADDLE if mask == "straddle" else random_slices(Tq, Tk, seed=13)
    (qr1, kr1, t1), (qr2, kr2, t2) = split_keys(qr, kr, t, m)
    whole = slices_to_dense(qr, kr, t, Tq, Tk)
    assert torch.equal(torch.cat([slices_to_dense(qr1, kr1, t1, Tq, m),
                                  slices_to_dense(qr2, kr2, t2, Tq, Tk - m)], 1), whole)
    assert whole[:, :m].any() and whole[:, m:].any() and not whole.any(1).all()
    q, k, v = _inputs(Tq, Tk, HQ, HKV, 32, dtype)
    kw = dict(softmax_scale=0.3, backend=backend)
    o1, lse1 = flex_attn(q, k[:m], v[:m], qr1, kr1, t1, **kw)
    o2, lse2 = flex_attn(q, k[m:], v[m:], qr2, kr2, t2, **kw)
    out, lse = merge_out_lse(o1, lse1, o2, lse2, backend=backend)
    out_w, lse_w = flex_attn(q, k, v, qr, kr, t, **kw)
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    assert_close("merged lse", lse_w, lse, atol=1e-5)
    assert_close("merged out", out_w, out, atol=atol)

    dout, dlse = torch.randn_like(q), torch.randn(Tq, HQ)
    delta = row_delta(dout, out, dlse, backend=backend)
    dq, dk, dv = flex_attn_backward(dout, q, k, v, lse, delta, qr, kr, t, **kw)
    dq1, dk1, dv1 = flex_attn_backward(dout, q, k[:m], v[:m], lse, delta, qr1, kr1, t1, **kw)
    dq2, dk2, dv2 = flex_attn_backward(dout, q, k[m:], v[m:], lse, delta, qr2, kr2, t2, **kw)
    assert_close("dq1 + dq2", dq, (dq1.float() + dq2.float()).to(dtype), atol=atol, rtol=0.0)
    assert_close("dk part 1", dk[:m], dk1, atol=atol, rtol=0.0)
    assert_close("dk part 2", dk[m:], dk2, atol=atol, rtol=0.0)
    assert_close("dv part 1", dv[:m], dv1, atol=atol, rtol=0.0)
    assert_close("dv part 2", dv[m:], dv2, atol=atol, rtol=0.0)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("T,H,D", [(37, 3, 40), (64, 4, 128)], ids=["T37-H3-D40", "T64-H4-D128"])
@pytest.mark.parametrize("with_dlse", [True, False], ids=["dlse", "no-dlse"])
def test_row_delta_triton_equals_twin(dtype, T, H, D, with_dlse):
    dtype = DTYPES[dtype]
    dout, out = torch.randn(T, H, D, dtype=dtype), torch.randn(T, H, D, dtype=dtype)
    dlse = torch.randn(T, H) if with_dlse else None
    ref_delta = ref.row_delta_ref(dout, out, dlse)
    tri = kernel.row_delta(dout, out, dlse)
    assert tri.dtype == torch.float32 and tri.shape == (T, H)
    assert_close("delta", ref_delta, tri, atol=1e-5)
    for backend in ("torch", "triton"):
        assert_close(f"delta {backend}", ref_delta, row_delta(dout, out, dlse, backend=backend), atol=1e-5)


def test_row_delta_of_empty_rows_is_minus_dlse():
    out, dout, dlse = torch.zeros(5, 2, 32), torch.randn(5, 2, 32), torch.randn(5, 2)
    assert torch.equal(kernel.row_delta(dout, out, dlse), -dlse)
    assert kernel.row_delta(torch.empty(0, 2, 32), torch.empty(0, 2, 32), None).shape == (0, 2)


def test_meta_device_no_host_reads():
    q, k, v = _inputs(64, 48, 4, 2, 32, device="meta")
    qr, kr, t = (x.to("meta") for x in ranges([[0, 64], [0, 0]], [[0, 48], [0, 0]], [1, 0]))
    dout, lse, dlse = torch.empty_like(q), torch.empty(64, 4, device="meta"), torch.empty(64, 4, device="meta")
    for dl in (dlse, None):
        delta = row_delta(dout, q, dl)
        assert delta.shape == (64, 4) and delta.dtype == torch.float32 and delta.device.type == "meta"
    dq, dk, dv = flex_attn_backward(dout, q, k, v, lse, delta, qr, kr, t)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert all(x.device.type == "meta" for x in (dq, dk, dv))
    # the torch twins (the CPU path) run on meta too
    g = ref.flex_attn_bwd_from_delta_ref(dout, q, k, v, lse, ref.row_delta_ref(dout, q, dlse), qr, kr, t, 0.1, 2.0)
    assert [x.shape for x in g] == [q.shape, k.shape, v.shape]


def test_fake_tensor_mode():
    with FakeTensorMode():
        q, k, v = _inputs(64, 64, 4, 2, 32)
        qr, kr, t = ranges([[0, 64]], [[0, 64]], [0])
        lse = torch.empty(64, 4)
        dq, dk, dv = flex_attn_backward(q, q, k, v, lse, row_delta(q, q, lse), qr, kr, t)
        assert dq.shape == q.shape and dk.shape == k.shape


def test_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = _inputs(40, 40, 2, 1, 32)
    qr, kr, t = ranges([[0, 40], [0, 0]], [[0, 40], [0, 0]], [1, 0])
    out, lse = flex_attn(q, k, v, qr, kr, t, backend="torch")
    dout, dlse = torch.randn_like(q), torch.randn(40, 2)

    def helper(dout, out, dlse, q, k, v, lse, qr, kr, t):
        return flex_attn_backward(dout, q, k, v, lse, row_delta(dout, out, dlse), qr, kr, t, backend="torch")

    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(helper, backend=counter, fullgraph=True)(dout, out, dlse, q, k, v, lse, qr, kr, t)
    want = helper(dout, out, dlse, q, k, v, lse, qr, kr, t)
    for name, a, b in zip(("dq", "dk", "dv"), want, got):
        assert_close(name, a, b, atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1


def _bwd_args():
    return dict(dout=torch.randn(8, 2, 32), q=torch.randn(8, 2, 32), k=torch.randn(6, 1, 32),
                v=torch.randn(6, 1, 32), lse=torch.randn(8, 2), delta=torch.randn(8, 2),
                q_ranges=torch.zeros(2, 2, dtype=torch.int32), k_ranges=torch.zeros(2, 2, dtype=torch.int32),
                attn_type=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("kwargs,match", [
    (dict(lse=torch.randn(8, 3)), r"lse must be \[Tq, Hq\] = \[8, 2\], got \[8, 3\]"),
    (dict(lse=torch.randn(8, 2, dtype=torch.float16)), "lse must be fp32"),
    (dict(delta=torch.randn(8)), r"delta must be \[Tq, Hq\]"),
    (dict(delta=torch.randn(8, 2, dtype=torch.float64)), "delta must be fp32"),
    (dict(delta=torch.randn(8, 2, device="meta")), "delta is on meta"),
    (dict(dout=torch.randn(8, 2, 64)), "dout must match q"),
    (dict(dout=torch.randn(8, 2, 32, dtype=torch.float16)), "dout must match q"),
    (dict(k=torch.randn(6, 3, 32), v=torch.randn(6, 3, 32)), "multiple of Hkv"),
    (dict(attn_type=torch.zeros(3, dtype=torch.int32)), "attn_type must be"),
    (dict(softcap=-1.0), "softcap"),
    (dict(backend="cuda"), "backend"),
])
def test_backward_bad_input_raises(kwargs, match):
    args = _bwd_args()
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        flex_attn_backward(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dout=torch.randn(8, 32)), r"dout must be \[Tq, Hq, D\]"),
    (dict(dout=torch.randn(8, 2, 32, dtype=torch.float64)), "dout must be fp16, bf16 or fp32"),
    (dict(out=torch.randn(8, 2, 16)), "out must match dout"),
    (dict(out=torch.randn(8, 2, 32, dtype=torch.float16)), "out must match dout"),
    (dict(dlse=torch.randn(8, 2, dtype=torch.float16)), "dlse must be fp32"),
    (dict(dlse=torch.randn(2, 8)), r"dlse must be \[Tq, Hq\]"),
    (dict(dlse=torch.randn(8, 2, device="meta")), "dlse is on meta but dout is on cpu"),
    (dict(backend="gpu"), "backend"),
])
def test_row_delta_bad_input_raises(kwargs, match):
    args = dict(dout=torch.randn(8, 2, 32), out=torch.randn(8, 2, 32), dlse=torch.randn(8, 2))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        row_delta(**args)


@pytest.mark.parametrize("min_programs,split", [(4, 2), (1000, 4)], ids=["split2", "split4"])
def test_dkdv_query_head_split(monkeypatch, min_programs, split):
    """Few KV heads: dK/dV programs share a group's query heads and sum fp32 partials (no atomics)."""
    Tq, Tk, HQ, HKV = 40, 50, 4, 1
    q, k, v = _inputs(Tq, Tk, HQ, HKV, 32)
    qr, kr, t = random_slices(Tq, Tk, seed=5)
    dout, lse = torch.randn_like(q), torch.randn(Tq, HQ)
    delta = torch.randn(Tq, HQ)
    blocks = dict(block_q=32, block_k=32)
    whole = kernel.flex_attn_bwd_from_delta(dout, q, k, v, lse, delta, qr, kr, t, 0.3, 0.0, **blocks)
    assert kernel._dkdv_split(HQ // HKV, 2, q.device) == 1
    monkeypatch.setattr(kernel, "MIN_DKDV_PROGRAMS", min_programs)
    assert kernel._dkdv_split(HQ // HKV, 2, q.device) == split
    counts = torch.zeros(4, dtype=torch.int64)
    parts = kernel.flex_attn_bwd_from_delta(dout, q, k, v, lse, delta, qr, kr, t, 0.3, 0.0, counts=counts, **blocks)
    twin = torch.zeros(4, dtype=torch.int64)
    ref.flex_attn_bwd_from_delta_ref(dout, q, k, v, lse, delta, qr, kr, t, 0.3, 0.0, counts=twin, **blocks)
    assert torch.equal(whole[0], parts[0])
    for name, a, b in zip(("dk", "dv"), whole[1:], parts[1:]):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(counts, twin)
