"""Triton build of the work lists: the same tensors as ``worklist.build``, in a handful of launches.

The torch build (``worklist.py``) is the twin: it runs on any device,
including ``meta``, but is about a hundred small ops per axis, each a kernel
launch on a GPU. Here the launcher that runs Triton attention builds the lists
with three Triton kernels and two sorts per axis:

1. ``_slice_table_kernel`` (one lane per slice): the effective rectangle
   ``rect`` and each slice's canonical tree nodes as sort keys
   ``node * R + slice`` (``M * R`` for none), for one or both axes;
2. ``torch.sort`` of the keys;
3. ``_csr_kernel``: ``ptr`` by a binary search per node, ``idx = key % R``;
4. ``_block_weight_kernel`` (one program per block): the block's mask
   entries, summed in closed form over the slices of its list;
5. ``torch.sort`` of the weights, heaviest first (stable: ties by block).

Every value is an exact integer, so the result equals the torch build bit for
bit (``tests/attn_kernels/test_worklist.py``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attn_kernels.flex_attn import worklist


@triton.jit
def _tree_keys(p_keys, o_r, m_r, a, b, R, NB, L, BLOCK: tl.constexpr):
    """Canonical nodes of the block range of [a, b) (one lane per slice), written as 2 * L keys per slice."""
    b0 = a // BLOCK
    b1 = tl.where(b > a, (b + BLOCK - 1) // BLOCK, b0)
    M = 0
    n_lev = NB
    for _ in range(0, L):
        M += n_lev
        n_lev = (n_lev + 1) // 2
    none = tl.cast(M, tl.int64) * R
    first = 0
    n_lev = NB
    for lev in range(0, L):
        lo = (b0 + (1 << lev) - 1) >> lev
        hi = b1 >> lev
        inside = lo < hi
        left = tl.where(inside & (lo % 2 == 1), tl.cast(first + lo, tl.int64) * R + o_r, none)
        right = tl.where(inside & (hi % 2 == 1), tl.cast(first + hi - 1, tl.int64) * R + o_r, none)
        tl.store(p_keys + (2 * lev) * R + o_r, left, mask=m_r)
        tl.store(p_keys + (2 * lev + 1) * R + o_r, right, mask=m_r)
        first += n_lev
        n_lev = (n_lev + 1) // 2


@triton.jit
def _slice_table_kernel(
    p_qr, p_kr, p_type, p_rect, p_keys_q, p_keys_k,
    R, Tq, Tk, NB_Q, L_Q, NB_K, L_K,
    BLOCK_R: tl.constexpr, BLOCK_QA: tl.constexpr, BLOCK_KA: tl.constexpr,
    KEYS_Q: tl.constexpr, KEYS_K: tl.constexpr,
):
    # one lane per slice; int64 so that no range value can overflow
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < R
    qs = tl.load(p_qr + 2 * o_r, mask=m_r, other=0).to(tl.int64)
    qe = tl.load(p_qr + 2 * o_r + 1, mask=m_r, other=0).to(tl.int64)
    ks = tl.load(p_kr + 2 * o_r, mask=m_r, other=0).to(tl.int64)
    ke = tl.load(p_kr + 2 * o_r + 1, mask=m_r, other=0).to(tl.int64)
    t = tl.load(p_type + o_r, mask=m_r, other=0)
    causal = (t == 1) | (t == 3)
    inv = (t == 2) | (t == 3)
    tq = tl.cast(Tq, tl.int64)
    tk = tl.cast(Tk, tl.int64)
    # as worklist.slice_rect
    dc = tl.minimum(tl.maximum(tl.where(causal, ke - qe, tk), -tq - 1), tk)
    di = tl.minimum(tl.maximum(tl.where(inv, ks - qs, -tq), -tq), tk + 1)
    qa = tl.minimum(tl.maximum(qs, 0), tq)
    qb = tl.minimum(tl.maximum(qe, 0), tq)
    ka = tl.minimum(tl.maximum(ks, 0), tk)
    kb = tl.minimum(tl.maximum(ke, 0), tk)
    qa = tl.maximum(qa, ka - dc)
    qb = tl.minimum(qb, kb - di)
    ka = tl.maximum(ka, qa + di)
    kb = tl.minimum(kb, qb + dc)
    empty = (qb <= qa) | (kb <= ka) | (di > dc)
    qa = tl.where(empty, 0, qa)
    qb = tl.where(empty, 0, qb)
    ka = tl.where(empty, 0, ka)
    kb = tl.where(empty, 0, kb)
    p = p_rect + 8 * o_r
    tl.store(p, qa.to(tl.int32), mask=m_r)
    tl.store(p + 1, qb.to(tl.int32), mask=m_r)
    tl.store(p + 2, ka.to(tl.int32), mask=m_r)
    tl.store(p + 3, kb.to(tl.int32), mask=m_r)
    tl.store(p + 4, dc.to(tl.int32), mask=m_r)
    tl.store(p + 5, di.to(tl.int32), mask=m_r)
    tl.store(p + 6, tl.zeros([BLOCK_R], tl.int32), mask=m_r)
    tl.store(p + 7, tl.zeros([BLOCK_R], tl.int32), mask=m_r)
    if KEYS_Q:
        _tree_keys(p_keys_q, o_r.to(tl.int64), m_r, qa, qb, R, NB_Q, L_Q, BLOCK_QA)
    if KEYS_K:
        _tree_keys(p_keys_k, o_r.to(tl.int64), m_r, ka, kb, R, NB_K, L_K, BLOCK_KA)


@triton.jit
def _csr_kernel(p_keys, p_ptr, p_idx, N, M, R, STEPS, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # ptr[m] = first item whose key is >= m * R (binary search over the sorted keys)
    m_m = i <= M
    target = i.to(tl.int64) * R
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + N
    for _ in range(0, STEPS):
        mid = (lo + hi) // 2
        key = tl.load(p_keys + mid, mask=m_m & (mid < hi), other=0)
        right = (mid < hi) & (key < target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right | (mid >= hi), hi, mid)
    tl.store(p_ptr + i, lo, mask=m_m)
    m_i = i < N
    key = tl.load(p_keys + i, mask=m_i, other=0)
    tl.store(p_idx + i, (key % R).to(tl.int32), mask=m_i)


@triton.jit
def _series(a, b):
    """sum of q for q in [a, b) (b >= a), int64."""
    return (b - a) * (a + b - 1) // 2


@triton.jit
def _area(x0, x1, lo_a, hi_b, d_lo, d_hi):
    """Entries of a slice in positions [x0, x1) of an axis, where position x covers
    [max(lo_a, x + d_lo), min(hi_b, x + d_hi + 1)) on the other axis (every x has one)."""
    s = tl.minimum(tl.maximum(hi_b - d_hi - 1, x0), x1)
    top = (s - x0) * (d_hi + 1) + _series(x0, s) + (x1 - s) * hi_b
    s2 = tl.minimum(tl.maximum(lo_a - d_lo + 1, x0), x1)
    bottom = (s2 - x0) * lo_a + _series(s2, x1) + (x1 - s2) * d_lo
    return tl.where(x1 > x0, top - bottom, 0)


@triton.jit
def _block_weight_kernel(p_rect, p_ptr, p_idx, p_w, NB, L, AXIS: tl.constexpr, BLOCK: tl.constexpr):
    i_b = tl.program_id(0)
    p0 = i_b * BLOCK
    w = tl.zeros([1], tl.int64)
    node0 = 0
    n_lev = NB
    for lev in range(0, L):
        node = node0 + (i_b >> lev)
        for j in range(tl.load(p_ptr + node), tl.load(p_ptr + node + 1)):
            p = p_rect + 8 * tl.load(p_idx + j)
            qa = tl.load(p).to(tl.int64)
            qb = tl.load(p + 1).to(tl.int64)
            ka = tl.load(p + 2).to(tl.int64)
            kb = tl.load(p + 3).to(tl.int64)
            dc = tl.load(p + 4).to(tl.int64)
            di = tl.load(p + 5).to(tl.int64)
            if AXIS == 0:  # row q sees keys [max(ka, q + di), min(kb, q + dc + 1))
                w += _area(tl.maximum(qa, p0), tl.minimum(qb, p0 + BLOCK), ka, kb, di, dc)
            else:  # column k is seen by rows [max(qa, k - dc), min(qb, k - di + 1))
                w += _area(tl.maximum(ka, p0), tl.minimum(kb, p0 + BLOCK), qa, qb, -dc, -di)
        node0 += n_lev
        n_lev = (n_lev + 1) // 2
    tl.store(p_w + i_b + tl.arange(0, 1), w)


# lanes per program of (the slice-table kernel, the CSR kernel); the interpreter pays per program
GPU_LANES = (128, 1024)
INTERPRETER_LANES = (1024, 8192)


def build(q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor, seqlen_q: int, seqlen_k: int,
          block_q: int | None, block_k: int | None, *, lanes: tuple[int, int] | None = None,
          ) -> tuple[torch.Tensor, worklist.WorkList | None, worklist.WorkList | None]:
    """(rect, query-axis list or None, key-axis list or None) as ``worklist.slice_rect`` / ``worklist.build``.

    q_ranges/k_ranges [R, 2] int32, attn_type [R] int32 contiguous; block_q /
    block_k: the program block of each list to build (None: skip that axis);
    lanes: ``GPU_LANES`` or ``INTERPRETER_LANES`` (default: by TRITON_INTERPRET).
    """
    dev, R = q_ranges.device, q_ranges.shape[0]
    if R == 0:
        rect = worklist.slice_rect(q_ranges, k_ranges, attn_type, seqlen_q, seqlen_k)
        return (rect,) + tuple(None if b is None else worklist.build(rect, a, n, b)
                               for a, n, b in ((0, seqlen_q, block_q), (1, seqlen_k, block_k)))
    rect = torch.empty(R, 8, dtype=torch.int32, device=dev)
    axes = []
    for axis, n, block in ((0, seqlen_q, block_q), (1, seqlen_k, block_k)):
        if block is None:
            axes.append(None)
            continue
        sizes = worklist.level_sizes(n, block)
        axes.append((n, block, sizes, torch.empty(2 * len(sizes) * R, dtype=torch.int64, device=dev)))
    dummy = torch.empty(1, dtype=torch.int64, device=dev)
    aq, ak = axes
    if lanes is None:
        lanes = INTERPRETER_LANES if os.environ.get("TRITON_INTERPRET", "0") == "1" else GPU_LANES
    block_r, blk = lanes
    _slice_table_kernel[(triton.cdiv(R, block_r),)](
        q_ranges, k_ranges, attn_type, rect, aq[3] if aq else dummy, ak[3] if ak else dummy,
        R, seqlen_q, seqlen_k, aq[2][0] if aq else 1, len(aq[2]) if aq else 1,
        ak[2][0] if ak else 1, len(ak[2]) if ak else 1,
        BLOCK_R=block_r, BLOCK_QA=aq[1] if aq else 16, BLOCK_KA=ak[1] if ak else 16,
        KEYS_Q=aq is not None, KEYS_K=ak is not None, num_warps=4)
    lists = []
    for axis, a in enumerate(axes):
        if a is None:
            lists.append(None)
            continue
        n, block, sizes, keys = a
        keys = torch.sort(keys).values
        M, N, NB, L = sum(sizes), keys.shape[0], sizes[0], len(sizes)
        ptr = torch.empty(M + 1, dtype=torch.int32, device=dev)
        idx = torch.empty(N, dtype=torch.int32, device=dev)
        _csr_kernel[(triton.cdiv(max(M + 1, N), blk),)](keys, ptr, idx, N, M, R, N.bit_length(), BLOCK=blk,
                                                        num_warps=4)
        w = torch.empty(NB, dtype=torch.int64, device=dev)
        _block_weight_kernel[(NB,)](rect, ptr, idx, w, NB, L, AXIS=axis, BLOCK=block, num_warps=1)
        order = torch.sort(w, descending=True, stable=True).indices
        lists.append(worklist.WorkList(ptr=ptr, idx=idx, order=order, num_blocks=NB, levels=L))
    return rect, lists[0], lists[1]
