"""flex_attn_backward(accumulate=...): the gradients added in fp32 into the caller's sums, in place."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from attn_kernels import flex_attn_backward
from attn_kernels.flex_attn import kernel, op, ref
from tests._testing import assert_close
from tests.attn_kernels._slices import random_slices, ranges

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
Tq, Tk, HQ, HKV, D = 50, 64, 4, 2, 32

# causal and inverse-causal slices sharing query rows, rows 40-49 see no key, keys 48-63 are seen by none
_CAUSAL = ranges([[0, 20], [0, 30], [20, 40]], [[0, 20], [20, 48], [10, 40]], [1, 2, 1])
_LAYOUTS = {"random": lambda: random_slices(Tq, Tk, seed=13), "causal-empty": lambda: _CAUSAL,
            "full": lambda: ranges([[0, Tq]], [[0, Tk]], [0])}


def _problem(dtype, seed=0, slices=None):
    """(dout, q, k, v, lse, delta) with the lse and delta of a real forward over ``slices``
    (default: the causal layout with empty rows)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, HQ, D, generator=g).to(dtype)
    k, v = (torch.randn(Tk, HKV, D, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(Tq, HQ, D, generator=g).to(dtype)
    out, lse = ref.flex_attn_fwd_ref(q, k, v, *(slices or _CAUSAL), 0.3, 0.0)
    return dout, q, k, v, lse, ref.row_delta_ref(dout, out, torch.randn(Tq, HQ, generator=g))


def _sums(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(Tq, HQ, D, generator=g), torch.randn(Tk, HKV, D, generator=g),
            torch.randn(Tk, HKV, D, generator=g)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_accumulate_adds_the_fp32_gradients(backend, dtype, layout):
    dtype = DTYPES[dtype]
    qr, kr, t = _LAYOUTS[layout]()
    args = _problem(dtype, slices=(qr, kr, t))
    acc = _sums()
    start = [a.clone() for a in acc]
    got = flex_attn_backward(*args, qr, kr, t, 0.3, backend=backend, accumulate=tuple(acc))
    assert all(g is a for g, a in zip(got, acc))  # the same tensors, written in place
    # the reference in fp32 from the same (rounded) inputs: the share is never rounded to q's dtype
    want = ref.flex_attn_bwd_from_delta_ref(*(x.float() for x in args), qr, kr, t, 0.3, 0.0)
    # fp16 kernels round P and dS to fp16 before their dots, as the non-accumulating path does
    tol = 0.0 if backend == "torch" else (1e-5 if dtype == torch.float32 else 3e-3)
    for name, a, s, w in zip(("dq", "dk", "dv"), acc, start, want):
        assert a.dtype == torch.float32
        assert_close(name, s + w, a, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_kernel_accumulate_equals_sums_plus_its_own_result(dtype):
    """Into zeros, the kernel's fp32 sums round to exactly its non-accumulating result (fp32: equal)."""
    dtype = DTYPES[dtype]
    qr, kr, t = random_slices(Tq, Tk, seed=5)
    args = _problem(dtype, seed=4, slices=(qr, kr, t))
    plain = kernel.flex_attn_bwd_from_delta(*args, qr, kr, t, 0.3, 0.0)
    acc = [torch.zeros_like(x, dtype=torch.float32) for x in plain]
    kernel.flex_attn_bwd_from_delta(*args, qr, kr, t, 0.3, 0.0, accumulate=tuple(acc))
    for name, a, p in zip(("dq", "dk", "dv"), acc, plain):
        assert torch.equal(a.to(dtype), p), name


@pytest.mark.parametrize("min_programs,split", [(4, 2), (1000, 4)], ids=["split2", "split4"])
def test_accumulate_with_query_head_split(monkeypatch, min_programs, split):
    """dK/dV over few KV heads: the fp32 partials are added into the sums in a fixed order."""
    HQ1, HKV1 = 4, 1
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(40, HQ1, 32, generator=g) for _ in range(2))
    k, v = (torch.randn(50, HKV1, 32, generator=g) for _ in range(2))
    lse, delta = torch.randn(40, HQ1, generator=g) + 4.0, torch.randn(40, HQ1, generator=g)
    qr, kr, t = random_slices(40, 50, seed=5)
    blocks = dict(block_q=32, block_k=32)
    whole = kernel.flex_attn_bwd_from_delta(dout, q, k, v, lse, delta, qr, kr, t, 0.3, 0.0, **blocks)
    monkeypatch.setattr(kernel, "MIN_DKDV_PROGRAMS", min_programs)
    assert kernel._dkdv_split(HQ1 // HKV1, 2, q.device) == split
    acc = [torch.randn_like(x, dtype=torch.float32) for x in whole]
    start = [a.clone() for a in acc]
    kernel.flex_attn_bwd_from_delta(dout, q, k, v, lse, delta, qr, kr, t, 0.3, 0.0, accumulate=tuple(acc),
                                    **blocks)
    again = [s.clone() for s in start]
    kernel.flex_attn_bwd_from_delta(dout, q, k, v, lse, delta, qr, kr, t, 0.3, 0.0, accumulate=tuple(again),
                                    **blocks)
    for name, a, b, s, w in zip(("dq", "dk", "dv"), acc, again, start, whole):
        assert torch.equal(a, b), f"{name} not deterministic"
        assert_close(name, s + w, a, atol=1e-5, rtol=0.0)


class _Allocations(TorchDispatchMode):
    """The ops that make a new tensor, seen under the mode."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith(("empty", "zeros", "new_", "ones", "full")) or name.endswith("_like"):
            self.made.append(name)
        return func(*args, **(kwargs or {}))


def test_meta_runs_and_allocates_nothing():
    dout, q, k, v, lse, delta = (x.to("meta") for x in _problem(torch.float16))
    qr, kr, t = (x.to("meta") for x in _CAUSAL)
    acc = tuple(torch.empty(x.shape, dtype=torch.float32, device="meta") for x in (q, k, v))
    with _Allocations() as seen:
        got = flex_attn_backward(dout, q, k, v, lse, delta, qr, kr, t, accumulate=acc)
    assert all(g is a for g, a in zip(got, acc))
    assert seen.made == []
    assert op.flex_attn_bwd_delta_acc_fake(dout, q, k, v, lse, delta, qr, kr, t, 0.1, 0.0, "torch", *acc) is None


def test_fake_tensor_mode():
    with FakeTensorMode():
        dout, q = torch.randn(Tq, HQ, D), torch.randn(Tq, HQ, D)
        k, v, lse, delta = torch.randn(Tk, HKV, D), torch.randn(Tk, HKV, D), torch.randn(Tq, HQ), torch.randn(Tq, HQ)
        acc = tuple(torch.zeros(x.shape) for x in (q, k, v))
        got = flex_attn_backward(dout, q, k, v, lse, delta, *ranges([[0, Tq]], [[0, Tk]], [1]), accumulate=acc)
        assert all(g is a for g, a in zip(got, acc))


def test_opcheck():
    args = _problem(torch.float32)
    qr, kr, t = random_slices(Tq, Tk, seed=13)
    torch.library.opcheck(op.flex_attn_bwd_delta_acc_op, (*args, qr, kr, t, 0.3, 0.0, "torch", *_sums()))


def test_compile_fullgraph():
    torch._dynamo.reset()
    args = _problem(torch.float32)
    qr, kr, t = random_slices(Tq, Tk, seed=13)

    def step(acc_q, acc_k, acc_v, *a):
        flex_attn_backward(*a, qr, kr, t, 0.3, backend="torch", accumulate=(acc_q, acc_k, acc_v))

    want, got = _sums(), _sums()
    step(*want, *args)
    torch.compile(step, backend="aot_eager", fullgraph=True)(*got, *args)
    for name, a, b in zip(("dq", "dk", "dv"), want, got):
        assert_close(name, a, b, atol=1e-6, rtol=0.0)


def _bad(which, t):
    acc = _sums()
    acc[which] = t
    return tuple(acc)


@pytest.mark.parametrize("accumulate,match", [
    ((torch.zeros(Tq, HQ, D),) * 2, "accumulate must be \\(dq_acc, dk_acc, dv_acc\\), got tuple of length 2"),
    (_bad(0, torch.zeros(Tq, HQ, D, dtype=torch.float16)), r"accumulate dq_acc must be fp32 \[50, 4, 32\] on cpu, "
                                                            r"got torch.float16"),
    (_bad(1, torch.zeros(Tk, HQ, D)), r"accumulate dk_acc must be fp32 \[64, 2, 32\] on cpu, got torch.float32 "
                                      r"\[64, 4, 32\]"),
    (_bad(2, torch.zeros(Tk, HKV, D, device="meta")), "accumulate dv_acc must be .* got torch.float32 .* on meta"),
    (_bad(1, torch.zeros(HKV, Tk, D).transpose(0, 1)), "accumulate dk_acc must be contiguous"),
    (_bad(2, None), "accumulate dv_acc must be a torch.Tensor, got NoneType"),
])
def test_bad_accumulate_raises(accumulate, match):
    args = _problem(torch.float32)
    with pytest.raises(ValueError, match=match):
        flex_attn_backward(*args, *_CAUSAL, accumulate=accumulate)
