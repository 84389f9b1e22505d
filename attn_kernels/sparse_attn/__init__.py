"""Sparse attention: each query row attends only the keys it selected.

Two selection forms, one kernel: NSA's block selection (``sel [Tq, Hkv, n]``
key-block indices, blocks of ``l`` keys, per KV head) and DSA's token top-k
(``sel [Tq, k]`` key indices shared by every head, ``l = 1``). A call runs a
query buffer against a key buffer that holds some windows of global keys at
known rows, keeping only the selected keys inside those windows and not after
the query's position (causal). This is what a rank computes for the tasks a
plan gives it.

Shape legend:

    q              [Tq, Hq, D]    fp16 / bf16 / fp32
    k, v           [Tk, Hkv, D]   same dtype as q
    sel            [Tq, Hs, n]    int32, Hs in {1, Hkv}; -1 = unused slot
    q_pos          [Tq]           int32 global query position (-1: padding row)
    q_class        [Tq]           int32 row class (its row of kv_windows)
    kv_windows     [C, W, 3]      int32 (lo, hi, offset) per class and window of keys
    out            [Tq, Hq, D]    q's dtype, 0 for rows with no kept key
    lse            [Tq, Hq]       fp32 natural log, -inf for rows with no kept key
    delta          [Tq, Hq]       fp32 rowsum(dout * out) - dlse of the final out

Files: ``kernel.py`` (Triton), ``ref.py`` (torch twin, the oracle), ``op.py``
(custom ops, checks, public functions).
"""
from attn_kernels.sparse_attn.op import selection_dense_mask, sparse_attn, sparse_attn_backward, validate_selection

__all__ = ["sparse_attn", "sparse_attn_backward", "validate_selection", "selection_dense_mask"]
