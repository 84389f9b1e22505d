"""Triton kernels for attention over slices: forward (out, lse) and backward.

Shape legend: Tq query tokens, Tk key tokens, Hq query heads, Hkv KV heads
(Hq a multiple of Hkv), D head dim in {32, 64, 128}, R slices.

Every grid depends on shapes only (Tq, Tk, Hq, Hkv), never on range values:

- forward and dQ: one program per (query block of Tq, query head). It loops
  over all R slices; a slice whose query range misses the block, or a dummy
  slice (start == end), gets an empty key loop, so padding costs R scalar
  loads. Shared query rows are reduced inside one program, in slice order,
  so the result is deterministic without atomics.
- dK/dV: one program per (key block of Tk, KV head). It loops over the query
  heads of its group, all R slices and the query blocks each slice needs.

Mask of slice r (qs, qe, ks, ke, t) at (q, k), see ``attn_kernels.reference``:
``qs <= q < qe``, ``ks <= k < ke``, and ``k <= q + ke - qe`` for CAUSAL (1) /
BI_CAUSAL (3), ``k >= q + ks - qs`` for INV_CAUSAL (2) / BI_CAUSAL (3).
The backward takes the row delta ``rowsum(dO * O) - dlse`` ([Tq, Hq] fp32,
``row_delta``) and the final lse of each row, so a rank that computed part of
a row's keys gets its share of dQ and its dK, dV from (dO, lse, delta) alone
(``flex_attn_bwd_from_delta``); ``flex_attn_bwd`` computes delta, then calls it.

The launchers expect contiguous tensors and int32 ranges (``op.py`` prepares
them); they read no tensor value on the host.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    # The interpreter needs "ieee"; on GPU fp32 stays exact, fp16/bf16 ignore it.
    return "ieee" if (_interpreting() or dtype == torch.float32) else "tf32"


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 (no libdevice).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _slice_meta(p_qr, p_kr, p_type, i_r):
    qs = tl.load(p_qr + 2 * i_r)
    qe = tl.load(p_qr + 2 * i_r + 1)
    ks = tl.load(p_kr + 2 * i_r)
    ke = tl.load(p_kr + 2 * i_r + 1)
    t = tl.load(p_type + i_r)
    return qs, qe, ks, ke, t


@triton.jit
def _slice_mask(o_q, o_k, qs, qe, ks, ke, t):
    """[len(o_q), len(o_k)] bool: entries of the slice among these rows/cols."""
    m = ((o_q[:, None] >= qs) & (o_q[:, None] < qe)) & ((o_k[None, :] >= ks) & (o_k[None, :] < ke))
    no_causal = (t != 1) & (t != 3)
    no_inv = (t != 2) & (t != 3)
    m = m & ((o_k[None, :] <= o_q[:, None] + (ke - qe)) | no_causal)
    m = m & ((o_k[None, :] >= o_q[:, None] + (ks - qs)) | no_inv)
    return m


@triton.jit
def _key_span(q_lo, q_hi, qs, qe, ks, ke, t):
    """Key columns [k_lo, k_hi) that query rows [q_lo, q_hi) of the slice can see."""
    is_causal = (t == 1) | (t == 3)
    is_inv = (t == 2) | (t == 3)
    k_lo = tl.where(is_inv, tl.maximum(ks, q_lo + (ks - qs)), ks)
    k_hi = tl.where(is_causal, tl.minimum(ke, q_hi + (ke - qe)), ke)
    k_hi = tl.where(q_hi > q_lo, k_hi, k_lo)  # rows miss the slice: empty loop
    return k_lo, tl.maximum(k_hi, k_lo)


@triton.jit
def _query_span(k_lo, k_hi, qs, qe, ks, ke, t):
    """Query rows [q_lo, q_hi) of the slice that see some key in [k_lo, k_hi)."""
    is_causal = (t == 1) | (t == 3)
    is_inv = (t == 2) | (t == 3)
    q_lo = tl.where(is_causal, tl.maximum(qs, k_lo - (ke - qe)), qs)
    q_hi = tl.where(is_inv, tl.minimum(qe, k_hi - (ks - qs)), qe)
    q_hi = tl.where(k_hi > k_lo, q_hi, q_lo)
    return q_lo, tl.maximum(q_hi, q_lo)


@triton.jit
def _scores(b_q, b_k, sm_scale, softcap, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Natural-log scores q k^T * scale (soft-capped); also returns tanh for the backward."""
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * sm_scale
    if USE_SOFTCAP:
        b_th = _tanh(b_s / softcap)
        b_s = softcap * b_th
    else:
        b_th = b_s
    return b_s, b_th


@triton.jit
def _flex_fwd_kernel(
    p_q, p_k, p_v, p_o, p_lse, p_qr, p_kr, p_type,
    Tq, Tk, R, sm_scale, softcap,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(HQ % HKV == 0)
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    i_kvh = i_h // (HQ // HKV)
    m0 = i_m * BLOCK_Q
    o_q = m0 + tl.arange(0, BLOCK_Q)
    o_d = tl.arange(0, HEAD_DIM)
    m_q = o_q < Tq
    # [BLOCK_Q, HEAD_DIM]
    b_q = tl.load(p_q + (o_q.to(tl.int64)[:, None] * HQ + i_h) * HEAD_DIM + o_d[None, :], mask=m_q[:, None], other=0.0)
    b_m = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max, log2 units
    b_l = tl.zeros([BLOCK_Q], tl.float32)
    b_acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    for i_r in range(0, R):
        qs, qe, ks, ke, t = _slice_meta(p_qr, p_kr, p_type, i_r)
        q_lo = tl.maximum(qs, m0)
        q_hi = tl.minimum(qe, m0 + BLOCK_Q)
        k_lo, k_hi = _key_span(q_lo, q_hi, qs, qe, ks, ke, t)
        for n0 in range(k_lo, k_hi, BLOCK_K):
            o_k = n0 + tl.arange(0, BLOCK_K)
            m_k = o_k < k_hi
            # [BLOCK_K, HEAD_DIM]
            b_k = tl.load(p_k + (o_k.to(tl.int64)[:, None] * HKV + i_kvh) * HEAD_DIM + o_d[None, :],
                          mask=m_k[:, None], other=0.0)
            b_v = tl.load(p_v + (o_k.to(tl.int64)[:, None] * HKV + i_kvh) * HEAD_DIM + o_d[None, :],
                          mask=m_k[:, None], other=0.0)
            # [BLOCK_Q, BLOCK_K]
            b_s, _ = _scores(b_q, b_k, sm_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
            m_s = _slice_mask(o_q, o_k, qs, qe, ks, ke, t) & m_k[None, :]
            b_s = tl.where(m_s, b_s * 1.4426950408889634, float("-inf"))  # 1/ln(2): base-2 softmax
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
            b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = tl.exp2(b_s - b_m_safe[:, None])
            b_alpha = tl.exp2(b_m - b_m_safe)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
            b_m = b_m_new
    m_row = b_l > 0.0
    b_o = b_acc / tl.where(m_row, b_l, 1.0)[:, None]
    # back to natural log: lse = (m + log2 l) * ln(2)
    b_lse = tl.where(m_row, (b_m + tl.log2(tl.where(m_row, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(p_o + (o_q.to(tl.int64)[:, None] * HQ + i_h) * HEAD_DIM + o_d[None, :],
             b_o.to(p_o.dtype.element_ty), mask=m_q[:, None])
    tl.store(p_lse + o_q.to(tl.int64) * HQ + i_h, b_lse, mask=m_q)


@triton.jit
def _flex_bwd_dq_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_qr, p_kr, p_type,
    Tq, Tk, R, sm_scale, softcap,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    i_kvh = i_h // (HQ // HKV)
    m0 = i_m * BLOCK_Q
    o_q = m0 + tl.arange(0, BLOCK_Q)
    o_d = tl.arange(0, HEAD_DIM)
    m_q = o_q < Tq
    o_qd = (o_q.to(tl.int64)[:, None] * HQ + i_h) * HEAD_DIM + o_d[None, :]
    # [BLOCK_Q, HEAD_DIM]
    b_q = tl.load(p_q + o_qd, mask=m_q[:, None], other=0.0)
    b_do = tl.load(p_do + o_qd, mask=m_q[:, None], other=0.0)
    # [BLOCK_Q]
    b_lse = tl.load(p_lse + o_q.to(tl.int64) * HQ + i_h, mask=m_q, other=0.0)
    b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse)  # empty row: every p is masked to 0
    b_delta = tl.load(p_delta + o_q.to(tl.int64) * HQ + i_h, mask=m_q, other=0.0)
    b_dq = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    for i_r in range(0, R):
        qs, qe, ks, ke, t = _slice_meta(p_qr, p_kr, p_type, i_r)
        q_lo = tl.maximum(qs, m0)
        q_hi = tl.minimum(qe, m0 + BLOCK_Q)
        k_lo, k_hi = _key_span(q_lo, q_hi, qs, qe, ks, ke, t)
        for n0 in range(k_lo, k_hi, BLOCK_K):
            o_k = n0 + tl.arange(0, BLOCK_K)
            m_k = o_k < k_hi
            o_kd = (o_k.to(tl.int64)[:, None] * HKV + i_kvh) * HEAD_DIM + o_d[None, :]
            # [BLOCK_K, HEAD_DIM]
            b_k = tl.load(p_k + o_kd, mask=m_k[:, None], other=0.0)
            b_v = tl.load(p_v + o_kd, mask=m_k[:, None], other=0.0)
            # [BLOCK_Q, BLOCK_K]
            b_s, b_th = _scores(b_q, b_k, sm_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
            m_s = _slice_mask(o_q, o_k, qs, qe, ks, ke, t) & m_k[None, :]
            b_p = tl.where(m_s, tl.exp(b_s - b_lse[:, None]), 0.0)
            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
            b_ds = b_p * (b_dp - b_delta[:, None])
            if USE_SOFTCAP:
                b_ds = b_ds * (1.0 - b_th * b_th)
            b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)
    tl.store(p_dq + o_qd, (b_dq * sm_scale).to(p_dq.dtype.element_ty), mask=m_q[:, None])


@triton.jit
def _flex_bwd_dkdv_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_qr, p_kr, p_type,
    Tq, Tk, R, sm_scale, softcap,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_n, i_kvh = tl.program_id(0), tl.program_id(1)
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
    for i_g in range(0, HQ // HKV):
        i_h = i_kvh * (HQ // HKV) + i_g
        for i_r in range(0, R):
            qs, qe, ks, ke, t = _slice_meta(p_qr, p_kr, p_type, i_r)
            k_lo = tl.maximum(ks, n0)
            k_hi = tl.minimum(ke, n0 + BLOCK_K)
            k_hi = tl.maximum(k_hi, k_lo)
            q_lo, q_hi = _query_span(k_lo, k_hi, qs, qe, ks, ke, t)
            for m0 in range(q_lo, q_hi, BLOCK_Q):
                o_q = m0 + tl.arange(0, BLOCK_Q)
                m_q = o_q < q_hi
                o_qd = (o_q.to(tl.int64)[:, None] * HQ + i_h) * HEAD_DIM + o_d[None, :]
                # [BLOCK_Q, HEAD_DIM]
                b_q = tl.load(p_q + o_qd, mask=m_q[:, None], other=0.0)
                b_do = tl.load(p_do + o_qd, mask=m_q[:, None], other=0.0)
                # [BLOCK_Q]
                b_lse = tl.load(p_lse + o_q.to(tl.int64) * HQ + i_h, mask=m_q, other=0.0)
                b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse)
                b_delta = tl.load(p_delta + o_q.to(tl.int64) * HQ + i_h, mask=m_q, other=0.0)
                # [BLOCK_Q, BLOCK_K]
                b_s, b_th = _scores(b_q, b_k, sm_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
                m_s = _slice_mask(o_q, o_k, qs, qe, ks, ke, t) & m_q[:, None] & m_k[None, :]
                b_p = tl.where(m_s, tl.exp(b_s - b_lse[:, None]), 0.0)
                b_dv += tl.dot(tl.trans(b_p).to(b_do.dtype), b_do, input_precision=DOT_PRECISION)
                b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
                b_ds = b_p * (b_dp - b_delta[:, None])
                if USE_SOFTCAP:
                    b_ds = b_ds * (1.0 - b_th * b_th)
                b_dk += tl.dot(tl.trans(b_ds).to(b_q.dtype), b_q, input_precision=DOT_PRECISION)
    tl.store(p_dk + o_kd, (b_dk * sm_scale).to(p_dk.dtype.element_ty), mask=m_k[:, None])
    tl.store(p_dv + o_kd, b_dv.to(p_dv.dtype.element_ty), mask=m_k[:, None])


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


def _blocks(q: torch.Tensor, block_q: int | None, block_k: int | None, backward: bool) -> tuple[int, int]:
    if q.is_cuda:
        default = (64, 64) if backward else (128, 64)
    else:
        default = (64, 64)  # interpreter: few, big programs
    return block_q or default[0], block_k or default[1]


def _num_warps(head_dim: int, block_q: int) -> int:
    return 8 if (head_dim >= 128 and block_q >= 128) else 4


def flex_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float,
    *, block_q: int | None = None, block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher.

    q: [Tq, Hq, D], k/v: [Tk, Hkv, D] contiguous, same float dtype;
    q_ranges/k_ranges: [R, 2] int32 contiguous; attn_type: [R] int32.
    Returns out [Tq, Hq, D] (q's dtype) and lse [Tq, Hq] fp32 (natural log,
    -inf where a row sees no key).
    """
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    R = q_ranges.shape[0]
    block_q, block_k = _blocks(q, block_q, block_k, backward=False)
    out = torch.empty_like(q)
    lse = torch.empty((Tq, HQ), dtype=torch.float32, device=q.device)
    if Tq == 0:
        return out, lse
    grid = (triton.cdiv(Tq, block_q), HQ)
    _flex_fwd_kernel[grid](
        q, k, v, out, lse, q_ranges, k_ranges, attn_type,
        Tq, Tk, R, float(softmax_scale), float(softcap) if softcap > 0 else 1.0,
        HQ=HQ, HKV=HKV, HEAD_DIM=D, BLOCK_Q=block_q, BLOCK_K=block_k,
        USE_SOFTCAP=softcap > 0, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=_num_warps(D, block_q), num_stages=2,
    )
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
    *, block_q: int | None = None, block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward from (out, dlse): ``row_delta`` then ``flex_attn_bwd_from_delta``.

    dout/out: [Tq, Hq, D]; lse/dlse: [Tq, Hq] fp32 (dlse is the gradient that
    reaches lse, zeros when lse is unused); other inputs as in ``flex_attn_fwd``.
    Returns dq [Tq, Hq, D], dk/dv [Tk, Hkv, D] (summed over each KV head's
    query heads), in the dtypes of q, k, v.
    """
    delta = row_delta(dout, out, dlse)
    return flex_attn_bwd_from_delta(dout, q, k, v, lse, delta, q_ranges, k_ranges, attn_type,
                                    softmax_scale, softcap, block_q=block_q, block_k=block_k)


def flex_attn_bwd_from_delta(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float,
    *, block_q: int | None = None, block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: two kernels (dQ over query blocks, dK/dV over key blocks), no atomics.

    dout: [Tq, Hq, D] in q's dtype; lse: [Tq, Hq] fp32, the FINAL lse of each
    row (over all its keys, wherever computed); delta: [Tq, Hq] fp32,
    ``row_delta`` of the final output. With them ``P = exp(s - lse)`` and
    ``dS = P * (dP - delta)`` are the exact terms of the whole row, so the
    gradients of a call over part of a row's keys sum to the whole row's.
    Other inputs as in ``flex_attn_fwd``. Returns dq [Tq, Hq, D] (this call's
    share), dk/dv [Tk, Hkv, D], in the dtypes of q, k, v.
    """
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    R = q_ranges.shape[0]
    block_q, block_k = _blocks(q, block_q, block_k, backward=True)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    common = dict(HQ=HQ, HKV=HKV, HEAD_DIM=D, BLOCK_Q=block_q, BLOCK_K=block_k,
                  USE_SOFTCAP=softcap > 0, DOT_PRECISION=_dot_precision(q.dtype),
                  num_warps=4, num_stages=2)
    cap = float(softcap) if softcap > 0 else 1.0
    if Tq > 0:
        _flex_bwd_dq_kernel[(triton.cdiv(Tq, block_q), HQ)](
            q, k, v, dout, lse, delta, dq, q_ranges, k_ranges, attn_type,
            Tq, Tk, R, float(softmax_scale), cap, **common)
    if Tk > 0:
        _flex_bwd_dkdv_kernel[(triton.cdiv(Tk, block_k), HKV)](
            q, k, v, dout, lse, delta, dk, dv, q_ranges, k_ranges, attn_type,
            Tq, Tk, R, float(softmax_scale), cap, **common)
    return dq, dk, dv
