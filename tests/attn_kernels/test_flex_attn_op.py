"""The flex_attn custom ops: fakes, meta device, autograd, torch.compile with padded ranges, validation."""
import inspect

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import attn_kernels
from attn_kernels import flex_attn
from attn_kernels.flex_attn import op, ref
from attn_kernels.reference import flex_attn_reference
from tests._testing import assert_close
from tests.attn_kernels._slices import ranges

R_PAD = 8


def _schema_names(opname):
    schema = getattr(torch.ops.attn_kernels, opname).default._schema
    return [a.name for a in schema.arguments], len(schema.returns)


@pytest.mark.parametrize("opname,fake", [
    ("flex_attn_fwd", op.flex_attn_fwd_fake), ("flex_attn_bwd", op.flex_attn_bwd_fake),
    ("flex_attn_bwd_delta", op.flex_attn_bwd_delta_fake), ("row_delta", op.row_delta_fake),
    ("flex_attn_bwd_delta_acc", op.flex_attn_bwd_delta_acc_fake),
    ("merge_out_lse", attn_kernels.merge.merge_out_lse_fake),
    ("merge_out_lse_", attn_kernels.merge.merge_out_lse_inplace_fake),
])
def test_fake_signature_matches_op(opname, fake):
    names, _ = _schema_names(opname)
    assert list(inspect.signature(fake).parameters) == names


def _problem(Tq=64, Tk=64, HQ=4, HKV=2, D=32, device="cpu"):
    q = torch.randn(Tq, HQ, D, device=device)
    k = torch.randn(Tk, HKV, D, device=device)
    v = torch.randn(Tk, HKV, D, device=device)
    return q, k, v


def _pad(qr, kr, t, R=R_PAD):
    n = R - qr.shape[0]
    z = torch.zeros(n, 2, dtype=torch.int32)
    return torch.cat([qr, z]), torch.cat([kr, z]), torch.cat([t, torch.ones(n, dtype=torch.int32)])


def test_meta_device_no_host_reads():
    q, k, v = _problem(device="meta")
    qr, kr, t = (x.to("meta") for x in _pad(*ranges([[0, 64]], [[0, 64]], [1])))
    for x in (q, k, v):
        x.requires_grad_()
    out, lse = flex_attn(q, k, v, qr, kr, t)
    assert out.shape == (64, 4, 32) and lse.shape == (64, 4) and lse.dtype == torch.float32
    (out.sum() + lse.sum()).backward()
    assert k.grad.shape == k.shape and k.grad.device.type == "meta"
    # the torch twins themselves (the CPU path) run on meta too
    o2, l2 = ref.flex_attn_fwd_ref(q, k, v, qr, kr, t, 0.1, 2.0)
    g = ref.flex_attn_bwd_ref(o2, q, k, v, o2, l2, l2, qr, kr, t, 0.1, 2.0)
    assert [x.shape for x in g] == [q.shape, k.shape, v.shape]


def test_fake_tensor_mode():
    with FakeTensorMode():
        q, k, v = _problem()
        qr, kr, t = ranges([[0, 64]], [[0, 64]], [0])
        out, lse = flex_attn(q, k, v, qr, kr, t)
        assert out.shape == q.shape and lse.shape == (64, 4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_op_matches_oracle_with_lse_gradient(backend):
    q, k, v = _problem(40, 50)
    qr, kr, t = ranges([[0, 20], [20, 40], [10, 40]], [[0, 25], [0, 25], [25, 50]], [1, 0, 2])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flex_attn(*leaves, qr, kr, t, softmax_scale=0.2, softcap=5.0, backend=backend)
    w = torch.randn(40, 4)
    (out.square().sum() + (lse * w).sum()).backward()
    leaves_ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out_r, lse_r = flex_attn_reference(*leaves_ref, qr, kr, t, 0.2, 5.0)
    (out_r.square().sum() + (lse_r * w).sum()).backward()
    assert_close("out", out_r, out)
    assert_close("lse", lse_r, lse)
    for name, a, b in zip(("dq", "dk", "dv"), leaves_ref, leaves):
        assert_close(name, a.grad, b.grad, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_padded_ranges_no_recompile(backend):
    """The seed's example: ranges padded to a fixed R, fullgraph compile, same result as unpadded eager."""
    torch._dynamo.reset()
    q, k, v = _problem()

    def layer(q, k, v, q_ranges, k_ranges, attn_type):
        out, lse = flex_attn(q, k, v, q_ranges, k_ranges, attn_type, backend=backend)
        return out * 2.0, lse

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    masks = [ranges([[0, 30], [30, 64], [30, 64]], [[0, 30], [0, 30], [30, 64]], [1, 0, 1]),
             ranges([[0, 10], [10, 64], [0, 64], [50, 60], [60, 64]],
                    [[0, 10], [10, 40], [40, 50], [50, 60], [60, 64]], [1, 1, 0, 2, 3])]
    for qr, kr, t in masks:
        res = []
        for fn, args in ((layer, (qr, kr, t)), (compiled, _pad(qr, kr, t))):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out, lse = fn(*leaves, *args)
            (out.sum() + lse.sum()).backward()
            res.append((out, lse) + tuple(x.grad for x in leaves))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *res):
            assert_close(name, a, b, atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1, "changing the number of real slices recompiled"


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=torch.randn(8, 2, 48)), "head dim"),
    (dict(k=torch.randn(8, 3, 32), v=torch.randn(8, 3, 32)), "multiple of Hkv"),
    (dict(q_ranges=torch.zeros(2, 3, dtype=torch.int32)), "q_ranges must be"),
    (dict(attn_type=torch.zeros(3, dtype=torch.int32)), "attn_type must be"),
    (dict(k_ranges=torch.zeros(2, 2)), "k_ranges must be int32"),
    (dict(v=torch.randn(8, 1, 32, dtype=torch.float64)), "v must be"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softmax_scale=-0.5), "softmax_scale must be > 0"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_raises(kwargs, match):
    args = dict(q=torch.randn(8, 2, 32), k=torch.randn(8, 1, 32), v=torch.randn(8, 1, 32),
                q_ranges=torch.zeros(2, 2, dtype=torch.int32), k_ranges=torch.zeros(2, 2, dtype=torch.int32),
                attn_type=torch.zeros(2, dtype=torch.int32))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        flex_attn(**args)


@pytest.mark.parametrize("qr,kr,t,match", [
    ([[0, 8], [5, 3]], [[0, 8], [0, 8]], [0, 0], r"q_ranges\[1\] = \[5, 3\)"),
    ([[0, 8], [0, 8]], [[0, 9], [0, 8]], [0, 0], r"k_ranges\[0\] = \[0, 9\)"),
    ([[0, 8], [0, 8]], [[0, 4], [4, 8]], [1, 7], r"attn_type\[1\] = 7"),
])
def test_validate_reports_row(qr, kr, t, match):
    q, k, v = torch.randn(8, 2, 32), torch.randn(8, 1, 32), torch.randn(8, 1, 32)
    with pytest.raises(ValueError, match=match):
        flex_attn(q, k, v, *ranges(qr, kr, t), validate=True)
