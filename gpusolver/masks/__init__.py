"""Attention masks in the three device-tensor forms the solver reads.

Slices (``AttnSlices``: ``q_ranges [R, 2]``, ``k_ranges [R, 2]`` int32 half-open,
``attn_type [R]`` int32 codes FULL/CAUSAL/INV_CAUSAL/BI_CAUSAL, optionally with a
leading head-group dim ``[G, R, ...]``), block-sparse NSA selections
(``BlockSparseMask``: ``block_indices [T, Hkv, n]`` int32, -1 unused) and DSA
token top-k (``TokenTopKMask``: ``topk_indices [T, k]`` int32/int64, -1 and
future keys dropped). The constructors build common slice masks on the host,
the generators draw seeded packed-document and sparse selections for tests and
benchmarks, and ``validate_slices`` / ``slices_to_dense`` are the host-side
checks and dense oracle. Shape legend: S tokens (S_q, S_k), R slices, G head
groups, T query tokens, Hkv KV heads, n blocks per selection, k tokens per
selection.
"""
from gpusolver.masks.constructors import (
    causal_mask,
    full_mask,
    prefix_lm_mask,
    sliding_window_mask,
    varlen_causal_mask,
    varlen_full_mask,
    varlen_prefix_lm_mask,
)
from gpusolver.masks.generators import (
    dsa_topk_indices,
    nsa_block_indices,
    packed_document_lengths,
    packed_documents,
)
from gpusolver.masks.slices import AttnSlices
from gpusolver.masks.types import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL
from gpusolver.masks.sparse import BlockSparseMask, TokenTopKMask
from gpusolver.masks.validation import check_heads, slices_to_dense, validate_slices

__all__ = [
    "AttnSlices", "FULL", "CAUSAL", "INV_CAUSAL", "BI_CAUSAL",
    "full_mask", "causal_mask", "sliding_window_mask", "varlen_full_mask", "varlen_causal_mask",
    "prefix_lm_mask", "varlen_prefix_lm_mask",
    "packed_document_lengths", "packed_documents", "nsa_block_indices", "dsa_topk_indices",
    "BlockSparseMask", "TokenTopKMask",
    "validate_slices", "slices_to_dense", "check_heads",
]
