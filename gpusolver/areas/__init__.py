"""Block areas and needed token intervals: every mask form -> BlockAreas.

Shape legend: S tokens (queries = keys), P ranks, c = S / P tokens per chunk,
G head groups, R slices, T = S query tokens of a sparse selection.

    area:   [G, P, P]    int64, valid (q, k) entries of block (g, i, j)
                         ([G, U, U] over units of c / n tokens with ``tiles=n``)
    q_need: [G, P, P, 2] int64, chunk-local [lo, hi) rows of query chunk i in use
    k_need: [G, P, P, 2] int64, chunk-local [lo, hi) columns of key chunk j in use

Block (g, i, j) is rows [i*c, (i+1)*c) x columns [j*c, (j+1)*c). Every
function here is sync-free (static shapes, no host reads).
"""
from __future__ import annotations

from gpusolver.areas.kernel import block_areas_triton
from gpusolver.areas.ref import block_areas_torch
from gpusolver.areas.sparse import block_sparse_areas, token_topk_areas
from gpusolver.masks.slices import AttnSlices
from gpusolver.problem import BlockAreas

__all__ = ["block_areas", "block_areas_torch", "block_areas_triton", "block_sparse_areas", "token_topk_areas"]

_IMPLS = ("auto", "torch", "triton")


def block_areas(mask: AttnSlices, cp_size: int, head_groups: int = 1, impl: str = "auto",
                tiles: int = 1, *, flag_errors: bool = True) -> BlockAreas:
    """Exact block areas and needed intervals of a slice mask.

    mask:        AttnSlices, q_ranges / k_ranges [R, 2] or [G, R, 2], attn_type
                 [R] or [G, R], int32 or int64; self-attention, so
                 total_seqlen_q == total_seqlen_k = S, divisible by cp_size.
    cp_size:     P, ranks of the CP group.
    head_groups: G; a grouped mask's leading dim must equal it, an
                 ungrouped mask is shared by every group.
    impl:        "torch", "triton", or "auto" (Triton on CUDA, torch elsewhere).
    tiles:       n sub-chunk tiles per rank's chunk (units of c / n tokens; S
                 divisible by n * P).
    flag_errors: record a reversed or out-of-range slice row, or a bad type
                 code, as a device error flag (``gpusolver.check_errors()``;
                 no host read; one launch on CUDA). The areas of such a mask
                 are meaningless, and the plan built from them has
                 INVALID_MASK in its status.

    Returns BlockAreas(area [G, U, U] int64, q_need / k_need [G, U, U, 2]
    int64, chunk = S / U, tiles = n) with U = n * P. Both implementations give
    identical integers.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles must be a positive int, got {tiles!r}")
    if impl == "auto":
        impl = "triton" if isinstance(mask, AttnSlices) and mask.device.type == "cuda" else "torch"
    if flag_errors and isinstance(mask, AttnSlices):
        from gpusolver.errors import record_slices

        record_slices("block_areas", mask)
    units = cp_size * tiles
    areas = block_areas_triton(mask, units, head_groups) if impl == "triton" else \
        block_areas_torch(mask, units, head_groups)
    return areas.as_tiles(tiles)

