"""Block areas of the sparse mask forms: NSA block selection and DSA token top-k.

Shape legend: S tokens, P ranks, c = S / P, U units of ``chunk`` tokens (U = P,
or n * P with n sub-chunk tiles), m query units held by a shard, G head
groups, Hkv KV heads, n selected blocks per query, k selected tokens per query.

Both reduce to the same BlockAreas as the slice form, with scatter
reductions over flattened ``(g, i, j)`` block ids: static shapes, no host
reads, integer sums (exact, whatever the order).

Sharded indexers. A rank holds only its own queries' selections, so it
computes its row of the problem, ``area[:, i, :]`` for its own query units
(``AreaRows``); an all-gather over the CP group stacks the rows into the full
BlockAreas (``AreaRows.pack`` / ``areas_from_rows``), and every rank solves
the same problem. The whole-mask functions are the same code with every row.

Area units. ``area[g, i, j]`` counts valid (query, key, KV head) triples of
the KV heads in group ``g``. With ``G == Hkv`` that is the plain (q, k) count
of the group's head; with ``G < Hkv`` each group sums its ``Hkv / G`` heads'
counts. A token top-k selection is shared by all heads, so it is counted once
per group (the same area for every group), as for an ungrouped slice mask.
An NSA layer's window branch applies to every KV head, so it counts
``Hkv / G`` times per group, like the selection it is added to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpusolver.areas.ref import BIG, finish_needs
from gpusolver.masks.sparse import BlockSparseMask, NSALayerMask, TokenTopKMask
from gpusolver.problem import BlockAreas

_INT_DTYPES = (torch.int32, torch.int64)
SparseMask = BlockSparseMask | TokenTopKMask | NSALayerMask


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


@dataclass(frozen=True)
class AreaRows:
    """The block areas of a shard's query units against every key unit.

    area:       [G, m, U] int64; q_need / k_need: [G, m, U, 2] int64, unit-local
                [lo, hi) as in BlockAreas.
    first_unit: the global index of the shard's first query unit (host int).
    chunk:      tokens per unit (host int).
    """

    area: torch.Tensor
    q_need: torch.Tensor
    k_need: torch.Tensor
    first_unit: int
    chunk: int

    def pack(self) -> torch.Tensor:
        """[m, G, U, 5] int64 (area, q_need, k_need): one tensor for one all-gather along dim 0."""
        return torch.cat((self.area[..., None], self.q_need, self.k_need), dim=-1).transpose(0, 1).contiguous()


def areas_from_rows(packed: torch.Tensor, chunk: int, tiles: int = 1) -> BlockAreas:
    """BlockAreas from the all-gathered rows: packed [U, G, U, 5] int64 (every shard's
    ``AreaRows.pack()`` stacked in rank order along dim 0). Sync-free."""
    full = packed.transpose(0, 1)  # [G, U, U, 5]
    return BlockAreas(area=full[..., 0].contiguous(), q_need=full[..., 1:3].contiguous(),
                      k_need=full[..., 3:5].contiguous(), chunk=chunk, tiles=tiles)


class _BlockAccumulator:
    """Scatter reductions of per-entry contributions into flattened blocks.

    Block ids are ``(g * m + i) * U + j`` for the m query units from ``first_unit``;
    every buffer is [G * m * U] int64.
    """

    def __init__(self, groups: int, m: int, units: int, first_unit: int, chunk: int, device: torch.device):
        self.G, self.m, self.U, self.first_unit, self.chunk = groups, m, units, first_unit, chunk
        zeros = torch.zeros(groups * m * units, dtype=torch.int64, device=device)
        self.area = zeros
        self.q_lo, self.k_lo = zeros + BIG, zeros + BIG
        self.q_hi, self.k_hi = zeros - BIG, zeros - BIG

    def add(self, block_id, count, row, col_lo, col_hi) -> None:
        """block_id: flattened block of each entry; count: its weighted valid (q, k) entries
        (0 = contributes nothing); row: its global query row; col_lo / col_hi:
        the global key columns [lo, hi) it attends. All the same shape, int64."""
        block_id, count = block_id.reshape(-1), count.reshape(-1)
        has = count > 0
        self.area.scatter_add_(0, block_id, count)
        for buf, values, fill, reduce in ((self.q_lo, row, BIG, "amin"), (self.q_hi, row + 1, -BIG, "amax"),
                                          (self.k_lo, col_lo, BIG, "amin"), (self.k_hi, col_hi, -BIG, "amax")):
            buf.scatter_reduce_(0, block_id, torch.where(has, values.reshape(-1), fill), reduce=reduce)

    def add_intervals(self, g, t, lo, hi, weight: int = 1) -> None:
        """Entries that each attend one key interval: g (head group), t (global query row),
        [lo, hi) (global keys, empty when hi <= lo); broadcastable int64 tensors."""
        g, t, lo, hi = torch.broadcast_tensors(g, t, lo, hi)
        U, chunk = self.U, self.chunk
        i = t // chunk - self.first_unit
        first = torch.clamp(lo // chunk, 0, U - 1)
        for s in range(self._span):  # static trip count
            j = first + s
            c_lo = torch.maximum(lo, j * chunk)
            c_hi = torch.minimum(hi, (j + 1) * chunk)
            ok = (j < U) & (c_hi > c_lo)
            block_id = (g * self.m + i) * U + torch.clamp(j, max=U - 1)
            self.add(block_id, torch.where(ok, (c_hi - c_lo) * weight, 0), t, c_lo, c_hi)

    def span_for(self, width: int) -> "_BlockAccumulator":
        """Intervals of at most ``width`` keys straddle at most this many units (static)."""
        self._span = min(self.U, (width - 1) // self.chunk + 2) if width > 1 else 1
        return self

    def finish(self) -> AreaRows:
        G, m, U, chunk = self.G, self.m, self.U, self.chunk
        shape = (G, m, U)
        dev = self.area.device
        q_start = (self.first_unit + torch.arange(m, device=dev, dtype=torch.int64)) * chunk
        k_start = torch.arange(U, device=dev, dtype=torch.int64) * chunk
        q_need = finish_needs(self.q_lo.view(shape), self.q_hi.view(shape), q_start.view(m, 1))
        k_need = finish_needs(self.k_lo.view(shape), self.k_hi.view(shape), k_start.view(1, U))
        return AreaRows(area=self.area.view(shape), q_need=q_need, k_need=k_need, first_unit=self.first_unit,
                        chunk=chunk)


def _unit_rows(name: str, T: int, offset: int, seqlen: int, num_units: int) -> tuple[int, int, int]:
    """(chunk, first unit, m) of a shard of T rows from ``offset`` in a sequence of ``seqlen`` tokens."""
    if seqlen % num_units:
        raise ValueError(f"total_seqlen_k={seqlen} must be divisible by the {num_units} units "
                         "(cp_size * chunk tiles); pad the sequence")
    chunk = seqlen // num_units
    if T == 0 or T % chunk or offset % chunk or offset + T > seqlen:
        raise ValueError(f"{name} holds T={T} rows from query_offset={offset}; a shard must be whole units of "
                         f"{chunk} tokens inside the {seqlen}-token sequence (rank * c rows from rank * c)")
    return chunk, offset // chunk, T // chunk


def _block_rows(block_indices, block_size, offset, acc, Hkv, G) -> None:
    T, _, n = block_indices.shape
    device = block_indices.device
    b = block_indices.long()  # [T, Hkv, n]
    t = offset + torch.arange(T, device=device, dtype=torch.int64).view(T, 1, 1)
    g = (torch.arange(Hkv, device=device, dtype=torch.int64) // (Hkv // G)).view(1, Hkv, 1)
    lo = b * block_size
    hi = torch.minimum(lo + block_size, t + 1)  # causal clip: keys <= t
    acc.span_for(block_size).add_intervals(g, t, torch.where(b >= 0, lo, 0), torch.where(b >= 0, hi, 0))


def _window_rows(T, offset, window, acc, device, weight) -> None:
    t = offset + torch.arange(T, device=device, dtype=torch.int64).view(1, T)
    g = torch.arange(acc.G, device=device, dtype=torch.int64).view(acc.G, 1)
    acc.span_for(window).add_intervals(g, t, torch.clamp(t - window + 1, min=0), t + 1, weight)


def _topk_rows(topk, offset, acc) -> None:
    T, k = topk.shape
    device = topk.device
    key = topk.long()  # [T, k]
    t = offset + torch.arange(T, device=device, dtype=torch.int64).view(T, 1)
    ok = (key >= 0) & (key <= t)
    key = torch.where(ok, key, 0)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    acc.span_for(1).add_intervals(zero, t, key, torch.where(ok, key + 1, key))


class _UsedBlocks:
    """Which key blocks of ``block`` tokens some row of each query unit attends: [G * m * NB] bool,
    ids ``(g * m + i) * NB + b``. The same interface as ``_BlockAccumulator`` (intervals in)."""

    def __init__(self, groups: int, m: int, first_unit: int, chunk: int, seqlen: int, block: int, device):
        self.G, self.m, self.first_unit, self.chunk, self.block = groups, m, first_unit, chunk, block
        self.NB = -(-seqlen // block)
        self.used = torch.zeros(groups * m * self.NB + 1, dtype=torch.bool, device=device)  # last: a sink

    def span_for(self, width: int) -> "_UsedBlocks":
        self._span = (width - 1) // self.block + 2 if width > 1 else 1
        return self

    def add_intervals(self, g, t, lo, hi, weight: int = 1) -> None:
        g, t, lo, hi = torch.broadcast_tensors(g, t, lo, hi)
        i = t // self.chunk - self.first_unit
        first = lo // self.block
        sink = self.used.numel() - 1
        for s in range(self._span):  # static trip count
            b = first + s
            ok = (hi > lo) & (b * self.block < hi) & (b < self.NB)
            at = torch.where(ok, (g * self.m + i) * self.NB + b, sink)
            self.used.index_fill_(0, at.reshape(-1), True)

    def finish(self) -> torch.Tensor:
        return self.used[:-1].view(self.G, self.m, self.NB)


def _fill_rows(mask: SparseMask, acc, G: int) -> None:
    """Feed every entry of the mask's rows to ``acc`` as key intervals (areas or used blocks)."""
    if isinstance(mask, TokenTopKMask):
        _topk_rows(mask.topk_indices, mask.query_offset, acc)
        return
    sel = mask if isinstance(mask, BlockSparseMask) else mask.selection
    T, Hkv, _ = sel.block_indices.shape
    if Hkv % G:
        raise ValueError(f"block_indices has Hkv={Hkv} KV heads, not divisible by head_groups={G}")
    _block_rows(sel.block_indices, sel.block_size, sel.query_offset, acc, Hkv, G)
    if isinstance(mask, NSALayerMask):
        _window_rows(T, sel.query_offset, mask.window_size, acc, sel.device, Hkv // G)


def used_block_rows(mask: SparseMask, num_units: int, head_groups: int, block: int) -> torch.Tensor:
    """[G, m, NB] bool: key block b (tokens [b * block, (b + 1) * block)) holds a key that some row of
    the shard's query unit i attends for group g (NB = ceil(S / block); a token top-k mask is the
    same for every group). What a block-granular KV transfer moves. Sync-free."""
    _check_positive("num_units", num_units)
    _check_positive("head_groups", head_groups)
    _check_positive("block", block)
    rows = _selection_rows(mask)
    chunk, first, m = _unit_rows(rows[0], rows[1], mask.query_offset, mask.total_seqlen_k, num_units)
    if isinstance(mask, TokenTopKMask):
        acc = _UsedBlocks(1, m, first, chunk, mask.total_seqlen_k, block, mask.device)
        _fill_rows(mask, acc, 1)
        one = acc.finish()
        return one.expand(head_groups, *one.shape[1:]).contiguous()
    acc = _UsedBlocks(head_groups, m, first, chunk, mask.total_seqlen_k, block, mask.device)
    _fill_rows(mask, acc, head_groups)
    return acc.finish()


def _selection_rows(mask: SparseMask) -> tuple[str, int]:
    if isinstance(mask, TokenTopKMask):
        return "topk_indices", mask.topk_indices.shape[0]
    if not isinstance(mask, (BlockSparseMask, NSALayerMask)):
        raise TypeError(f"mask must be a BlockSparseMask, TokenTopKMask or NSALayerMask, got {type(mask).__name__}")
    sel = mask if isinstance(mask, BlockSparseMask) else mask.selection
    return "block_indices", sel.block_indices.shape[0]


def sparse_area_rows(mask: SparseMask, num_units: int, head_groups: int = 1) -> AreaRows:
    """The block areas of the query units a sparse mask's rows cover (one rank's row of the problem).

    mask:        BlockSparseMask, TokenTopKMask or NSALayerMask whose T rows start at
                 ``query_offset`` (whole units; the whole sequence when offset 0 and T = S).
    num_units:   U = cp_size * chunk tiles; total_seqlen_k must be divisible by U.
    head_groups: G; must divide the mask's Hkv (block forms).

    Returns AreaRows with area [G, m, U], needs [G, m, U, 2] (m = T / (S / U)).
    Sync-free: static shapes, no host reads.
    """
    _check_positive("num_units", num_units)
    _check_positive("head_groups", head_groups)
    G = head_groups
    name, T = _selection_rows(mask)
    chunk, first, m = _unit_rows(name, T, mask.query_offset, mask.total_seqlen_k, num_units)
    if isinstance(mask, TokenTopKMask):
        acc = _BlockAccumulator(1, m, num_units, first, chunk, mask.device)
        _fill_rows(mask, acc, 1)
        rows = acc.finish()
        return AreaRows(rows.area.expand(G, m, num_units).contiguous(),
                        rows.q_need.expand(G, m, num_units, 2).contiguous(),
                        rows.k_need.expand(G, m, num_units, 2).contiguous(), first, chunk)
    acc = _BlockAccumulator(G, m, num_units, first, chunk, mask.device)
    _fill_rows(mask, acc, G)
    return acc.finish()


def sparse_areas(mask: SparseMask, cp_size: int, head_groups: int = 1, tiles: int = 1) -> BlockAreas:
    """Block areas of a whole-sequence sparse mask (every row, query_offset 0): BlockAreas with
    area [G, U, U] int64 and needs [G, U, U, 2], U = tiles * cp_size. Sync-free."""
    _check_positive("cp_size", cp_size)
    _check_positive("tiles", tiles)
    rows = sparse_area_rows(mask, cp_size * tiles, head_groups)
    if rows.first_unit != 0 or rows.area.shape[1] != cp_size * tiles:
        raise ValueError("sparse_areas needs the whole sequence's rows (query_offset 0, T = S); "
                         "for a shard use sparse_area_rows and gather the rows")
    return BlockAreas(rows.area, rows.q_need, rows.k_need, rows.chunk).as_tiles(tiles)


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
    T, Hkv, _ = block_indices.shape
    if Hkv % head_groups:
        raise ValueError(
            f"block_indices has Hkv={Hkv} KV heads, not divisible by head_groups={head_groups}")
    acc = _BlockAccumulator(head_groups, cp_size, cp_size, 0, chunk, block_indices.device)
    _block_rows(block_indices, block_size, 0, acc, Hkv, head_groups)
    rows = acc.finish()
    return BlockAreas(rows.area, rows.q_need, rows.k_need, chunk)


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
    P = cp_size
    acc = _BlockAccumulator(1, P, P, 0, chunk, topk_indices.device)
    _topk_rows(topk_indices, 0, acc)
    one = acc.finish()
    G = head_groups
    return BlockAreas(area=one.area.expand(G, P, P).contiguous(),
                      q_need=one.q_need.expand(G, P, P, 2).contiguous(),
                      k_need=one.k_need.expand(G, P, P, 2).contiguous(), chunk=chunk)
