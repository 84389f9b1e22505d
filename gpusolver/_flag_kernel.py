"""One-launch device check of a slice table for ``gpusolver.errors`` (CUDA; the interpreter in tests).

One program walks the ``[N, 2]`` ranges and ``[N]`` types in blocks, keeps the
first bad row, and updates the error table the way ``errors.record`` does,
so the two leave equal tables: the clock ticks on every check, and when a
row is bad ``hits`` grows and the first hit keeps (clock, row, values). The
values are those of ``errors.record_slice_table``: (0 q / 1 k / 2 type,
start or code, end, limit, rows per group). Every load is masked by N; the table row is written
by this one program only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _flag_slices_kernel(p_q, p_k, p_t, p_table, N, S_Q, S_K, ROWS, SLOT, CLOCK, NONE, COLS: tl.constexpr,
                        BLOCK: tl.constexpr):
    best = N
    for start in range(0, N, BLOCK):
        o_n = start + tl.arange(0, BLOCK)
        m_n = o_n < N
        # [BLOCK]
        b_qs = tl.load(p_q + 2 * o_n, mask=m_n, other=0).to(tl.int64)
        b_qe = tl.load(p_q + 2 * o_n + 1, mask=m_n, other=0).to(tl.int64)
        b_ks = tl.load(p_k + 2 * o_n, mask=m_n, other=0).to(tl.int64)
        b_ke = tl.load(p_k + 2 * o_n + 1, mask=m_n, other=0).to(tl.int64)
        b_t = tl.load(p_t + o_n, mask=m_n, other=0).to(tl.int64)
        bad = (b_qs < 0) | (b_qs > b_qe) | (b_qe > S_Q) | (b_ks < 0) | (b_ks > b_ke) | (b_ke > S_K) | \
            (b_t < 0) | (b_t > 3)
        best = tl.minimum(best, tl.min(tl.where(m_n & bad, o_n, N), axis=0))
    hit = best < N
    row = tl.minimum(best, N - 1).to(tl.int64)
    qs, qe = tl.load(p_q + 2 * row).to(tl.int64), tl.load(p_q + 2 * row + 1).to(tl.int64)
    ks, ke = tl.load(p_k + 2 * row).to(tl.int64), tl.load(p_k + 2 * row + 1).to(tl.int64)
    t = tl.load(p_t + row).to(tl.int64)
    bad_q = (qs < 0) | (qs > qe) | (qe > S_Q)
    bad_k = (ks < 0) | (ks > ke) | (ke > S_K)
    which = tl.where(bad_q, 0, tl.where(bad_k, 1, 2))
    a = tl.where(bad_q, qs, tl.where(bad_k, ks, t))
    b = tl.where(bad_q, qe, ke)
    limit = tl.where(bad_q, S_Q, S_K)
    clock = tl.load(p_table + CLOCK * COLS) + 1
    tl.store(p_table + CLOCK * COLS, clock)
    p_row = p_table + SLOT * COLS
    first = hit & (tl.load(p_row) == NONE)
    tl.store(p_row + 1, tl.load(p_row + 1) + 1, mask=hit)
    tl.store(p_row, clock, mask=first)
    tl.store(p_row + 2, row, mask=first)
    tl.store(p_row + 3, which.to(tl.int64), mask=first)
    tl.store(p_row + 4, a, mask=first)
    tl.store(p_row + 5, b, mask=first)
    tl.store(p_row + 6, limit.to(tl.int64), mask=first)
    tl.store(p_row + 7, ROWS + 0 * clock, mask=first)


def flag_slices(table: torch.Tensor, slot: int, clock_row: int, none: int, q_ranges: torch.Tensor,
                k_ranges: torch.Tensor, attn_type: torch.Tensor, seqlen_q: int, seqlen_k: int,
                rows_per_group: int) -> None:
    """Check ``q_ranges`` / ``k_ranges`` (``[..., 2]``) and ``attn_type`` (``[...]``) into ``table`` row ``slot``."""
    q = q_ranges.reshape(-1, 2).contiguous()
    k = k_ranges.reshape(-1, 2).contiguous()
    t = attn_type.reshape(-1).contiguous()
    N = t.numel()
    if N == 0:
        return
    _flag_slices_kernel[(1,)](q, k, t, table, N, seqlen_q, seqlen_k, rows_per_group, slot, clock_row, none,
                              COLS=table.shape[1], BLOCK=1024)
