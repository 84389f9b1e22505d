"""Block areas of a slice mask in closed form: the torch version.

Shape legend: G head groups, R slices, P ranks, c = S / P tokens per chunk.

Block ``(g, i, j)`` covers query rows ``[i*c, (i+1)*c)`` and key columns
``[j*c, (j+1)*c)``. A slice ``[qs, qe) x [ks, ke)`` of type ``t`` cut by
the block keeps rows ``[Q0, Q1)`` and columns ``[L, E)``:

    Q0 = max(qs, i*c), Q1 = min(qe, (i+1)*c), L = max(ks, j*c), E = min(ke, (j+1)*c)

Row ``q`` keeps the columns ``k`` in ``[L, E)`` with ``a <= k - q < b``:

    a = ks - qs      for INV_CAUSAL / BI_CAUSAL, else -inf
    b = ke - qe + 1  for CAUSAL / BI_CAUSAL,     else +inf

Counting. ``N(t) = #{(q, k) : Q0 <= q < Q1, L <= k < E, k - q < t}``. Row
``q`` contributes ``clamp(q + t - L, 0, W)`` with ``W = E - L``, so with
``H(x) = sum_{y < x} clamp(y, 0, W)``

    H(x) = 0                          x <= 0
         = x (x - 1) / 2              0 < x <= W
         = W (W - 1) / 2 + (x - W) W  x > W

``N(t) = H(Q1 + t - L) - H(Q0 + t - L)`` and the slice's area in the block is
``N(b) - N(a)`` (zero when the rows or columns are empty or ``a >= b``).
``N`` is flat below ``t = L - Q1`` (zero) and above ``t = E - Q0`` (every
row full), so ``t`` is clamped to that range first: the infinities become
finite and every product stays of the order of ``S^2``.

Needs. Row ``q`` has a valid column iff ``L - b < q < E - a``; column ``k``
is attended by some row iff ``Q0 + a <= k < Q1 + b - 1``. So a slice needs
rows ``[max(Q0, L - b + 1), min(Q1, E - a))`` and columns
``[max(L, Q0 + a), min(E, Q1 + b - 1))``. A block's needs are the hulls of
those of its slices with a non-zero area, in chunk-local coordinates;
an empty block gets ``[0, 0)``.
"""
from __future__ import annotations

import torch

from gpusolver.masks.slices import AttnSlices
from gpusolver.masks.types import BI_CAUSAL, CAUSAL, INV_CAUSAL
from gpusolver.problem import BlockAreas


# Stands in for +-inf in the diagonal offsets a, b (int64, far beyond any S).
BIG = 2 ** 40

# Slices per step of the torch version: bounds the [G, R_TILE, P, P] working set.
_MAX_TILE_ELEMS = 1 << 22


def check_block_areas_args(mask: AttnSlices, cp_size: int, head_groups: int) -> int:
    """Host-metadata checks shared by both implementations; returns the chunk c."""
    if not isinstance(mask, AttnSlices):
        raise TypeError(f"mask must be an AttnSlices, got {type(mask).__name__}")
    for name, v in (("cp_size", cp_size), ("head_groups", head_groups)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    S_q, S_k = mask.total_seqlen_q, mask.total_seqlen_k
    if S_q != S_k:
        raise ValueError(
            f"total_seqlen_q={S_q} must equal total_seqlen_k={S_k}: context-parallel block "
            "areas are defined for self-attention only")
    if S_q % cp_size:
        raise ValueError(
            f"total_seqlen_q={S_q} is not divisible by cp_size={cp_size}; pad the sequence "
            f"to a multiple of {cp_size}")
    if mask.grouped and mask.q_ranges.shape[0] != head_groups:
        raise ValueError(
            f"mask has a head-group dim of {mask.q_ranges.shape[0]} but head_groups={head_groups}; "
            "pass head_groups equal to the mask's leading dim, or an ungrouped [R, 2] mask")
    return S_q // cp_size


def _tri(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """H(x) of the module docstring: sum over integers y < x of clamp(y, 0, w)."""
    inside = x * (x - 1) // 2
    beyond = w * (w - 1) // 2 + (x - w) * w
    return torch.where(x <= 0, 0, torch.where(x <= w, inside, beyond))


def slice_block_terms(qs, qe, ks, ke, ty, r0, r1, c0, c1):
    """Area and needs of slices cut by blocks (broadcasting int64 tensors).

    qs, qe, ks, ke, ty: slice bounds and type; r0, r1: block rows; c0, c1:
    block columns. All broadcast together to one shape ``X``.

    Returns (area, row_lo, row_hi, col_lo, col_hi), each int64 of shape X, in
    global coordinates; the needs are meaningful only where area > 0.
    """
    Q0, Q1 = torch.maximum(qs, r0), torch.minimum(qe, r1)
    L, E = torch.maximum(ks, c0), torch.minimum(ke, c1)
    inv = (ty == INV_CAUSAL) | (ty == BI_CAUSAL)
    causal = (ty == CAUSAL) | (ty == BI_CAUSAL)
    a = torch.where(inv, ks - qs, -BIG)
    b = torch.where(causal, ke - qe + 1, BIG)
    W = E - L
    t_lo, t_hi = L - Q1, E - Q0

    def count_below(t):
        t = torch.minimum(torch.maximum(t, t_lo), t_hi)
        return _tri(Q1 + t - L, W) - _tri(Q0 + t - L, W)

    valid = (Q1 > Q0) & (W > 0) & (a < b)
    area = torch.where(valid, count_below(b) - count_below(a), 0)
    row_lo, row_hi = torch.maximum(Q0, L - b + 1), torch.minimum(Q1, E - a)
    col_lo, col_hi = torch.maximum(L, Q0 + a), torch.minimum(E, Q1 + b - 1)
    return area, row_lo, row_hi, col_lo, col_hi


def finish_needs(lo: torch.Tensor, hi: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """Global hull [lo, hi) -> chunk-local [G, P, P, 2] int64, [0, 0) where empty."""
    empty = hi <= lo
    return torch.stack((torch.where(empty, 0, lo - origin), torch.where(empty, 0, hi - origin)), dim=-1)


def block_areas_torch(mask: AttnSlices, cp_size: int, head_groups: int = 1) -> BlockAreas:
    """Exact block areas and needed intervals of a slice mask (torch, sync-free).

    mask:        AttnSlices, q_ranges / k_ranges [R, 2] or [G, R, 2], attn_type
                 [R] or [G, R], int32 or int64; total_seqlen_q == total_seqlen_k = S.
    cp_size:     P; S must be divisible by P.
    head_groups: G; must equal the mask's leading dim when it is grouped.

    Returns BlockAreas with area [G, P, P] int64 and q_need / k_need
    [G, P, P, 2] int64 (chunk-local [lo, hi)), chunk = S / P.

    Static shapes, no host reads: runs on any device, including "meta".
    """
    chunk = check_block_areas_args(mask, cp_size, head_groups)
    # an ungrouped mask is the same for every group: count once, expand at the end
    G_mask = head_groups if mask.grouped else 1
    q_ranges, k_ranges, attn_type = mask.per_group(G_mask)  # [G, R, 2], [G, R, 2], [G, R]
    G, R, P = G_mask, q_ranges.shape[1], cp_size
    device = q_ranges.device
    starts = torch.arange(P, device=device, dtype=torch.int64) * chunk  # [P]
    r0, r1 = starts.view(P, 1), starts.view(P, 1) + chunk  # [P(i), 1]
    c0, c1 = starts.view(1, P), starts.view(1, P) + chunk  # [1, P(j)]

    area = torch.zeros(G, P, P, dtype=torch.int64, device=device)
    q_lo = torch.full((G, P, P), BIG, dtype=torch.int64, device=device)
    k_lo = torch.full((G, P, P), BIG, dtype=torch.int64, device=device)
    q_hi = torch.full((G, P, P), -BIG, dtype=torch.int64, device=device)
    k_hi = torch.full((G, P, P), -BIG, dtype=torch.int64, device=device)
    tile = max(1, _MAX_TILE_ELEMS // (G * P * P))
    for s in range(0, R, tile):  # static trip count: R and the tile are shapes
        # [G, r, 1, 1] slice fields against [P, 1] rows and [1, P] columns
        qs, qe = q_ranges[:, s:s + tile, 0, None, None], q_ranges[:, s:s + tile, 1, None, None]
        ks, ke = k_ranges[:, s:s + tile, 0, None, None], k_ranges[:, s:s + tile, 1, None, None]
        ty = attn_type[:, s:s + tile, None, None]
        blk, rlo, rhi, clo, chi = slice_block_terms(qs, qe, ks, ke, ty, r0, r1, c0, c1)  # [G, r, P, P]
        has = blk > 0
        area += blk.sum(dim=1)
        q_lo = torch.minimum(q_lo, torch.where(has, rlo, BIG).amin(dim=1))
        q_hi = torch.maximum(q_hi, torch.where(has, rhi, -BIG).amax(dim=1))
        k_lo = torch.minimum(k_lo, torch.where(has, clo, BIG).amin(dim=1))
        k_hi = torch.maximum(k_hi, torch.where(has, chi, -BIG).amax(dim=1))

    q_need = finish_needs(q_lo, q_hi, r0)
    k_need = finish_needs(k_lo, k_hi, c0)
    return BlockAreas(area=area, q_need=q_need, k_need=k_need, chunk=chunk).expand_groups(head_groups)
