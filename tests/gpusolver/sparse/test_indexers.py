"""Reference indexers: causal top-k of the scores they define, forced NSA blocks, sharded calls."""
import pytest
import torch

from gpusolver.indexers import CompressedKeyIndexer, LightningIndexer
from gpusolver.masks.sparse import BlockSparseMask, TokenTopKMask

torch.set_num_threads(1)


def _is_topk(scores: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor, k: int) -> None:
    """chosen [k] (-1 padded) holds min(k, #valid) distinct valid entries, none scoring below an unchosen valid one."""
    picked = chosen[chosen >= 0]
    assert picked.unique().numel() == picked.numel() == min(k, int(valid.sum()))
    assert valid[picked].all()
    rest = valid.clone()
    rest[picked] = False
    if rest.any():
        assert scores[picked].min() >= scores[rest].max()


def test_lightning_indexer_keeps_the_causal_topk():
    S, dm, k = 40, 16, 6
    x = torch.randn(S, dm)
    ix = LightningIndexer.init(dm, heads=3, head_dim=8, topk=k, seed=1)
    keys = ix.keys(x)
    topk = ix(x, keys)
    assert topk.shape == (S, k) and topk.dtype == torch.int32
    q = (x @ ix.wq).view(S, 3, 8)
    score = torch.einsum("thd,sd->ths", q, keys).relu().mul((x @ ix.ww)[:, :, None]).sum(1)  # [S, S]
    for t in range(S):
        _is_topk(score[t], topk[t].long(), torch.arange(S) <= t, k)
    TokenTopKMask(topk, S).validate()
    # a rank scores its own rows against every key: the same top-k per row
    for r in range(4):
        part = ix(x[r * 10:(r + 1) * 10], keys, r * 10)
        for t in range(10):
            _is_topk(score[r * 10 + t], part[t].long(), torch.arange(S) <= r * 10 + t, k)


@pytest.mark.parametrize("hg", [1, 2])
def test_compressed_key_indexer_forces_first_and_local_blocks(hg):
    S, Hkv, D, l, n = 48, 2, 16, 4, 5
    Hq = hg * Hkv
    q, k = torch.randn(S, Hq, D), torch.randn(S, Hkv, D)
    ix = CompressedKeyIndexer(block_size=l, top_n=n, local_blocks=2)
    k_cmp = ix.compress(k)
    assert torch.allclose(k_cmp[3], k[12:16].mean(0))
    blocks = ix(q, k_cmp)
    assert blocks.shape == (S, Hkv, n)
    BlockSparseMask(blocks, l, S).validate()
    s = torch.einsum("thgd,bhd->thgb", q.view(S, Hkv, hg, D), k_cmp) * D ** -0.5
    for t in range(S):
        own = t // l
        valid = torch.arange(S // l) <= own
        p = torch.softmax(s[t].masked_fill(~valid, float("-inf")), -1).sum(1)  # [Hkv, nb]
        for h in range(Hkv):
            chosen = blocks[t, h].long()
            forced = {0, own, max(own - 1, 0)}
            assert forced <= set(chosen.tolist())
            score = p[h].clone()
            score[list(forced)] = float("inf")
            _is_topk(score, chosen, valid, n)
    sharded = torch.cat([ix(q[r * 12:(r + 1) * 12], k_cmp, r * 12) for r in range(4)])
    assert torch.equal(sharded.sort(-1).values, blocks.sort(-1).values)


def test_indexers_on_meta_and_errors():
    ix = LightningIndexer.init(8, 2, 4, topk=5, device="meta")
    x = torch.randn(12, 8, device="meta")
    assert ix(x, ix.keys(x), 0).shape == (12, 5)
    nsa = CompressedKeyIndexer(4, 3, 1)
    k = torch.randn(12, 2, 16, device="meta")
    assert nsa(torch.randn(12, 4, 16, device="meta"), nsa.compress(k)).device.type == "meta"
    with pytest.raises(ValueError, match="top_n=2 must hold the first block and local_blocks=2"):
        CompressedKeyIndexer(4, 2, 2)
    with pytest.raises(ValueError, match="query_offset must be a non-negative int"):
        ix(x, ix.keys(x), -1)



def _untiled_lightning(ix, x_q, keys, query_offset, step):
    """The lightning indexer without key tiles: each step of rows scores its keys in one einsum and
    masks every future entry out of place, then top-k."""
    T, d = x_q.shape[0], keys.shape[1]
    q, w = (x_q @ ix.wq).view(T, -1, d), x_q @ ix.ww
    out = []
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        n = min(keys.shape[0], query_offset + t1)
        score = torch.bmm(w[t0:t1, None, :], torch.einsum("thd,sd->ths", q[t0:t1], keys[:n]).relu_())[:, 0]
        pos = query_offset + torch.arange(t0, t1)
        score = torch.where(torch.arange(n)[None, :] <= pos[:, None], score, float("-inf"))
        best = torch.topk(score, min(ix.topk, n), dim=-1, sorted=False)
        idx = torch.where(torch.isinf(best.values), -1, best.indices)
        out.append(torch.cat((idx, idx.new_full((t1 - t0, ix.topk - idx.shape[1]), -1)), -1))
    return torch.cat(out).to(torch.int32)


def test_key_tiles_and_tail_masking_change_nothing():
    """Key tiles and in-place masking of a step's last columns give the untiled output, bit for bit."""
    S, dm, step = 96, 16, 5
    x = torch.randn(S, dm, generator=torch.Generator().manual_seed(3))
    ix = LightningIndexer.init(dm, heads=2, head_dim=8, topk=20, seed=2)
    keys = ix.keys(x)
    tiled = LightningIndexer(ix.wq, ix.wk, ix.ww, ix.topk, step_elems=step * 2 * S, key_tile=7)
    for offset, rows in ((0, S), (48, 48)):
        assert torch.equal(tiled(x[offset:offset + rows], keys, offset),
                           _untiled_lightning(ix, x[offset:offset + rows], keys, offset, step))
