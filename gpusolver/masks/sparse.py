"""The two sparse mask forms: NSA-style block selection and DSA-style token top-k.

Shape legend: T query tokens, S_k key tokens, Hkv KV heads, n selected blocks
per (query, KV head), k selected tokens per query, l block size.

Both are self-attention masks over one sequence: query t and key t are the
same position, so "causal" means key <= t. A mask may hold only some query
rows, those of one rank's shard: row ``r`` is query ``query_offset + r``.
Shape/dtype checks run in ``__post_init__`` (host metadata only);
``value_error()`` is the sync-free device-side check (a 0-dim bool flag),
``validate()`` reads the values on the host and names the offending row, and
``to_dense`` rebuilds the dense mask for tests.

Also here: ``NSALayerMask``, a whole NSA layer's work (the selection branch
plus the sliding-window branch) seen by the solver as one mask, and
``BlockSparseMask.from_flex_block_mask``, the conversion of a FlexAttention
``BlockMask``.
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


def _offset(v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"query_offset must be a non-negative int, got {v!r}")
    return v


def _has_duplicate(rows: torch.Tensor) -> torch.Tensor:
    """0-dim bool: some row of ``rows [..., m]`` repeats a non-negative value. Sync-free."""
    order = torch.sort(rows, dim=-1).values
    return ((order[..., 1:] == order[..., :-1]) & (order[..., 1:] >= 0)).any()


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
    query_offset:   position of row 0 (host int, default 0; ``rank * c`` for a
                    rank's shard of the rows).

    Row t (query ``t0 + t``, ``t0 = query_offset``) attends key k for head h
    when block ``k // l`` is selected in ``block_indices[t, h]`` and
    ``k <= t0 + t`` (causal clipping)::

        dense = zeros(T, S_k, bool)
        for t in range(T):
            for b in block_indices[t, h]:
                if b >= 0:
                    dense[t, b*l : min((b+1)*l, t0+t+1, S_k)] = True
    """

    block_indices: torch.Tensor
    block_size: int
    total_seqlen_k: int
    query_offset: int = 0

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
        _offset(self.query_offset)

    @property
    def num_heads(self) -> int:
        return self.block_indices.shape[1]

    @property
    def device(self) -> torch.device:
        return self.block_indices.device

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

    def rows(self, start: int, stop: int) -> "BlockSparseMask":
        """The mask of rows [start, stop) only (a shard: query_offset moves by start). A view."""
        return BlockSparseMask(self.block_indices[start:stop], self.block_size, self.total_seqlen_k,
                               self.query_offset + start)

    def value_error(self) -> torch.Tensor:
        """0-dim bool on the mask's device: some index is outside [-1, num_blocks_k) or some
        (t, h) row selects a block twice. Sync-free (the device twin of ``validate``)."""
        bi = self.block_indices
        return ((bi < -1) | (bi >= self.num_blocks_k)).any() | _has_duplicate(bi)

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
        pos = self.query_offset + np.arange(t_len)
        dense = selected[:, keys // self.block_size] & (keys[None, :] <= pos[:, None])
        return torch.from_numpy(dense)

    @staticmethod
    def from_flex_block_mask(block_mask, num_kv_heads: int | None = None) -> "BlockSparseMask":
        """The NSA form of a FlexAttention ``BlockMask`` (one sequence, causal). Sync-free.

        block_mask:   ``torch.nn.attention.flex_attention.BlockMask`` with batch 1;
                      ``kv_num_blocks [1, H, QB]``, ``kv_indices [1, H, QB, KB]`` (partial
                      blocks) and optional ``full_kv_num_blocks`` / ``full_kv_indices``;
                      ``BLOCK_SIZE = (q_block, kv_block)``.
        num_kv_heads: Hkv; a mask with H = 1 is shared by every KV head and is
                      expanded to it (default 1), else H must equal Hkv.

        Query t selects, for each head, the partial and full key blocks of its
        query block ``t // q_block``; blocks are ``kv_block`` keys. Partial blocks
        are read as causally clipped (key <= query): exact for masks built as
        ``causal & block selection``, the form block-sparse attention layers use.
        A mask_mod that cuts blocks in another way (documents, windows) is not a
        block selection; compare ``to_dense`` with the BlockMask on small sizes.
        Returns block_indices [S_q, Hkv, n] int32 with n = 2 * KB (-1 unused).
        """
        kv_num, kv_idx = block_mask.kv_num_blocks, block_mask.kv_indices
        if kv_num.dim() != 3 or kv_idx.dim() != 4 or kv_num.shape[0] != 1:
            raise ValueError(f"block_mask must have batch 1: kv_num_blocks [1, H, QB], kv_indices [1, H, QB, KB]; "
                             f"got {tuple(kv_num.shape)} and {tuple(kv_idx.shape)}")
        q_block, kv_block = block_mask.BLOCK_SIZE
        seq_q, seq_k = block_mask.seq_lengths
        H = kv_num.shape[1]
        Hkv = H if num_kv_heads is None and H > 1 else (num_kv_heads or 1)
        if H not in (1, Hkv):
            raise ValueError(f"block_mask has H={H} heads; it must be 1 (shared) or num_kv_heads={Hkv}")

        def listed(num, idx):  # [H, QB, KB] block ids, -1 past each row's count
            slots = torch.arange(idx.shape[-1], device=idx.device)
            return torch.where(slots < num[0, ..., None], idx[0].long(), -1)

        parts = [listed(kv_num, kv_idx)]
        if block_mask.full_kv_num_blocks is not None:
            parts.append(listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
        sel = torch.cat(parts, dim=-1)  # [H, QB, n]
        qb = torch.arange(seq_q, device=sel.device) // q_block
        rows = sel[:, qb].permute(1, 0, 2).expand(seq_q, Hkv, sel.shape[-1])  # [S_q, Hkv, n]
        return BlockSparseMask(rows.to(torch.int32).contiguous(), kv_block, seq_k)


@dataclass(frozen=True)
class TokenTopKMask:
    """DSA token top-k mask, shared by all heads.

    topk_indices:   [T, k] int32 or int64 — keys selected by row t.
    total_seqlen_k: S_k (host int).
    query_offset:   position of row 0 (host int, default 0; ``rank * c`` for a shard).

    Row t (query ``t0 + t``) attends key ``topk_indices[t, i]`` unless it is -1
    or in the future (``> t0 + t``; top-k returns such indices when fewer than k
    keys are valid) — both are dropped::

        dense = zeros(T, S_k, bool)
        for t in range(T):
            for key in topk_indices[t]:
                if 0 <= key <= t0 + t:
                    dense[t, key] = True
    """

    topk_indices: torch.Tensor
    total_seqlen_k: int
    query_offset: int = 0

    def __post_init__(self):
        ti = self.topk_indices
        if not isinstance(ti, torch.Tensor):
            raise TypeError(f"topk_indices must be a torch.Tensor, got {type(ti).__name__}")
        if ti.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_indices must be int32 or int64, got {ti.dtype}")
        if ti.dim() != 2:
            raise ValueError(f"topk_indices must be [T, k], got shape {tuple(ti.shape)}")
        _positive("total_seqlen_k", self.total_seqlen_k)
        _offset(self.query_offset)

    @property
    def device(self) -> torch.device:
        return self.topk_indices.device

    def _kept(self, ti):
        """Indices with the future ones set to -1 (torch or numpy rows [T, k])."""
        if isinstance(ti, np.ndarray):
            return np.where(ti <= self.query_offset + np.arange(ti.shape[0])[:, None], ti, -1)
        pos = self.query_offset + torch.arange(ti.shape[0], device=ti.device)[:, None]
        return torch.where(ti <= pos, ti, -1)

    def rows(self, start: int, stop: int) -> "TokenTopKMask":
        """The mask of rows [start, stop) only (a shard: query_offset moves by start). A view."""
        return TokenTopKMask(self.topk_indices[start:stop], self.total_seqlen_k, self.query_offset + start)

    def value_error(self) -> torch.Tensor:
        """0-dim bool on the mask's device: some index is outside [-1, S_k) or some row keeps a
        key twice. Sync-free (the device twin of ``validate``)."""
        ti = self.topk_indices
        return ((ti < -1) | (ti >= self.total_seqlen_k)).any() | _has_duplicate(self._kept(ti))

    def validate(self) -> "TokenTopKMask":
        """Host-side value checks (reads the tensor): every index in [-1, S_k), no key
        kept twice in one row (future indices are dropped, so they may repeat). Returns self."""
        ti = _host("topk_indices", self.topk_indices)
        bad = np.argwhere((ti < -1) | (ti >= self.total_seqlen_k))
        if bad.size:
            t, i = bad[0].tolist()
            raise ValueError(
                f"topk_indices[{t}, {i}] = {int(ti[t, i])} is outside [-1, total_seqlen_k={self.total_seqlen_k})")
        dup = _first_duplicate(self._kept(ti))
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
        kept = (ti >= 0) & (ti <= self.query_offset + np.arange(t_len)[:, None])
        dense = np.zeros((t_len, self.total_seqlen_k + 1), dtype=bool)
        np.put_along_axis(dense, np.where(kept, ti, self.total_seqlen_k), True, axis=-1)
        return torch.from_numpy(dense[:, :-1].copy())


@dataclass(frozen=True)
class NSALayerMask:
    """A whole NSA layer's attention work, seen by the solver as one mask.

    selection:   BlockSparseMask, the selection branch (blocks of l keys per KV head).
    window_size: w (host int), the sliding-window branch: row t attends keys
                 ``(t0 + t - w, t0 + t]``, for every head.

    The two branches are separate softmaxes (NSA gates their outputs), so a
    key in both is computed twice: the block areas are the sum of the
    branches' areas and the needs the hulls of both. (NSA's third branch, the
    compressed keys, is a small dense attention over block summaries and is
    not part of this mask.)
    """

    selection: BlockSparseMask
    window_size: int

    def __post_init__(self):
        if not isinstance(self.selection, BlockSparseMask):
            raise TypeError(f"selection must be a BlockSparseMask, got {type(self.selection).__name__}")
        _positive("window_size", self.window_size)

    @property
    def total_seqlen_k(self) -> int:
        return self.selection.total_seqlen_k

    @property
    def query_offset(self) -> int:
        return self.selection.query_offset

    @property
    def device(self) -> torch.device:
        return self.selection.device

    def rows(self, start: int, stop: int) -> "NSALayerMask":
        """The mask of rows [start, stop) only (a shard)."""
        return NSALayerMask(self.selection.rows(start, stop), self.window_size)

    def value_error(self) -> torch.Tensor:
        return self.selection.value_error()

    def validate(self) -> "NSALayerMask":
        self.selection.validate()
        return self

    def window_dense(self) -> torch.Tensor:
        """The dense [T, S_k] bool mask of the window branch (CPU, tests)."""
        t_len = self.selection.block_indices.shape[0]
        pos = self.query_offset + torch.arange(t_len)[:, None]
        keys = torch.arange(self.total_seqlen_k)[None, :]
        return (keys <= pos) & (keys > pos - self.window_size)
