"""Per-block work lists for the slice-attention kernels, built on the device with static shapes.

A kernel program owns a block of query rows (forward, dQ) or of key columns
(dK/dV). It must visit only the slices that touch its block, never a padding
row, whatever the capacity R of the slice table. Everything here is torch ops
on the slice tensors' device with shapes that depend on (R, Tq, Tk) and the
block size only: no host read, so it runs on ``meta`` and under CUDA-graph
capture.

Layout. An axis of n positions is cut into ``NB = cdiv(n, block)`` program
blocks, and a dyadic tree is put over them: level l has ``cdiv(NB, 2**l)``
nodes, node i of level l covering blocks ``[i * 2**l, (i + 1) * 2**l)``. Each
slice's block range is split into its canonical nodes (at most two per level,
disjoint, as in a segment tree), so the list has a static capacity of
``2 * levels * R`` items, and the program of block b finds every slice that
touches it exactly once, in the nodes on the path from b to the root (one per
level). Items are sorted by (node, slice), so a program visits its slices in
a fixed order that padding rows cannot change.

    rect   [R, 8] int32             effective slice: qa, qb, ka, kb, dc, di, 0, 0
    ptr    [M + 1] int32            items of flat node m are idx[ptr[m]:ptr[m + 1]]
    idx    [2 * levels * R] int32   slice numbers (the tail past ptr[M] is unused)
    order  [NB] int64               program blocks, heaviest first (most entries)

Flat node ids run level by level (level 0 first). ``rect`` clips each slice to
the tensors: rows ``[qa, qb)`` each see at least one key, keys ``[ka, kb)``
each are seen by at least one row, and ``(q, k)`` is in the slice iff both are
in range and ``q + di <= k <= q + dc``. The diagonals come from the ranges as
given, so a range that runs past a tensor keeps its shape and only loses the
positions outside; a FULL slice gets ``dc = Tk``, ``di = -Tq`` (never binding).
Empty slices get an empty rectangle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorkList:
    """Per-node slice lists of one axis for one program block size (see the module docstring)."""

    ptr: torch.Tensor
    idx: torch.Tensor
    order: torch.Tensor
    num_blocks: int
    levels: int


def level_sizes(n: int, block: int) -> list[int]:
    """Nodes per tree level over an axis of n positions in blocks of ``block`` (down to one top node)."""
    nb = max(1, -(-n // block))
    return [-(-nb // (1 << lev)) for lev in range((nb - 1).bit_length() + 1)]


def slice_rect(q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
               seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Effective slices [R, 8] int32 (qa, qb, ka, kb, dc, di, 0, 0), see the module docstring."""
    qs, qe = q_ranges[:, 0].long(), q_ranges[:, 1].long()
    ks, ke = k_ranges[:, 0].long(), k_ranges[:, 1].long()
    t = attn_type.long()
    causal, inv = (t == 1) | (t == 3), (t == 2) | (t == 3)
    # Clamped to the window: a diagonal outside it binds every entry or none.
    dc = torch.where(causal, ke - qe, seqlen_k).clamp(-seqlen_q - 1, seqlen_k)
    di = torch.where(inv, ks - qs, -seqlen_q).clamp(-seqlen_q, seqlen_k + 1)
    qa, qb = qs.clamp(0, seqlen_q), qe.clamp(0, seqlen_q)
    ka, kb = ks.clamp(0, seqlen_k), ke.clamp(0, seqlen_k)
    # rows with a key: q + dc >= ka and q + di < kb; then keys with a row
    qa, qb = torch.maximum(qa, ka - dc), torch.minimum(qb, kb - di)
    ka, kb = torch.maximum(ka, qa + di), torch.minimum(kb, qb + dc)
    empty = (qb <= qa) | (kb <= ka) | (di > dc)
    zero = torch.zeros_like(qa)
    cols = [torch.where(empty, zero, x) for x in (qa, qb, ka, kb)] + [dc, di, zero, zero]
    return torch.stack(cols, 1).to(torch.int32).contiguous()


def _counts(rect: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """[n] int64: entries of all slices in each row (axis 0) or column (axis 1).

    On its span [A, B) a slice's count is ``W - relu(pc - x) - relu(x - pi)``
    (W the width on the other axis; pc, pi where the two diagonals start to
    bind), so the sum over slices is piecewise linear: slope and intercept
    change at six points per slice, added into difference arrays.
    """
    r = rect.long()
    qa, qb, ka, kb, dc, di = (r[:, i] for i in range(6))
    if axis == 0:
        A, B, W, pc, pi = qa, qb, kb - ka, kb - dc - 1, ka - di
    else:
        A, B, W, pc, pi = ka, kb, qb - qa, qb + di - 1, qa + dc
    E, S = torch.minimum(torch.maximum(pc, A), B), torch.minimum(torch.maximum(pi, A), B)
    one = torch.ones_like(A)
    slope = torch.zeros(n + 1, dtype=torch.int64, device=rect.device)
    icpt = torch.zeros(n + 1, dtype=torch.int64, device=rect.device)
    pos = torch.cat([A, B, A, E, S, B])
    slope.index_add_(0, pos, torch.cat([0 * one, 0 * one, one, -one, -one, one]))
    icpt.index_add_(0, pos, torch.cat([W, -W, -pc, pc, pi, -pi]))
    x = torch.arange(n, device=rect.device)
    return slope.cumsum(0)[:n] * x + icpt.cumsum(0)[:n]


def build(rect: torch.Tensor, axis: int, n: int, block: int) -> WorkList:
    """Work list of the query axis (axis 0, n = Tq) or the key axis (axis 1, n = Tk) for programs of ``block``."""
    dev, R = rect.device, rect.shape[0]
    sizes = level_sizes(n, block)
    L, NB, M = len(sizes), sizes[0], sum(sizes)
    a, b = rect[:, 2 * axis].long(), rect[:, 2 * axis + 1].long()
    b0 = a // block
    b1 = torch.where(b > a, (b + block - 1) // block, b0)
    # Canonical split, all levels at once: at level l the nodes fully inside
    # are [lo, hi); an odd end node is canonical (its parent is not inside).
    lev = torch.arange(L, device=dev)[:, None]
    lo = (b0[None, :] + 2 ** lev - 1) >> lev
    hi = b1[None, :] >> lev
    inside = lo < hi
    first = torch.tensor([sum(sizes[:i]) for i in range(L)], device=dev)[:, None]
    rows = torch.arange(R, device=dev)[None, :]
    none = M * R
    left = torch.where(inside & (lo % 2 == 1), (first + lo) * R + rows, none)
    right = torch.where(inside & (hi % 2 == 1), (first + hi - 1) * R + rows, none)
    key = torch.sort(torch.cat([left.flatten(), right.flatten()])).values
    ptr = torch.searchsorted(key, torch.arange(M + 1, device=dev) * R).to(torch.int32)
    idx = (key % max(R, 1)).to(torch.int32)
    # heaviest first: exact entries per block; a stable sort breaks ties by block number
    w = _counts(rect, axis, n)
    w = torch.nn.functional.pad(w, (0, NB * block - n)).view(NB, block).sum(1)
    order = torch.sort(w, descending=True, stable=True).indices
    return WorkList(ptr=ptr, idx=idx, order=order, num_blocks=NB, levels=L)


def block_pairs(rect: torch.Tensor, axis: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slice [N], block [N]) int64: every (slice, program block) pair a kernel visits (host-side helper)."""
    a, b = rect[:, 2 * axis].long().cpu(), rect[:, 2 * axis + 1].long().cpu()
    b0 = a // block
    nblk = torch.where(b > a, (b + block - 1) // block - b0, torch.zeros_like(a))
    r = torch.repeat_interleave(torch.arange(rect.shape[0]), nblk)
    start = torch.repeat_interleave(torch.cumsum(nblk, 0) - nblk, nblk)
    return r, b0[r] + torch.arange(r.numel()) - start


def inner_iterations(rect: torch.Tensor, axis: int, n: int, block: int, inner_block: int) -> dict[str, int]:
    """What the kernels' loops over this axis cost (host-side twin of their counters, for tests and benchmarks).

    axis 0: forward / dQ programs over query blocks of ``block`` rows, key
    blocks of ``inner_block``; axis 1: dK/dV programs over key blocks, query
    blocks of ``inner_block``. Returns ``visits`` (slice visits, summed over
    programs), ``iterations`` (inner-loop iterations) and ``interior`` (those
    without a mask), per head.
    """
    r, blk = block_pairs(rect, axis, block)
    x = rect.long().cpu()[r]
    qa, qb, ka, kb, dc, di = (x[:, i] for i in range(6))
    p0 = blk * block
    if axis == 0:
        lo, hi = torch.maximum(qa, p0), torch.minimum(qb, p0 + block)
        o_lo, o_hi = torch.maximum(ka, lo + di), torch.minimum(kb, hi + dc)
        full = (lo == p0) & (hi == p0 + block)
        a, b = torch.maximum(o_lo, hi - 1 + di), torch.minimum(o_hi, lo + dc + 1)
    else:
        lo, hi = torch.maximum(ka, p0), torch.minimum(kb, p0 + block)
        o_lo, o_hi = torch.maximum(qa, lo - dc), torch.minimum(qb, hi - di)
        full = (lo == p0) & (hi == p0 + block)
        a, b = torch.maximum(o_lo, hi - 1 - dc), torch.minimum(o_hi, lo - di + 1)
    span = (o_hi - o_lo).clamp(min=0)
    j_a = (a - o_lo + inner_block - 1).div(inner_block, rounding_mode="floor").clamp(min=0)
    j_b = (b - o_lo).div(inner_block, rounding_mode="floor")
    interior = torch.where(full & (j_b > j_a), j_b - j_a, torch.zeros_like(j_a))
    iters = (span + inner_block - 1) // inner_block
    return dict(visits=int(r.numel()), iterations=int(iters.sum()), interior=int(interior.sum()))
