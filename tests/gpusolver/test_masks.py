"""Slice masks: constructors against brute-force dense masks, validation, dense rebuilds, sparse forms."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusolver.masks import (
    BI_CAUSAL,
    CAUSAL,
    FULL,
    INV_CAUSAL,
    AttnSlices,
    BlockSparseMask,
    TokenTopKMask,
    causal_mask,
    check_heads,
    full_mask,
    prefix_lm_mask,
    slices_to_dense,
    sliding_window_mask,
    validate_slices,
    varlen_causal_mask,
    varlen_full_mask,
    varlen_prefix_lm_mask,
)
from tests._testing import assert_close


def _slices(rows, s_q, s_k=None, dtype=torch.int32, device="cpu"):
    """AttnSlices from host rows (qs, qe, ks, ke, type) or, grouped, a list of such lists."""
    t = torch.tensor(rows, dtype=dtype, device=device)
    return AttnSlices(t[..., 0:2], t[..., 2:4], t[..., 4], s_q, s_q if s_k is None else s_k)


def _entry_valid(row, q, k):
    """The module docstring's per-entry definition, one (q, k) at a time."""
    qs, qe, ks, ke, t = row
    if qs == qe or ks == ke or not (qs <= q < qe and ks <= k < ke):
        return False
    causal_ok = k <= q + (ke - qe)
    inv_ok = k >= q + (ks - qs)
    return {FULL: True, CAUSAL: causal_ok, INV_CAUSAL: inv_ok, BI_CAUSAL: causal_ok and inv_ok}[t]


def _brute_dense(rows, s_q, s_k):
    return torch.tensor([[any(_entry_valid(r, q, k) for r in rows) for k in range(s_k)] for q in range(s_q)],
                        dtype=torch.bool).reshape(s_q, s_k)


def _grid(s):
    q = torch.arange(s)[:, None]
    k = torch.arange(s)[None, :]
    return q, k


def _doc_ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


# ---------------------------------------------------------------- dense rebuild


@pytest.mark.parametrize("attn_type", [FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL])
@pytest.mark.parametrize("q_range,k_range", [((2, 7), (1, 10)), ((0, 9), (3, 6)), ((4, 5), (0, 11)), ((1, 6), (2, 7))])
def test_slices_to_dense_one_slice(attn_type, q_range, k_range):
    row = (*q_range, *k_range, attn_type)
    ref = _brute_dense([row], 11, 12)
    tri = slices_to_dense(_slices([row], 11, 12))
    assert_close("dense", ref, tri)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 12), st.integers(0, 12),
                          st.integers(0, 3)), min_size=1, max_size=5))
def test_slices_to_dense_random(raw):
    rows = [(min(a, b), max(a, b), min(c, d), max(c, d), t) for a, b, c, d, t in raw]
    assert_close("dense", _brute_dense(rows, 9, 12), slices_to_dense(_slices(rows, 9, 12)))


def test_slices_to_dense_padding_and_groups():
    rows = [[(0, 4, 0, 4, CAUSAL), (0, 0, 0, 0, FULL), (3, 3, 0, 4, FULL)],
            [(0, 4, 0, 4, FULL), (2, 4, 5, 5, FULL), (0, 0, 0, 0, CAUSAL)]]
    mask = _slices(rows, 4)
    assert mask.grouped
    assert_close("group 0", torch.ones(4, 4, dtype=torch.bool).tril(), mask.to_dense(0))
    assert_close("group 1", torch.ones(4, 4, dtype=torch.bool), mask.to_dense(1))
    with pytest.raises(ValueError, match="head_group=2"):
        mask.to_dense(2)


# ---------------------------------------------------------------- constructors


@pytest.mark.parametrize("s", [1, 7, 64])
def test_full_and_causal(s):
    q, k = _grid(s)
    assert_close("full", torch.ones(s, s, dtype=torch.bool), full_mask(s).to_dense())
    assert_close("causal", k <= q, causal_mask(s).to_dense())


@pytest.mark.parametrize("s,window,band_rows", [(1, 1, None), (10, 1, None), (10, 3, None), (10, 3, 3),
                                                (33, 8, 5), (33, 32, None), (33, 33, None), (20, 50, 4),
                                                (63, 17, 16)])
def test_sliding_window(s, window, band_rows):
    q, k = _grid(s)
    ref = (k <= q) & (k >= q - window + 1)
    mask = sliding_window_mask(s, window, band_rows=band_rows)
    assert_close("window", ref, mask.to_dense())
    mask.validate()
    assert mask.q_ranges.dtype == torch.int32 and mask.attn_type.dtype == torch.int32


@pytest.mark.parametrize("lengths", [[5], [1, 1, 1], [3, 8, 1, 13], [16, 16]])
def test_varlen(lengths):
    s = sum(lengths)
    q, k = _grid(s)
    doc = _doc_ids(lengths)
    same = doc[:, None] == doc[None, :]
    full, causal = varlen_full_mask(lengths), varlen_causal_mask(torch.tensor(lengths))
    assert_close("varlen full", same, full.to_dense())
    assert_close("varlen causal", same & (k <= q), causal.to_dense())
    assert full.num_slices == causal.num_slices == len(lengths)
    full.validate(), causal.validate()


@pytest.mark.parametrize("s,prefix", [(9, 0), (9, 4), (9, 9), (1, 1), (16, 1)])
def test_prefix_lm(s, prefix):
    q, k = _grid(s)
    assert_close("prefix lm", (k < prefix) | (k <= q), prefix_lm_mask(s, prefix).to_dense())
    prefix_lm_mask(s, prefix).validate()


def test_varlen_prefix_lm():
    lengths, prefixes = [4, 6, 3], [2, 0, 3]
    s = sum(lengths)
    q, k = _grid(s)
    doc = _doc_ids(lengths)
    start = torch.tensor([0, 4, 10])[doc]
    prefix_end = start + torch.tensor(prefixes)[doc]
    ref = (doc[:, None] == doc[None, :]) & ((k < prefix_end[:, None]) | (k <= q))
    mask = varlen_prefix_lm_mask(lengths, prefixes)
    assert_close("varlen prefix lm", ref, mask.to_dense())
    mask.validate()


def test_pad_to_keeps_the_mask():
    plain = sliding_window_mask(24, 5, band_rows=7)
    padded = sliding_window_mask(24, 5, band_rows=7, pad_to=10)
    assert padded.num_slices == 10
    assert_close("dense", plain.to_dense(), padded.to_dense())
    pad_rows = torch.cat([padded.q_ranges[plain.num_slices:], padded.k_ranges[plain.num_slices:]], dim=-1)
    assert_close("padding rows", torch.zeros(10 - plain.num_slices, 4, dtype=torch.int32), pad_rows)
    padded.validate()
    with pytest.raises(ValueError, match="pad_to=2"):
        varlen_causal_mask([1, 2, 3], pad_to=2)


def test_constructor_device_argument():
    mask = varlen_causal_mask([3, 5], device="meta", pad_to=4)
    assert mask.device.type == "meta" and mask.q_ranges.shape == (4, 2)


@pytest.mark.parametrize("call,match", [
    (lambda: full_mask(0), "seqlen"),
    (lambda: causal_mask(-3), "seqlen"),
    (lambda: sliding_window_mask(8, 0), "window"),
    (lambda: sliding_window_mask(8, 2, band_rows=0), "band_rows"),
    (lambda: varlen_causal_mask([3, 0, 2]), r"doc_lengths\[1\] = 0"),
    (lambda: varlen_full_mask([]), "doc_lengths"),
    (lambda: varlen_full_mask([2, 2.5]), r"doc_lengths\[1\]"),
    (lambda: prefix_lm_mask(8, 9), "prefix_len"),
    (lambda: varlen_prefix_lm_mask([3, 4], [1, 5]), r"prefix_lengths\[1\] = 5"),
    (lambda: varlen_prefix_lm_mask([3, 4], [1]), "prefix_lengths has 1"),
])
def test_constructor_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("rows,s_k,match", [
    ([(0, 4, 0, 4, FULL), (2, 9, 0, 4, FULL)], 8, r"q_ranges row 1: \[2, 9\) is outside \[0, total_seqlen_q=8\)"),
    ([(0, 4, 0, 4, FULL), (5, 3, 0, 4, FULL)], 8, r"q_ranges row 1: start 5 > end 3"),
    ([(0, 4, 0, 4, FULL), (4, 8, -1, 4, FULL)], 8, r"k_ranges row 1: \[-1, 4\)"),
    ([(0, 4, 0, 4, FULL), (4, 8, 0, 7, FULL)], 6, r"k_ranges row 1: \[0, 7\) is outside \[0, total_seqlen_k=6\)"),
    ([(0, 4, 0, 4, FULL), (4, 8, 0, 4, CAUSAL), (0, 1, 5, 6, 4)], 8, r"attn_type row 2: code 4"),
    ([(0, 4, 0, 4, CAUSAL), (4, 8, 0, 8, CAUSAL), (2, 3, 1, 3, FULL)], 8,
     r"row 2 \(FULL q \[2, 3\) k \[1, 3\)\) covers entry \(q=2, k=1\) already covered by row 0"),
])
def test_validate_messages(rows, s_k, match):
    with pytest.raises(ValueError, match=match):
        validate_slices(_slices(rows, 8, s_k))


def test_validate_grouped_names_group():
    rows = [[(0, 4, 0, 4, FULL), (0, 0, 0, 0, FULL)], [(0, 4, 0, 4, FULL), (1, 2, 3, 4, BI_CAUSAL)]]
    with pytest.raises(ValueError, match=r"\[group 1\] row 1 \(BI_CAUSAL"):
        _slices(rows, 4).validate()


def test_validate_overlap_only_on_covered_entries():
    # k <= q and k >= q + 1: the two halves tile the rectangle without touching.
    touching = [(0, 6, 0, 6, CAUSAL), (0, 6, 1, 7, INV_CAUSAL)]
    validate_slices(_slices(touching, 6, 7))
    clash = [(0, 6, 0, 6, CAUSAL), (0, 6, 0, 6, INV_CAUSAL)]
    with pytest.raises(ValueError, match=r"row 1 .* \(q=0, k=0\) already covered by row 0"):
        validate_slices(_slices(clash, 6))
    validate_slices(_slices(clash, 6), check_overlap=False)


def test_validate_cp_size():
    mask = causal_mask(12)
    mask.validate(cp_size=4)
    with pytest.raises(ValueError, match="total_seqlen_q=12 must be divisible by cp_size=5"):
        mask.validate(cp_size=5)
    with pytest.raises(ValueError, match="cp_size"):
        mask.validate(cp_size=0)


def test_check_heads():
    assert check_heads(64, 8) == 8
    with pytest.raises(ValueError, match="num_heads_q=12 must be divisible by num_heads_kv=5"):
        check_heads(12, 5)
    with pytest.raises(ValueError, match="num_heads_kv"):
        check_heads(8, 0)


def test_meta_tensors_accepted():
    rows = [(0, 4, 0, 4, CAUSAL), (0, 0, 0, 0, FULL)]
    mask = _slices(rows, 4, device="meta")
    assert mask.device.type == "meta" and mask.num_slices == 2
    grouped = _slices([rows, rows], 4, dtype=torch.int64, device="meta")
    q, k, t = grouped.per_group(2)
    assert q.shape == (2, 2, 2) and t.shape == (2, 2) and q.device.type == "meta"
    with pytest.raises(ValueError, match="meta"):
        mask.validate()
    BlockSparseMask(torch.empty(8, 2, 3, dtype=torch.int32, device="meta"), 4, 8)
    TokenTopKMask(torch.empty(8, 3, dtype=torch.int64, device="meta"), 8)


# ---------------------------------------------------------------- sparse forms


def _block_dense_brute(bi, head, block_size, s_k):
    dense = torch.zeros(bi.shape[0], s_k, dtype=torch.bool)
    for t in range(bi.shape[0]):
        for b in bi[t, head].tolist():
            for key in range(max(b, 0) * block_size, min((b + 1) * block_size, s_k)):
                dense[t, key] |= b >= 0 and key <= t
    return dense


@pytest.mark.parametrize("head", [0, 1])
def test_block_sparse_to_dense(head):
    gen = np.random.default_rng(3)
    t_len, bs, s_k = 19, 4, 19
    nb = -(-s_k // bs)
    bi = np.stack([np.stack([gen.permutation(nb)[:3] for _ in range(2)]) for _ in range(t_len)])
    bi[gen.random(bi.shape) < 0.3] = -1
    bi = torch.from_numpy(bi.astype(np.int32))
    mask = BlockSparseMask(bi, bs, s_k).validate()
    assert_close("block dense", _block_dense_brute(bi, head, bs, s_k), mask.to_dense(head))


def test_block_sparse_checks():
    with pytest.raises(ValueError, match="int32"):
        BlockSparseMask(torch.zeros(4, 1, 2, dtype=torch.int64), 2, 4)
    with pytest.raises(ValueError, match=r"\[T, Hkv, n\]"):
        BlockSparseMask(torch.zeros(4, 2, dtype=torch.int32), 2, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockSparseMask(torch.zeros(4, 1, 2, dtype=torch.int32), 0, 4)
    bi = torch.tensor([[[0, -1]], [[0, 1]], [[1, 2]], [[-1, -1]]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_indices\[2, 0, 1\] = 2 is outside \[-1, 2\)"):
        BlockSparseMask(bi, 2, 4).validate()
    bi = torch.tensor([[[0, -1]], [[0, 1]], [[1, 1]], [[-1, -1]]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_indices\[2, 0, 1\] = 1 selects block 1 twice"):
        BlockSparseMask(bi, 2, 4).validate()
    with pytest.raises(ValueError, match="head"):
        BlockSparseMask(bi, 2, 4).to_dense(1)


def test_token_topk_to_dense():
    ti = torch.tensor([[0, -1, 3], [1, 0, 5], [2, -1, -1], [3, 1, 2], [-1, -1, -1]], dtype=torch.int64)
    ref = torch.zeros(5, 6, dtype=torch.bool)
    for t, keys in enumerate(ti.tolist()):
        for key in keys:
            if 0 <= key <= t:
                ref[t, key] = True
    mask = TokenTopKMask(ti, 6).validate()
    assert_close("topk dense", ref, mask.to_dense())
    assert_close("topk dense head 3", ref, TokenTopKMask(ti.int(), 6).to_dense(3))


def test_token_topk_checks():
    with pytest.raises(ValueError, match="int32 or int64"):
        TokenTopKMask(torch.zeros(3, 2, dtype=torch.float32), 4)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        TokenTopKMask(torch.zeros(3, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"topk_indices\[1, 0\] = 4 is outside \[-1, total_seqlen_k=4\)"):
        TokenTopKMask(torch.tensor([[0, -1], [4, 0]]), 4).validate()
    with pytest.raises(ValueError, match=r"topk_indices\[2, 2\] = 1 selects key 1 twice in row 2"):
        TokenTopKMask(torch.tensor([[0, -1, -1], [0, 1, -1], [1, 0, 1]]), 4).validate()
    # future keys are dropped, so repeats of them are fine
    TokenTopKMask(torch.tensor([[0, 3, 3], [0, 1, -1], [1, 0, 2]]), 4).validate()
