"""flex_attn(accumulate=...): each call's result merged in fp32 into the caller's running (out, lse)."""
import pytest
import torch

from attn_kernels import flex_attn, merge_out_lse
from attn_kernels.flex_attn import kernel, ref
from tests._testing import assert_close
from tests.attn_kernels._slices import random_slices, ranges

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
Tq, Tk, HQ, HKV, D = 50, 64, 4, 2, 32

# the keys cut in two disjoint parts; rows 40-49 see no key in either, rows 30-39 only in the second
_PART_A = ranges([[0, 20], [0, 30]], [[0, 20], [20, 40]], [1, 0])
_PART_B = ranges([[0, 20], [20, 40]], [[40, 48], [40, 64]], [0, 1])


def _qkv(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, HQ, D, generator=g).to(dtype)
    k, v = (torch.randn(Tk, HKV, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _start(seed=1):
    """A running result of earlier parts: random out, finite lse on rows 0-24, -inf (nothing yet) below."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(Tq, HQ, D, generator=g)
    lse = torch.randn(Tq, HQ, generator=g)
    out[25:], lse[25:] = 0.0, float("-inf")
    return out, lse


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_accumulate_merges_the_fp32_part(backend, dtype):
    """The running result after the call is the log-sum-exp merge of it with the call's part, computed
    in fp32 from the part's unrounded out; rows the part saw no key of are left bit for bit."""
    dtype = DTYPES[dtype]
    q, k, v = _qkv(dtype)
    acc = _start()
    start = tuple(t.clone() for t in acc)
    got = flex_attn(q, k, v, *_PART_A, 0.3, backend=backend, accumulate=acc)
    assert all(g is a for g, a in zip(got, acc))  # the same tensors, written in place
    part_o, part_l = ref.flex_attn_fwd_ref(q.float(), k.float(), v.float(), *_PART_A, 0.3, 0.0)
    want_o, want_l = merge_out_lse(start[0], start[1], part_o, part_l)
    seen = part_l > float("-inf")
    assert not seen[40:].any() and seen[:30].all()
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16 kernels round P before the PV dot
    assert_close("out", want_o[seen], acc[0][seen], atol=tol, rtol=tol)
    assert_close("lse", want_l[seen], acc[1][seen], atol=1e-5, rtol=1e-5)
    assert torch.equal(acc[0][~seen], start[0][~seen]) and torch.equal(acc[1][~seen], start[1][~seen])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("slices", ["parts", "random"])
def test_parts_accumulated_from_empty_equal_one_call(backend, slices):
    """From (0, -inf), the parts of a mask over disjoint keys accumulated one after the other equal one
    call over the whole mask (fp32), the rows no part sees included (out 0, lse -inf)."""
    q, k, v = _qkv(torch.float32, seed=2)
    if slices == "parts":
        parts, whole = (_PART_A, _PART_B), tuple(torch.cat(x) for x in zip(_PART_A, _PART_B))
    else:  # random_slices cut the keys in two halves: each half's slices are one part
        qr, kr, t = random_slices(Tq, Tk, seed=5)
        half = int(kr[:, 0].max())  # a slice of the second half starts at or past the cut
        first = (kr[:, 1] <= half) | (kr[:, 0] == kr[:, 1])
        parts = ((qr[first], kr[first], t[first]), (qr[~first], kr[~first], t[~first]))
        whole = (qr, kr, t)
    acc = (torch.zeros(Tq, HQ, D), torch.full((Tq, HQ), float("-inf")))
    for part in parts:
        flex_attn(q, k, v, *part, 0.3, backend=backend, accumulate=acc)
    want_o, want_l = flex_attn(q, k, v, *whole, 0.3, backend=backend)
    assert_close("out", want_o, acc[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(want_l == float("-inf"), acc[1] == float("-inf"))
    assert_close("lse", want_l, acc[1], atol=1e-5, rtol=1e-5)


def test_kernel_equals_its_torch_twin():
    q, k, v = _qkv(torch.float32, seed=3)
    got, twin = _start(), _start()
    kernel.flex_attn_fwd(q, k, v, *_PART_B, 0.3, 0.0, accumulate=got)
    ref.flex_attn_fwd_ref(q, k, v, *_PART_B, 0.3, 0.0, accumulate=twin)
    for name, a, b in zip(("out", "lse"), got, twin):
        assert_close(name, b, a, atol=1e-5, rtol=1e-5)


def test_meta_and_compile_trace_the_in_place_op():
    """On meta the op allocates nothing and returns the given tensors; compiled, it writes them."""
    q, k, v = (t.to("meta") for t in _qkv(torch.float32))
    acc = (torch.empty(Tq, HQ, D, device="meta"), torch.empty(Tq, HQ, device="meta"))
    assert all(a is b for a, b in zip(flex_attn(q, k, v, *(x.to("meta") for x in _PART_A), 0.3, validate=False,
                                                flag_errors=False, accumulate=acc), acc))

    def step(q, k, v, o, lse):
        flex_attn(q, k, v, *_PART_A, 0.3, validate=False, flag_errors=False, accumulate=(o, lse))
        return o.sum()
    q, k, v = _qkv(torch.float32, seed=4)
    eager, compiled = _start(), _start()
    step(q, k, v, *eager)
    torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, *compiled)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_tuned_accumulating_forward_restores_its_running_result(monkeypatch):
    """Tuned over several configs (GPU), an accumulating forward runs once per trial: the tuner must
    put out_acc and lse_acc back after each, or the part would be merged in once per config."""
    got = {}

    class Tuned:
        def __getitem__(self, grid):
            return lambda **kw: got.setdefault("launched", grid)

    def autotune(configs, key, restore_value=None):
        got["restore"] = restore_value
        return lambda fn: Tuned()
    monkeypatch.setattr(kernel.triton, "autotune", autotune)
    monkeypatch.setattr(kernel, "_TUNED", {})
    cfg = kernel._config("fwd", torch.zeros(1, 1, 16), None, None, False)
    args = {"p_q": 0, "p_o": 0, "p_lse": 0}
    for accumulate, want in ((True, ["p_o", "p_lse"]), (False, None)):
        kernel._launch("fwd", kernel._flex_fwd_kernel, (2, 3), args, {"ACCUMULATE": accumulate}, cfg, [cfg, cfg])
        assert got.pop("restore") == want and got.pop("launched") == (2, 3)


def _bad(i, t):
    acc = [torch.zeros(Tq, HQ, D), torch.zeros(Tq, HQ)]
    acc[i] = t
    return tuple(acc)


@pytest.mark.parametrize("accumulate,match", [
    ((torch.zeros(Tq, HQ, D),), "accumulate must be \\(out_acc, lse_acc\\), got tuple of length 1"),
    (_bad(0, torch.zeros(Tq, HQ, D, dtype=torch.float16)), r"accumulate out_acc must be fp32 \[50, 4, 32\] on cpu, "
                                                         r"got torch.float16"),
    (_bad(1, torch.zeros(Tq, HQ, 1)), r"accumulate lse_acc must be fp32 \[50, 4\] on cpu, got torch.float32 "
                                      r"\[50, 4, 1\]"),
    (_bad(0, torch.zeros(HQ, Tq, D).transpose(0, 1)), "accumulate out_acc must be contiguous"),
    (_bad(1, None), "accumulate lse_acc must be a torch.Tensor, got NoneType"),
])
def test_bad_accumulate_raises(accumulate, match):
    with pytest.raises(ValueError, match=match):
        flex_attn(*_qkv(torch.float32), *_PART_A, 0.3, accumulate=accumulate)
