"""Sparse attention (NSA blocks, DSA token top-k): twin and Triton kernels against dense attention
built from the same indices, windows of a key buffer, the delta-protocol backward, ops and errors."""
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from attn_kernels.reference import dense_attn
from attn_kernels.sparse_attn import op, selection_dense_mask, sparse_attn, sparse_attn_backward
from attn_kernels.sparse_attn.ref import row_delta_ref
from tests._testing import assert_close


def _qkv(Tq, Tk, HQ, HKV, D, dtype=torch.float32):
    return (torch.randn(Tq, HQ, D, dtype=dtype), torch.randn(Tk, HKV, D, dtype=dtype),
            torch.randn(Tk, HKV, D, dtype=dtype))


def _topk(T, k, seed=0):
    """[T, k] int32: k distinct keys per row from [0, T) (future ones included: dropped), some -1."""
    g = torch.Generator().manual_seed(seed)
    sel = torch.stack([torch.randperm(T, generator=g)[:k] for _ in range(T)]).int()
    sel[::5, 0] = -1
    return sel


def _blocks(T, H, n, l, seed=0):
    """[T, H, n] int32: n distinct blocks of l keys per row and head, some -1."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-T // l)
    sel = torch.stack([torch.stack([torch.randperm(nb, generator=g)[:n] for _ in range(H)])
                       for _ in range(T)]).int()
    sel[::3, :, -1] = -1
    return sel


def _dense_ref(q, k, v, sel, l, masks_fn=None):
    """out, lse and grads through ``dense_attn`` per KV head (fp64 math)."""
    HQ, HKV = q.shape[1], k.shape[1]
    hg = HQ // HKV
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    outs, lses = [], []
    for h in range(HKV):
        m = selection_dense_mask(sel, l, k.shape[0], head=h) if masks_fn is None else masks_fn(h)
        o, s = dense_attn(leaves[0][:, h * hg:(h + 1) * hg], leaves[1][:, h:h + 1], leaves[2][:, h:h + 1], m)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs, 1), torch.cat(lses, 1), leaves


def _loss(out, lse, w):
    return out.float().square().sum() + (torch.where(torch.isinf(lse), 0.0, lse) * w).sum()


CASES = [  # (name, Tq, HQ, HKV, D, n, l, shared)
    ("dsa-T37-h4:1-D32", 37, 4, 1, 32, 9, 1, True),
    ("dsa-T40-h4:2-D16", 40, 4, 2, 16, 16, 1, True),
    ("nsa-T45-h4:2-D32-l4", 45, 4, 2, 32, 3, 4, False),
    ("nsa-T33-h2:2-D16-l8", 33, 2, 2, 16, 2, 8, False),
    ("nsa-T24-h6:2-l5", 24, 6, 2, 16, 2, 5, False),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_dense_attention(case, backend):
    _, T, HQ, HKV, D, n, l, shared = case
    q, k, v = _qkv(T, T, HQ, HKV, D)
    sel = _topk(T, n) if shared else _blocks(T, HKV, n, l)
    out_r, lse_r, leaves_r = _dense_ref(q, k, v, sel, l)
    w = torch.randn(T, HQ)
    _loss(out_r, lse_r, w).backward()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = sparse_attn(*leaves, sel, l, backend=backend)
    _loss(out, lse, w).backward()
    assert_close("out", out_r, out, atol=1e-5)
    assert_close("lse", lse_r, lse, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv"), leaves_r, leaves):
        assert_close(name, a.grad, b.grad, atol=1e-4)


def test_triton_fp16_matches_twin():
    q, k, v = _qkv(32, 32, 4, 2, 32, torch.float16)
    sel = _blocks(32, 2, 3, 4)
    ref_out, ref_lse = sparse_attn(q, k, v, sel, 4, backend="torch")
    out, lse = sparse_attn(q, k, v, sel, 4, backend="triton")
    assert_close("out", ref_out.float(), out.float(), atol=2e-3, rtol=2e-3)
    assert_close("lse", ref_lse, lse, atol=2e-3)


def _windowed_problem():
    """Keys 0..31 in windows of 8; the buffer holds keys [26, 32) at rows 0..5 and [9, 16) at rows 6..12.
    Rows: class 0 sees both windows, class 1 only [26, 32); the last row is padding."""
    S, window, T = 32, 8, 12
    q_pos = torch.tensor([31, 30, 28, 27, 20, 15, 12, 9, 31, 29, 26, -1], dtype=torch.int32)
    q_class = torch.tensor([0] * 8 + [1] * 4, dtype=torch.int32)
    win = torch.zeros(2, 4, 3, dtype=torch.int32)
    win[:, 3] = torch.tensor([26, 32, -26])
    win[0, 1] = torch.tensor([9, 16, 6 - 9])
    key_of_row = torch.tensor(list(range(26, 32)) + list(range(9, 16)))
    held = torch.zeros(2, S, dtype=torch.bool)
    held[:, 26:32] = True
    held[0, 9:16] = True
    return S, window, T, q_pos, q_class, win, key_of_row, held


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["dsa", "nsa"])
def test_key_windows_and_padding(kind, backend):
    S, window, T, q_pos, q_class, win, key_of_row, held = _windowed_problem()
    HQ, HKV, D = 4, 2, 16
    l = 1 if kind == "dsa" else 4
    sel = _topk(S, 10)[:T] if kind == "dsa" else _blocks(S, HKV, 3, l)[:T]
    q, k, v = _qkv(T, key_of_row.numel(), HQ, HKV, D)

    def mask(h):
        glob = selection_dense_mask(sel, l, S, head=h, q_pos=q_pos.clamp(min=-1))  # [T, S]
        glob &= held[q_class.long()] & (q_pos >= 0)[:, None]
        return glob[:, key_of_row]

    out_r, lse_r, leaves_r = _dense_ref(q, k, v, sel, l, mask)
    w = torch.randn(T, HQ)
    _loss(out_r, lse_r, w).backward()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = sparse_attn(*leaves, sel, l, q_pos=q_pos, q_class=q_class, kv_windows=win, window=window,
                           backend=backend)
    _loss(out, lse, w).backward()
    assert torch.isinf(lse[-1]).all() and (out[-1] == 0).all()  # the padding row
    assert_close("out", out_r, out, atol=1e-5)
    assert_close("lse", lse_r, lse, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv"), leaves_r, leaves):
        assert_close(name, a.grad, b.grad, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_split_keys_backward_from_final_lse(backend):
    """Keys split over two buffers (windows [0, 20) and [20, 40)): merged outputs equal the whole, and the
    delta-protocol backward of each part sums to the whole gradient."""
    T, HQ, HKV, D = 40, 4, 2, 16
    q, k, v = _qkv(T, T, HQ, HKV, D)
    sel = _blocks(T, HKV, 4, 4)
    out, lse = sparse_attn(q, k, v, sel, 4, backend="torch")
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_w, l_w = sparse_attn(*leaves, sel, 4, backend="torch")
    (o_w * dout).sum().add((torch.where(torch.isinf(l_w), 0.0, l_w) * dlse).sum()).backward()
    delta = row_delta_ref(dout, out, dlse)
    dq = torch.zeros_like(q)
    parts = []
    for lo, hi in ((0, 20), (20, 40)):
        win = torch.tensor([[[lo, hi, -lo]]], dtype=torch.int32)
        kw = dict(kv_windows=win, window=64, backend=backend)
        o_p, l_p = sparse_attn(q, k[lo:hi], v[lo:hi], sel, 4, **kw)
        parts.append((o_p, l_p))
        g = sparse_attn_backward(dout, q, k[lo:hi], v[lo:hi], lse, delta, sel, 4, **kw)
        dq += g[0]
        assert_close("dk part", leaves[1].grad[lo:hi], g[1], atol=1e-4)
        assert_close("dv part", leaves[2].grad[lo:hi], g[2], atol=1e-4)
    assert_close("dq", leaves[0].grad, dq, atol=1e-4)
    merged_lse = torch.logaddexp(parts[0][1], parts[1][1])
    assert_close("merged lse", lse, merged_lse, atol=1e-5)


@pytest.mark.parametrize("kind", ["dsa", "nsa"])
def test_triton_dkdv_paths(kind):
    """Key-major dK, dV (deterministic) against the atomic scatter and the twin; bit-identical reruns."""
    T, HQ, HKV, D = 24, 4, 2, 16
    q, k, v = _qkv(T, T, HQ, HKV, D)
    sel, l = (_topk(T, 6), 1) if kind == "dsa" else (_blocks(T, HKV, 2, 4), 4)
    out, lse = sparse_attn(q, k, v, sel, l, backend="torch")
    dout = torch.randn_like(out)
    delta = row_delta_ref(dout, out, None)
    ref = sparse_attn_backward(dout, q, k, v, lse, delta, sel, l, backend="torch")
    det = sparse_attn_backward(dout, q, k, v, lse, delta, sel, l, backend="triton")
    again = sparse_attn_backward(dout, q, k, v, lse, delta, sel, l, backend="triton")
    atomic = sparse_attn_backward(dout, q, k, v, lse, delta, sel, l, backend="triton", deterministic=False)
    for name, a, b, c, e in zip(("dq", "dk", "dv"), ref, det, atomic, again):
        assert_close(f"{name} deterministic", a, b, atol=1e-4)
        assert_close(f"{name} atomic", a, c, atol=1e-4)
        assert torch.equal(b, e), f"{name}: a rerun differs"


def test_meta_and_fake_tensors():
    q, k, v = (x.to("meta").requires_grad_() for x in _qkv(16, 16, 4, 2, 16))
    sel = _blocks(16, 2, 2, 4).to("meta")
    out, lse = sparse_attn(q, k, v, sel, 4)
    (out.sum() + lse.sum()).backward()
    assert out.shape == (16, 4, 16) and lse.shape == (16, 4) and k.grad.shape == k.shape
    with FakeTensorMode():
        q, k, v = _qkv(16, 16, 4, 1, 16)
        out, lse = sparse_attn(q, k, v, torch.zeros(16, 8, dtype=torch.int64))
        assert out.shape == q.shape and lse.dtype == torch.float32


@pytest.mark.parametrize("opname,fake", [("sparse_attn_fwd", op.sparse_attn_fwd_fake),
                                         ("sparse_attn_bwd_delta", op.sparse_attn_bwd_delta_fake)])
def test_fake_signature_matches_op(opname, fake):
    schema = getattr(torch.ops.attn_kernels, opname).default._schema
    assert list(inspect.signature(fake).parameters) == [a.name for a in schema.arguments]


def test_errors_name_the_argument_and_row():
    q, k, v = _qkv(8, 8, 4, 2, 16)
    sel = _topk(8, 3)
    with pytest.raises(ValueError, match="sel must be int32 or int64"):
        sparse_attn(q, k, v, sel.float())
    with pytest.raises(ValueError, match=r"sel must be \[Tq, n\] or \[Tq, Hs, n\]"):
        sparse_attn(q, k, v, sel[:5])
    with pytest.raises(ValueError, match="Hs in"):
        sparse_attn(q, k, v, torch.zeros(8, 3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="q_pos must be"):
        sparse_attn(q, k, v, sel, q_pos=torch.zeros(7, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        sparse_attn(q, k, v, sel, 0)
    with pytest.raises(ValueError, match="head dim"):
        sparse_attn(q[..., :12], k[..., :12], v[..., :12], sel)
    bad = sel.clone()
    bad[5, 1] = -3
    with pytest.raises(ValueError, match=r"sel\[5, 1\] = -3"):
        sparse_attn(q, k, v, bad, validate=True)
    bad = sel.clone()
    bad[6, 2] = bad[6, 1] = 4
    with pytest.raises(ValueError, match=r"sel\[6, 2\] = 4 repeats a selection in row 6"):
        sparse_attn(q, k, v, bad, validate=True)
    with pytest.raises(ValueError, match="lse must be"):
        sparse_attn_backward(q, q, k, v, torch.zeros(8, 3), torch.zeros(8, 4), sel)
