"""Triton kernels for attention over slices: forward (out, lse) and backward (dQ; dK, dV).

Shape legend: Tq query tokens, Tk key tokens, Hq query heads, Hkv KV heads
(Hq a multiple of Hkv), D head dim in {16, 32, 64, 128}, R slices.

Grids depend on shapes only, never on range values:

- forward and dQ: one program per (query head, query block). Its slices come
  from a work list (``worklist.py``) built on the device by the launcher, so
  it visits exactly the slices touching its block, never a padding row.
  Shared query rows are reduced inside one program in a fixed order, so the
  result is deterministic without atomics and independent of padding.
- dK/dV: one program per (KV head, key block), looping over the query heads
  of its group, the slices touching its key block (a work list of the key
  axis) and the query blocks each slice needs.

The second grid axis walks blocks heaviest first (most mask entries), so the
tail of the grid is short. Each (slice, block) pair splits its inner span into
block-aligned interior blocks, where every entry is in the slice and no mask
is computed, and masked edge/diagonal blocks. Scores are scaled once by
``softmax_scale * log2(e)`` and exponentiated with ``exp2``; lse is kept in
base 2 inside the kernels and is natural-log at the interface.

Mask of slice r at (q, k), see ``attn_kernels.reference``: ``qs <= q < qe``,
``ks <= k < ke``, and ``k <= q + ke - qe`` for CAUSAL (1) / BI_CAUSAL (3),
``k >= q + ks - qs`` for INV_CAUSAL (2) / BI_CAUSAL (3). Entries outside the
tensors (a range past Tq or Tk, or below 0) are dropped; the diagonals stay
where the given ranges put them. Every load and store is inside the tensors.

The backward takes the row delta ``rowsum(dO * O) - dlse`` ([Tq, Hq] fp32,
``row_delta``) and the final lse of each row, so a rank that computed part of
a row's keys gets its share of dQ and its dK, dV from (dO, lse, delta) alone
(``flex_attn_bwd_from_delta``); ``flex_attn_bwd`` computes delta, then calls
it. Both backward kernels only store (no atomics): the backward is
deterministic.

The launchers expect contiguous tensors and int32 ranges (``op.py`` prepares
them); they read no tensor value on the host.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attn_kernels.flex_attn import worklist, worklist_kernel

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2)
LN2 = tl.constexpr(0.6931471805599453)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    # The interpreter needs "ieee"; on GPU fp32 stays exact, fp16/bf16 ignore it.
    return "ieee" if (_interpreting() or dtype == torch.float32) else "tf32"


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    if FAST:  # one MUFU.TANH on sm_75+ (the interpreter cannot run inline asm)
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 (no libdevice).
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _rect(p_rect, i_r):
    """Effective slice i_r (``worklist.slice_rect``): rows [qa, qb), keys [ka, kb), q + di <= k <= q + dc."""
    p = p_rect + i_r * 8
    return tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3), tl.load(p + 4), tl.load(p + 5)


@triton.jit
def _split(lo, hi, p_lo, p_hi, a, b, full, BLOCK: tl.constexpr):
    """Cut the inner span [lo, hi), walked in steps of BLOCK from lo, into masked [lo, n_a),
    interior [n_a, n_b), masked [n_b, hi). [a, b) is where every row/column of the program
    block [p_lo, p_hi) is inside the slice; ``full`` says the program block is inside the slice."""
    j_a = (tl.maximum(a - lo, 0) + BLOCK - 1) // BLOCK
    j_b = tl.maximum(b - lo, 0) // BLOCK
    interior = full & (j_b > j_a)
    n_a = tl.where(interior, lo + j_a * BLOCK, hi)
    n_b = tl.where(interior, lo + j_b * BLOCK, hi)
    return n_a, n_b


@triton.jit
def _scores(b_s, sc_in, sc_out, USE_SOFTCAP: tl.constexpr):
    """Raw q.k -> scores before the qk_scale multiply; with softcap, log2-domain capped scores and tanh."""
    if USE_SOFTCAP:
        b_th = _tanh(b_s * sc_in, USE_SOFTCAP == 2)
        b_s = b_th * sc_out
    else:
        b_th = b_s
    return b_s, b_th


@triton.jit
def _fwd_step(b_acc, b_m, b_l, b_q, p_k, p_v, n0, o_head, o_q, m_row, k_hi, dc, di,
              qk_scale, sc_in, sc_out,
              HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
              MASKED: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    o_k = n0 + tl.arange(0, BLOCK_K)
    # 64-bit block start (scalar), 32-bit offsets inside the block, rebuilt here rather than kept live
    off = tl.cast(n0, tl.int64) * (HKV * HEAD_DIM) + o_head
    o_kd = tl.arange(0, BLOCK_K)[:, None] * (HKV * HEAD_DIM) + tl.arange(0, HEAD_DIM)[None, :]
    # [BLOCK_K, HEAD_DIM]
    if MASKED:
        m_k = o_k < k_hi
        b_k = tl.load(p_k + off + o_kd, mask=m_k[:, None], other=0.0)
        b_v = tl.load(p_v + off + o_kd, mask=m_k[:, None], other=0.0)
    else:
        b_k = tl.load(p_k + off + o_kd)
        b_v = tl.load(p_v + off + o_kd)
    # [BLOCK_Q, BLOCK_K]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
    b_s, _ = _scores(b_s, sc_in, sc_out, USE_SOFTCAP)
    if MASKED:
        b_d = o_k[None, :] - o_q[:, None]
        m_s = m_row[:, None] & m_k[None, :] & (b_d <= dc) & (b_d >= di)
        b_s = tl.where(m_s, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * qk_scale)
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # row empty so far
    else:
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * qk_scale)
        b_m_use = b_m_new
    # one multiply-add per score: log2-domain exponent
    b_p = tl.exp2(b_s * qk_scale - b_m_use[:, None])
    b_alpha = tl.exp2(b_m - b_m_use)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    return b_acc, b_m_new, b_l


@triton.jit
def _flex_fwd_kernel(
    p_q, p_k, p_v, p_o, p_lse, p_rect, p_ptr, p_idx, p_order, p_cnt,
    Tq, NB, L, qk_scale, sc_in, sc_out,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, COUNT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    tl.static_assert(HQ % HKV == 0)
    tl.static_assert(BLOCK_Q >= 16 and BLOCK_K >= 16)
    i_h, i_p = tl.program_id(0), tl.program_id(1)
    i_m = tl.load(p_order + i_p).to(tl.int32)  # heaviest query block first
    i_kvh = i_h // (HQ // HKV)
    m0 = i_m * BLOCK_Q
    o_q = m0 + tl.arange(0, BLOCK_Q)
    o_d = tl.arange(0, HEAD_DIM)
    m_q = o_q < Tq
    o_qd = (o_q.to(tl.int64)[:, None] * HQ + i_h) * HEAD_DIM + o_d[None, :]
    o_head = i_kvh * HEAD_DIM  # the KV head's columns in a key row
    # [BLOCK_Q, HEAD_DIM]
    b_q = tl.load(p_q + o_qd, mask=m_q[:, None], other=0.0)
    b_m = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max, log2 units
    b_l = tl.zeros([BLOCK_Q], tl.float32)
    b_acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    n_vis = 0
    n_it = 0
    node0 = 0
    n_lev = NB
    for lev in range(0, L):  # the nodes on the path from this block to the root
        node = node0 + (i_m >> lev)
        j_lo = tl.load(p_ptr + node)
        j_hi = tl.load(p_ptr + node + 1)
        for j in range(j_lo, j_hi):
            i_r = tl.load(p_idx + j)
            qa, qb, ka, kb, dc, di = _rect(p_rect, i_r)
            q_lo = tl.maximum(qa, m0)
            q_hi = tl.minimum(qb, m0 + BLOCK_Q)
            k_lo = tl.maximum(ka, q_lo + di)
            k_hi = tl.minimum(kb, q_hi + dc)
            n_a, n_b = _split(k_lo, k_hi, m0, m0 + BLOCK_Q,
                              tl.maximum(k_lo, q_hi - 1 + di), tl.minimum(k_hi, q_lo + dc + 1),
                              (q_lo == m0) & (q_hi == m0 + BLOCK_Q), BLOCK_K)
            m_row = (o_q >= q_lo) & (o_q < q_hi)
            for n0 in range(k_lo, n_a, BLOCK_K):
                b_acc, b_m, b_l = _fwd_step(b_acc, b_m, b_l, b_q, p_k, p_v, n0, o_head, o_q, m_row, k_hi, dc, di,
                                            qk_scale, sc_in, sc_out, HKV, HEAD_DIM, BLOCK_K,
                                            True, USE_SOFTCAP, DOT_PRECISION)
            for n0 in range(n_a, n_b, BLOCK_K):
                b_acc, b_m, b_l = _fwd_step(b_acc, b_m, b_l, b_q, p_k, p_v, n0, o_head, o_q, m_row, k_hi, dc, di,
                                            qk_scale, sc_in, sc_out, HKV, HEAD_DIM, BLOCK_K,
                                            False, USE_SOFTCAP, DOT_PRECISION)
            for n0 in range(n_b, k_hi, BLOCK_K):
                b_acc, b_m, b_l = _fwd_step(b_acc, b_m, b_l, b_q, p_k, p_v, n0, o_head, o_q, m_row, k_hi, dc, di,
                                            qk_scale, sc_in, sc_out, HKV, HEAD_DIM, BLOCK_K,
                                            True, USE_SOFTCAP, DOT_PRECISION)
            if COUNT:
                n_vis += 1
                n_it += (k_hi - k_lo + BLOCK_K - 1) // BLOCK_K
        node0 += n_lev
        n_lev = (n_lev + 1) // 2
    m_row = b_l > 0.0
    b_o = b_acc / tl.where(m_row, b_l, 1.0)[:, None]
    b_lse = tl.where(m_row, (b_m + tl.log2(tl.where(m_row, b_l, 1.0))) * LN2, float("-inf"))
    o_l = o_q.to(tl.int64) * HQ + i_h
    if ACCUMULATE:
        # merged in fp32 into the running (out, lse) this program alone owns for these rows and head;
        # rows that saw no key here are neither read nor written (the merge of an empty part is a no-op)
        m_w = m_q & m_row
        b_la = tl.load(p_lse + o_l, mask=m_w, other=float("-inf"))
        b_oa = tl.load(p_o + o_qd, mask=m_w[:, None], other=0.0)
        b_mx = tl.where(m_w, tl.maximum(b_la, b_lse), 0.0)  # finite where written: this part saw a key
        b_new = b_mx + tl.log(1.0 + tl.exp(tl.minimum(b_la, b_lse) - b_mx))  # no libdevice log1p in the interpreter
        b_o = tl.exp(b_la - b_new)[:, None] * b_oa + tl.exp(b_lse - b_new)[:, None] * b_o
        tl.store(p_o + o_qd, b_o, mask=m_w[:, None])
        tl.store(p_lse + o_l, b_new, mask=m_w)
    else:
        tl.store(p_o + o_qd, b_o.to(p_o.dtype.element_ty), mask=m_q[:, None])
        tl.store(p_lse + o_l, b_lse, mask=m_q)
    if COUNT:
        tl.store(p_cnt + 2 * (i_p * HQ + i_h), n_vis)
        tl.store(p_cnt + 2 * (i_p * HQ + i_h) + 1, n_it)


@triton.jit
def _dq_step(b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, n0, o_head, o_q, m_row, k_hi, dc, di,
             qk_scale, sc_in, sc_out,
             HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
             MASKED: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    o_k = n0 + tl.arange(0, BLOCK_K)
    # 64-bit block start (scalar), 32-bit offsets inside the block, rebuilt here rather than kept live
    off = tl.cast(n0, tl.int64) * (HKV * HEAD_DIM) + o_head
    o_kd = tl.arange(0, BLOCK_K)[:, None] * (HKV * HEAD_DIM) + tl.arange(0, HEAD_DIM)[None, :]
    # [BLOCK_K, HEAD_DIM]
    if MASKED:
        m_k = o_k < k_hi
        b_k = tl.load(p_k + off + o_kd, mask=m_k[:, None], other=0.0)
        b_v = tl.load(p_v + off + o_kd, mask=m_k[:, None], other=0.0)
    else:
        b_k = tl.load(p_k + off + o_kd)
        b_v = tl.load(p_v + off + o_kd)
    # [BLOCK_Q, BLOCK_K]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
    b_s, b_th = _scores(b_s, sc_in, sc_out, USE_SOFTCAP)
    b_p = tl.exp2(b_s * qk_scale - b_lse2[:, None])
    if MASKED:
        b_d = o_k[None, :] - o_q[:, None]
        b_p = tl.where(m_row[:, None] & m_k[None, :] & (b_d <= dc) & (b_d >= di), b_p, 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
    b_ds = b_p * (b_dp - b_delta[:, None])
    if USE_SOFTCAP:
        b_ds = b_ds * (1.0 - b_th * b_th)
    return b_dq + tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)


@triton.jit
def _flex_bwd_dq_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_rect, p_ptr, p_idx, p_order, p_cnt,
    Tq, NB, L, sm_scale, qk_scale, sc_in, sc_out,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, COUNT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    # ACCUMULATE: p_dq is the caller's fp32 sum, which this program's tile is added into (one program
    # per tile, so a plain load and store is race-free)
    tl.static_assert(HQ % HKV == 0)
    i_h, i_p = tl.program_id(0), tl.program_id(1)
    i_m = tl.load(p_order + i_p).to(tl.int32)
    i_kvh = i_h // (HQ // HKV)
    m0 = i_m * BLOCK_Q
    o_q = m0 + tl.arange(0, BLOCK_Q)
    o_d = tl.arange(0, HEAD_DIM)
    m_q = o_q < Tq
    o_qd = (o_q.to(tl.int64)[:, None] * HQ + i_h) * HEAD_DIM + o_d[None, :]
    o_head = i_kvh * HEAD_DIM  # the KV head's columns in a key row
    # [BLOCK_Q, HEAD_DIM]
    b_q = tl.load(p_q + o_qd, mask=m_q[:, None], other=0.0)
    b_do = tl.load(p_do + o_qd, mask=m_q[:, None], other=0.0)
    # [BLOCK_Q]
    b_lse = tl.load(p_lse + o_q.to(tl.int64) * HQ + i_h, mask=m_q, other=0.0)
    b_lse2 = tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)  # empty row: every p is masked to 0
    b_delta = tl.load(p_delta + o_q.to(tl.int64) * HQ + i_h, mask=m_q, other=0.0)
    b_dq = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    n_vis = 0
    n_it = 0
    node0 = 0
    n_lev = NB
    for lev in range(0, L):
        node = node0 + (i_m >> lev)
        j_lo = tl.load(p_ptr + node)
        j_hi = tl.load(p_ptr + node + 1)
        for j in range(j_lo, j_hi):
            i_r = tl.load(p_idx + j)
            qa, qb, ka, kb, dc, di = _rect(p_rect, i_r)
            q_lo = tl.maximum(qa, m0)
            q_hi = tl.minimum(qb, m0 + BLOCK_Q)
            k_lo = tl.maximum(ka, q_lo + di)
            k_hi = tl.minimum(kb, q_hi + dc)
            n_a, n_b = _split(k_lo, k_hi, m0, m0 + BLOCK_Q,
                              tl.maximum(k_lo, q_hi - 1 + di), tl.minimum(k_hi, q_lo + dc + 1),
                              (q_lo == m0) & (q_hi == m0 + BLOCK_Q), BLOCK_K)
            m_row = (o_q >= q_lo) & (o_q < q_hi)
            for n0 in range(k_lo, n_a, BLOCK_K):
                b_dq = _dq_step(b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, n0, o_head, o_q, m_row, k_hi, dc, di,
                                qk_scale, sc_in, sc_out, HKV, HEAD_DIM, BLOCK_K, True, USE_SOFTCAP, DOT_PRECISION)
            for n0 in range(n_a, n_b, BLOCK_K):
                b_dq = _dq_step(b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, n0, o_head, o_q, m_row, k_hi, dc, di,
                                qk_scale, sc_in, sc_out, HKV, HEAD_DIM, BLOCK_K, False, USE_SOFTCAP, DOT_PRECISION)
            for n0 in range(n_b, k_hi, BLOCK_K):
                b_dq = _dq_step(b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, n0, o_head, o_q, m_row, k_hi, dc, di,
                                qk_scale, sc_in, sc_out, HKV, HEAD_DIM, BLOCK_K, True, USE_SOFTCAP, DOT_PRECISION)
            if COUNT:
                n_vis += 1
                n_it += (k_hi - k_lo + BLOCK_K - 1) // BLOCK_K
        node0 += n_lev
        n_lev = (n_lev + 1) // 2
    if ACCUMULATE:
        b_old = tl.load(p_dq + o_qd, mask=m_q[:, None], other=0.0)
        tl.store(p_dq + o_qd, b_old + b_dq * sm_scale, mask=m_q[:, None])
    else:
        tl.store(p_dq + o_qd, (b_dq * sm_scale).to(p_dq.dtype.element_ty), mask=m_q[:, None])
    if COUNT:
        tl.store(p_cnt + 2 * (i_p * HQ + i_h), n_vis)
        tl.store(p_cnt + 2 * (i_p * HQ + i_h) + 1, n_it)


@triton.jit
def _dkdv_step(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, m0, o_qd_t, o_qd, o_k, m_col, q_hi, dc, di,
               qk_scale, sc_in, sc_out,
               HQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
               MASKED: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    o_q = m0 + tl.arange(0, BLOCK_Q)
    off = tl.cast(m0, tl.int64) * (HQ * HEAD_DIM)
    p_row = tl.cast(m0, tl.int64) * HQ
    if MASKED:
        m_q = o_q < q_hi
        # [HEAD_DIM, BLOCK_Q]: Q^T straight from memory, so S^T = K Q^T needs no transpose
        b_qt = tl.load(p_q + off + o_qd_t, mask=m_q[None, :], other=0.0)
        # [BLOCK_Q, HEAD_DIM]
        b_do = tl.load(p_do + off + o_qd, mask=m_q[:, None], other=0.0)
        # [BLOCK_Q]
        b_lse = tl.load(p_lse + p_row + tl.arange(0, BLOCK_Q) * HQ, mask=m_q, other=0.0)
        b_delta = tl.load(p_delta + p_row + tl.arange(0, BLOCK_Q) * HQ, mask=m_q, other=0.0)
    else:
        b_qt = tl.load(p_q + off + o_qd_t)
        b_do = tl.load(p_do + off + o_qd)
        b_lse = tl.load(p_lse + p_row + tl.arange(0, BLOCK_Q) * HQ)
        b_delta = tl.load(p_delta + p_row + tl.arange(0, BLOCK_Q) * HQ)
    b_lse2 = tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)
    # [BLOCK_K, BLOCK_Q]
    b_st = tl.dot(b_k, b_qt, input_precision=DOT_PRECISION)
    b_st, b_th = _scores(b_st, sc_in, sc_out, USE_SOFTCAP)
    b_pt = tl.exp2(b_st * qk_scale - b_lse2[None, :])
    if MASKED:
        b_d = o_k[:, None] - o_q[None, :]
        b_pt = tl.where(m_col[:, None] & m_q[None, :] & (b_d <= dc) & (b_d >= di), b_pt, 0.0)
    b_dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=DOT_PRECISION)
    b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    if USE_SOFTCAP:
        b_dst = b_dst * (1.0 - b_th * b_th)
    b_dk += tl.dot(b_dst.to(b_qt.dtype), tl.trans(b_qt), input_precision=DOT_PRECISION)
    return b_dk, b_dv


@triton.jit
def _flex_bwd_dkdv_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_rect, p_ptr, p_idx, p_order, p_cnt,
    Tk, NB, L, sm_scale, qk_scale, sc_in, sc_out,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, COUNT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    # SPLIT > 1: the group's query heads are shared among SPLIT programs, each
    # storing fp32 partial dK, dV at [i_s, Tk, HKV, D] (summed by the launcher)
    # ACCUMULATE (SPLIT 1 only: the launcher adds the partials itself): p_dk, p_dv are the caller's
    # fp32 sums, this program's tile added into them. One program per tile, so the add is old + new
    # exactly, deterministic; it is an atomic add because a load of the old tiles next to both live
    # accumulators spills at the sm_90 config (test_kernel_compiles), the atomic needs no registers.
    tl.static_assert(HQ % HKV == 0)
    tl.static_assert(SPLIT == 1 or not ACCUMULATE)
    tl.static_assert((HQ // HKV) % SPLIT == 0)
    GS = HQ // HKV // SPLIT
    i_0, i_p = tl.program_id(0), tl.program_id(1)
    i_kvh, i_s = i_0 // SPLIT, i_0 % SPLIT
    i_n = tl.load(p_order + i_p).to(tl.int32)  # heaviest key block first
    n0 = i_n * BLOCK_K
    o_k = n0 + tl.arange(0, BLOCK_K)
    o_d = tl.arange(0, HEAD_DIM)
    m_k = o_k < Tk
    o_kd = (o_k.to(tl.int64)[:, None] * HKV + i_kvh) * HEAD_DIM + o_d[None, :]
    # [BLOCK_K, HEAD_DIM]
    b_k = tl.load(p_k + o_kd, mask=m_k[:, None], other=0.0)
    b_v = tl.load(p_v + o_kd, mask=m_k[:, None], other=0.0)
    b_dk = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    b_dv = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    n_vis = 0
    n_it = 0
    for i_g in range(0, GS):
        i_h = i_kvh * (HQ // HKV) + i_s * GS + i_g
        o_qd = tl.arange(0, BLOCK_Q)[:, None] * (HQ * HEAD_DIM) + i_h * HEAD_DIM + o_d[None, :]
        o_qd_t = tl.arange(0, BLOCK_Q)[None, :] * (HQ * HEAD_DIM) + i_h * HEAD_DIM + o_d[:, None]
        node0 = 0
        n_lev = NB
        for lev in range(0, L):
            node = node0 + (i_n >> lev)
            j_lo = tl.load(p_ptr + node)
            j_hi = tl.load(p_ptr + node + 1)
            for j in range(j_lo, j_hi):
                i_r = tl.load(p_idx + j)
                qa, qb, ka, kb, dc, di = _rect(p_rect, i_r)
                k_lo = tl.maximum(ka, n0)
                k_hi = tl.minimum(kb, n0 + BLOCK_K)
                q_lo = tl.maximum(qa, k_lo - dc)
                q_hi = tl.minimum(qb, k_hi - di)
                m_a, m_b = _split(q_lo, q_hi, n0, n0 + BLOCK_K,
                                  tl.maximum(q_lo, k_hi - 1 - dc), tl.minimum(q_hi, k_lo - di + 1),
                                  (k_lo == n0) & (k_hi == n0 + BLOCK_K), BLOCK_Q)
                m_col = (o_k >= k_lo) & (o_k < k_hi)
                for m0 in range(q_lo, m_a, BLOCK_Q):
                    b_dk, b_dv = _dkdv_step(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse + i_h, p_delta + i_h, m0,
                                            o_qd_t, o_qd, o_k, m_col, q_hi, dc, di, qk_scale, sc_in, sc_out,
                                            HQ, HEAD_DIM, BLOCK_Q, True, USE_SOFTCAP, DOT_PRECISION)
                for m0 in range(m_a, m_b, BLOCK_Q):
                    b_dk, b_dv = _dkdv_step(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse + i_h, p_delta + i_h, m0,
                                            o_qd_t, o_qd, o_k, m_col, q_hi, dc, di, qk_scale, sc_in, sc_out,
                                            HQ, HEAD_DIM, BLOCK_Q, False, USE_SOFTCAP, DOT_PRECISION)
                for m0 in range(m_b, q_hi, BLOCK_Q):
                    b_dk, b_dv = _dkdv_step(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse + i_h, p_delta + i_h, m0,
                                            o_qd_t, o_qd, o_k, m_col, q_hi, dc, di, qk_scale, sc_in, sc_out,
                                            HQ, HEAD_DIM, BLOCK_Q, True, USE_SOFTCAP, DOT_PRECISION)
                if COUNT:
                    n_vis += 1
                    n_it += (q_hi - q_lo + BLOCK_Q - 1) // BLOCK_Q
            node0 += n_lev
            n_lev = (n_lev + 1) // 2
    if SPLIT > 1:
        o_kd += tl.cast(i_s, tl.int64) * Tk * (HKV * HEAD_DIM)
    if ACCUMULATE:
        tl.atomic_add(p_dk + o_kd, b_dk * sm_scale, mask=m_k[:, None], sem="relaxed")
        tl.atomic_add(p_dv + o_kd, b_dv, mask=m_k[:, None], sem="relaxed")
    else:
        tl.store(p_dk + o_kd, (b_dk * sm_scale).to(p_dk.dtype.element_ty), mask=m_k[:, None])
        tl.store(p_dv + o_kd, b_dv.to(p_dv.dtype.element_ty), mask=m_k[:, None])
    if COUNT:
        tl.store(p_cnt + 2 * (i_p * HKV * SPLIT + i_0), n_vis)
        tl.store(p_cnt + 2 * (i_p * HKV * SPLIT + i_0) + 1, n_it)


@triton.jit
def _row_delta_kernel(
    p_do, p_o, p_dlse, p_delta, N,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    # N = Tq * Hq rows of HEAD_DIM elements; one fp32 sum per row.
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < N
    m_nd = m_n[:, None] & (o_d[None, :] < HEAD_DIM)
    o_nd = o_n.to(tl.int64)[:, None] * HEAD_DIM + o_d[None, :]
    # [BLOCK_N, BLOCK_D]
    b_do = tl.load(p_do + o_nd, mask=m_nd, other=0.0).to(tl.float32)
    b_o = tl.load(p_o + o_nd, mask=m_nd, other=0.0).to(tl.float32)
    # [BLOCK_N]
    b_delta = tl.sum(b_do * b_o, 1)
    if HAS_DLSE:
        b_delta -= tl.load(p_dlse + o_n, mask=m_n, other=0.0)
    tl.store(p_delta + o_n, b_delta, mask=m_n)


# ---------------------------------------------------------------------------------------------
# Launch configurations


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: ``block`` positions per program (query rows for the forward and
    dQ, key columns for dK/dV), ``inner`` positions per inner-loop step, warps and pipeline stages."""

    block: int
    inner: int
    num_warps: int
    num_stages: int


# sm_90 launch configs at D = 128 bf16 (checked spill-free by tests/attn_kernels/test_kernel_compiles.py).
# dK/dV keeps two [block, D] fp32 accumulators, so its query step is short.
GPU_CONFIGS = {
    "fwd": KernelConfig(block=128, inner=64, num_warps=8, num_stages=3),
    "dq": KernelConfig(block=128, inner=64, num_warps=8, num_stages=2),
    "dkdv": KernelConfig(block=128, inner=32, num_warps=8, num_stages=2),
}
# The sm_90 autotune set: the program block stays at 128 (the work list is built for it); the
# inner block, stages and warps vary, among configs that compile without spills at D = 128.
GPU_AUTOTUNE = {
    "fwd": [KernelConfig(128, 64, 8, s) for s in (2, 3, 4)] + [KernelConfig(128, 32, 8, 3)],
    "dq": [KernelConfig(128, 64, 8, s) for s in (2, 3)] + [KernelConfig(128, 32, 8, 2)],
    "dkdv": [KernelConfig(128, 32, 8, s) for s in (2, 3)] + [KernelConfig(128, 16, 8, 2)],
}
# With softcap the tanh and its derivative stay live in dQ: its inner block is capped.
SOFTCAP_MAX_INNER = {"dq": 32}
# The interpreter runs one Python step per program and block: few, big programs.
INTERPRETER_CONFIG = KernelConfig(block=64, inner=64, num_warps=4, num_stages=1)
AUTOTUNE = True  # on GPU, when the caller gives no block sizes; the interpreter never autotunes


def _gpu_configs(kind: str, softcap: bool) -> tuple[KernelConfig, list[KernelConfig]]:
    """(default config, autotune set) of one kernel on sm_90."""
    cfg, tune = GPU_CONFIGS[kind], GPU_AUTOTUNE[kind]
    cap = SOFTCAP_MAX_INNER.get(kind) if softcap else None
    if cap is not None:
        tune = [c for c in tune if c.inner <= cap]
        cfg = tune[0] if cfg.inner > cap else cfg
    return cfg, tune


def _config(kind: str, q: torch.Tensor, block_q: int | None, block_k: int | None, softcap: bool) -> KernelConfig:
    gpu = q.is_cuda or _RECORDING is not None
    cfg = _gpu_configs(kind, softcap)[0] if gpu else INTERPRETER_CONFIG
    if kind == "dkdv":
        block, inner = block_k or cfg.block, block_q or cfg.inner
    else:
        block, inner = block_q or cfg.block, block_k or cfg.inner
    for name, b in (("block_q", block), ("block_k", inner)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    return KernelConfig(block, inner, cfg.num_warps, cfg.num_stages)


def _autotune_set(kind: str, q: torch.Tensor, block_q, block_k, softcap: bool) -> list[KernelConfig] | None:
    if not (q.is_cuda and AUTOTUNE) or block_q is not None or block_k is not None:
        return None
    return _gpu_configs(kind, softcap)[1]


# ---------------------------------------------------------------------------------------------
# Launching (and recording launches for the sm_90 compile checks)

_RECORDING: list | None = None
_TUNED: dict = {}


@contextlib.contextmanager
def record_launches():
    """Record the launches the launchers would make on a GPU instead of running them.

    Call the launchers inside with tensors on any device (``meta`` works: the
    work lists are torch ops). Each record is a dict with ``module``, ``name``,
    ``signature`` and ``attrs`` (as a real launch specialises them: pointers
    and multiples of 16 get the 16-byte divisibility hint, ints equal to 1
    become constants), ``constexprs``, ``options`` (warps, stages) and
    ``autotune`` (the other configs of the sm_90 autotune set, as option and
    constexpr overrides). Compile them with ``tests/_sm90.py``.
    """
    global _RECORDING
    prev, _RECORDING = _RECORDING, []
    try:
        yield _RECORDING
    finally:
        _RECORDING = prev


def _spec(value):
    """(signature type, attrs) of one runtime argument, as Triton's launcher specialises it."""
    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                      torch.int32: "i32", torch.int64: "i64"}[value.dtype], True  # allocations are 16 B aligned
    if isinstance(value, float):
        return "fp32", False
    if value is None or value == 1:
        return "constexpr", False
    return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0


def _consts(kind: str, cfg: KernelConfig) -> dict:
    if kind == "dkdv":
        return dict(BLOCK_K=cfg.block, BLOCK_Q=cfg.inner)
    return dict(BLOCK_Q=cfg.block, BLOCK_K=cfg.inner)


def _launch(kind: str, fn, grid, args: dict, consts: dict, cfg: KernelConfig, tune: list[KernelConfig] | None):
    if _RECORDING is not None:
        sig, attrs, const = {}, {}, dict(consts, **_consts(kind, cfg))
        for name, value in args.items():
            sig[name], aligned = _spec(value)
            if sig[name] == "constexpr":
                const[name] = value
            elif aligned:
                attrs[name] = [["tt.divisibility", 16]]
        sig.update({name: "constexpr" for name in const})
        _RECORDING.append(dict(
            module=fn.fn.__module__, name=fn.fn.__name__, kind=kind, grid=list(grid), signature=sig, attrs=attrs,
            constexprs=const, options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            autotune=[dict(constexprs=_consts(kind, c), options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
                      for c in (tune or _gpu_configs(kind, bool(consts["USE_SOFTCAP"]))[1])]))
        return
    if tune is None:
        fn[grid](**args, **consts, **_consts(kind, cfg), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    # an accumulating launch adds into its outputs: tuning runs it once per config, so the tuner must
    # put their values back after each trial (it copies them while tuning, once per key)
    restore = [name for name in ("p_o", "p_lse", "p_dq", "p_dk", "p_dv") if name in args] \
        if consts.get("ACCUMULATE") else []
    key = (kind, fn.fn.__name__, tuple(tune), tuple(restore))
    if key not in _TUNED:
        _TUNED[key] = triton.autotune(
            [triton.Config(_consts(kind, c), num_warps=c.num_warps, num_stages=c.num_stages) for c in tune],
            key=["NB", "HQ", "HKV", "HEAD_DIM", "USE_SOFTCAP"], restore_value=restore or None)(fn)
    _TUNED[key][grid](**args, **consts)


def _common(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, softcap: float) -> tuple[dict, dict]:
    """Scalars and constexprs shared by the three attention kernels."""
    cap = softcap > 0
    scalars = dict(
        # scores in log2 units: raw * qk_scale, or (with softcap) tanh(raw * sc_in) * sc_out
        qk_scale=1.0 if cap else float(softmax_scale) * LOG2E,
        sc_in=float(softmax_scale) / softcap if cap else 1.0,
        sc_out=float(softcap) * LOG2E if cap else 1.0)
    # USE_SOFTCAP 2: the hardware tanh (GPU), 1: an exact formula (interpreter)
    fast = q.is_cuda or _RECORDING is not None
    consts = dict(HQ=q.shape[1], HKV=k.shape[1], HEAD_DIM=q.shape[2], USE_SOFTCAP=(2 if fast else 1) if cap else 0,
                  DOT_PRECISION=_dot_precision(q.dtype))
    return scalars, consts


def _counter(counts: torch.Tensor | None, programs: int, device) -> torch.Tensor | None:
    return None if counts is None else torch.zeros(programs, 2, dtype=torch.int32, device=device)


def _add_counts(counts: torch.Tensor | None, at: int, cnt: torch.Tensor | None) -> None:
    if counts is not None:
        counts[at:at + 2] += cnt.sum(0).to(counts.dtype)


def _work_lists(q_ranges, k_ranges, attn_type, seqlen_q: int, seqlen_k: int, block_q: int | None,
                block_k: int | None):
    """(rect, query-axis list, key-axis list): Triton builds them (a few launches); on ``meta`` (recording
    launches) the torch twin does."""
    if q_ranges.device.type == "meta":
        rect = worklist.slice_rect(q_ranges, k_ranges, attn_type, seqlen_q, seqlen_k)
        return (rect,) + tuple(None if b is None else worklist.build(rect, a, n, b)
                               for a, n, b in ((0, seqlen_q, block_q), (1, seqlen_k, block_k)))
    return worklist_kernel.build(q_ranges, k_ranges, attn_type, seqlen_q, seqlen_k, block_q, block_k)


MIN_DKDV_PROGRAMS: int | None = None  # None: two waves of the GPU's SMs; 1 (no split) in the interpreter
_SM90_SMS = 132  # H100 / H200 SXM, for recorded launches


def _dkdv_split(group: int, programs: int, device: torch.device) -> int:
    """Query-head split of dK/dV: the smallest divisor of the group size that gives enough programs."""
    want = MIN_DKDV_PROGRAMS
    if want is None and device.type == "cuda":
        want = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    elif want is None:
        want = 2 * _SM90_SMS if _RECORDING is not None else 1
    for split in range(1, group + 1):
        if group % split == 0 and programs * split >= want:
            return split
    return group


def _check_scale(softmax_scale: float) -> None:
    # The running max is taken before the scale multiply, which is only valid for a positive scale.
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")


# ---------------------------------------------------------------------------------------------
# Launchers


def flex_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float,
    *, block_q: int | None = None, block_k: int | None = None, counts: torch.Tensor | None = None,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher.

    q: [Tq, Hq, D], k/v: [Tk, Hkv, D] contiguous, same float dtype;
    q_ranges/k_ranges: [R, 2] int32 contiguous; attn_type: [R] int32.
    block_q/block_k: powers of two >= 16 (default: the launch config, autotuned on GPU).
    counts: optional [2] int64, incremented by the slice visits and inner-loop
    iterations of all programs (the interpreter counts; for tests).
    Returns out [Tq, Hq, D] (q's dtype) and lse [Tq, Hq] fp32 (natural log,
    -inf where a row sees no key).
    accumulate: (out_acc [Tq, Hq, D], lse_acc [Tq, Hq]), contiguous fp32 (the caller checks): this
    call's (out, lse) is merged into them in place, in fp32 (its out is never rounded to q's dtype),
    and they are returned; no output is allocated (the pipelined forward's running result).
    """
    _check_scale(softmax_scale)
    Tq, HQ, D = q.shape
    Tk = k.shape[0]
    cfg = _config("fwd", q, block_q, block_k, softcap > 0)
    acc = accumulate is not None
    if acc:
        out, lse = accumulate
    else:
        out = torch.empty_like(q)
        lse = torch.empty((Tq, HQ), dtype=torch.float32, device=q.device)
    if Tq == 0:
        return out, lse
    rect, wl, _ = _work_lists(q_ranges, k_ranges, attn_type, Tq, Tk, cfg.block, None)
    cnt = _counter(counts, wl.num_blocks * HQ, q.device)
    scalars, consts = _common(q, k, softmax_scale, softcap)
    args = dict(p_q=q, p_k=k, p_v=v, p_o=out, p_lse=lse, p_rect=rect, p_ptr=wl.ptr, p_idx=wl.idx,
                p_order=wl.order, p_cnt=cnt, Tq=Tq, NB=wl.num_blocks, L=wl.levels, **scalars)
    _launch("fwd", _flex_fwd_kernel, (HQ, wl.num_blocks), args,
            dict(consts, COUNT=cnt is not None, ACCUMULATE=acc), cfg,
            _autotune_set("fwd", q, block_q, block_k, softcap > 0))
    _add_counts(counts, 0, cnt)
    return out, lse


def row_delta(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None = None) -> torch.Tensor:
    """delta = rowsum(dout * out) - dlse: [Tq, Hq] fp32, one Triton launch, no [Tq, Hq, D] temporaries.

    dout/out: [Tq, Hq, D] contiguous (any float dtype, summed in fp32);
    dlse: [Tq, Hq] fp32 contiguous, the gradient reaching lse (None: zero).
    d lse_i / d s_ij = p_ij, so dlse folds into the softmax term as -dlse.
    """
    Tq, HQ, D = dout.shape
    delta = torch.empty((Tq, HQ), dtype=torch.float32, device=dout.device)
    N = Tq * HQ
    if N == 0:
        return delta
    block_d = triton.next_power_of_2(D)
    block_n = 128 if _interpreting() else max(1, 4096 // block_d)  # interpreter: few, big programs
    _row_delta_kernel[(triton.cdiv(N, block_n),)](
        dout, out, delta if dlse is None else dlse, delta, N,
        HEAD_DIM=D, BLOCK_N=block_n, BLOCK_D=block_d, HAS_DLSE=dlse is not None, num_warps=4,
    )
    return delta


def flex_attn_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float,
    *, block_q: int | None = None, block_k: int | None = None, counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward from (out, dlse): ``row_delta`` then ``flex_attn_bwd_from_delta``.

    dout/out: [Tq, Hq, D]; lse/dlse: [Tq, Hq] fp32 (dlse is the gradient that
    reaches lse, zeros when lse is unused); other inputs as in ``flex_attn_fwd``.
    Returns dq [Tq, Hq, D], dk/dv [Tk, Hkv, D] (summed over each KV head's
    query heads), in the dtypes of q, k, v.
    """
    delta = row_delta(dout, out, dlse)
    return flex_attn_bwd_from_delta(dout, q, k, v, lse, delta, q_ranges, k_ranges, attn_type,
                                    softmax_scale, softcap, block_q=block_q, block_k=block_k, counts=counts)


def flex_attn_bwd_from_delta(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float,
    *, block_q: int | None = None, block_k: int | None = None, counts: torch.Tensor | None = None,
    accumulate: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: dQ over query blocks, dK/dV over key blocks, each with its own config; no atomics
    (but the accumulating dK/dV's add, which has one writer per element: exact and deterministic).

    dout: [Tq, Hq, D] in q's dtype; lse: [Tq, Hq] fp32, the FINAL lse of each
    row (over all its keys, wherever computed); delta: [Tq, Hq] fp32,
    ``row_delta`` of the final output. With them ``P = exp(s - lse)`` and
    ``dS = P * (dP - delta)`` are the exact terms of the whole row, so the
    gradients of a call over part of a row's keys sum to the whole row's.
    block_q/block_k: the query / key block of both kernels (default: each
    kernel's launch config). counts: optional [4] int64, incremented by
    (dQ visits, dQ iterations, dK/dV visits, dK/dV iterations).
    Other inputs as in ``flex_attn_fwd``. Returns dq [Tq, Hq, D] (this call's
    share), dk/dv [Tk, Hkv, D], in the dtypes of q, k, v.
    accumulate: (dq_acc, dk_acc, dv_acc), contiguous fp32 tensors shaped as q, k, v (the caller
    checks): the gradients are added into them in fp32, in place, and they are returned; no
    gradient tensor is allocated (the pipelined backward's per-stage sums).
    """
    _check_scale(softmax_scale)
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    acc = accumulate is not None
    dq, dk, dv = accumulate if acc else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    scalars, consts = _common(q, k, softmax_scale, softcap)
    scalars = dict(sm_scale=float(softmax_scale), **scalars)
    cfg_dq, cfg_dkdv = (_config(kind, q, block_q, block_k, softcap > 0) for kind in ("dq", "dkdv"))
    rect, wl_q, wl_k = _work_lists(q_ranges, k_ranges, attn_type, Tq, Tk, cfg_dq.block if Tq > 0 else None,
                                   cfg_dkdv.block if Tk > 0 else None)
    if Tq > 0:
        cfg, wl = cfg_dq, wl_q
        cnt = _counter(counts, wl.num_blocks * HQ, q.device)
        args = dict(p_q=q, p_k=k, p_v=v, p_do=dout, p_lse=lse, p_delta=delta, p_dq=dq, p_rect=rect, p_ptr=wl.ptr,
                    p_idx=wl.idx, p_order=wl.order, p_cnt=cnt, Tq=Tq, NB=wl.num_blocks, L=wl.levels, **scalars)
        _launch("dq", _flex_bwd_dq_kernel, (HQ, wl.num_blocks), args,
                dict(consts, COUNT=cnt is not None, ACCUMULATE=acc), cfg,
                _autotune_set("dq", q, block_q, block_k, softcap > 0))
        _add_counts(counts, 0, cnt)
    if Tk > 0:
        cfg, wl = cfg_dkdv, wl_k
        split = _dkdv_split(HQ // HKV, HKV * wl.num_blocks, q.device)
        cnt = _counter(counts, wl.num_blocks * HKV * split, q.device)
        # split over query heads: fp32 partials, summed in a fixed order below (deterministic)
        dk_p, dv_p = (torch.empty((split,) + tuple(k.shape), dtype=torch.float32, device=k.device) if split > 1
                      else x for x in (dk, dv))
        args = dict(p_q=q, p_k=k, p_v=v, p_do=dout, p_lse=lse, p_delta=delta, p_dk=dk_p, p_dv=dv_p, p_rect=rect,
                    p_ptr=wl.ptr, p_idx=wl.idx, p_order=wl.order, p_cnt=cnt, Tk=Tk, NB=wl.num_blocks,
                    L=wl.levels, **scalars)
        _launch("dkdv", _flex_bwd_dkdv_kernel, (HKV * split, wl.num_blocks), args,
                dict(consts, SPLIT=split, COUNT=cnt is not None, ACCUMULATE=acc and split == 1), cfg,
                _autotune_set("dkdv", q, block_q, block_k, softcap > 0))
        _add_counts(counts, 2, cnt)
        if split > 1 and acc:  # partial by partial, in order: deterministic, no [Tk, Hkv, D] temporary
            for i in range(split):
                dk.add_(dk_p[i])
                dv.add_(dv_p[i])
        elif split > 1:
            dk.copy_(dk_p.sum(0))
            dv.copy_(dv_p.sum(0))
    return dq, dk, dv


def gpu_launch_records(seqlen: int, hq: int, hkv: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                       softcap: float = 0.0, accumulate: bool = False) -> list[dict]:
    """What one causal forward and backward launch on sm_90 (``record_launches`` records, meta tensors).

    Four records: the forward, dQ and dK/dV kernels at their launch configs
    (each with its autotune set) and the row-delta kernel. accumulate: the
    forward merges into a running fp32 result (``flex_attn_fwd(accumulate=...)``) and the
    backward adds into fp32 sums (``flex_attn_bwd_from_delta(accumulate=...)``).
    """
    q = torch.empty(seqlen, hq, head_dim, dtype=dtype, device="meta")
    k = torch.empty(seqlen, hkv, head_dim, dtype=dtype, device="meta")
    rng = torch.tensor([[0, seqlen]], dtype=torch.int32, device="meta")
    typ = torch.ones(1, dtype=torch.int32, device="meta")
    lse = torch.empty(seqlen, hq, dtype=torch.float32, device="meta")
    with record_launches() as records:
        run = (torch.empty_like(q, dtype=torch.float32), lse) if accumulate else None
        flex_attn_fwd(q, k, k, rng, rng, typ, head_dim ** -0.5, softcap, accumulate=run)
        acc = tuple(torch.empty_like(t, dtype=torch.float32) for t in (q, k, k)) if accumulate else None
        flex_attn_bwd_from_delta(q, q, k, k, lse, lse, rng, rng, typ, head_dim ** -0.5, softcap, accumulate=acc)
    ptr = {"p_do": "*" + _spec(q)[0][1:], "p_o": "*" + _spec(q)[0][1:], "p_dlse": "*fp32", "p_delta": "*fp32"}
    n = seqlen * hq
    block_d = triton.next_power_of_2(head_dim)
    records.append(dict(
        module=__name__, name="_row_delta_kernel", kind="row_delta", grid=[triton.cdiv(n, 4096 // block_d)],
        signature=dict(ptr, N=_spec(n)[0], HEAD_DIM="constexpr", BLOCK_N="constexpr", BLOCK_D="constexpr",
                       HAS_DLSE="constexpr"),
        attrs={name: [["tt.divisibility", 16]] for name in list(ptr) + (["N"] if n % 16 == 0 else [])},
        constexprs=dict(HEAD_DIM=head_dim, BLOCK_N=4096 // block_d, BLOCK_D=block_d, HAS_DLSE=True),
        options=dict(num_warps=4, num_stages=3), autotune=[]))
    return records
