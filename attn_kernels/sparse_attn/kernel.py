"""Triton kernels for sparse attention: forward (out, lse) and backward (dQ, dK, dV).

Shape legend: Tq query rows, Tk key rows, Hq / Hkv query / KV heads, hg = Hq /
Hkv query heads per KV head, D head dim, n selection slots, l block size.

One program per (query row, KV head). Its hg query heads share the keys the
row selected, so they form the matrix dimension (``BLOCK_H`` rows, padded to
16): a tile is ``BLOCK_S`` slots of ``BLOCK_L`` keys each (``BLOCK_S = 64`` of
one key for DSA's token top-k, one slot of ``l`` keys for NSA's blocks),
gathered through the row's key windows (``ref.selected_rows``). Scores are
scaled once by ``softmax_scale * log2(e)`` and exponentiated with ``exp2``;
lse is base 2 inside, natural log at the interface.

The backward takes each row's final lse and delta (``rowsum(dO * O) - dlse``),
so a rank that computed part of a row's keys gets its exact share. dQ is
stored by the row's program. dK and dV have two paths, since many rows select
the same key:

- deterministic (default): the launcher lists, for every (key row, KV head),
  the query rows that kept it (a stable sort of the kept entries by key, so
  rows ascend), and one program per (key row, KV head) sums their shares in
  that order and stores the result: bit-identical between runs;
- atomic: the row's program scatters its share with fp32 ``atomic_add``
  (relaxed) into fp32 buffers: no sort and tensor-core tiles, but on a GPU the
  summation order, and so the last bits, may differ between runs.

The launchers take contiguous tensors and int32 index tensors (``op.py``
prepares them) and read no tensor value on the host.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2)
LN2 = tl.constexpr(0.6931471805599453)

# Keys per tile (slots * keys per slot): one tl.dot's N dimension.
TILE_KEYS = 64


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    # The interpreter needs "ieee"; on GPU fp32 stays exact, fp16/bf16 ignore it.
    return "ieee" if (interpreting() or dtype == torch.float32) else "tf32"


def tile_shape(block_size: int) -> tuple[int, int]:
    """(BLOCK_S slots, BLOCK_L keys per slot) of a tile for blocks of ``block_size`` keys."""
    block_l = triton.next_power_of_2(block_size)
    return max(1, TILE_KEYS // block_l), block_l


@triton.jit
def _tile_keys(p_sel, p_win, i_row, s0, pos, cls, n_sel, W, window, Tk,
               L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    """Buffer rows [BLOCK_S * BLOCK_L] int64 of the keys of slots [s0, s0 + BLOCK_S) and which are kept."""
    o_s = s0 + tl.arange(0, BLOCK_S)
    # [BLOCK_S]
    b_sel = tl.load(p_sel + (i_row * n_sel + o_s), mask=o_s < n_sel, other=-1).to(tl.int64)
    o_l = tl.arange(0, BLOCK_L)
    # [BLOCK_S, BLOCK_L]
    b_key = b_sel[:, None] * L + o_l[None, :]
    m_key = (b_sel[:, None] >= 0) & (o_l[None, :] < L) & (b_key <= pos)
    b_key = tl.reshape(b_key, (BLOCK_S * BLOCK_L,))
    m_key = tl.reshape(m_key, (BLOCK_S * BLOCK_L,))
    i_w = b_key // window
    m_key = m_key & (i_w < W)
    p_w = p_win + (cls * W + i_w) * 3
    b_lo = tl.load(p_w, mask=m_key, other=0)
    b_hi = tl.load(p_w + 1, mask=m_key, other=0)
    b_off = tl.load(p_w + 2, mask=m_key, other=0)
    m_key = m_key & (b_key >= b_lo) & (b_key < b_hi)
    b_row = b_key + b_off
    m_key = m_key & (b_row >= 0) & (b_row < Tk)
    return tl.where(m_key, b_row, 0), m_key


@triton.jit
def _sparse_fwd_kernel(
    p_q, p_k, p_v, p_sel, p_pos, p_cls, p_win, p_o, p_lse,
    n_sel, W, window, Tk, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, HS: tl.constexpr, HEAD_DIM: tl.constexpr,
    L: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(HQ % HKV == 0)
    tl.static_assert(BLOCK_H >= HQ // HKV)
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    HG: tl.constexpr = HQ // HKV
    o_g = tl.arange(0, BLOCK_H)
    m_g = o_g < HG
    o_d = tl.arange(0, HEAD_DIM)
    o_qd = (i_t * HQ + i_h * HG + o_g)[:, None] * HEAD_DIM + o_d[None, :]
    # [BLOCK_H, HEAD_DIM]
    b_q = tl.load(p_q + o_qd, mask=m_g[:, None], other=0.0)
    pos = tl.load(p_pos + i_t).to(tl.int64)
    cls = tl.load(p_cls + i_t).to(tl.int64)
    i_row = i_t * HS + i_h % HS  # HS is 1 (shared by all KV heads) or HKV
    b_m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 units
    b_l = tl.zeros([BLOCK_H], tl.float32)
    b_acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for s0 in range(0, n_sel, BLOCK_S):
        b_row, m_key = _tile_keys(p_sel, p_win, i_row, s0, pos, cls, n_sel, W, window, Tk,
                                  L, BLOCK_S, BLOCK_L)
        o_kd = (b_row * HKV + i_h)[:, None] * HEAD_DIM + o_d[None, :]
        # [BLOCK_N, HEAD_DIM]
        b_k = tl.load(p_k + o_kd, mask=m_key[:, None], other=0.0)
        b_v = tl.load(p_v + o_kd, mask=m_key[:, None], other=0.0)
        # [BLOCK_H, BLOCK_N]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
        b_s = tl.where(m_key[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # nothing kept so far
        b_p = tl.exp2(b_s - b_m_use[:, None])
        b_alpha = tl.exp2(b_m - b_m_use)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new
    m_row = b_l > 0.0
    b_o = b_acc / tl.where(m_row, b_l, 1.0)[:, None]
    b_lse = tl.where(m_row, (b_m + tl.log2(tl.where(m_row, b_l, 1.0))) * LN2, float("-inf"))
    tl.store(p_o + o_qd, b_o.to(p_o.dtype.element_ty), mask=m_g[:, None])
    tl.store(p_lse + i_t * HQ + i_h * HG + o_g, b_lse, mask=m_g)


@triton.jit
def _sparse_bwd_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_sel, p_pos, p_cls, p_win, p_dq, p_dk, p_dv,
    n_sel, W, window, Tk, sm_scale, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, HS: tl.constexpr, HEAD_DIM: tl.constexpr,
    L: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DKV: tl.constexpr,
):
    tl.static_assert(HQ % HKV == 0)
    tl.static_assert(BLOCK_H >= HQ // HKV)
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    HG: tl.constexpr = HQ // HKV
    o_g = tl.arange(0, BLOCK_H)
    m_g = o_g < HG
    o_d = tl.arange(0, HEAD_DIM)
    o_qd = (i_t * HQ + i_h * HG + o_g)[:, None] * HEAD_DIM + o_d[None, :]
    # [BLOCK_H, HEAD_DIM]
    b_q = tl.load(p_q + o_qd, mask=m_g[:, None], other=0.0)
    b_do = tl.load(p_do + o_qd, mask=m_g[:, None], other=0.0)
    # [BLOCK_H]
    b_lse = tl.load(p_lse + i_t * HQ + i_h * HG + o_g, mask=m_g, other=0.0)
    b_lse2 = tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)  # empty row: every p is masked to 0
    b_delta = tl.load(p_delta + i_t * HQ + i_h * HG + o_g, mask=m_g, other=0.0)
    pos = tl.load(p_pos + i_t).to(tl.int64)
    cls = tl.load(p_cls + i_t).to(tl.int64)
    i_row = i_t * HS + i_h % HS  # HS is 1 (shared by all KV heads) or HKV
    b_dq = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for s0 in range(0, n_sel, BLOCK_S):
        b_row, m_key = _tile_keys(p_sel, p_win, i_row, s0, pos, cls, n_sel, W, window, Tk,
                                  L, BLOCK_S, BLOCK_L)
        o_kd = (b_row * HKV + i_h)[:, None] * HEAD_DIM + o_d[None, :]
        # [BLOCK_N, HEAD_DIM]
        b_k = tl.load(p_k + o_kd, mask=m_key[:, None], other=0.0)
        b_v = tl.load(p_v + o_kd, mask=m_key[:, None], other=0.0)
        # [BLOCK_H, BLOCK_N]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
        b_p = tl.where(m_key[None, :] & m_g[:, None], tl.exp2(b_s - b_lse2[:, None]), 0.0)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)
        if ATOMIC_DKV:
            # [BLOCK_N, HEAD_DIM]: this row's share of the gathered keys' gradients
            b_dk = tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, input_precision=DOT_PRECISION) * sm_scale
            b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=DOT_PRECISION)
            tl.atomic_add(p_dk + o_kd, b_dk, mask=m_key[:, None], sem="relaxed")
            tl.atomic_add(p_dv + o_kd, b_dv, mask=m_key[:, None], sem="relaxed")
    tl.store(p_dq + o_qd, (b_dq * sm_scale).to(p_dq.dtype.element_ty), mask=m_g[:, None])


@triton.jit
def _sparse_dkdv_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_rows, p_ptr, p_dk, p_dv,
    sm_scale, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One (key row, KV head): the shares of the query rows listed for it, summed in list order."""
    tl.static_assert(BLOCK_H >= HQ // HKV)
    i_k, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    HG: tl.constexpr = HQ // HKV
    o_d = tl.arange(0, HEAD_DIM)
    o_kd = (i_k * HKV + i_h) * HEAD_DIM + o_d
    # [HEAD_DIM]
    b_k = tl.load(p_k + o_kd).to(tl.float32)
    b_v = tl.load(p_v + o_kd).to(tl.float32)
    e_lo = tl.load(p_ptr + i_k * HKV + i_h)
    e_hi = tl.load(p_ptr + i_k * HKV + i_h + 1)
    # rows m of a step: entry m // BLOCK_H, query head m % BLOCK_H of this KV head
    o_m = tl.arange(0, BLOCK_E * BLOCK_H)
    o_g = o_m % BLOCK_H
    b_dk = tl.zeros([HEAD_DIM], tl.float32)
    b_dv = tl.zeros([HEAD_DIM], tl.float32)
    for e0 in range(e_lo, e_hi, BLOCK_E):
        o_e = e0 + o_m // BLOCK_H
        m_m = (o_e < e_hi) & (o_g < HG)
        b_t = tl.load(p_rows + o_e, mask=m_m, other=0).to(tl.int64)
        o_hq = b_t * HQ + i_h * HG + o_g  # [M] (query row, query head)
        o_qd = o_hq[:, None] * HEAD_DIM + o_d[None, :]
        # [M, HEAD_DIM]
        b_q = tl.load(p_q + o_qd, mask=m_m[:, None], other=0.0).to(tl.float32)
        b_do = tl.load(p_do + o_qd, mask=m_m[:, None], other=0.0).to(tl.float32)
        # [M]
        b_lse = tl.load(p_lse + o_hq, mask=m_m, other=0.0)
        b_lse2 = tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)
        b_delta = tl.load(p_delta + o_hq, mask=m_m, other=0.0)
        b_s = tl.sum(b_q * b_k[None, :], 1) * qk_scale
        b_p = tl.where(m_m, tl.exp2(b_s - b_lse2), 0.0)
        b_ds = b_p * (tl.sum(b_do * b_v[None, :], 1) - b_delta)
        b_dk += tl.sum(b_ds[:, None] * b_q, 0)
        b_dv += tl.sum(b_p[:, None] * b_do, 0)
    tl.store(p_dk + o_kd, (b_dk * sm_scale).to(p_dk.dtype.element_ty))
    tl.store(p_dv + o_kd, b_dv.to(p_dv.dtype.element_ty))


def key_major_lists(sel, q_pos, q_class, kv_windows, block_size: int, window: int, Tk: int,
                    num_heads_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every (key row, KV head) the query rows that kept it, ascending (sync-free, static shapes).

    Returns (rows [E] int32, ptr [Tk * Hkv + 1] int64): the rows of (key r, head h) are
    ``rows[ptr[r * Hkv + h]:ptr[r * Hkv + h + 1]]``; E = Tq * Hkv * n * l (kept entries first,
    then unused padding past ``ptr[-1]``).
    """
    from attn_kernels.sparse_attn.ref import selected_rows

    Tq, Hs, n = sel.shape
    HKV = num_heads_kv
    N = n * block_size
    rows, ok = selected_rows(sel, q_pos, q_class, kv_windows, block_size, window, Tk)  # [Tq, Hs, N]
    heads = torch.arange(HKV, device=sel.device).view(1, HKV, 1)
    key = torch.where(ok.expand(Tq, HKV, N), rows.expand(Tq, HKV, N) * HKV + heads, Tk * HKV).reshape(-1)
    order = torch.sort(key, stable=True)  # entries of one key stay in row order
    t = torch.arange(Tq, device=sel.device, dtype=torch.int32).view(Tq, 1, 1).expand(Tq, HKV, N).reshape(-1)
    ptr = torch.searchsorted(order.values, torch.arange(Tk * HKV + 1, device=sel.device))
    return t[order.indices].contiguous(), ptr


def _launch_args(q, k, sel, kv_windows, block_size):
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    block_s, block_l = tile_shape(block_size)
    consts = dict(HQ=HQ, HKV=HKV, HS=sel.shape[1], HEAD_DIM=D, L=block_size,
                  BLOCK_H=max(16, triton.next_power_of_2(HQ // HKV)), BLOCK_S=block_s, BLOCK_L=block_l,
                  DOT_PRECISION=_dot_precision(q.dtype))
    return (Tq, HKV), (sel.shape[2], kv_windows.shape[1]), consts


def sparse_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
    block_size: int, window: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: out [Tq, Hq, D] (q's dtype), lse [Tq, Hq] fp32. Arguments as ``ref.sparse_attn_fwd_ref``
    (contiguous, index tensors int32)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    grid, (n_sel, W), consts = _launch_args(q, k, sel, kv_windows, block_size)
    if q.shape[0] == 0:
        return out, lse
    _sparse_fwd_kernel[grid](q, k, v, sel, q_pos, q_class, kv_windows, out, lse,
                             n_sel, W, window, k.shape[0], softmax_scale * 1.4426950408889634, **consts)
    return out, lse


def sparse_attn_bwd_from_delta(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
    block_size: int, window: int, softmax_scale: float, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward from each row's final lse and delta: dq [Tq, Hq, D], dk / dv [Tk, Hkv, D] in the inputs'
    dtypes. ``deterministic``: dK, dV summed per key in row order (else fp32 atomics)."""
    dq = torch.empty_like(q)
    grid, (n_sel, W), consts = _launch_args(q, k, sel, kv_windows, block_size)
    qk_scale = softmax_scale * 1.4426950408889634
    if deterministic:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if q.shape[0] > 0:
        _sparse_bwd_kernel[grid](q, k, v, dout, lse, delta, sel, q_pos, q_class, kv_windows, dq, dk, dv,
                                 n_sel, W, window, k.shape[0], softmax_scale, qk_scale,
                                 ATOMIC_DKV=not deterministic, **consts)
    if not deterministic:
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    Tk, HKV = k.shape[0], k.shape[1]
    if Tk == 0:
        return dq, dk, dv
    rows, ptr = key_major_lists(sel, q_pos, q_class, kv_windows, block_size, window, Tk, HKV)
    _sparse_dkdv_kernel[(Tk, HKV)](q, k, v, dout, lse, delta, rows, ptr, dk, dv, softmax_scale, qk_scale,
                                   HQ=q.shape[1], HKV=HKV, HEAD_DIM=q.shape[2], BLOCK_E=16,
                                   BLOCK_H=triton.next_power_of_2(q.shape[1] // HKV))
    return dq, dk, dv
