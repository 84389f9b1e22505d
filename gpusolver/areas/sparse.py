"""Block areas of the sparse mask forms: NSA block selection and DSA token top-k.

Shape legend: T = S query (and key) tokens, P ranks, c = S / P, G head groups,
Hkv KV heads, n selected blocks per query, k selected tokens per query.

Both reduce to the same BlockAreas as the slice form, with scatter
reductions over flattened ``(g, i, j)`` block ids: static shapes, no host
reads, integer sums (exact, whatever the order).

Area units. ``area[g, i, j]`` counts valid (query, key, KV head) triples of
the KV heads in group ``g``. With ``G == Hkv`` that is the plain (q, k) count
of the group's head; with ``G < Hkv`` each group sums its ``Hkv / G`` heads'
counts. A token top-k selection is shared by all heads, so it is counted once
per group (the same area for every group), as for an ungrouped slice mask.
"""
from __future__ import annotations

import torch

from gpusolver.areas.ref import BIG, finish_needs
from gpusolver.problem import BlockAreas

_INT_DTYPES = (torch.int32, torch.int64)


def _check_positive(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def _check_tokens(name: str, t: torch.Tensor, dims: int, layout: str, cp_size: int) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    T = t.shape[0]
    if T == 0 or T % cp_size:
        raise ValueError(
            f"{name} has T={T} query tokens, which must be a positive multiple of cp_size={cp_size}")
    return T // cp_size


class _BlockAccumulator:
    """Scatter reductions of per-entry contributions into flattened blocks.

    Block ids are ``(g * P + i) * P + j``; every buffer is [G * P * P] int64.
    """

    def __init__(self, num_blocks: int, chunk: int, cp_size: int, device: torch.device):
        self.chunk, self.cp_size = chunk, cp_size
        zeros = torch.zeros(num_blocks, dtype=torch.int64, device=device)
        self.area = zeros
        self.q_lo, self.k_lo = zeros + BIG, zeros + BIG
        self.q_hi, self.k_hi = zeros - BIG, zeros - BIG

    def add(self, block_id, count, row, col_lo, col_hi) -> None:
        """block_id: flattened block of each entry; count: its valid (q, k) entries
        (0 = contributes nothing); row: its global query row; col_lo / col_hi:
        the global key columns [lo, hi) it attends. All the same shape, int64."""
        block_id, count = block_id.reshape(-1), count.reshape(-1)
        has = count > 0
        self.area.scatter_add_(0, block_id, count)
        for buf, values, fill, reduce in ((self.q_lo, row, BIG, "amin"), (self.q_hi, row + 1, -BIG, "amax"),
                                          (self.k_lo, col_lo, BIG, "amin"), (self.k_hi, col_hi, -BIG, "amax")):
            buf.scatter_reduce_(0, block_id, torch.where(has, values.reshape(-1), fill), reduce=reduce)

    def finish(self, head_groups: int) -> BlockAreas:
        P, chunk = self.cp_size, self.chunk
        shape = (head_groups, P, P)
        starts = torch.arange(P, device=self.area.device, dtype=torch.int64) * chunk
        q_need = finish_needs(self.q_lo.view(shape), self.q_hi.view(shape), starts.view(P, 1))
        k_need = finish_needs(self.k_lo.view(shape), self.k_hi.view(shape), starts.view(1, P))
        return BlockAreas(area=self.area.view(shape), q_need=q_need, k_need=k_need, chunk=chunk)


def block_sparse_areas(block_indices: torch.Tensor, block_size: int, cp_size: int,
                       head_groups: int = 1) -> BlockAreas:
    """Block areas of a block-sparse selection (NSA's selection branch).

    block_indices: [T, Hkv, n] int32/int64; query t of KV head h attends the
                   keys of block b = block_indices[t, h, s], i.e.
                   [b * block_size, (b + 1) * block_size), causally clipped to
                   keys <= t. -1 (any negative value) = unused slot. The
                   selected blocks of one (t, h) must be distinct.
    block_size:    l, keys per selection block (need not divide c).
    cp_size:       P; T must be divisible by P.
    head_groups:   G; must divide Hkv. KV head h belongs to group h // (Hkv / G).

    Returns BlockAreas: area [G, P, P] int64 (summed over the group's KV heads,
    see the module docstring); q_need / k_need [G, P, P, 2] int64 chunk-local
    hulls of the rows with a valid entry and of the attended key columns.
    Sync-free: static shapes, no host reads.
    """
    for name, v in (("block_size", block_size), ("cp_size", cp_size), ("head_groups", head_groups)):
        _check_positive(name, v)
    chunk = _check_tokens("block_indices", block_indices, 3, "[T, Hkv, n]", cp_size)
    T, Hkv, n = block_indices.shape
    if Hkv % head_groups:
        raise ValueError(
            f"block_indices has Hkv={Hkv} KV heads, not divisible by head_groups={head_groups}")
    P, G = cp_size, head_groups
    device = block_indices.device
    b = block_indices.long()  # [T, Hkv, n]
    t = torch.arange(T, device=device, dtype=torch.int64).view(T, 1, 1)
    g = (torch.arange(Hkv, device=device, dtype=torch.int64) // (Hkv // G)).view(1, Hkv, 1)
    lo = b * block_size
    hi = torch.minimum(lo + block_size, t + 1)  # causal clip: keys <= t
    lo = torch.where(b >= 0, lo, 0)
    hi = torch.where(b >= 0, hi, 0)
    # A block of l keys straddles at most `span` key chunks (static).
    span = (block_size - 1) // chunk + 2
    first = torch.clamp(lo // chunk, max=P - 1)
    i = t // chunk
    acc = _BlockAccumulator(G * P * P, chunk, P, device)
    for s in range(span):  # static trip count
        j = first + s  # [T, Hkv, n]
        c_lo = torch.maximum(lo, j * chunk)
        c_hi = torch.minimum(hi, (j + 1) * chunk)
        ok = (j < P) & (c_hi > c_lo)
        block_id = (g * P + i) * P + torch.clamp(j, max=P - 1)
        acc.add(block_id, torch.where(ok, c_hi - c_lo, 0), t.expand(T, Hkv, n), c_lo, c_hi)
    return acc.finish(G)


def token_topk_areas(topk_indices: torch.Tensor, cp_size: int, head_groups: int = 1) -> BlockAreas:
    """Block areas of a token top-k selection (DSA's indexer), shared by all heads.

    topk_indices: [T, k] int32/int64; query t attends key topk_indices[t, s].
                  Negative values (-1 = unused) and future keys (> t) are
                  dropped. The keys of one query must be distinct.
    cp_size:      P; T must be divisible by P.
    head_groups:  G; every group gets the same areas and needs.

    Returns BlockAreas: area [G, P, P] int64 (the (q, k) count of each block);
    q_need / k_need [G, P, P, 2] int64 chunk-local hulls of the rows with a
    valid key and of the selected key columns. Sync-free.
    """
    for name, v in (("cp_size", cp_size), ("head_groups", head_groups)):
        _check_positive(name, v)
    chunk = _check_tokens("topk_indices", topk_indices, 2, "[T, k]", cp_size)
    T, k = topk_indices.shape
    P = cp_size
    device = topk_indices.device
    key = topk_indices.long()  # [T, k]
    t = torch.arange(T, device=device, dtype=torch.int64).view(T, 1).expand(T, k)
    ok = (key >= 0) & (key <= t)
    key = torch.where(ok, key, 0)
    block_id = (t // chunk) * P + key // chunk
    acc = _BlockAccumulator(P * P, chunk, P, device)
    acc.add(block_id, ok.long(), t, key, key + 1)
    one = acc.finish(1)
    G = head_groups
    return BlockAreas(area=one.area.expand(G, P, P).contiguous(),
                      q_need=one.q_need.expand(G, P, P, 2).contiguous(),
                      k_need=one.k_need.expand(G, P, P, 2).contiguous(), chunk=chunk)
