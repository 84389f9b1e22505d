"""Reference sparse-attention indexers, on the device: where sparse masks come from.

Shape legend: T query rows (a shard, from ``query_offset``), S keys (the whole
sequence), d_model hidden size, Hi indexer heads, d indexer head dim, Hq /
Hkv attention heads, D head dim, l block size, nb = ceil(S / l) blocks.

Two scorers, each a few tensor ops with static shapes (no host reads; they
run on ``device="meta"``) and a causal top-k:

- ``LightningIndexer`` (DSA-like): small projections of the hidden states give
  index queries ``[T, Hi, d]``, index keys ``[S, d]`` and per-head weights
  ``[T, Hi]``; the score of key s for row t is
  ``sum_h w[t, h] * relu(q[t, h] . k[s])`` and each row keeps its ``topk``
  best keys ``s <= t`` -> ``topk_indices [T, topk]`` (a ``TokenTopKMask``).
- ``CompressedKeyIndexer`` (NSA-like): the mean of each block of ``l`` keys is
  that block's compressed key; each query head's softmax over the compressed
  keys is summed over the query heads of a KV head, and each (row, KV head)
  keeps its ``top_n`` best blocks ``b <= t // l``, with the first block and
  the ``local_blocks`` blocks ending at the query's own always selected ->
  ``block_indices [T, Hkv, top_n]`` (a ``BlockSparseMask``).

Rows with fewer valid candidates than slots pad with -1. Scores are computed
in steps of rows so that the working set stays near ``step_elems`` entries,
each step against only the keys (blocks) up to its last row's position; only
the step's last columns (past its first row) can lie in a row's future, so
only they are masked, in place. The lightning scores of a step are built
``key_tile`` keys at a time: each tile's per-head scores stay in cache and
only the head-weighted sum is written (the same ops on the same values, bit
for bit; 1.5-1.8x faster on this machine's CPU at 64K keys).
These are references for demos, tests and benchmarks: their selections have
the structure of the real indexers' (causal, local blocks, a spread of
remote keys), not their learned content.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Score entries per row step (rows * S): bounds the [rows, S] score working set.
STEP_ELEMS = 1 << 24
# Keys per lightning score tile: a (64 rows, 2 heads, 4096 keys) fp32 tile is 2 MiB.
KEY_TILE = 4096


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _offset(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"query_offset must be a non-negative int, got {v!r}")
    return v


def _causal_topk(scores: torch.Tensor, valid_tail: torch.Tensor, width: int) -> torch.Tensor:
    """Indices [..., width] int32 of the best valid entries along the last dim, -1 where fewer are valid.

    valid_tail: [..., m] bool validity of the last m columns (every earlier column is valid).
    ``scores`` is overwritten with -inf at the invalid tail entries."""
    n, m = scores.shape[-1], valid_tail.shape[-1]
    k = min(width, n)
    scores[..., n - m:].masked_fill_(~valid_tail, float("-inf"))
    best = torch.topk(scores, k, dim=-1, sorted=False)
    idx = torch.where(torch.isinf(best.values) & (best.values < 0), -1, best.indices)
    if k < width:
        idx = torch.cat((idx, idx.new_full((*idx.shape[:-1], width - k), -1)), dim=-1)
    return idx.to(torch.int32)


def _rows_per_step(rows: int, width: int, step_elems: int) -> int:
    return max(1, min(rows, step_elems // max(1, width)))


@dataclass
class LightningIndexer:
    """A DSA-like lightning indexer: small projections, ReLU scores weighted per head, causal top-k.

    wq: [d_model, Hi * d], wk: [d_model, d], ww: [d_model, Hi] projection weights.
    topk: keys kept per query row (2048 in DeepSeek-V3.2).
    """

    wq: torch.Tensor
    wk: torch.Tensor
    ww: torch.Tensor
    topk: int
    step_elems: int = STEP_ELEMS
    key_tile: int = KEY_TILE

    @staticmethod
    def init(d_model: int, heads: int = 4, head_dim: int = 32, topk: int = 2048, *, seed: int = 0,
             device="cpu", dtype=torch.float32) -> "LightningIndexer":
        """Random projections (seeded, scaled by 1 / sqrt(fan-in))."""
        for name, v in (("d_model", d_model), ("heads", heads), ("head_dim", head_dim), ("topk", topk)):
            _positive(name, v)
        g = torch.Generator().manual_seed(seed)
        draw = lambda *shape: (torch.randn(*shape, generator=g) / d_model ** 0.5).to(device, dtype)  # noqa: E731
        return LightningIndexer(draw(d_model, heads * head_dim), draw(d_model, head_dim), draw(d_model, heads), topk)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """Index keys [S, d] of hidden states x [S, d_model] (all-gathered over the CP group:
        d values per token, a small fraction of K)."""
        return x @ self.wk

    def __call__(self, x_q: torch.Tensor, keys: torch.Tensor, query_offset: int = 0) -> torch.Tensor:
        """topk_indices [T, topk] int32 of the rows x_q [T, d_model] (queries ``query_offset + t``)
        against index keys [S, d]. Sync-free."""
        _offset(query_offset)
        T, S = x_q.shape[0], keys.shape[0]
        d = keys.shape[1]
        q = (x_q @ self.wq).view(T, -1, d)  # [T, Hi, d]
        w = x_q @ self.ww  # [T, Hi]
        out = []
        step = _rows_per_step(T, S * q.shape[1], self.step_elems)
        for t0 in range(0, T, step):  # static trip count
            t1 = min(T, t0 + step)
            n_keys = min(S, query_offset + t1)  # causal: later keys cannot be selected (a host int)
            score = q.new_empty(t1 - t0, n_keys)
            for s0 in range(0, n_keys, self.key_tile):  # static trip count
                s1 = min(n_keys, s0 + self.key_tile)
                part = torch.einsum("thd,sd->ths", q[t0:t1], keys[s0:s1]).relu_()  # [t, Hi, tile]
                score[:, s0:s1] = torch.bmm(w[t0:t1, None, :], part)[:, 0]  # head-weighted sum
            pos = query_offset + torch.arange(t0, t1, device=keys.device)
            first = min(n_keys, query_offset + t0 + 1)  # keys before it are in every row's past
            cols = torch.arange(first, n_keys, device=keys.device)
            out.append(_causal_topk(score, cols[None, :] <= pos[:, None], self.topk))
        return torch.cat(out) if out else torch.empty(0, self.topk, dtype=torch.int32, device=keys.device)


@dataclass
class CompressedKeyIndexer:
    """An NSA-like block selector: block-mean compressed keys, softmax scores summed over a KV
    head's query heads, top-n blocks with the first and the local blocks forced.

    block_size:   l, keys per block (64 in NSA).
    top_n:        blocks per (row, KV head) (16 in NSA).
    local_blocks: blocks ending at the query's own that are always selected (2 in NSA).
    """

    block_size: int = 64
    top_n: int = 16
    local_blocks: int = 2
    step_elems: int = STEP_ELEMS

    def __post_init__(self):
        _positive("block_size", self.block_size)
        _positive("top_n", self.top_n)
        if isinstance(self.local_blocks, bool) or not isinstance(self.local_blocks, int) or self.local_blocks < 0:
            raise ValueError(f"local_blocks must be a non-negative int, got {self.local_blocks!r}")
        if self.top_n < self.local_blocks + 1:
            raise ValueError(f"top_n={self.top_n} must hold the first block and local_blocks={self.local_blocks}")

    def compress(self, k: torch.Tensor) -> torch.Tensor:
        """Compressed keys [nb, Hkv, D]: the mean of each block of k [S, Hkv, D] (the last block
        averages the keys it has)."""
        S, Hkv, D = k.shape
        l = self.block_size
        nb = -(-S // l)
        pad = nb * l - S
        kp = torch.cat((k, k.new_zeros(pad, Hkv, D))) if pad else k
        count = torch.full((nb, 1, 1), float(l), dtype=k.dtype, device=k.device)
        if pad:
            count[-1] = l - pad
        return kp.view(nb, l, Hkv, D).sum(1) / count

    def __call__(self, q: torch.Tensor, k_cmp: torch.Tensor, query_offset: int = 0) -> torch.Tensor:
        """block_indices [T, Hkv, top_n] int32 of query rows q [T, Hq, D] (queries
        ``query_offset + t``) against compressed keys [nb, Hkv, D]. Sync-free."""
        _offset(query_offset)
        T, Hq, D = q.shape
        nb, Hkv, _ = k_cmp.shape
        hg = Hq // Hkv
        l = self.block_size
        out = []
        step = _rows_per_step(T, nb * Hq, self.step_elems)
        for t0 in range(0, T, step):  # static trip count
            t1 = min(T, t0 + step)
            t = t1 - t0
            n_blk = min(nb, (query_offset + t1 - 1) // l + 1)  # causal: later blocks cannot be selected
            blocks = torch.arange(n_blk, device=q.device).view(1, 1, n_blk)
            own = ((query_offset + torch.arange(t0, t1, device=q.device)) // l).view(t, 1, 1)  # the query's block
            valid = blocks <= own  # [t, 1, n_blk]
            s = torch.einsum("thgd,bhd->thgb", q[t0:t1].float().view(t, Hkv, hg, D), k_cmp[:n_blk].float())
            if hg == 1:
                score = s[:, :, 0]  # one head: its softmax ranks blocks as its logits do
            else:
                s = (s * D ** -0.5).masked_fill(~valid[:, :, None, :], float("-inf"))
                score = torch.softmax(s, dim=-1).sum(2)  # [t, Hkv, n_blk]
            forced = (blocks == 0) | ((own - blocks < self.local_blocks) & valid)
            score = torch.where(forced, float("inf"), score)
            first = min(n_blk, (query_offset + t0) // l + 1)  # blocks up to the first row's own are valid
            out.append(_causal_topk(score, valid[..., first:].expand(t, Hkv, n_blk - first), self.top_n))
        return torch.cat(out) if out else torch.empty(0, Hkv, self.top_n, dtype=torch.int32, device=q.device)
