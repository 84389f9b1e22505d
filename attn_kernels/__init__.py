"""Attention kernels over slice masks, with torch twins and torch.library ops.

Shape legend:

    Tq, Tk   query / key tokens held by this call
    Hq, Hkv  query / KV heads (Hq a multiple of Hkv: GQA; equal: MHA)
    D        head dim, one of 16, 32, 64, 128
    R        slices (rows of q_ranges / k_ranges / attn_type), padded freely

    q              [Tq, Hq, D]   fp16 / bf16 (GPU), fp32 / fp16 (CPU)
    k, v           [Tk, Hkv, D]  same dtype as q
    q_ranges       [R, 2] int32  half-open query rows of each slice
    k_ranges       [R, 2] int32  half-open key columns of each slice
    attn_type      [R] int32     0 FULL, 1 CAUSAL, 2 INV_CAUSAL, 3 BI_CAUSAL
    out            [Tq, Hq, D]   q's dtype, 0 for rows with no valid key
    lse            [Tq, Hq] fp32 natural log, -inf for rows with no valid key

    dout           [Tq, Hq, D]   gradient of the final out, q's dtype
    delta          [Tq, Hq] fp32 rowsum(dout * out) - dlse of the final out

Public names: ``flex_attn`` (forward + autograd), ``flex_attn_backward`` (the
backward of a part of each row's keys from the row's final lse and delta),
``row_delta`` (that delta, computed where the row's final out lives),
``merge_out_lse`` and its in-place ``merge_out_lse_`` (log-sum-exp merge of
partial results), and the ``reference`` module (dense-mask oracle for tests).
"""
from attn_kernels import reference
from attn_kernels.flex_attn.op import flex_attn, flex_attn_backward, row_delta
from attn_kernels.merge import merge_out_lse, merge_out_lse_

__all__ = ["flex_attn", "flex_attn_backward", "merge_out_lse", "merge_out_lse_", "reference", "row_delta"]

# sparse attention (NSA block selection, DSA token top-k)
from attn_kernels.sparse_attn import sparse_attn, sparse_attn_backward  # noqa: E402

__all__ += ["sparse_attn", "sparse_attn_backward"]
