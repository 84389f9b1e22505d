"""Sparse masks in: area rows of shards against dense counts, the gathered rows against the whole mask,
NSA layer masks, FlexAttention BlockMask conversion, device-side and host-side value checks."""
import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from gpusolver.areas.sparse import areas_from_rows, sparse_area_rows, sparse_areas
from gpusolver.masks import dsa_topk_indices, nsa_block_indices
from gpusolver.masks.sparse import BlockSparseMask, NSALayerMask, TokenTopKMask
from tests._testing import assert_close

torch.set_num_threads(1)


def _dense_rows(mask, Hkv: int, G: int) -> torch.Tensor:
    """[G, T, S] int64 counts of the mask's rows by brute force (per-head dense masks summed per group)."""
    if isinstance(mask, TokenTopKMask):
        return mask.to_dense().long().expand(G, -1, -1)
    sel = mask if isinstance(mask, BlockSparseMask) else mask.selection
    T = sel.block_indices.shape[0]
    out = torch.zeros(G, T, sel.total_seqlen_k, dtype=torch.int64)
    for h in range(Hkv):
        out[h // (Hkv // G)] += sel.to_dense(h).long()
        if isinstance(mask, NSALayerMask):
            out[h // (Hkv // G)] += mask.window_dense().long()
    return out


def _expect_rows(dense: torch.Tensor, first_unit: int, chunk: int):
    """area / needs of dense [G, T, S] rows by brute force, in AreaRows layout."""
    G, T, S = dense.shape
    m, U = T // chunk, S // chunk
    area = torch.zeros(G, m, U, dtype=torch.int64)
    q_need = torch.zeros(G, m, U, 2, dtype=torch.int64)
    k_need = torch.zeros(G, m, U, 2, dtype=torch.int64)
    for g in range(G):
        for i in range(m):
            for j in range(U):
                blk = dense[g, i * chunk:(i + 1) * chunk, j * chunk:(j + 1) * chunk]
                area[g, i, j] = blk.sum()
                rows = blk.any(1).nonzero().flatten()
                cols = blk.any(0).nonzero().flatten()
                if rows.numel():
                    q_need[g, i, j] = torch.tensor([rows.min(), rows.max() + 1])
                    k_need[g, i, j] = torch.tensor([cols.min(), cols.max() + 1])
    return area, q_need, k_need


MASKS = [  # (kind, S, Hkv, G, units)
    ("dsa", 48, 2, 2, 4),
    ("nsa", 40, 4, 2, 5),
    ("nsa", 36, 2, 1, 6),
    ("nsa-layer", 48, 2, 2, 4),
    ("nsa-layer", 30, 1, 1, 3),
]


def _mask(kind, S, Hkv, seed=0):
    if kind == "dsa":
        return TokenTopKMask(dsa_topk_indices(S, 7, seed=seed), S)
    sel = BlockSparseMask(nsa_block_indices(S, Hkv, 5, 3, seed=seed), 5, S)
    return sel if kind == "nsa" else NSALayerMask(sel, 7)


@pytest.mark.parametrize("kind,S,Hkv,G,U", MASKS, ids=[f"{k}-S{S}-Hkv{h}-G{g}-U{u}" for k, S, h, g, u in MASKS])
def test_shard_rows_equal_dense_count_and_gather_to_the_whole(kind, S, Hkv, G, U):
    mask = _mask(kind, S, Hkv)
    chunk = S // U
    dense = _dense_rows(mask, Hkv, G)
    packed = []
    for r in range(U):  # each shard's rows (one unit per "rank" here)
        rows = sparse_area_rows(mask.rows(r * chunk, (r + 1) * chunk), U, G)
        area, q_need, k_need = _expect_rows(dense[:, r * chunk:(r + 1) * chunk], r, chunk)
        assert rows.first_unit == r and rows.chunk == chunk
        assert_close(f"area rows of shard {r}", area, rows.area)
        assert_close(f"q_need rows of shard {r}", q_need, rows.q_need)
        assert_close(f"k_need rows of shard {r}", k_need, rows.k_need)
        packed.append(rows.pack())
    whole = sparse_areas(mask, U, G)
    gathered = areas_from_rows(torch.cat(packed), chunk)
    for name in ("area", "q_need", "k_need"):
        assert_close(f"gathered {name}", getattr(whole, name), getattr(gathered, name))


def test_window_counts_every_head_of_a_group():
    sel = BlockSparseMask(torch.full((8, 2, 1), -1, dtype=torch.int32), 4, 8)  # no selection
    rows = sparse_areas(NSALayerMask(sel, 3), 2, 1)
    # row t attends min(t + 1, 3) keys, once per KV head (2 heads in the one group); rows 4, 5 reach chunk 0
    assert rows.area[0].tolist() == [[2 * (1 + 2 + 3 + 3), 0], [2 * (2 + 1), 2 * (1 + 2 + 3 + 3)]]


def test_sparse_areas_on_meta():
    mask = NSALayerMask(BlockSparseMask(torch.zeros(16, 2, 3, dtype=torch.int32, device="meta"), 4, 16), 5)
    out = sparse_areas(mask, 4, 2, tiles=2)
    assert out.area.device.type == "meta" and out.area.shape == (2, 8, 8) and out.tiles == 2
    assert mask.value_error().device.type == "meta"


@pytest.mark.parametrize("heads", [1, 2])
def test_flex_block_mask_conversion(heads):
    S, B = 256, 64
    chosen = torch.tensor([[[0, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 1], [0, 1, 0, 1]],
                           [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 0, 1, 1]]], dtype=torch.bool)[:heads]

    def mask_mod(b, h, q, k):  # causal block selection, the form NSA-like block masks take
        return (q >= k) & chosen[h, q // B, k // B]

    bm = create_block_mask(mask_mod, 1, heads, S, S, device="cpu", BLOCK_SIZE=B)
    got = BlockSparseMask.from_flex_block_mask(bm, num_kv_heads=2)
    assert got.block_indices.shape[:2] == (S, 2) and got.block_size == B
    got.validate()
    dense = create_mask(mask_mod, 1, heads, S, S, device="cpu")[0]
    for h in range(2):
        assert torch.equal(got.to_dense(h), dense[h if heads > 1 else 0])
    if heads == 2:
        with pytest.raises(ValueError, match="H=2 heads; it must be 1 .shared. or num_kv_heads=4"):
            BlockSparseMask.from_flex_block_mask(bm, num_kv_heads=4)


def test_value_error_flags_and_host_messages():
    ok = TokenTopKMask(torch.tensor([[0, -1], [0, 1], [2, 5]], dtype=torch.int32), 6)
    assert not ok.value_error().item()  # key 5 in the future of row 2: dropped, not an error
    dup = TokenTopKMask(torch.tensor([[0, -1], [1, 1], [0, 2]], dtype=torch.int32), 6)
    assert dup.value_error().item()
    with pytest.raises(ValueError, match=r"topk_indices\[1, 1\] = 1 selects key 1 twice in row 1"):
        dup.validate()
    far = TokenTopKMask(torch.tensor([[0, 6]], dtype=torch.int32), 6)
    assert far.value_error().item()
    blocks = BlockSparseMask(torch.tensor([[[0, 1]], [[2, 2]]], dtype=torch.int32), 2, 6)
    assert blocks.value_error().item()
    with pytest.raises(ValueError, match=r"block_indices\[1, 0, 1\] = 2 selects block 2 twice in row \(t=1, h=0\)"):
        blocks.validate()
    with pytest.raises(ValueError, match="block_indices must be int32"):
        BlockSparseMask(torch.zeros(2, 1, 1, dtype=torch.int64), 2, 6)
    with pytest.raises(ValueError, match="query_offset must be a non-negative int"):
        TokenTopKMask(torch.zeros(2, 1, dtype=torch.int32), 6, -2)
    with pytest.raises(ValueError, match="window_size must be a positive int"):
        NSALayerMask(BlockSparseMask(torch.zeros(2, 1, 1, dtype=torch.int32), 2, 6), 0)


def test_shard_offsets_shift_causality():
    ti = torch.tensor([[3, 4, 5, -1]] * 2, dtype=torch.int32)
    shard = TokenTopKMask(ti, 8, query_offset=4)  # rows are queries 4 and 5
    dense = shard.to_dense()
    assert dense[0].nonzero().flatten().tolist() == [3, 4] and dense[1].nonzero().flatten().tolist() == [3, 4, 5]
    whole = TokenTopKMask(dsa_topk_indices(16, 5, seed=1), 16)
    assert torch.equal(whole.rows(8, 12).to_dense(), whole.to_dense()[8:12])
    nsa = BlockSparseMask(nsa_block_indices(16, 2, 4, 2, seed=1), 4, 16)
    assert torch.equal(nsa.rows(4, 12).to_dense(1), nsa.to_dense(1)[4:12])
    with pytest.raises(ValueError, match="a shard must be whole units of 4 tokens"):
        sparse_area_rows(whole.rows(2, 6), 4)


def test_bad_selection_rows_named():
    bi = np.zeros((4, 2, 2), dtype=np.int32)
    bi[2, 1, 0] = 9
    with pytest.raises(ValueError, match=r"block_indices\[2, 1, 0\] = 9 is outside \[-1, 4\)"):
        BlockSparseMask(torch.from_numpy(bi), 2, 8).validate()
