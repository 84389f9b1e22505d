"""Block areas: torch and Triton against each other and against dense brute force."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from gpusolver.areas import (block_areas, block_areas_torch, block_areas_triton, block_sparse_areas,
                             token_topk_areas)
from gpusolver.areas.kernel import launch_block_areas
from gpusolver.masks.slices import AttnSlices
from gpusolver.problem import BlockAreas
from tests._testing import assert_close

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- dense oracles

def dense_counts(q_ranges, k_ranges, attn_type, S):
    """[G, S, S] int64: how many slices cover each (q, k), rebuilt row by row."""
    G = q_ranges.shape[0]
    dense = torch.zeros(G, S, S, dtype=torch.int64)
    for g in range(G):
        for (qs, qe), (ks, ke), t in zip(q_ranges[g].tolist(), k_ranges[g].tolist(), attn_type[g].tolist()):
            for q in range(qs, qe):
                lo = max(ks, q + ks - qs) if t in (INV_CAUSAL, BI_CAUSAL) else ks
                hi = min(ke, q + ke - qe + 1) if t in (CAUSAL, BI_CAUSAL) else ke
                if hi > lo:
                    dense[g, q, lo:hi] += 1
    return dense


def dense_block_areas(dense, P):
    """BlockAreas from a dense [G, S, S] count matrix, by brute force."""
    G, S, _ = dense.shape
    c = S // P
    area = torch.zeros(G, P, P, dtype=torch.int64)
    q_need = torch.zeros(G, P, P, 2, dtype=torch.int64)
    k_need = torch.zeros(G, P, P, 2, dtype=torch.int64)
    for g in range(G):
        for i in range(P):
            for j in range(P):
                blk = dense[g, i * c:(i + 1) * c, j * c:(j + 1) * c]
                area[g, i, j] = blk.sum()
                rows = [r for r in range(c) if blk[r].any()]
                cols = [k for k in range(c) if blk[:, k].any()]
                if rows:
                    q_need[g, i, j] = torch.tensor([rows[0], rows[-1] + 1])
                    k_need[g, i, j] = torch.tensor([cols[0], cols[-1] + 1])
    return BlockAreas(area, q_need, k_need, c)


def assert_areas_equal(name, ref: BlockAreas, tri: BlockAreas):
    assert ref.chunk == tri.chunk, f"{name}: chunk {ref.chunk} != {tri.chunk}"
    assert_close(f"{name}.area", ref.area, tri.area)
    assert_close(f"{name}.q_need", ref.q_need, tri.q_need)
    assert_close(f"{name}.k_need", ref.k_need, tri.k_need)


# ---------------------------------------------------------------- random slice masks

@st.composite
def slice_masks(draw):
    P = draw(st.integers(1, 5))
    c = draw(st.integers(1, 6))
    S = P * c
    G = draw(st.integers(1, 3))
    grouped = draw(st.booleans())
    R = draw(st.integers(0, 6))
    rows_per_group = []
    for _ in range(G if grouped else 1):
        rows = []
        for _ in range(R):
            qs, qe = sorted(draw(st.tuples(st.integers(0, S), st.integers(0, S))))
            ks, ke = sorted(draw(st.tuples(st.integers(0, S), st.integers(0, S))))
            if draw(st.integers(0, 5)) == 0:  # padding row
                qe, ke = (qs, ke) if draw(st.booleans()) else (qe, ks)
            rows.append((qs, qe, ks, ke, draw(st.integers(0, 3))))
        rows_per_group.append(rows)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    t = torch.tensor(rows_per_group, dtype=dtype).reshape(len(rows_per_group), R, 5)
    q, k, ty = t[..., 0:2].contiguous(), t[..., 2:4].contiguous(), t[..., 4].contiguous()
    if not grouped:
        q, k, ty = q[0], k[0], ty[0]
    return AttnSlices(q, k, ty, S, S), P, G


@SETTINGS
@given(slice_masks())
def test_block_areas_matches_dense(case):
    mask, P, G = case
    q, k, t = mask.per_group(G)
    expect = dense_block_areas(dense_counts(q, k, t, mask.total_seqlen_q), P)
    ref = block_areas(mask, P, G, impl="torch")
    tri = block_areas(mask, P, G, impl="triton")
    assert ref.area.dtype == tri.area.dtype == torch.int64
    assert_areas_equal("torch vs dense", expect, ref)
    assert_areas_equal("triton vs torch", ref, tri)


@pytest.mark.parametrize("P,c,G", [(3, 5, 1), (4, 7, 2)], ids=["P3-c5-G1", "P4-c7-G2"])
def test_block_areas_padding_rows_change_nothing(P, c, G):
    S = P * c
    q = torch.tensor([[0, S // 2], [S // 2, S]], dtype=torch.int32)
    k = torch.tensor([[0, S // 2], [0, S]], dtype=torch.int32)
    t = torch.tensor([CAUSAL, BI_CAUSAL], dtype=torch.int32)
    plain = block_areas_torch(AttnSlices(q, k, t, S, S), P, G)
    pad_q = torch.cat([q, torch.tensor([[3, 3], [0, 0], [1, 4]], dtype=torch.int32)])
    pad_k = torch.cat([k, torch.tensor([[0, S], [0, 0], [2, 2]], dtype=torch.int32)])
    pad_t = torch.cat([t, torch.tensor([FULL, CAUSAL, INV_CAUSAL], dtype=torch.int32)])
    padded = AttnSlices(pad_q, pad_k, pad_t, S, S)
    assert_areas_equal("padded torch", plain, block_areas_torch(padded, P, G))
    assert_areas_equal("padded triton", plain, block_areas_triton(padded, P, G))


def test_block_areas_causal_closed_form():
    """One causal slice over the whole sequence: triangles on the diagonal, full blocks below."""
    P, c = 4, 6
    S = P * c
    mask = AttnSlices(torch.tensor([[0, S]]), torch.tensor([[0, S]]), torch.tensor([CAUSAL]), S, S)
    out = block_areas_torch(mask, P)
    i = torch.arange(P)
    expect = torch.where(i[:, None] > i[None, :], c * c, 0) + torch.diag(torch.full((P,), c * (c + 1) // 2))
    assert_close("causal area", expect[None], out.area)
    full = torch.tensor([0, c])
    assert (out.q_need[0][expect > 0] == full).all() and (out.k_need[0][expect > 0] == full).all()
    assert (out.q_need[0][expect == 0] == 0).all()


@pytest.mark.parametrize("block_r,block_j", [(4, 2), (32, 64)], ids=["BR4-BJ2", "BR32-BJ64"])
def test_block_areas_many_slices_cross_tiles(block_r, block_j):
    """Several slice tiles and key-chunk blocks per program, with ragged last tiles."""
    gen = torch.Generator().manual_seed(1)
    P, c, R = 5, 3, 11
    S = P * c
    ends = torch.randint(0, S + 1, (R, 2, 2), generator=gen).sort(dim=-1).values
    mask = AttnSlices(ends[:, 0].contiguous(), ends[:, 1].contiguous(),
                      torch.randint(0, 4, (R,), generator=gen), S, S)
    ref = block_areas_torch(mask, P)
    q, k, t = mask.per_group(1)
    assert_close("area vs dense", dense_counts(q, k, t, S).view(1, P, c, P, c).sum(dim=(2, 4)), ref.area)
    assert_areas_equal("triton vs torch", ref, launch_block_areas(mask, P, 1, block_r, block_j))


# ---------------------------------------------------------------- sync-free proofs

def _doc_mask(device, S=32, grouped=False):
    q = torch.tensor([[0, 10], [10, 25], [25, S], [0, 0]], dtype=torch.int32, device=device)
    t = torch.tensor([CAUSAL, FULL, BI_CAUSAL, FULL], dtype=torch.int32, device=device)
    if grouped:
        q, t = q.expand(2, -1, -1), t.expand(2, -1)
    return AttnSlices(q, q.clone(), t.clone(), S, S)


@pytest.mark.parametrize("grouped", [False, True], ids=["shared", "grouped-G2"])
def test_block_areas_torch_on_meta(grouped):
    out = block_areas_torch(_doc_mask("meta", grouped=grouped), 4, 2)
    assert out.area.device.type == "meta" and out.area.shape == (2, 4, 4)
    assert out.q_need.shape == out.k_need.shape == (2, 4, 4, 2) and out.chunk == 8
    assert block_areas(_doc_mask("meta"), 4, 2).area.device.type == "meta"  # auto picks torch


def test_block_areas_torch_under_fake_tensor_mode():
    with FakeTensorMode():
        out = block_areas_torch(_doc_mask("cpu"), 4, 2)
        assert out.area.shape == (2, 4, 4) and out.q_need.shape == (2, 4, 4, 2)


def test_sparse_on_meta_and_fake():
    idx = torch.zeros(16, 4, 3, dtype=torch.int32, device="meta")
    out = block_sparse_areas(idx, 3, 4, 2)
    assert out.area.device.type == "meta" and out.area.shape == (2, 4, 4) and out.k_need.shape == (2, 4, 4, 2)
    out = token_topk_areas(torch.zeros(16, 5, dtype=torch.int64, device="meta"), 4, 3)
    assert out.area.device.type == "meta" and out.area.shape == (3, 4, 4)
    with FakeTensorMode():
        assert block_sparse_areas(torch.zeros(16, 4, 3, dtype=torch.int32), 5, 2).area.shape == (1, 2, 2)
        assert token_topk_areas(torch.zeros(16, 5, dtype=torch.int32), 2, 2).q_need.shape == (2, 2, 2, 2)


# ---------------------------------------------------------------- sparse forms

@SETTINGS
@given(st.data())
def test_block_sparse_matches_dense(data):
    P = data.draw(st.integers(1, 4))
    c = data.draw(st.integers(1, 6))
    T = P * c
    Hkv = data.draw(st.sampled_from([1, 2, 4]))
    G = data.draw(st.sampled_from([g for g in (1, 2, 4) if Hkv % g == 0]))
    l = data.draw(st.integers(1, 9))
    n = data.draw(st.integers(1, 3))
    nblocks = -(-T // l)
    rows = []
    for _ in range(T * Hkv):
        picks = data.draw(st.lists(st.integers(0, nblocks), min_size=0, max_size=n, unique=True))
        rows.append(picks + [-1] * (n - len(picks)))
    idx = torch.tensor(rows, dtype=torch.int32).view(T, Hkv, n)
    dense = torch.zeros(G, T, T, dtype=torch.int64)
    for t in range(T):
        for h in range(Hkv):
            for b in idx[t, h].tolist():
                if b >= 0:
                    dense[h // (Hkv // G), t, b * l:min((b + 1) * l, t + 1, T)] += 1
    expect = dense_block_areas(dense, P)
    assert_areas_equal("block sparse vs dense", expect, block_sparse_areas(idx, l, P, G))


@SETTINGS
@given(st.data())
def test_token_topk_matches_dense(data):
    P = data.draw(st.integers(1, 4))
    c = data.draw(st.integers(1, 6))
    T = P * c
    G = data.draw(st.integers(1, 3))
    k = data.draw(st.integers(1, 5))
    rows = []
    for _ in range(T):
        picks = data.draw(st.lists(st.integers(0, T - 1), min_size=0, max_size=k, unique=True))
        rows.append(picks + [-1] * (k - len(picks)))
    idx = torch.tensor(rows, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    dense = torch.zeros(1, T, T, dtype=torch.int64)
    for t in range(T):
        for key in idx[t].tolist():
            if 0 <= key <= t:
                dense[0, t, key] += 1
    expect = dense_block_areas(dense.expand(G, T, T), P)
    assert_areas_equal("token top-k vs dense", expect, token_topk_areas(idx, P, G))


def test_block_sparse_sums_heads_of_a_group():
    """Two KV heads with the same selection: G = 1 doubles the per-head area."""
    idx = torch.tensor([[[0], [0]], [[0], [0]], [[1], [1]], [[1], [-1]]], dtype=torch.int32)  # [T=4, Hkv=2, 1]
    per_head = block_sparse_areas(idx, 2, 2, 2)
    summed = block_sparse_areas(idx, 2, 2, 1)
    assert_close("G=1 sums heads", per_head.area.sum(dim=0, keepdim=True), summed.area)
    assert per_head.area[0].tolist() == [[3, 0], [0, 3]] and per_head.area[1].tolist() == [[3, 0], [0, 1]]


# ---------------------------------------------------------------- bad inputs

def test_block_areas_bad_inputs():
    q = torch.tensor([[0, 4]], dtype=torch.int32)
    t = torch.tensor([FULL], dtype=torch.int32)
    with pytest.raises(ValueError, match="total_seqlen_q=10 is not divisible by cp_size=4"):
        block_areas(AttnSlices(q, q, t, 10, 10), 4)
    with pytest.raises(ValueError, match="total_seqlen_q=8 must equal total_seqlen_k=12"):
        block_areas(AttnSlices(q, q, t, 8, 12), 4)
    grouped = AttnSlices(q.expand(3, 1, 2), q.expand(3, 1, 2), t.expand(3, 1), 8, 8)
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match="head-group dim of 3 but head_groups=2"):
            block_areas(grouped, 4, 2, impl=impl)
    with pytest.raises(ValueError, match="cp_size must be a positive int, got 0"):
        block_areas(AttnSlices(q, q, t, 8, 8), 0)
    with pytest.raises(ValueError, match="impl must be one of"):
        block_areas(AttnSlices(q, q, t, 8, 8), 4, impl="cuda")


def test_sparse_bad_inputs():
    with pytest.raises(ValueError, match="T=10 query tokens, which must be a positive multiple of cp_size=4"):
        token_topk_areas(torch.zeros(10, 3, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"topk_indices must be \[T, k\]"):
        token_topk_areas(torch.zeros(8, 3, 1, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="topk_indices must be int32 or int64, got torch.float32"):
        token_topk_areas(torch.zeros(8, 3), 4)
    with pytest.raises(ValueError, match="Hkv=3 KV heads, not divisible by head_groups=2"):
        block_sparse_areas(torch.zeros(8, 3, 2, dtype=torch.int32), 4, 2, 2)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        block_sparse_areas(torch.zeros(8, 2, 2, dtype=torch.int32), 0, 2)
