"""Per-block work lists: exact slice sets per program, capacity-independent kernel cost, tensor bounds."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from attn_kernels.flex_attn import kernel, ref, worklist, worklist_kernel
from attn_kernels.reference import dense_attn, slices_to_dense
from tests._testing import assert_close
from tests.attn_kernels._slices import random_slices, ranges


def _one_slice_dense(qr, kr, t, i, Tq, Tk):
    """Dense mask of slice i alone, positions outside [0, Tq) x [0, Tk) dropped.

    Drawn on a canvas shifted by 64 on both axes (which keeps the diagonals), so negative starts fit.
    """
    big = slices_to_dense(qr[i:i + 1] + 64, kr[i:i + 1] + 64, t[i:i + 1], 2 * Tq + 128, 2 * Tk + 128)
    return big[64:64 + Tq, 64:64 + Tk]


def _walk(wl: worklist.WorkList, blk: int) -> list[int]:
    """The slices the kernels visit for program block blk: one tree node per level."""
    got, node0, n_lev = [], 0, wl.num_blocks
    for lev in range(wl.levels):
        node = node0 + (blk >> lev)
        got += wl.idx[int(wl.ptr[node]):int(wl.ptr[node + 1])].tolist()
        node0, n_lev = node0 + n_lev, (n_lev + 1) // 2
    return got


def _with_bad_rows(qr, kr, t, Tq, Tk):
    """Append slices that run past the tensors (and one that starts below 0)."""
    extra = ranges([[Tq - 5, Tq + 9], [3, Tq + 30], [-4, 6]], [[Tk - 3, Tk + 20], [-6, 5], [0, Tk + 2]], [1, 2, 0])
    return tuple(torch.cat([a, b]) for a, b in zip((qr, kr, t), extra))


@pytest.mark.parametrize("seed,Tq,Tk", [(0, 70, 90), (1, 33, 130), (2, 129, 17), (3, 200, 200)],
                         ids=["T70x90", "T33x130", "T129x17", "T200x200"])
def test_rect_and_counts_are_exact(seed, Tq, Tk):
    qr, kr, t = _with_bad_rows(*random_slices(Tq, Tk, seed), Tq, Tk)
    rect = worklist.slice_rect(qr, kr, t, Tq, Tk)
    per_row, per_col = torch.zeros(Tq, dtype=torch.int64), torch.zeros(Tk, dtype=torch.int64)
    for i in range(qr.shape[0]):
        d = _one_slice_dense(qr, kr, t, i, Tq, Tk)
        qa, qb, ka, kb = rect[i, :4].tolist()
        rows, cols = d.any(1).nonzero().flatten(), d.any(0).nonzero().flatten()
        if rows.numel() == 0:
            assert qa == qb and ka == kb, f"slice {i} is empty but its rectangle is {rect[i].tolist()}"
        else:  # the tightest rectangle, and every row and column in it has an entry
            assert [qa, qb, ka, kb] == [int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1], i
        per_row += d.sum(1)
        per_col += d.sum(0)
    assert_close("row counts", per_row, worklist._counts(rect, 0, Tq))
    assert_close("column counts", per_col, worklist._counts(rect, 1, Tk))


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("seed,Tq,Tk", [(4, 70, 90), (5, 257, 100)], ids=["T70x90", "T257x100"])
def test_each_program_gets_exactly_its_slices(seed, Tq, Tk, block):
    qr, kr, t = _with_bad_rows(*random_slices(Tq, Tk, seed, num_pad=6), Tq, Tk)
    rect = worklist.slice_rect(qr, kr, t, Tq, Tk)
    for axis, n in ((0, Tq), (1, Tk)):
        wl = worklist.build(rect, axis, n, block)
        assert wl.num_blocks == -(-n // block)
        lo, hi = rect[:, 2 * axis].long(), rect[:, 2 * axis + 1].long()
        for blk in range(wl.num_blocks):
            got = _walk(wl, blk)
            want = ((hi > lo) & (lo < (blk + 1) * block) & (hi > blk * block)).nonzero().flatten().tolist()
            assert sorted(got) == want and len(set(got)) == len(got), f"axis {axis} block {blk}: {got} != {want}"
        assert sorted(wl.order.tolist()) == list(range(wl.num_blocks))


@pytest.mark.parametrize("seed,Tq,Tk,bq,bk", [(6, 70, 90, 16, 32), (7, 257, 100, 64, 16), (8, 40, 300, 32, 64)],
                         ids=["T70x90-b16x32", "T257x100-b64x16", "T40x300-b32x64"])
def test_triton_build_equals_torch_build(seed, Tq, Tk, bq, bk):
    qr, kr, t = _with_bad_rows(*random_slices(Tq, Tk, seed, num_pad=5), Tq, Tk)
    rect, wl_q, wl_k = worklist_kernel.build(qr, kr, t, Tq, Tk, bq, bk)
    want = worklist.slice_rect(qr, kr, t, Tq, Tk)
    assert_close("rect", want, rect)
    for name, got, axis, n, block in (("q", wl_q, 0, Tq, bq), ("k", wl_k, 1, Tk, bk)):
        ref_wl = worklist.build(want, axis, n, block)
        assert (got.num_blocks, got.levels) == (ref_wl.num_blocks, ref_wl.levels)
        for field in ("ptr", "idx", "order"):
            a, b = getattr(ref_wl, field), getattr(got, field)
            if field == "idx":  # only the items before ptr[M] are lists; the tail is padding
                a, b = a[:int(ref_wl.ptr[-1])], b[:int(ref_wl.ptr[-1])]
            assert_close(f"{name} {field}", a, b)
    _, only_q, none_k = worklist_kernel.build(qr, kr, t, Tq, Tk, bq, None)
    assert none_k is None and torch.equal(only_q.ptr, wl_q.ptr)


def test_heaviest_block_first():
    Tq = Tk = 192
    rect = worklist.slice_rect(*ranges([[0, Tq]], [[0, Tk]], [1]), Tq, Tk)
    # causal: the last query blocks see the most keys, the first key blocks the most queries
    assert worklist.build(rect, 0, Tq, 32).order.tolist() == [5, 4, 3, 2, 1, 0]
    assert worklist.build(rect, 1, Tk, 32).order.tolist() == [0, 1, 2, 3, 4, 5]
    # a short last block holds fewer entries than a full one
    rect = worklist.slice_rect(*ranges([[0, 200]], [[0, 200]], [0]), 200, 200)
    assert worklist.build(rect, 0, 200, 32).order.tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_build_runs_on_meta_and_fake_tensors():
    for ctx, dev in ((torch.no_grad(), "meta"), (FakeTensorMode(), "cpu")):
        with ctx:
            qr, kr, t = (x.to(dev) for x in ranges([[0, 64], [0, 0]], [[0, 48], [0, 0]], [1, 0]))
            rect = worklist.slice_rect(qr, kr, t, 64, 48)
            wl = worklist.build(rect, 1, 48, 16)
            assert rect.shape == (2, 8) and wl.ptr.shape == (3 + 2 + 1 + 1,) and wl.idx.shape == (2 * 3 * 2,)


def _pad_to(qr, kr, t, R):
    """Pad a slice list to R rows: dummy rows (empty q range) spread through it, real rows kept in order."""
    n, g = R - qr.shape[0], torch.Generator().manual_seed(R)
    out = [torch.randint(0, 60, (R, 1), generator=g, dtype=torch.int32).repeat(1, 2),
           torch.randint(0, 60, (R, 2), generator=g, dtype=torch.int32).sort(1).values,
           torch.randint(0, 4, (R,), generator=g, dtype=torch.int32)]
    at = torch.randperm(R, generator=g)[:qr.shape[0]].sort().values
    for x, real in zip(out, (qr, kr, t)):
        x[at] = real
    assert n >= 0
    return tuple(out)


def test_stage_cost_does_not_depend_on_capacity():
    """The same 10 real slices at capacity 16 and 4,096: every kernel loop costs the same, no dummy is visited."""
    Tq, Tk, HQ, HKV, D = 96, 80, 2, 1, 32
    # five causal documents, a sink every later row sees, and four pieces of other types
    qr, kr, t = ranges([[0, 10], [10, 30], [30, 45], [45, 70], [70, 96], [10, 96], [20, 60], [60, 64], [0, 5], [85, 96]],
                       [[0, 10], [10, 30], [30, 45], [45, 70], [70, 80], [0, 8], [8, 10], [70, 76], [75, 80], [60, 70]],
                       [1, 1, 1, 1, 1, 0, 2, 3, 0, 2])
    dense = [slices_to_dense(qr[i:i + 1], kr[i:i + 1], t[i:i + 1], Tq, Tk) for i in range(10)]
    assert all(d.any() for d in dense) and int(sum(d.long() for d in dense).max()) == 1  # real, disjoint
    q = torch.randn(Tq, HQ, D)
    k, v = torch.randn(Tk, HKV, D), torch.randn(Tk, HKV, D)
    dout, dlse = torch.randn_like(q), torch.randn(Tq, HQ)
    blocks = dict(block_q=32, block_k=32)
    results = {}
    for R in (16, 4096):
        args = _pad_to(qr, kr, t, R)
        fwd, bwd = torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
        out, lse = kernel.flex_attn_fwd(q, k, v, *args, 0.3, 0.0, counts=fwd, **blocks)
        grads = kernel.flex_attn_bwd(dout, q, k, v, out, lse, dlse, *args, 0.3, 0.0, counts=bwd, **blocks)
        if R == 16:  # the twin's count (its dense math grows with R, so once)
            twin_fwd, twin_bwd = torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
            ref.flex_attn_fwd_ref(q, k, v, *args, 0.3, 0.0, counts=twin_fwd, **blocks)
            ref.flex_attn_bwd_ref(dout, q, k, v, out, lse, dlse, *args, 0.3, 0.0, counts=twin_bwd, **blocks)
            assert_close("forward counts", twin_fwd, fwd)
            assert_close("backward counts", twin_bwd, bwd)
        results[R] = (fwd, bwd, (out, lse) + grads)
    assert_close("forward cost", results[16][0], results[4096][0])
    assert_close("backward cost", results[16][1], results[4096][1])
    # visits are (real slice, block) pairs: per head, at most 10 slices x 3 query blocks
    assert 10 * HQ <= int(results[16][0][0]) <= 10 * 3 * HQ
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[16][2], results[4096][2]):
        assert torch.equal(a, b), f"{name} changed with the capacity"


@pytest.mark.parametrize("attn_type", [0, 1, 2, 3], ids=["full", "causal", "inv_causal", "bi_causal"])
def test_ranges_past_the_tensors_drop_outside_entries(attn_type):
    """Defined behaviour: entries outside [0, Tq) x [0, Tk) are dropped; the diagonals stay where the ranges put them."""
    Tq, Tk, HQ, HKV, D = 40, 48, 2, 1, 32
    q = torch.randn(Tq, HQ, D)
    k, v = torch.randn(Tk, HKV, D), torch.randn(Tk, HKV, D)
    qr, kr, t = ranges([[20, 70], [-8, 20]], [[30, 90], [-5, 30]], [attn_type, attn_type])
    dense = sum(_one_slice_dense(qr, kr, t, i, Tq, Tk).long() for i in range(2)) > 0
    assert dense.any() and not dense.all()
    o_ref, l_ref = dense_attn(q.double(), k.double(), v.double(), dense)
    o_tri, l_tri = kernel.flex_attn_fwd(q, k, v, qr, kr, t, D ** -0.5, 0.0, block_q=32, block_k=32)
    o_twin, l_twin = ref.flex_attn_fwd_ref(q, k, v, qr, kr, t, D ** -0.5, 0.0)
    assert_close("out", o_ref.float(), o_tri)
    assert_close("lse", l_ref, l_tri)
    assert_close("out twin", o_twin, o_tri)
    dout, dlse = torch.randn_like(q), torch.randn(Tq, HQ)
    g_tri = kernel.flex_attn_bwd(dout, q, k, v, o_tri, l_tri, dlse, qr, kr, t, D ** -0.5, 0.0, block_q=32, block_k=32)
    g_twin = ref.flex_attn_bwd_ref(dout, q, k, v, o_tri, l_tri, dlse, qr, kr, t, D ** -0.5, 0.0)
    for name, a, b in zip(("dq", "dk", "dv"), g_twin, g_tri):
        assert_close(name, a, b, atol=1e-4)
    if attn_type == 0:  # FULL: the same as the ranges clipped to the tensors, bit for bit
        clipped = ranges([[20, 40], [0, 20]], [[30, 48], [0, 30]], [0, 0])
        o_c, l_c = kernel.flex_attn_fwd(q, k, v, *clipped, D ** -0.5, 0.0, block_q=32, block_k=32)
        assert torch.equal(o_c, o_tri) and torch.equal(l_c, l_tri)
