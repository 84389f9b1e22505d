"""Block areas of a slice mask in closed form: the Triton kernel and launcher.

The formulas are those of ``gpusolver/areas/ref.py`` (derived in its module
docstring). One program owns the outputs of query chunk ``i`` of head group
``g`` against a block of ``BLOCK_J`` key chunks, and walks the slices in tiles
of ``BLOCK_R``: sums and min/max reductions in int64, no atomics, so the
result is deterministic and identical to the torch version.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpusolver.areas.ref import BIG, check_block_areas_args
from gpusolver.masks.slices import AttnSlices
from gpusolver.problem import BlockAreas

_BIG = tl.constexpr(BIG)


@triton.jit
def _tri(x, w):
    """H(x): sum over integers y < x of clamp(y, 0, w)."""
    inside = x * (x - 1) // 2
    beyond = w * (w - 1) // 2 + (x - w) * w
    return tl.where(x <= 0, 0, tl.where(x <= w, inside, beyond))


@triton.jit
def _count_below(t, Q0, Q1, L, W, t_lo, t_hi):
    """N(t) = #{(q, k) in [Q0, Q1) x [L, L + W) : k - q < t}."""
    t = tl.minimum(tl.maximum(t, t_lo), t_hi)
    return _tri(Q1 + t - L, W) - _tri(Q0 + t - L, W)


@triton.jit
def _block_areas_kernel(
    q_ptr, k_ptr, t_ptr,  # [G, R, 2], [G, R, 2], [G, R] int32/int64 (strided)
    area_ptr, q_need_ptr, k_need_ptr,  # [G, P, P], [G, P, P, 2], [G, P, P, 2] int64, contiguous
    R, P, CHUNK,
    stride_qg, stride_qr, stride_qe,
    stride_kg, stride_kr, stride_ke,
    stride_tg, stride_tr,
    BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
):
    i_g, i_i, i_jb = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    o_j = (i_jb * BLOCK_J + tl.arange(0, BLOCK_J)).to(tl.int64)  # [BLOCK_J]
    m_j = o_j < P
    r0 = i_i * CHUNK
    r1 = r0 + CHUNK
    c0 = (o_j * CHUNK)[None, :]  # [1, BLOCK_J]
    c1 = c0 + CHUNK

    b_area = tl.zeros([BLOCK_J], dtype=tl.int64)
    b_qlo = tl.full([BLOCK_J], _BIG, dtype=tl.int64)
    b_qhi = tl.full([BLOCK_J], -_BIG, dtype=tl.int64)
    b_klo = tl.full([BLOCK_J], _BIG, dtype=tl.int64)
    b_khi = tl.full([BLOCK_J], -_BIG, dtype=tl.int64)
    for s in range(0, R, BLOCK_R):
        o_r = s + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        m_r = o_r < R
        p_q = q_ptr + i_g * stride_qg + o_r.to(tl.int64) * stride_qr
        p_k = k_ptr + i_g * stride_kg + o_r.to(tl.int64) * stride_kr
        # [BLOCK_R, 1]; masked rows read as the padding slice [0, 0) x [0, 0)
        qs = tl.load(p_q, mask=m_r, other=0).to(tl.int64)[:, None]
        qe = tl.load(p_q + stride_qe, mask=m_r, other=0).to(tl.int64)[:, None]
        ks = tl.load(p_k, mask=m_r, other=0).to(tl.int64)[:, None]
        ke = tl.load(p_k + stride_ke, mask=m_r, other=0).to(tl.int64)[:, None]
        ty = tl.load(t_ptr + i_g * stride_tg + o_r.to(tl.int64) * stride_tr, mask=m_r, other=0)[:, None]

        Q0 = tl.maximum(qs, r0)  # [BLOCK_R, 1]
        Q1 = tl.minimum(qe, r1)
        L = tl.maximum(ks, c0)  # [BLOCK_R, BLOCK_J]
        E = tl.minimum(ke, c1)
        inv = (ty == 2) | (ty == 3)  # INV_CAUSAL, BI_CAUSAL
        causal = (ty == 1) | (ty == 3)  # CAUSAL, BI_CAUSAL
        a = tl.where(inv, ks - qs, -_BIG)  # [BLOCK_R, 1]
        b = tl.where(causal, ke - qe + 1, _BIG)
        W = E - L
        t_lo = L - Q1
        t_hi = E - Q0
        valid = (Q1 > Q0) & (W > 0) & (a < b)
        n_b = _count_below(b, Q0, Q1, L, W, t_lo, t_hi)
        n_a = _count_below(a, Q0, Q1, L, W, t_lo, t_hi)
        blk = tl.where(valid, n_b - n_a, 0)  # [BLOCK_R, BLOCK_J]
        has = blk > 0

        b_area += tl.sum(blk, axis=0)
        b_qlo = tl.minimum(b_qlo, tl.min(tl.where(has, tl.maximum(Q0, L - b + 1), _BIG), axis=0))
        b_qhi = tl.maximum(b_qhi, tl.max(tl.where(has, tl.minimum(Q1, E - a), -_BIG), axis=0))
        b_klo = tl.minimum(b_klo, tl.min(tl.where(has, tl.maximum(L, Q0 + a), _BIG), axis=0))
        b_khi = tl.maximum(b_khi, tl.max(tl.where(has, tl.minimum(E, Q1 + b - 1), -_BIG), axis=0))

    q_empty = b_qhi <= b_qlo
    k_empty = b_khi <= b_klo
    cj = o_j * CHUNK  # [BLOCK_J]
    o_out = (i_g * P + i_i) * P + o_j  # [BLOCK_J]
    tl.store(area_ptr + o_out, b_area, mask=m_j)
    tl.store(q_need_ptr + 2 * o_out, tl.where(q_empty, 0, b_qlo - r0), mask=m_j)
    tl.store(q_need_ptr + 2 * o_out + 1, tl.where(q_empty, 0, b_qhi - r0), mask=m_j)
    tl.store(k_need_ptr + 2 * o_out, tl.where(k_empty, 0, b_klo - cj), mask=m_j)
    tl.store(k_need_ptr + 2 * o_out + 1, tl.where(k_empty, 0, b_khi - cj), mask=m_j)


def block_areas_triton(mask: AttnSlices, cp_size: int, head_groups: int = 1) -> BlockAreas:
    """Exact block areas and needed intervals of a slice mask (Triton, sync-free).

    mask:        AttnSlices, q_ranges / k_ranges [R, 2] or [G, R, 2], attn_type
                 [R] or [G, R], int32 or int64; total_seqlen_q == total_seqlen_k = S.
    cp_size:     P; S must be divisible by P.
    head_groups: G; must equal the mask's leading dim when it is grouped.

    Returns BlockAreas with area [G, P, P] int64 and q_need / k_need
    [G, P, P, 2] int64 (chunk-local [lo, hi)), chunk = S / P. Equal, entry for
    entry, to ``block_areas_torch``.
    """
    return launch_block_areas(mask, cp_size, head_groups,
                              block_r=32, block_j=min(64, triton.next_power_of_2(cp_size)))


def launch_block_areas(mask: AttnSlices, cp_size: int, head_groups: int, block_r: int, block_j: int) -> BlockAreas:
    """``block_areas_triton`` with explicit tile sizes (powers of two; tests use small ones)."""
    chunk = check_block_areas_args(mask, cp_size, head_groups)
    P = cp_size
    q, k, t = mask.q_ranges, mask.k_ranges, mask.attn_type
    if not mask.grouped:  # one mask for every group: count it once, expand at the end
        q, k, t = q[None], k[None], t[None]
    G = q.shape[0]
    R = q.shape[1]
    device = q.device
    area = torch.empty(G, P, P, dtype=torch.int64, device=device)
    q_need = torch.empty(G, P, P, 2, dtype=torch.int64, device=device)
    k_need = torch.empty(G, P, P, 2, dtype=torch.int64, device=device)
    grid = (G, P, triton.cdiv(P, block_j))
    if device.type == "meta":  # shapes only: no data to run the kernel on (the meta-device proof)
        return BlockAreas(area=area, q_need=q_need, k_need=k_need, chunk=chunk).expand_groups(head_groups)
    _block_areas_kernel[grid](
        q, k, t, area, q_need, k_need,
        R, P, chunk,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        t.stride(0), t.stride(1),
        BLOCK_R=block_r, BLOCK_J=block_j,
    )
    return BlockAreas(area=area, q_need=q_need, k_need=k_need, chunk=chunk).expand_groups(head_groups)
