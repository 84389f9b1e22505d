"""The two sparse mask forms: NSA-style block selection and DSA-style token top-k.

Shape legend: T query tokens, S_k key tokens, Hkv KV heads, n selected blocks
per (query, KV head), k selected tokens per query, l block size.

Both are self-attention masks over one sequence: query t and key t are the
same position, so "causal" means key <= t. Shape/dtype checks run in
``__post_init__`` (host metadata only); ``validate()`` reads the values on the
host and ``to_dense`` rebuilds the dense mask for tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def _positive(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _host(name: str, t: torch.Tensor) -> np.ndarray:
    if t.device.type == "meta":
        raise ValueError(f"host-side checks read {name}; got a tensor on device 'meta'")
    return t.detach().to("cpu", torch.int64).numpy()


def _first_duplicate(rows: np.ndarray) -> tuple[int, int, int] | None:
    """(row, position, value) of the first repeated non-negative value in a row of ``rows [N, m]``."""
    order = np.sort(rows, axis=-1)
    dup = (order[:, 1:] == order[:, :-1]) & (order[:, 1:] >= 0)
    if not dup.any():
        return None
    r = int(np.argwhere(dup.any(axis=-1))[0, 0])
    value = int(order[r, 1:][dup[r]][0])
    pos = int(np.flatnonzero(rows[r] == value)[1])
    return r, pos, value


@dataclass(frozen=True)
class BlockSparseMask:
    """NSA selection-branch mask.

    block_indices:  [T, Hkv, n] int32 — key blocks selected by query t for KV
                    head h; -1 = unused slot.
    block_size:     l, keys per block (host int); block b is keys [b*l, (b+1)*l).
    total_seqlen_k: S_k (host int); there are ceil(S_k / l) blocks.

    Query t attends key k for head h when block ``k // l`` is selected in
    ``block_indices[t, h]`` and ``k <= t`` (causal clipping)::

        dense = zeros(T, S_k, bool)
        for t in range(T):
            for b in block_indices[t, h]:
                if b >= 0:
                    dense[t, b*l : min((b+1)*l, t+1, S_k)] = True
    """

    block_indices: torch.Tensor
    block_size: int
    total_seqlen_k: int

    def __post_init__(self):
        bi = self.block_indices
        if not isinstance(bi, torch.Tensor):
            raise TypeError(f"block_indices must be a torch.Tensor, got {type(bi).__name__}")
        if bi.dtype != torch.int32:
            raise ValueError(f"block_indices must be int32, got {bi.dtype}")
        if bi.dim() != 3:
            raise ValueError(f"block_indices must be [T, Hkv, n], got shape {tuple(bi.shape)}")
        _positive("block_size", self.block_size)
        _positive("total_seqlen_k", self.total_seqlen_k)

    @property
    def num_blocks_k(self) -> int:
        """ceil(S_k / l): the number of key blocks."""
        return -(-self.total_seqlen_k // self.block_size)

    def validate(self) -> "BlockSparseMask":
        """Host-side value checks (reads the tensor): every index in [-1, num_blocks_k),
        no block selected twice in one (t, h) row. Returns self."""
        bi = _host("block_indices", self.block_indices)
        nb = self.num_blocks_k
        bad = np.argwhere((bi < -1) | (bi >= nb))
        if bad.size:
            t, h, i = bad[0].tolist()
            raise ValueError(
                f"block_indices[{t}, {h}, {i}] = {int(bi[t, h, i])} is outside [-1, {nb}) "
                f"(total_seqlen_k={self.total_seqlen_k}, block_size={self.block_size}; -1 marks an unused slot)")
        dup = _first_duplicate(bi.reshape(-1, bi.shape[-1]))
        if dup is not None:
            r, i, v = dup
            t, h = divmod(r, bi.shape[1])
            raise ValueError(f"block_indices[{t}, {h}, {i}] = {v} selects block {v} twice in row (t={t}, h={h})")
        return self

    def to_dense(self, head: int = 0) -> torch.Tensor:
        """The dense [T, S_k] bool mask of KV head ``head`` (on the CPU; small masks, tests)."""
        num_heads = self.block_indices.shape[1]
        if not isinstance(head, int) or not 0 <= head < num_heads:
            raise ValueError(f"head must be an int in [0, {num_heads}), got {head!r}")
        self.validate()
        bi = _host("block_indices", self.block_indices)[:, head]  # [T, n]
        t_len, s_k = bi.shape[0], self.total_seqlen_k
        selected = np.zeros((t_len, self.num_blocks_k + 1), dtype=bool)  # last column: the -1 slots
        np.put_along_axis(selected, np.where(bi < 0, self.num_blocks_k, bi), True, axis=-1)
        keys = np.arange(s_k)
        dense = selected[:, keys // self.block_size] & (keys[None, :] <= np.arange(t_len)[:, None])
        return torch.from_numpy(dense)


@dataclass(frozen=True)
class TokenTopKMask:
    """DSA token top-k mask, shared by all heads.

    topk_indices:   [T, k] int32 or int64 — keys selected by query t.
    total_seqlen_k: S_k (host int).

    Query t attends key ``topk_indices[t, i]`` unless it is -1 or in the future
    (``> t``; top-k returns such indices when fewer than k keys are valid) —
    both are dropped::

        dense = zeros(T, S_k, bool)
        for t in range(T):
            for key in topk_indices[t]:
                if 0 <= key <= t:
                    dense[t, key] = True
    """

    topk_indices: torch.Tensor
    total_seqlen_k: int

    def __post_init__(self):
        ti = self.topk_indices
        if not isinstance(ti, torch.Tensor):
            raise TypeError(f"topk_indices must be a torch.Tensor, got {type(ti).__name__}")
        if ti.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_indices must be int32 or int64, got {ti.dtype}")
        if ti.dim() != 2:
            raise ValueError(f"topk_indices must be [T, k], got shape {tuple(ti.shape)}")
        _positive("total_seqlen_k", self.total_seqlen_k)

    def validate(self) -> "TokenTopKMask":
        """Host-side value checks (reads the tensor): every index in [-1, S_k), no key
        kept twice in one row (future indices are dropped, so they may repeat). Returns self."""
        ti = _host("topk_indices", self.topk_indices)
        bad = np.argwhere((ti < -1) | (ti >= self.total_seqlen_k))
        if bad.size:
            t, i = bad[0].tolist()
            raise ValueError(
                f"topk_indices[{t}, {i}] = {int(ti[t, i])} is outside [-1, total_seqlen_k={self.total_seqlen_k})")
        kept = np.where(ti <= np.arange(ti.shape[0])[:, None], ti, -1)
        dup = _first_duplicate(kept)
        if dup is not None:
            t, i, v = dup
            raise ValueError(f"topk_indices[{t}, {i}] = {v} selects key {v} twice in row {t}")
        return self

    def to_dense(self, head: int = 0) -> torch.Tensor:
        """The dense [T, S_k] bool mask (the same for every head; CPU, small masks, tests)."""
        if not isinstance(head, int) or head < 0:
            raise ValueError(f"head must be a non-negative int, got {head!r}")
        self.validate()
        ti = _host("topk_indices", self.topk_indices)
        t_len = ti.shape[0]
        kept = (ti >= 0) & (ti <= np.arange(t_len)[:, None])
        dense = np.zeros((t_len, self.total_seqlen_k + 1), dtype=bool)
        np.put_along_axis(dense, np.where(kept, ti, self.total_seqlen_k), True, axis=-1)
        return torch.from_numpy(dense[:, :-1].copy())
