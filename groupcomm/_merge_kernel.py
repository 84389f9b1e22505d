"""Fused row merge kernels: the host's rows and their returned partials, merged in registers.

Both kernels read the partials of host row (b, n) through the slot table ``slots [B, N, P]``
int32 (``_merge.slot_table``): ``slots[b, n, d]`` is the send position p (a row of
``ret[b]``) whose partial came back from destination d, -1 where the row was not sent to d.
Slots are visited d = 0, 1, ..., P - 1, after the host's own row: the order of the torch
path's deterministic sums (``_reduce.scatter_add_``), so the fp32 sums add the same terms in
the same order.

Nothing but the outputs is written: no fp32 copy of the returned rows and no fp32 accumulator
in memory (the accumulators live in registers, one tile of rows at a time).

- ``_merge_lse_kernel``: one program per (BLOCK_M items, rank b), an item being one (row,
  head) pair of D values. Three passes over the slots: the max of the lse, the sum of
  exp(lse_k - m), then the weighted sum of the outputs (the formula of ``_reduce``'s
  docstring; only lse are read in the first two passes).
- ``_merge_sum_kernel``: one program per (BLOCK_R rows, BLOCK_F columns, rank b) of rows
  flattened to F values; one pass.

Every load and store is masked (an out-of-bounds access under the interpreter corrupts the
process); a slot of -1 masks its loads, so its address is never read.

In place (``IN_PLACE``, ``group_reduce(inplace=True)``): the outputs are the host's rows
themselves (out / lse, acc), written through their own strides. That is safe because
1. each output element is owned by one program: the grid partitions the (rank, row, head) items
   (lse) and the (rank, row, column) elements (sum), and a program reads the host's values of
   its own elements only (the partials and slots it reads are other tensors, never written);
2. within a program every host value it stores is loaded first: the value stored at an address
   is computed from the value loaded there (a data dependence), and a CTA barrier
   (``tl.debug_barrier``) sits between the last load and the first store, because a block's
   layout may hold one element in several threads or warps (a [BLOCK_M] lse replicated across
   the threads of a row's D columns): without it, one warp could store a merged lse before
   another warp had loaded the old one for its columns.
The interpreter runs a program's ops in order, so the CPU tests check (1) and the arithmetic;
(2) on a GPU rests on the barrier, which the sm_90 compile test finds between the last global
load and the first global store of the PTX (at the GPU's blocks the layout changes before the
stores put barriers there too; the explicit one keeps it so whatever layouts a compiler picks).
No GPU run has checked the in-place kernels yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_lse_kernel(p_o, p_l, p_po, p_pl, p_slot, p_out, p_lse, N, H, D, P,
                      s_ob, s_on, s_oh, s_lb, s_ln, s_lh, s_pob, s_poc, s_poh, s_plb, s_plc, s_plh,
                      s_xb, s_xn, s_xh, s_yb, s_yn, s_yh,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, O_BCAST: tl.constexpr, IN_PLACE: tl.constexpr):
    i_m = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    m_m = o_m < N * H
    o_n = o_m // H
    o_h = o_m % H
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_slots = p_slot + (i_b * N + o_n) * P
    # [BLOCK_M]: the host's own lse, then the max over its partials
    b_l0 = tl.load(p_l + i_b * s_lb + o_n * s_ln + o_h * s_lh, mask=m_m, other=float("-inf")).to(tl.float32)
    b_mx = b_l0
    for k in range(0, P):
        b_p = tl.load(p_slots + k, mask=m_m, other=-1).to(tl.int64)
        m_k = m_m & (b_p >= 0)
        b_lk = tl.load(p_pl + i_b * s_plb + b_p * s_plc + o_h * s_plh, mask=m_k, other=float("-inf"))
        b_mx = tl.maximum(b_mx, b_lk.to(tl.float32))
    # a row whose every lse is -inf: 0 in the exponents, so its sum is 0 and its lse log(0) = -inf
    b_mx = tl.where(b_mx == float("-inf"), 0.0, b_mx)
    b_s = tl.exp(b_l0 - b_mx)
    for k in range(0, P):
        b_p = tl.load(p_slots + k, mask=m_m, other=-1).to(tl.int64)
        m_k = m_m & (b_p >= 0)
        b_lk = tl.load(p_pl + i_b * s_plb + b_p * s_plc + o_h * s_plh, mask=m_k, other=float("-inf"))
        b_s += tl.exp(b_lk.to(tl.float32) - b_mx)  # an empty slot adds exp(-inf) = 0: the same bits
    b_lse = b_mx + tl.log(b_s)
    b_safe = tl.where(b_lse == float("-inf"), 0.0, b_lse)
    m_md = m_m[:, None] & m_d[None, :]
    # [BLOCK_M, BLOCK_D]
    # O_BCAST: the host's out is one value per (row, head) broadcast over D (a neutral accumulator)
    o_d0 = o_d * 0 if O_BCAST else o_d
    b_o0 = tl.load(p_o + (i_b * s_ob + o_n * s_on + o_h * s_oh)[:, None] + o_d0[None, :], mask=m_md, other=0.0)
    b_acc = tl.exp(b_l0 - b_safe)[:, None] * b_o0.to(tl.float32)
    for k in range(0, P):
        b_p = tl.load(p_slots + k, mask=m_m, other=-1).to(tl.int64)
        m_k = m_m & (b_p >= 0)
        b_lk = tl.load(p_pl + i_b * s_plb + b_p * s_plc + o_h * s_plh, mask=m_k, other=float("-inf"))
        b_w = tl.exp(b_lk.to(tl.float32) - b_safe)
        # [BLOCK_M, BLOCK_D]
        b_ok = tl.load(p_po + (i_b * s_pob + b_p * s_poc + o_h * s_poh)[:, None] + o_d[None, :],
                       mask=m_k[:, None] & m_d[None, :], other=0.0)
        b_acc += b_w[:, None] * b_ok.to(tl.float32)
    if IN_PLACE:  # every thread has loaded the host's values it merges before any is overwritten
        tl.debug_barrier()
    # outputs [B, N, H, D] (strides s_x*, D contiguous) and [B, N, H] (strides s_y*)
    tl.store(p_out + (i_b * s_xb + o_n * s_xn + o_h * s_xh)[:, None] + o_d[None, :],
             b_acc.to(p_out.dtype.element_ty), mask=m_md)
    tl.store(p_lse + i_b * s_yb + o_n * s_yn + o_h * s_yh, b_lse.to(p_lse.dtype.element_ty), mask=m_m)


@triton.jit
def _merge_sum_kernel(p_a, p_r, p_slot, p_out, N, F, P, s_ab, s_an, s_rb, s_rc, s_xb, s_xn,
                      BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, A_BCAST: tl.constexpr, IN_PLACE: tl.constexpr):
    i_r = tl.program_id(0)
    i_f = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    o_n = i_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    m_n = o_n < N
    m_f = o_f < F
    m_nf = m_n[:, None] & m_f[None, :]
    p_slots = p_slot + (i_b * N + o_n) * P
    # [BLOCK_R, BLOCK_F]
    # A_BCAST: the host's row is one value broadcast over its F columns (a neutral accumulator)
    o_f0 = o_f * 0 if A_BCAST else o_f
    b_acc = tl.load(p_a + (i_b * s_ab + o_n * s_an)[:, None] + o_f0[None, :], mask=m_nf, other=0.0).to(tl.float32)
    for k in range(0, P):
        # [BLOCK_R]
        b_p = tl.load(p_slots + k, mask=m_n, other=-1).to(tl.int64)
        m_k = m_n & (b_p >= 0)
        # [BLOCK_R, BLOCK_F]
        b_x = tl.load(p_r + (i_b * s_rb + b_p * s_rc)[:, None] + o_f[None, :], mask=m_k[:, None] & m_f[None, :],
                      other=0.0)
        b_acc += b_x.to(tl.float32)
    if IN_PLACE:  # every thread has loaded the host's values it sums before any is overwritten
        tl.debug_barrier()
    # output [B, N, F] (strides s_xb, s_xn, F contiguous)
    tl.store(p_out + (i_b * s_xb + o_n * s_xn)[:, None] + o_f[None, :], b_acc.to(p_out.dtype.element_ty),
             mask=m_nf)


def _broadcast(t: torch.Tensor, inner: int) -> bool:
    """Whether ``t``'s last ``inner`` dims are one value broadcast (every stride 0): an accumulator
    from ``neutral_rows``, which the kernels read as it is instead of a copy of its rows."""
    return t.numel() > 0 and all(st == 0 for st in t.stride()[t.dim() - inner:])


def _flat(t: torch.Tensor, inner: int) -> bool:
    """Whether ``t``'s last ``inner`` dims are one contiguous run of values."""
    expect = 1
    for size, stride in zip(reversed(t.shape[t.dim() - inner:]), reversed(t.stride()[t.dim() - inner:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def rows_are_flat(t: torch.Tensor) -> bool:
    """Whether each row of ``t [B, N, *f]`` is one contiguous run of values (what the sum kernel
    writes in place)."""
    return _flat(t, t.dim() - 2)


def _rows(t: torch.Tensor, inner: int) -> torch.Tensor:
    """``t`` whose last ``inner`` dims are contiguous (a view when they are: the returned rows
    are strided views of the packed return buffer), else a contiguous copy."""
    return t if _flat(t, inner) else t.contiguous()


def lse_blocks(D: int, items: int, gpu: bool) -> dict:
    """BLOCK_M x BLOCK_D of the lse kernel: about 4096 fp32 accumulators a program on a GPU (four
    warps, no spills); the interpreter runs few, big programs."""
    block_d = triton.next_power_of_2(D)
    block_m = max(1, (4096 if gpu else 16384) // block_d)
    return dict(BLOCK_M=min(block_m, triton.next_power_of_2(items)), BLOCK_D=block_d)


def sum_blocks(F: int, N: int, gpu: bool) -> dict:
    """BLOCK_R x BLOCK_F of the sum kernel (as ``lse_blocks``; rows of F > 1024 values in column blocks)."""
    block_f = min(triton.next_power_of_2(F), 1024)
    block_r = max(1, (4096 if gpu else 16384) // block_f)
    return dict(BLOCK_R=min(block_r, triton.next_power_of_2(N)), BLOCK_F=block_f)


def merge_lse_into(out: torch.Tensor, lse: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor,
                   slots: torch.Tensor, out_new: torch.Tensor, lse_new: torch.Tensor, gpu: bool,
                   inplace: bool = False) -> None:
    """Launch ``_merge_lse_kernel``: out ``[B, N, h, D]``, lse ``[B, N, h]``, out_p ``[B, C, h, D]``,
    lse_p ``[B, C, h]``, slots ``[B, N, P]`` int32 -> out_new, lse_new (written through their
    strides; out_new's D contiguous); ``gpu``: the GPU's block sizes (else the interpreter's).
    ``inplace``: out_new is out and lse_new is lse (out's D contiguous), see the module docstring."""
    B, N, H, D = out.shape
    P = slots.shape[2]
    if B * N * H * D == 0:
        return
    if out_new.shape[-1] != 1 and out_new.stride(-1) != 1:
        raise ValueError(f"merge_lse_into: out_new's D must be contiguous, got strides {tuple(out_new.stride())}")
    if inplace and (out_new is not out or lse_new is not lse):
        raise ValueError("merge_lse_into(inplace=True) writes out and lse themselves: pass them as out_new, lse_new")
    bcast = _broadcast(out, 1)
    out = out if bcast or inplace else _rows(out, 1)
    out_p = _rows(out_p, 1)
    slots = slots.contiguous()
    blocks = lse_blocks(D, N * H, gpu)
    grid = (triton.cdiv(N * H, blocks["BLOCK_M"]), B)
    _merge_lse_kernel[grid](out, lse, out_p, lse_p, slots, out_new, lse_new, N, H, D, P,
                            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
                            out_p.stride(0), out_p.stride(1), out_p.stride(2),
                            lse_p.stride(0), lse_p.stride(1), lse_p.stride(2),
                            out_new.stride(0), out_new.stride(1), out_new.stride(2),
                            lse_new.stride(0), lse_new.stride(1), lse_new.stride(2),
                            **blocks, O_BCAST=bcast, IN_PLACE=inplace, num_warps=4)


def merge_sum_into(acc: torch.Tensor, ret: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                   gpu: bool, inplace: bool = False) -> None:
    """Launch ``_merge_sum_kernel``: acc ``[B, N, *f]``, ret ``[B, C, *f]``, slots ``[B, N, P]`` int32
    -> out ``[B, N, *f]`` (written through its first two strides, each row one contiguous run);
    ``gpu`` as in ``merge_lse_into``. ``inplace``: out is acc, see the module docstring."""
    B, N = acc.shape[:2]
    C, P = ret.shape[1], slots.shape[2]
    F = out[0, 0].numel() if B and N else 0
    if B * N * F == 0:
        return
    if not rows_are_flat(out):
        raise ValueError(f"merge_sum_into: out's rows must each be contiguous, got strides {tuple(out.stride())}")
    if inplace and out is not acc:
        raise ValueError("merge_sum_into(inplace=True) writes acc itself: pass it as out")
    bcast = _broadcast(acc, acc.dim() - 2)
    if bcast:
        a = acc.as_strided((B, N, F), (*acc.stride()[:2], 0))
    else:  # in place a view of acc itself (its rows are flat: checked above), never a copy
        a = acc.view(B, N, F) if inplace else _rows(acc, acc.dim() - 2).reshape(B, N, F)
    r = _rows(ret, ret.dim() - 2).reshape(B, C, F)
    slots = slots.contiguous()
    blocks = sum_blocks(F, N, gpu)
    grid = (triton.cdiv(N, blocks["BLOCK_R"]), triton.cdiv(F, blocks["BLOCK_F"]), B)
    _merge_sum_kernel[grid](a, r, slots, out, N, F, P, a.stride(0), a.stride(1), r.stride(0), r.stride(1),
                            out.stride(0), out.stride(1), **blocks, A_BCAST=bcast, IN_PLACE=inplace, num_warps=4)
