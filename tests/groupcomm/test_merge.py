"""The fused row merge (``groupcomm._merge``): slot table, kernels against their twins and the torch path.

Kernels run under ``TRITON_INTERPRET=1`` in fp32 and fp16 (the interpreter computes bf16
wrongly, so bf16 is checked on meta only). The torch path (``_reduce.reduce_lse`` /
``reduce_sum``) adds the same terms in the same order, so the fp32 results agree to rounding of
exp/log (1e-6).
"""
import inspect

import pytest
import torch

from groupcomm import LocalGroup, group_reduce, neutral_rows
from groupcomm import _merge
from groupcomm._merge import (fused_reduce, merge_lse_inplace_op, merge_lse_op, merge_lse_ref, merge_lse_ref_,
                              merge_sum_inplace_op, merge_sum_op, merge_sum_ref, merge_sum_ref_, slot_table, use_fused)
from groupcomm._reduce import reduce_lse, reduce_sum
from groupcomm._routing import put_targets
from tests._testing import assert_close
from tests.groupcomm._cases import random_routing

CASES = [(2, 5, 0), (3, 7, 1), (5, 6, 2), (8, 9, 3), (8, 1, 4)]  # (P, N, seed)
IDS = [f"P{p}-N{n}-seed{s}" for p, n, s in CASES]
NEG_INF = float("-inf")


def _routing(P, N, seed):
    """(send_index [P, C], dest [P, C]) of a random routing: the returned rows' layout of LocalGroup."""
    r = random_routing(P, N, seed)
    dest, _ = put_targets(r.split, r.send_index, torch.arange(P), r.recv_capacity)
    return r.send_index, dest


def _slots_loop(send_index, dest, N, P):
    """The slot table by plain loops."""
    B, C = send_index.shape
    table = [[[-1] * P for _ in range(N)] for _ in range(B)]
    for b in range(B):
        for p in range(C):
            d, n = int(dest[b, p]), int(send_index[b, p])
            if 0 <= d < P and 0 <= n < N:
                assert table[b][n][d] == -1, "a row goes to each destination at most once"
                table[b][n][d] = p
    return torch.tensor(table, dtype=torch.int32).view(B, N, P)


@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_slot_table_matches_loops(P, N, seed):
    send_index, dest = _routing(P, N, seed)
    got = slot_table(send_index, dest, N, P)
    assert got.dtype == torch.int32 and got.shape == (P, N, P)
    assert_close("slots", _slots_loop(send_index, dest, N, P), got)


def test_slot_table_skips_padding_and_out_of_range():
    send_index = torch.tensor([[2, 0, 5, -1, 1], [1, 1, 0, 2, -1]])
    dest = torch.tensor([[1, 1, 1, -1, 0], [0, 1, -1, 2, 1]])
    got = slot_table(send_index, dest, 3, 3)
    ref = torch.tensor([[[-1, 1, -1], [4, -1, -1], [-1, 0, -1]],
                        [[-1, -1, -1], [0, 1, -1], [-1, -1, 3]]], dtype=torch.int32)
    assert_close("slots", ref, got)
    assert_close("loops", _slots_loop(send_index, dest, 3, 3), got)


def _lse_inputs(P, N, seed, h=3, D=5, dtype=torch.float32):
    """Host (out, lse), returned (out_p, lse_p) with -inf partials, an empty host row 0 (every lse
    -inf) and lse far apart (exp would overflow unshifted)."""
    send_index, dest = _routing(P, N, seed)
    C = send_index.shape[1]
    g = torch.Generator().manual_seed(seed + 100)
    out_p = torch.randn(P, C, h, D, generator=g)
    lse_p = torch.randn(P, C, h, generator=g) * 60
    lse_p[torch.rand(lse_p.shape, generator=g) < 0.2] = NEG_INF
    out = torch.randn(P, N, h, D, generator=g)
    lse = torch.randn(P, N, h, generator=g) * 60
    lse[:, 0] = NEG_INF
    out[:, 0] = 0.0
    lse_p[send_index == 0] = NEG_INF
    out_p[send_index == 0] = 0.0
    return send_index, dest, out.to(dtype), lse, out_p.to(dtype), lse_p


def _no_partials(send_index, dest, N, P):
    """Whether some host row gets no partial at all."""
    return bool((slot_table(send_index, dest, N, P) < 0).all(-1).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_merge_lse_kernel_matches_twin_and_torch_path(P, N, seed, dtype):
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(P, N, seed, dtype=dtype)
    slots = slot_table(send_index, dest, N, P)
    ref = merge_lse_ref(out, lse, out_p, lse_p, slots)
    tri = merge_lse_op(out, lse, out_p, lse_p, slots, True)
    again = merge_lse_op(out, lse, out_p, lse_p, slots, True)
    torch_path = reduce_lse([out, lse], [out_p, lse_p], send_index, dest, P, deterministic=True)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    assert tri[0].dtype == dtype and tri[1].dtype == torch.float32
    for name, r, t, p, a in zip(("out", "lse"), ref, tri, torch_path, again):
        assert not t.isnan().any()
        assert torch.equal(t, a), f"{name}: two runs differ"
        assert_close(f"{name} twin", r.float(), t.float(), **tol)
        assert_close(f"{name} torch path", p.float(), t.float(), **tol)
    assert (tri[1][:, 0] == NEG_INF).all() and (tri[0][:, 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_merge_sum_kernel_matches_twin_and_torch_path(P, N, seed, dtype):
    send_index, dest = _routing(P, N, seed)
    C = send_index.shape[1]
    g = torch.Generator().manual_seed(seed + 200)
    acc = torch.randn(P, N, 3, 5, generator=g).to(dtype)
    ret = torch.randn(P, C, 3, 5, generator=g).to(dtype)
    slots = slot_table(send_index, dest, N, P)
    ref = merge_sum_ref(acc, ret, slots)
    tri = merge_sum_op(acc, ret, slots, True)
    torch_path, = reduce_sum([acc], [ret], send_index, dest, P, deterministic=True)
    assert tri.dtype == dtype
    assert torch.equal(tri, merge_sum_op(acc, ret, slots, True)), "two runs differ"
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    assert_close("sum twin", ref.float(), tri.float(), **tol)
    assert_close("sum torch path", torch_path.float(), tri.float(), **tol)


_INTS = {2: torch.int16, 4: torch.int32}


def _bits(t):
    return t.view(_INTS[t.element_size()])


def _strided(t, extra, last_strided=False):
    """t's values as rows of a larger buffer (batch-strided, ``extra`` rows more per rank), as the
    layer's running accumulators are; ``last_strided``: the last dim not contiguous either."""
    shape = (t.shape[0], t.shape[1] + extra, *t.shape[2:])
    if last_strided:
        buf = torch.full((*shape[:-1], 2 * shape[-1]), 7.0, dtype=t.dtype)[..., ::2]
    else:
        buf = torch.full(shape, 7.0, dtype=t.dtype)
    view = buf.narrow(1, 0, t.shape[1])
    view.copy_(t)
    return buf, view


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", ["contiguous", "rows", "rows-last-strided"])
@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_merge_lse_inplace_kernel_matches_twin(P, N, seed, layout, part_dtype):
    """``merge_lse_`` (the kernel writing its accumulator) against its twin ``merge_lse_ref_`` and with
    the bits of the out-of-place kernel, into fp32 (out, lse) contiguous or as strided rows of a larger
    buffer (a non-contiguous D is merged in a copy): only acc's rows change."""
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(P, N, seed)
    out_p = out_p.to(part_dtype)
    slots = slot_table(send_index, dest, N, P)
    want = merge_lse_op(out, lse, out_p, lse_p, slots, True)
    if layout == "contiguous":
        bufs, acc = None, [out.clone(), lse.clone()]
    else:
        (b_o, v_o), (b_l, v_l) = _strided(out, 2, layout == "rows-last-strided"), _strided(lse, 3)
        bufs, acc = (b_o, b_l), [v_o, v_l]
    twin = [out.clone(), lse.clone()]
    assert merge_lse_inplace_op(*acc, out_p, lse_p, slots, True) is None
    merge_lse_ref_(*twin, out_p, lse_p, slots)
    for name, w, a, t in zip(("out", "lse"), want, acc, twin):
        assert torch.equal(_bits(w), _bits(a)), f"{name}: in place differs from the out-of-place kernel"
        assert_close(f"{name} twin", t, a, atol=1e-6, rtol=1e-6)
    if bufs is not None:  # the rows past acc's are untouched
        assert (bufs[0].narrow(1, N, 2) == 7).all() and (bufs[1].narrow(1, N, 3) == 7).all()
    assert (acc[1][:, 0] == NEG_INF).all() and (acc[0][:, 0] == 0).all()


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", ["contiguous", "rows", "rows-last-strided"])
@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_merge_sum_inplace_kernel_matches_twin(P, N, seed, layout, part_dtype):
    """``merge_sum_`` against its twin ``merge_sum_ref_`` and the out-of-place kernel's bits."""
    send_index, dest = _routing(P, N, seed)
    C = send_index.shape[1]
    g = torch.Generator().manual_seed(seed + 300)
    acc0 = torch.randn(P, N, 3, 5, generator=g)
    ret = torch.randn(P, C, 3, 5, generator=g).to(part_dtype)
    slots = slot_table(send_index, dest, N, P)
    want = merge_sum_op(acc0, ret, slots, True)
    buf, acc = (None, acc0.clone()) if layout == "contiguous" else _strided(acc0, 2, layout == "rows-last-strided")
    twin = acc0.clone()
    assert merge_sum_inplace_op(acc, ret, slots, True) is None
    merge_sum_ref_(twin, ret, slots)
    assert torch.equal(_bits(want), _bits(acc)), "in place differs from the out-of-place kernel"
    assert_close("sum twin", twin, acc, atol=1e-6, rtol=1e-6)
    if buf is not None:
        assert (buf.narrow(1, N, 2) == 7).all()


def test_inplace_ops_torch_impl_is_the_twin():
    """``use_triton=False`` runs the twins: the same bits as the out-of-place twins."""
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(4, 6, 2)
    slots = slot_table(send_index, dest, 6, 4)
    acc = [out.clone(), lse.clone()]
    merge_lse_inplace_op(*acc, out_p, lse_p, slots, False)
    for w, a in zip(merge_lse_ref(out, lse, out_p, lse_p, slots), acc):
        assert torch.equal(_bits(w), _bits(a))
    a = out.clone()
    merge_sum_inplace_op(a, out_p, slots, False)
    assert torch.equal(_bits(merge_sum_ref(out, out_p, slots)), _bits(a))


def test_cases_have_rows_with_no_partials():
    """The cases above cover host rows no partial comes back to (the kernel then copies the host's row)."""
    assert any(_no_partials(*_routing(P, N, seed), N, P) for P, N, seed in CASES)


def test_row_with_no_partials_is_the_host_row():
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(3, 7, 1)
    slots = torch.full((3, 7, 3), -1, dtype=torch.int32)
    got_out, got_lse = merge_lse_op(out, lse, out_p, lse_p, slots, True)
    assert torch.equal(got_lse, lse)
    assert_close("out", out, got_out, atol=0, rtol=0)
    assert torch.equal(merge_sum_op(out, out_p, slots, True), out)


def test_strided_returned_rows():
    """The returned rows as TorchGroup hands them over: B = 1, views strided by the packed row."""
    P, N, h, D = 4, 6, 2, 8
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(P, N, 2, h=h, D=D)
    packed = torch.cat([out_p.reshape(P, -1, h * D), lse_p], dim=-1)       # [P, C, h * D + h]
    v_out, v_lse = packed[..., :h * D].view(P, -1, h, D), packed[..., h * D:]
    assert not v_out.is_contiguous() and not v_lse.is_contiguous()
    for b in range(P):
        s = slot_table(send_index[b:b + 1], dest[b:b + 1], N, P)
        got = merge_lse_op(out[b:b + 1], lse[b:b + 1], v_out[b:b + 1], v_lse[b:b + 1], s, True)
        ref = merge_lse_ref(out[b:b + 1], lse[b:b + 1], out_p[b:b + 1], lse_p[b:b + 1], s)
        for name, r, t in zip(("out", "lse"), ref, got):
            assert_close(name, r, t, atol=1e-6, rtol=1e-6)
        got = merge_sum_op(out[b:b + 1], v_out[b:b + 1], s, True)
        assert_close("sum", merge_sum_ref(out[b:b + 1], out_p[b:b + 1], s), got, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("op", ["lse", "sum"])
@pytest.mark.parametrize("det", [True, False], ids=["det", "nondet"])
def test_group_reduce_fused_equals_torch_path(op, det):
    P, N = 5, 9
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(P, N, 7)
    r = random_routing(P, N, 7)
    # partials in the receive layout: cast back by LocalGroup to the send order above
    g = torch.Generator().manual_seed(3)
    if op == "lse":
        partials = [torch.randn(P, r.recv_capacity, 3, 5, generator=g),
                    torch.randn(P, r.recv_capacity, 3, generator=g) * 30]
        partials[1][torch.rand(partials[1].shape, generator=g) < 0.3] = NEG_INF
        acc = [out, lse]
    else:
        partials = [torch.randn(P, r.recv_capacity, 4, generator=g),
                    torch.randn(P, r.recv_capacity, 2, 3, generator=g).half()]
        acc = [torch.randn(P, N, 4, generator=g), torch.randn(P, N, 2, 3, generator=g).half()]
    before = [a.clone() for a in acc]
    ref = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op=op, deterministic=det)
    with fused_reduce(True):
        tri = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op=op, deterministic=det)
        again = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op=op, deterministic=det)
    for a, b in zip(acc, before):
        assert torch.equal(a, b), "acc must not be modified"
    for i, (x, y, z) in enumerate(zip(ref, tri, again)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(y, z), f"tensor {i}: two runs differ"
        tol = dict(atol=1e-6, rtol=1e-6) if y.dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
        assert_close(f"{op} {i}", x.float(), y.float(), **tol)


def test_dispatch_modes():
    x = [torch.zeros(2, 3, 4)]
    assert not use_fused(x, x)  # CPU: the torch path by default
    with fused_reduce(True):
        assert use_fused(x, x)
        assert not use_fused([torch.zeros(2, 3, dtype=torch.int64)], x)  # integers: the torch path
        with fused_reduce(False):
            assert not use_fused(x, x)
        assert use_fused(x, x)
    assert _merge._MODE is None
    with pytest.raises(ValueError, match="mode"):
        _merge.set_fused_reduce("yes")


def test_forced_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(3, 4, 0)
    slots = slot_table(send_index, dest, 4, 3)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        merge_lse_op(out, lse, out_p, lse_p, slots, True)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        merge_sum_op(out, out_p, slots, True)


@pytest.mark.parametrize("opname,fake", [("merge_lse", _merge.merge_lse_fake), ("merge_sum", _merge.merge_sum_fake),
                                         ("merge_lse_", _merge.merge_lse_inplace_fake),
                                         ("merge_sum_", _merge.merge_sum_inplace_fake)])
def test_fake_signature_matches_op(opname, fake):
    schema = getattr(torch.ops.groupcomm, opname).default._schema
    assert list(inspect.signature(fake).parameters) == [a.name for a in schema.arguments]


def test_inplace_ops_declare_what_they_mutate():
    """The in-place ops' schemas mark exactly their accumulators as written and return nothing."""
    for opname, written in (("merge_lse_", {"out", "lse"}), ("merge_sum_", {"acc"})):
        schema = getattr(torch.ops.groupcomm, opname).default._schema
        assert {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write} == written
        assert not schema.returns


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_opcheck(use_triton):
    """torch.library's checks of the four ops: schema (the in-place ones mutate what they declare),
    fake against real (shapes, dtypes, strides), no alias of an input in the outputs."""
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(3, 5, 1)
    slots = slot_table(send_index, dest, 5, 3)
    torch.library.opcheck(merge_lse_op, (out, lse, out_p, lse_p, slots, use_triton))
    torch.library.opcheck(merge_sum_op, (out, out_p, slots, use_triton))
    torch.library.opcheck(merge_lse_inplace_op, (out.clone(), lse.clone(), out_p, lse_p, slots, use_triton))
    torch.library.opcheck(merge_sum_inplace_op, (out.clone(), out_p, slots, use_triton))


def test_meta_bf16_allocates_outputs_only():
    """On meta the fused reduce is the fakes: outputs in acc's dtypes, contiguous, no host read."""
    P, N, h, D, cap, send_cap = 4, 6, 2, 8, 11, 9
    meta = torch.device("meta")
    split = torch.empty(P, P, dtype=torch.int64, device=meta)
    send_index = torch.empty(P, send_cap, dtype=torch.int64, device=meta)
    q = torch.empty(P, N, h, D, dtype=torch.bfloat16, device=meta)
    lse = torch.empty(P, N, h, device=meta)
    partials = [torch.empty(P, cap, h, D, dtype=torch.bfloat16, device=meta), torch.empty(P, cap, h, device=meta)]
    with fused_reduce(True):
        out, l2 = group_reduce(partials, send_index, split, [q, lse], LocalGroup(P), op="lse")
        dq, = group_reduce(partials[:1], send_index, split, [q], LocalGroup(P), op="sum")
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device == meta and out.is_contiguous()
    assert l2.shape == lse.shape and l2.dtype == torch.float32
    assert dq.shape == q.shape and dq.dtype == torch.bfloat16


def test_compiles_fullgraph():
    """group_reduce with the fused ops under torch.compile(fullgraph=True): one graph, the eager bits."""
    P, N = 4, 7
    r = random_routing(P, N, 5)
    g = torch.Generator().manual_seed(5)
    partials = [torch.randn(P, r.recv_capacity, 2, 4, generator=g), torch.randn(P, r.recv_capacity, 2, generator=g)]
    acc = [torch.randn(P, N, 2, 4, generator=g), torch.randn(P, N, 2, generator=g)]
    group = LocalGroup(P)

    def both(partials, acc):
        out, lse = group_reduce(list(partials), r.send_index, r.split, list(acc), group, op="lse")
        s, = group_reduce([partials[0]], r.send_index, r.split, [acc[0]], group, op="sum")
        return out, lse, s
    with fused_reduce(True):
        eager = both(partials, acc)
        torch._dynamo.reset()
        compiled = torch.compile(both, fullgraph=True, backend="aot_eager")(partials, acc)
    torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_kernels_compile_for_sm90_without_spills():
    """Both kernels as a GPU launches them at real shapes (h = 8, D = 128 and rows of 1024 values, bf16
    and fp16, the GPU's block sizes and divisibility hints) compile for sm_90 with no spills, with the
    host's rows given, as a neutral accumulator (``neutral_rows``) and in place into fp32 rows of a
    larger buffer (``IN_PLACE``, the sub-stage reduces'). In place, a CTA barrier (``bar.sync``) lies
    between the last global load and the first global store in the PTX: every thread has read the
    host's values before any is overwritten (the kernel's ``tl.debug_barrier``; the layout changes
    before the stores make barriers there too, which is why the count alone would say nothing)."""
    from groupcomm._merge_kernel import lse_blocks, sum_blocks
    from tests._sm90 import capture_launches, compile_sm90

    P, N, h, D = 4, 6, 8, 128
    send_index, dest, out, lse, out_p, lse_p = _lse_inputs(P, N, 2, h=h, D=D)
    slots = slot_table(send_index, dest, N, P)
    records = []
    for dtype in (torch.bfloat16, torch.float16):
        with capture_launches(specialize=True) as got:
            merge_lse_op(out.to(dtype), lse, out_p.to(dtype), lse_p, slots, True)
            merge_sum_op(out.to(dtype), out_p.to(dtype), slots, True)
            merge_lse_op(neutral_rows(out, 0.0, dtype), neutral_rows(lse, NEG_INF), out_p.to(dtype), lse_p, slots,
                         True)
            merge_sum_op(neutral_rows(out, 0.0, dtype), out_p.to(dtype), slots, True)
            merge_lse_op(out, lse, out_p.to(dtype), lse_p, slots, True)  # fp32 host rows: the in-place twins
            merge_sum_op(out, out_p.to(dtype), slots, True)
            acc = [_strided(out, 3)[1], _strided(lse, 3)[1]]
            merge_lse_inplace_op(*acc, out_p.to(dtype), lse_p, slots, True)
            merge_sum_inplace_op(acc[0], out_p.to(dtype), slots, True)
        records += got
    assert sorted(r["name"] for r in records) == ["_merge_lse_kernel"] * 8 + ["_merge_sum_kernel"] * 8
    assert sorted(r["constexprs"].get("O_BCAST", r["constexprs"].get("A_BCAST")) for r in records) == [False] * 12 + [True] * 4
    assert sum(r["constexprs"]["IN_PLACE"] for r in records) == 4
    for rec in records:  # the interpreter's launches use bigger blocks: the GPU's, at 65536 rows per rank
        lse_kernel = rec["name"] == "_merge_lse_kernel"
        blocks = lse_blocks(D, 65536 * h, gpu=True) if lse_kernel else sum_blocks(h * D, 65536, gpu=True)
        rec["constexprs"].update(blocks)
        if rec["constexprs"]["IN_PLACE"]:
            rec["ptx_between"] = ["ld.global", "bar.sync", "st.global"]
    results = compile_sm90(records, stats=True)
    if any(r["error"] and "ptxas" in r["error"] and "not found" in r["error"].lower() for r in results):
        pytest.skip("no ptxas in this Triton install")
    for rec, res in zip(records, results):
        assert res["error"] is None, f"{rec['name']}: {res['error']}"
        assert res["spill_stores"] == res["spill_loads"] == res["stack"] == 0, f"{rec['name']} spills: {res}"
        if rec["constexprs"]["IN_PLACE"]:
            assert res["ptx_between"], f"{rec['name']}: no barrier between its loads and its stores"
