"""Seeded mask generators: packed documents, NSA block selections, DSA token top-k."""
import numpy as np
import pytest
import torch

from gpusolver.masks import (
    CAUSAL,
    FULL,
    BlockSparseMask,
    TokenTopKMask,
    dsa_topk_indices,
    nsa_block_indices,
    packed_document_lengths,
    packed_documents,
)
from gpusolver.masks.generators import doc_length_histogram
from tests._testing import assert_close


def test_histogram_loads():
    lo, hi, prob = doc_length_histogram()
    assert len(lo) == len(hi) == len(prob) == 14
    assert lo[0] == 1 and hi[-1] == 196608
    assert np.all(lo[1:] == hi[:-1] + 1)
    assert abs(prob.sum() - 1.0) < 1e-12 and np.all(prob > 0)


@pytest.mark.parametrize("total", [1, 3, 4, 1000, 8192, 65536, 8192 * 64])
@pytest.mark.parametrize("seed", [0, 7])
def test_packed_lengths(total, seed):
    lengths = packed_document_lengths(total, seed)
    assert sum(lengths) == total
    assert all(isinstance(n, int) and n > 0 for n in lengths)
    assert max(lengths) <= max(1, total // 4)
    assert lengths == packed_document_lengths(total, seed)


def test_packed_lengths_depend_on_seed():
    assert packed_document_lengths(65536, 0) != packed_document_lengths(65536, 1)


def test_packed_lengths_follow_histogram():
    # A pack large enough that the quarter cut never touches the histogram's
    # bulk: the median document lands in the 201-1024 bins (cumulative 18.6 %
    # below 201, 71.4 % at or below 1024).
    lengths = np.asarray(packed_document_lengths(2 ** 24, seed=3))
    assert 201 <= np.median(lengths) <= 1024
    share_short = np.mean(lengths <= 200)
    assert 0.14 <= share_short <= 0.24


def test_packed_documents_mask():
    total = 4096
    lengths = packed_document_lengths(total, 5)
    for causal, code in ((True, CAUSAL), (False, FULL)):
        mask = packed_documents(total, 5, causal=causal, pad_to=len(lengths) + 3)
        assert mask.total_seqlen_q == mask.total_seqlen_k == total
        assert mask.num_slices == len(lengths) + 3
        used = mask.q_ranges[: len(lengths)]
        assert_close("doc lengths", torch.tensor(lengths, dtype=torch.int32), used[:, 1] - used[:, 0])
        assert_close("k = q", mask.q_ranges, mask.k_ranges)
        assert_close("types", torch.full((len(lengths),), code, dtype=torch.int32), mask.attn_type[: len(lengths)])
        mask.validate(cp_size=8, check_overlap=False)


@pytest.mark.parametrize("t_len,heads,bs,top_n", [(1, 1, 4, 2), (37, 2, 4, 3), (130, 3, 16, 4), (64, 1, 8, 16)])
def test_nsa_block_indices(t_len, heads, bs, top_n):
    bi = nsa_block_indices(t_len, heads, block_size=bs, top_n=top_n, seed=1)
    assert bi.shape == (t_len, heads, top_n) and bi.dtype == torch.int32
    assert torch.equal(bi, nsa_block_indices(t_len, heads, block_size=bs, top_n=top_n, seed=1))
    BlockSparseMask(bi, bs, t_len).validate()
    arr = bi.numpy()
    for t in range(t_len):
        local = t // bs
        valid = local + 1
        for h in range(heads):
            row = arr[t, h]
            chosen = row[row >= 0]
            assert len(chosen) == min(top_n, valid), (t, h, row)
            assert np.all(row[len(chosen):] == -1) and np.all(np.diff(chosen) > 0)
            assert chosen[0] == 0 and local in chosen and chosen.max() <= local


def test_nsa_block_indices_random_part_varies():
    a = nsa_block_indices(512, 2, block_size=16, top_n=4, seed=0)
    assert not torch.equal(a, nsa_block_indices(512, 2, block_size=16, top_n=4, seed=1))
    assert not torch.equal(a[:, 0], a[:, 1])  # heads draw independently
    with pytest.raises(ValueError, match="top_n"):
        nsa_block_indices(8, 1, top_n=1)


@pytest.mark.parametrize("t_len,k", [(1, 4), (9, 4), (40, 8), (300, 64)])
def test_dsa_topk_indices(t_len, k):
    ti = dsa_topk_indices(t_len, topk=k, seed=2)
    assert ti.shape == (t_len, k) and ti.dtype == torch.int32
    assert torch.equal(ti, dsa_topk_indices(t_len, topk=k, seed=2))
    mask = TokenTopKMask(ti, t_len).validate()
    arr = ti.numpy()
    for t in range(t_len):
        chosen = arr[t][arr[t] >= 0]
        assert len(chosen) == min(k, t + 1)
        assert np.all(arr[t][len(chosen):] == -1) and np.all(np.diff(chosen) > 0) and chosen.max() <= t
    dense = mask.to_dense()
    assert_close("row counts", torch.clamp(torch.arange(1, t_len + 1), max=k), dense.sum(-1))


def test_dsa_topk_indices_depend_on_seed():
    assert not torch.equal(dsa_topk_indices(200, 16, seed=0), dsa_topk_indices(200, 16, seed=1))
    with pytest.raises(ValueError, match="topk"):
        dsa_topk_indices(10, 0)


def test_generators_device_argument():
    assert nsa_block_indices(16, 1, block_size=4, top_n=2, device="meta").device.type == "meta"
    assert dsa_topk_indices(16, 4, device="meta").device.type == "meta"
    assert packed_documents(64, 0, device="meta").device.type == "meta"
