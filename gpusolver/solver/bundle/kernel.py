"""Triton bundle step (twin of ``bundle.ref.bundle_proposals``).

The offered units (top-k by area) and the destination windows come from
``offers_triton`` (one launch); one kernel with grid ``(B, P, K)`` then
prices every (destination, size) of one offered unit of one source in
registers, as ``[D1, U]`` tiles (D1 destinations, U task slots), and writes
that unit's best proposal. It equals the twin exactly (integers entry for
entry, float64 scores bit for bit).

Shape legend: B variants, G head groups, P ranks, n sub-chunk tiles per rank
(TILES), U = n * P units per group (unit u on rank u // n), T = G * U * U
tasks, K units offered per source, D destinations per unit from the headroom
window, D1 = D + 3 (plus the unit's first key host, its query host, and the
helper holding most of its rows; with a topology D + 4, plus the rank of the
source's node with most headroom). n = 1 compiles to the untiled kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpusolver.solver.core import _BIG, Proposals, State, Tasks
from gpusolver.solver.offers.kernel import offers_triton
from gpusolver.solver.state.kernel import byte_prices, link_prices, rank_table

_BIG_T = tl.constexpr(_BIG)
# Destinations priced at once by the bundle kernel: small enough that ptxas (sm_90a) reports no
# spill stores at P = 64 (window 64) with 8 warps, where a whole [128, 64] tile spills (the
# compile records: CHANGELOG.md, "Design notes"). With n tiles a destination's row
# holds n times the task slots, so the tile holds n times fewer destinations (n = 2: none).
_DEST_TILE = 8


def dest_tile(n_dests: int, tiles: int = 1) -> int:
    """BLOCK_D of the bundle kernel for a window of ``n_dests`` (plus the 3 extra destinations)
    and ``tiles`` units per rank."""
    return min(triton.next_power_of_2(n_dests + 3), max(1, _DEST_TILE // triton.next_power_of_2(tiles)))


@triton.jit
def _union_growth(cur_lo, cur_hi, lo, hi):
    """Tokens a hull [cur_lo, cur_hi) grows by when [lo, hi) joins it."""
    cur_len = tl.maximum(cur_hi - cur_lo, 0)
    u_lo = tl.where(cur_len > 0, tl.minimum(cur_lo, lo), lo)
    u_hi = tl.where(cur_len > 0, tl.maximum(cur_hi, hi), hi)
    return (u_hi - u_lo) - cur_len


@triton.jit
def _fits(now, delta, cap):
    """The rows ``now + delta`` stay within ``cap``, or do not grow."""
    return (now + delta <= cap) | (delta <= 0)


@triton.jit
def _price(
    inc,  # [BLOCK_D, BLOCK_S] the moved tasks of each destination (BLOCK_S task slots)
    mine, t_area, qlo_t, qhi_t, k_free_t, j_t,  # [1, BLOCK_S]
    j_send, j_recv, j_bsend, j_brecv, j_kout,  # [1, BLOCK_P]: of each task's key host (TILES == 1), of each rank
    k_grow_t,  # [BLOCK_D, BLOCK_S]
    d_of, qlo_d, qhi_d, send_d, recv_d, bsend_d, brecv_d, qin_d, kin_d,  # [BLOCK_D]
    s, i, bn, q_cur, send_i, recv_i, send_s, recv_s, send_bn, recv_bn, bnv, bal, exc, thr,  # scalars
    bsend_i, brecv_i, bsend_s, brecv_s, qout_i, kout_i, kout_s, b_bn, bwv, f_2nd, b_2nd,  # scalars
    Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES, QIN_CAP, KIN_CAP, QOUT_CAP, KOUT_CAP,
    w_id, w_is, w_jd, w_js,  # TOPO only: link prices (i, d) [BLOCK_D], (i, s), (j, d) [BLOCK_D, BLOCK_S], (j, s)
    ib_d, qn_lo_d, qn_hi_d, kx_t,  # RELAY only: IB price of the rows' node hull growth and that hull
    # [BLOCK_D]; each task's priced key-hull growth at the destination's node [BLOCK_D, BLOCK_S]
    SIDEWAYS: tl.constexpr, TRAINING: tl.constexpr, CAPS: tl.constexpr,
    TILES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_TL: tl.constexpr,
    TOPO: tl.constexpr, RELAY: tl.constexpr,
):
    """ok [BLOCK_D] bool, score [BLOCK_D] fp64, area, dest_send, dest_recv, dest_bsend, dest_brecv,
    dest_qin, dest_kin [BLOCK_D] int64 of one size (``bundle.ref``: the forward rule, or with
    TRAINING ``_training_scores``; with CAPS ``_fits_buffers``).

    Every task term is a sum, min or max over the slots, so the slots may hold the tasks in any
    order; with TILES > 1 they must be the key-host-major slots of ``_bundle_unit``. With TOPO
    the bytes price each token by its link (the twin's b* tokens); the rows stay plain."""
    area = tl.sum(tl.where(inc, t_area, 0), axis=1)
    # query rows: growth of the destination's hull, and what the source frees when it is not the host
    b_lo = tl.min(tl.where(inc, qlo_t, _BIG_T), axis=1)
    b_hi = tl.max(tl.where(inc, qhi_t, 0), axis=1)
    q_grow = tl.where((area > 0) & (d_of != i), _union_growth(qlo_d, qhi_d, b_lo, b_hi), 0)
    rest = mine & ~inc
    r_lo = tl.min(tl.where(rest, qlo_t, _BIG_T), axis=1)
    r_hi = tl.max(tl.where(rest, qhi_t, 0), axis=1)
    q_free = tl.where((area > 0) & (s != i), q_cur - tl.maximum(r_hi - r_lo, 0), 0)
    # key columns of the moved tasks, per key host: token changes, and their K/V bytes
    tok_t = tl.where(inc, k_grow_t - k_free_t, 0)  # [BLOCK_D, BLOCK_S]
    if TOPO:  # priced tokens: rows over link (i, d) and (i, s), each task's keys over (j, d) and (j, s)
        bq_grow = q_grow * w_id
        bq_free = q_free * w_is
        if RELAY:  # plus the InfiniBand crossing: what the rows add to the hull at d's node (``bundle.relay``)
            n_grow = tl.where((area > 0) & (ib_d > 0), _union_growth(qn_lo_d, qn_hi_d, b_lo, b_hi), 0)
            bq_grow += n_grow * ib_d
            btok_t = tl.where(inc, k_grow_t * w_jd + kx_t - k_free_t * w_js, 0)
        else:
            btok_t = tl.where(inc, k_grow_t * w_jd - k_free_t * w_js, 0)
    else:
        bq_grow = q_grow
        bq_free = q_free
        btok_t = tok_t
    kv_delta = btok_t * KV_BYTES
    tok_src = tl.sum(tl.where(j_t == s, tok_t, 0), axis=1)
    tok_host = tl.sum(tl.where(j_t == i, tok_t, 0), axis=1)
    btok_src = tl.sum(tl.where(j_t == s, btok_t, 0), axis=1)
    btok_host = tl.sum(tl.where(j_t == i, btok_t, 0), axis=1)
    # the destination as key host: it no longer sends the K/V it ships to the source alone
    tok_dest = tl.sum(tl.where(j_t == d_of[:, None], btok_t, 0), axis=1)
    kv_to_src = btok_src * KV_BYTES
    kv_to_host = tl.where(i != s, btok_host * KV_BYTES, 0)
    kv_to_dest = tok_dest * KV_BYTES
    elsewhere = inc & (j_t != s) & (j_t != i) & (j_t != d_of[:, None])
    if TILES == 1:  # each task's key unit has its own host
        kvh_max = tl.max(tl.where(elsewhere, j_send + kv_delta, 0), axis=1)
        tok_j = tok_t  # [BLOCK_D, BLOCK_P] per key host
        btok_j = btok_t
        hit_j = elsewhere
    else:  # slot h * BLOCK_TL + t holds key host h's tile t: up to TILES deltas add up per host
        tok_j = tl.sum(tl.reshape(tl.where(elsewhere, tok_t, 0), [BLOCK_D, BLOCK_P, BLOCK_TL]), axis=2)
        btok_j = tl.sum(tl.reshape(tl.where(elsewhere, btok_t, 0), [BLOCK_D, BLOCK_P, BLOCK_TL]), axis=2)
        hit_j = tl.max(tl.reshape(elsewhere.to(tl.int32), [BLOCK_D, BLOCK_P, BLOCK_TL]), axis=2) > 0
        kvh_max = tl.max(tl.where(hit_j, j_send + btok_j * KV_BYTES, 0), axis=1)
    k_grow = tl.sum(tl.where(inc, k_grow_t, 0), axis=1)
    k_free = tl.sum(tl.where(inc, k_free_t, 0), axis=1)
    if TOPO:
        if RELAY:
            bk_grow = tl.sum(tl.where(inc, k_grow_t * w_jd + kx_t, 0), axis=1)
        else:
            bk_grow = tl.sum(tl.where(inc, k_grow_t * w_jd, 0), axis=1)
        bk_free = tl.sum(tl.where(inc, k_free_t * w_js, 0), axis=1)
    else:
        bk_grow = k_grow
        bk_free = k_free

    # byte deltas of the three touched ranks (the query host may be the source or the destination)
    dq = q_grow - q_free
    bdq = bq_grow - bq_free
    h_ds = bdq * Q_BYTES
    h_dr = bdq * O_BYTES
    s_ds = -bq_free * O_BYTES
    s_dr = -bq_free * Q_BYTES - bk_free * KV_BYTES
    dest_send = bq_grow * O_BYTES
    dest_recv = bq_grow * Q_BYTES + bk_grow * KV_BYTES
    s_is_h = s == i
    d_is_h = d_of == i
    host_send = (send_i + h_ds + tl.where(s_is_h, s_ds + kv_to_src, kv_to_host)
                 + tl.where(d_is_h, dest_send, 0))
    host_recv = recv_i + h_dr + tl.where(s_is_h, s_dr, 0) + tl.where(d_is_h, dest_recv, 0)
    src_send = send_s + s_ds + kv_to_src + tl.where(s_is_h, h_ds, 0)
    src_recv = recv_s + s_dr + tl.where(s_is_h, h_dr, 0)
    d_send = send_d + dest_send + tl.where(d_is_h, h_ds, 0) + kv_to_dest
    d_recv = recv_d + dest_recv + tl.where(d_is_h, h_dr, 0)
    eps = tl.full([], 1e-12, tl.float64)  # a float64 constant, as in the torch twin
    if TRAINING:
        host_f = tl.maximum(host_send, host_recv)
        src_f = tl.maximum(src_send, src_recv)
        dest_f = tl.maximum(d_send, d_recv)
        # backward volumes from each touched rank's token changes (QO out, QO in, KV out, KV in)
        h_ko = tl.where(s_is_h, btok_src, btok_host)
        h_ki = tl.where(s_is_h, -bk_free, 0) + tl.where(d_is_h, bk_grow, 0)
        host_b = tl.maximum(bsend_i + bdq * QB_BYTES + h_ko * KVB_BYTES + h_ki * DKV_BYTES,
                            brecv_i + bdq * DQ_BYTES + h_ki * KVB_BYTES + h_ko * DKV_BYTES)
        s_qo = tl.where(s_is_h, bdq, 0)
        src_b = tl.maximum(bsend_s + s_qo * QB_BYTES - bq_free * DQ_BYTES + btok_src * KVB_BYTES
                           - bk_free * DKV_BYTES,
                           brecv_s - bq_free * QB_BYTES + s_qo * DQ_BYTES - bk_free * KVB_BYTES
                           + btok_src * DKV_BYTES)
        d_qo = tl.where(d_is_h, bdq, 0)
        dest_b = tl.maximum(bsend_d + d_qo * QB_BYTES + bq_grow * DQ_BYTES + tok_dest * KVB_BYTES
                            + bk_grow * DKV_BYTES,
                            brecv_d + bq_grow * QB_BYTES + d_qo * DQ_BYTES + bk_grow * KVB_BYTES
                            + tok_dest * DKV_BYTES)
        # key hosts other than the touched ranks: K/V out, dK/dV back
        kh_f = tl.max(tl.where(hit_j, tl.maximum(j_send + btok_j * KV_BYTES, j_recv), 0), axis=1)
        kh_b = tl.max(tl.where(hit_j, tl.maximum(j_bsend + btok_j * KVB_BYTES, j_brecv + btok_j * DKV_BYTES), 0),
                      axis=1)
        new_f = tl.maximum(tl.maximum(host_f, src_f), tl.maximum(dest_f, kh_f))
        new_b = tl.maximum(tl.maximum(host_b, src_b), tl.maximum(dest_b, kh_b))
        f_hit = (s == bn) | (i == bn) | (d_of == bn) | (tl.max((inc & (j_t == bn)).to(tl.int32), axis=1) > 0)
        b_hit = (s == b_bn) | (i == b_bn) | (d_of == b_bn) | (tl.max((inc & (j_t == b_bn)).to(tl.int32), axis=1) > 0)
        goal = bnv + bwv
        goal_new = (tl.maximum(new_f, tl.where(f_hit, f_2nd, bnv)) + tl.maximum(new_b, tl.where(b_hit, b_2nd, bwv)))
        added = bdq * (Q_BYTES + O_BYTES + QB_BYTES + DQ_BYTES) + (bk_grow - bk_free) * (KV_BYTES + KVB_BYTES
                                                                                           + DKV_BYTES)
        below = (new_f < bnv) & (new_b < bwv)
        ok_bn = ((goal_new < goal) | (below & (f_hit | b_hit))) & (dest_f < bnv) & (dest_b < bwv)
        if SIDEWAYS:
            side = (ok_bn == 0) & below & (added < 0)
        else:
            side = ok_bn & (ok_bn == 0)
        ok_bn = ok_bn | side
        ok_bal = (exc > 0) & ((new_f + new_b).to(tl.float64) <= thr)
        ok = (area > 0) & (d_of != s) & tl.where(bal, ok_bal, ok_bn)
        score_bal = added.to(tl.float64) / tl.maximum(area, 1).to(tl.float64)
        goal64 = tl.maximum(goal, 1).to(tl.float64)
        score_bn = goal_new.to(tl.float64) / goal64 + eps * (added.to(tl.float64) / goal64) + side.to(tl.float64)
    else:
        new_max = tl.maximum(tl.maximum(tl.maximum(host_send, host_recv), tl.maximum(src_send, src_recv)),
                             tl.maximum(tl.maximum(d_send, d_recv), kvh_max))
        added = bdq * (Q_BYTES + O_BYTES) + (bk_grow - bk_free) * KV_BYTES

        bn_is_j = elsewhere & (j_t == bn)
        bn_as_j = tl.maximum(send_bn + tl.sum(tl.where(bn_is_j, kv_delta, 0), axis=1), recv_bn)
        bn_any = tl.max(bn_is_j.to(tl.int32), axis=1) > 0
        bn_new = tl.where(s == bn, tl.maximum(src_send, src_recv),
                          tl.where(i == bn, tl.maximum(host_send, host_recv),
                                   tl.where(d_of == bn, tl.maximum(d_send, d_recv),
                                            tl.where(bn_any, bn_as_j, bnv))))
        ok_bal = (exc > 0) & (new_max.to(tl.float64) <= thr)
        ok_bn = (bn_new < bnv) & (new_max < bnv)
        if SIDEWAYS:  # the bottleneck stays, no touched rank reaches it, the total bytes fall
            side = (ok_bn == 0) & (bn_new <= bnv) & (new_max < bnv) & (added < 0)
        else:
            side = ok_bn & (ok_bn == 0)
        ok_bn = ok_bn | side
        ok = (area > 0) & (d_of != s) & tl.where(bal, ok_bal, ok_bn)
        score_bal = added.to(tl.float64) / tl.maximum(area, 1).to(tl.float64)
        # the tie-break is relative to the bottleneck, so it stays a tie-break at any sequence length
        bnv64 = tl.maximum(bnv, 1).to(tl.float64)
        score_bn = new_max.to(tl.float64) / bnv64 + eps * (added.to(tl.float64) / bnv64) + side.to(tl.float64)
    if CAPS:  # rows within the plan's buffers (``bundle.ref._fits_buffers``)
        ok = (ok & _fits(qout_i, dq, QOUT_CAP) & _fits(qin_d, q_grow, QIN_CAP) & _fits(kin_d, k_grow, KIN_CAP)
              & _fits(kout_s, tok_src, KOUT_CAP) & (s_is_h | _fits(kout_i, tok_host, KOUT_CAP)))
        over = hit_j & (tok_j > 0) & (j_kout + tok_j > KOUT_CAP)
        ok = ok & (tl.max(over.to(tl.int32), axis=1) == 0)
    score = tl.where(ok, tl.where(bal, score_bal, score_bn), float("inf"))
    # the destination's backward change (its own part, as dest_send)
    dest_bsend = bq_grow * DQ_BYTES + tok_dest * KVB_BYTES + bk_grow * DKV_BYTES
    dest_brecv = bq_grow * QB_BYTES + bk_grow * KVB_BYTES + tok_dest * DKV_BYTES
    return ok, score, area, dest_send + kv_to_dest, dest_recv, dest_bsend, dest_brecv, q_grow, k_grow


@triton.jit
def _bundle_kernel(
    rank_ptr,  # [B, T] int64 (row stride stride_rb)
    area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr,  # [T] int64 (strided)
    unit_tasks_ptr,  # [len(TASK_ORDERS), G*U, U] int64 contiguous: each QO unit's tasks per order
    order_ptr,  # [B] int64: the task order of each variant
    unit_ptr,  # [B, P, K] int64 contiguous: offered units
    dests_ptr,  # [B, P, D] int64 contiguous: headroom-window destinations
    headroom_ptr, excess_ptr,  # [B, P] int64 contiguous
    ranks_ptr,  # [10, B, P] int64 (planes RS apart): send, recv, vol, bsend, brecv, bvol, q_out, q_in, k_out, k_in
    bal_ptr, bneck_ptr, bwd_bneck_ptr, thr_ptr,  # [B] bool, int64, int64, fp64
    q_lo_ptr, q_hi_ptr, k_lo_ptr, k_hi_ptr, qlen_ptr, klen_ptr, kcount_ptr,  # [B, G*U, P] int64 contiguous
    ok_ptr, score_ptr, dest_ptr, moved_area_ptr, dsend_ptr, drecv_ptr,  # [B, P*K] bool/fp64/int64
    dx_ptr,  # [4, B, P*K] int64: the destination's bsend, brecv, QO rows in, KV rows in
    tasks_out_ptr,  # [B, P*K, U] int64
    caps_ptr,  # [4, B] int64 (CAPS only): each variant's QO / KV receive and QO / KV send rows
    T, P, K, D, GU, RS,
    stride_rb, stride_a, stride_q, stride_k,
    Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
    PER_NODE, W_NV, W_IB,  # TOPO only: ranks per node, the price of a byte inside and across nodes
    nodes_ptr,  # RELAY only: [6, B, G*U, N] int64, the state's node tables (``State.nodes``)
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, SIDEWAYS: tl.constexpr, SINGLES: tl.constexpr,
    TRAINING: tl.constexpr, CAPS: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_TL: tl.constexpr, TOPO: tl.constexpr, RELAY: tl.constexpr,
):
    _bundle_unit(rank_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, unit_tasks_ptr, order_ptr, unit_ptr,
                 dests_ptr, headroom_ptr, excess_ptr, ranks_ptr, bal_ptr, bneck_ptr, bwd_bneck_ptr, thr_ptr,
                 q_lo_ptr, q_hi_ptr, k_lo_ptr, k_hi_ptr, qlen_ptr, klen_ptr, kcount_ptr,
                 ok_ptr, score_ptr, dest_ptr, moved_area_ptr, dsend_ptr, drecv_ptr, dx_ptr, tasks_out_ptr, order_ptr,
                 caps_ptr,
                 tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64),
                 T, P, K, D, GU, RS, stride_rb, stride_a, stride_q, stride_k,
                 Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
                 BLOCK_P, BLOCK_D, False, SIDEWAYS, SINGLES, TRAINING, CAPS, TILES, BLOCK_M, BLOCK_TL,
                 PER_NODE, W_NV, W_IB, TOPO, nodes_ptr, RELAY)


@triton.jit
def _bundle_unit(
    rank_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, unit_tasks_ptr, order_ptr, unit_ptr,
    dests_ptr, headroom_ptr, excess_ptr, ranks_ptr, bal_ptr, bneck_ptr, bwd_bneck_ptr, thr_ptr,
    q_lo_ptr, q_hi_ptr, k_lo_ptr, k_hi_ptr, qlen_ptr, klen_ptr, kcount_ptr,
    ok_ptr, score_ptr, dest_ptr, moved_area_ptr, dsend_ptr, drecv_ptr, dx_ptr, tasks_out_ptr,
    units_ptr,  # [B] int64 (HAS_UNITS only): units variant b offers; slots past it propose nothing
    caps_ptr,  # [4, B] int64 (CAPS only): each variant's QO / KV receive and QO / KV send rows
    i_b, i_s, i_k,  # int64: variant, source, offered-unit slot
    T, P, K, D, GU, RS, stride_rb, stride_a, stride_q, stride_k,
    Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, HAS_UNITS: tl.constexpr, SIDEWAYS: tl.constexpr,
    SINGLES: tl.constexpr, TRAINING: tl.constexpr, CAPS: tl.constexpr, TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_TL: tl.constexpr,
    PER_NODE, W_NV, W_IB, TOPO: tl.constexpr,  # link prices (``_bundle_kernel``)
    nodes_ptr=None, RELAY: tl.constexpr = False,  # the relay transport's node tables (``_bundle_kernel``)
):
    """Program (i_b, i_s, i_k) of ``_bundle_kernel`` (its arguments, plus the per-variant unit count).

    The D + 3 destinations are priced in tiles of BLOCK_D, keeping the best
    (destination, size) so far: a whole ``[D + 3, P]`` tile spills registers
    to local memory on a GPU at large P (``_DEST_TILE``).

    Every per-task and per-rank vector is a ``[1, BLOCK]`` row, never 1-D: the
    sm_90 compiler (Triton 3.7) fails on 1-D vectors from a gathered load that
    are used both alone and broadcast against the ``[BLOCK_D, BLOCK]`` tiles.

    Untiled (TILES == 1) the U = P task slots hold the unit's tasks in the
    variant's order, and each task's key host is its own. With TILES > 1 the
    prefixes are taken in that order (``[1, BLOCK_M]``, U slots), then each
    task's prefix sum travels through the proposal's task row in memory to
    key-host-major slots (h * BLOCK_TL + t: key unit h * TILES + t), where
    the pricing sums each key host's TILES deltas in one reshape. BLOCK_S, the
    task slots the pricing sees: BLOCK_P untiled, BLOCK_P * BLOCK_TL tiled.
    """
    o_p = tl.arange(0, BLOCK_P).to(tl.int64)[None, :]  # [1, BLOCK_P] ranks (untiled: also the task slots)
    m_p = o_p < P
    U = P * TILES
    o_row = i_b * P  # [B, P] row of this variant
    o_cell = i_b * GU * P  # [B, G*U, P] slab of this variant
    u = tl.load(unit_ptr + (o_row + i_s) * K + i_k)
    i = (u % U) // TILES  # the unit's query host
    order = tl.load(order_ptr + i_b)
    # the ranks' bytes and rows: planes RS apart
    send_ptr = ranks_ptr
    recv_ptr = ranks_ptr + RS
    vol_ptr = ranks_ptr + 2 * RS
    bsend_ptr = ranks_ptr + 3 * RS
    brecv_ptr = ranks_ptr + 4 * RS
    bvol_ptr = ranks_ptr + 5 * RS
    qout_ptr = ranks_ptr + 6 * RS
    qin_ptr = ranks_ptr + 7 * RS
    kout_ptr = ranks_ptr + 8 * RS
    kin_ptr = ranks_ptr + 9 * RS

    if TILES == 1:
        # the unit's tasks by area; mine = on the source. [1, BLOCK_P]
        m_t = m_p
        tid = tl.load(unit_tasks_ptr + (order * GU + u) * P + o_p, mask=m_p, other=0)
        mine = (tl.load(rank_ptr + i_b * stride_rb + tid, mask=m_p, other=-1) == i_s) & m_p
        t_area = tl.where(mine, tl.load(area_ptr + tid * stride_a, mask=m_p, other=0), 0)
        after = tl.cumsum(t_area, axis=1)
        before = after - t_area
        first = mine & (tl.cumsum(mine.to(tl.int64), axis=1) == 1)
        j_t = tid % P  # key host
        kv_u = (tid // (P * P)) * P + j_t  # KV unit
        key_host = tl.sum(tl.sum(tl.where(first, j_t, 0), axis=1), axis=0)
        o_jh = j_t  # the key host of each slot
    else:
        # the unit's tasks in the variant's order (the prefixes'): [1, BLOCK_M] rows
        o_m = tl.arange(0, BLOCK_M).to(tl.int64)[None, :]
        m_m = o_m < U
        tid_s = tl.load(unit_tasks_ptr + (order * GU + u) * U + o_m, mask=m_m, other=0)
        mine_s = (tl.load(rank_ptr + i_b * stride_rb + tid_s, mask=m_m, other=-1) == i_s) & m_m
        t_area_s = tl.where(mine_s, tl.load(area_ptr + tid_s * stride_a, mask=m_m, other=0), 0)
        after_s = tl.cumsum(t_area_s, axis=1)
        first_s = mine_s & (tl.cumsum(mine_s.to(tl.int64), axis=1) == 1)
        key_host = tl.sum(tl.sum(tl.where(first_s, (tid_s % U) // TILES, 0), axis=1), axis=0)
        # key-host-major slots [1, BLOCK_P * BLOCK_TL]: slot h * BLOCK_TL + t is task (u, h * TILES + t)
        o_n = tl.arange(0, BLOCK_P * BLOCK_TL).to(tl.int64)[None, :]
        j_t = o_n // BLOCK_TL  # key host
        m_t = (j_t < P) & (o_n % BLOCK_TL < TILES)
        j_u = j_t * TILES + o_n % BLOCK_TL  # key unit in the group
        tid = u * U + j_u
        kv_u = (u // U) * U + j_u  # KV unit
        mine = (tl.load(rank_ptr + i_b * stride_rb + tid, mask=m_t, other=-1) == i_s) & m_t
        t_area = tl.where(mine, tl.load(area_ptr + tid * stride_a, mask=m_t, other=0), 0)
        # each task's prefix sum and first flag, from its place in the order to its key unit's slot
        # through this proposal's task row (written last, below)
        scratch = tasks_out_ptr + ((o_row + i_s) * K + i_k) * U
        tl.store(scratch + tid_s % U, after_s * 2 + first_s.to(tl.int64), mask=m_m)
        tl.debug_barrier()
        after_first = tl.load(scratch + j_u, mask=m_t, other=0)
        after = after_first // 2
        first = (after_first % 2) == 1
        before = after - t_area
        o_jh = o_p  # every rank: the slots' changes are summed per key host
    j_send = tl.load(send_ptr + o_row + o_jh, mask=m_p, other=0)
    zero_j = tl.zeros_like(j_send)
    if TRAINING:
        j_recv = tl.load(recv_ptr + o_row + o_jh, mask=m_p, other=0)
        j_bsend = tl.load(bsend_ptr + o_row + o_jh, mask=m_p, other=0)
        j_brecv = tl.load(brecv_ptr + o_row + o_jh, mask=m_p, other=0)
    else:
        j_recv, j_bsend, j_brecv = zero_j, zero_j, zero_j
    if CAPS:
        j_kout = tl.load(kout_ptr + o_row + o_jh, mask=m_p, other=0)
    else:
        j_kout = zero_j
    qlo_t = tl.load(qlo_ptr + tid * stride_q, mask=m_t, other=0)
    qhi_t = tl.load(qhi_ptr + tid * stride_q, mask=m_t, other=0)
    klo_t = tl.load(klo_ptr + tid * stride_k, mask=m_t, other=0)
    khi_t = tl.load(khi_ptr + tid * stride_k, mask=m_t, other=0)

    # the extra destinations after the window: the first key host, the query host, and the
    # other rank holding most of the unit's rows (first on ties)
    held = tl.load(qlen_ptr + o_cell + u * P + o_p, mask=m_p, other=0)
    held = tl.where(m_p, tl.where(o_p == i_s, -1, held), -_BIG_T)
    holder = tl.min(tl.min(tl.where(held == tl.max(tl.max(held, axis=1), axis=0), o_p, BLOCK_P), axis=1), axis=0)
    if TOPO:  # and the other rank of the source's node with most headroom (first on ties; none: the source)
        extra = 4
        peer = m_p & (o_p // PER_NODE == i_s // PER_NODE) & (o_p != i_s)
        peer_room = tl.where(peer, tl.load(headroom_ptr + o_row + o_p, mask=m_p, other=0), -_BIG_T)
        top_room = tl.max(tl.max(peer_room, axis=1), axis=0)
        node_peer = tl.min(tl.min(tl.where(peer & (peer_room == top_room), o_p, BLOCK_P), axis=1), axis=0)
        node_peer = tl.where(node_peer < P, node_peer, i_s)
    else:
        extra = 3
        node_peer = i_s

    # prefixes: size 0 = the first task (bottleneck phase only, unless SINGLES), size 1 = while
    # it fits the destination (and, balancing, until the excess is covered)
    bal = tl.load(bal_ptr + i_b).to(tl.int32) != 0
    exc = tl.load(excess_ptr + o_row + i_s)
    still_over = tl.where(bal, before < exc, True)
    single_ok = (bal == 0) | SINGLES
    first_only = first & single_ok

    # key columns freed at the source. [1, BLOCK_S]
    o_ks = o_cell + kv_u * P + i_s
    sole = tl.load(kcount_ptr + o_ks, mask=m_t, other=0) == 1
    k_free_t = tl.where(mine & sole, tl.load(klen_ptr + o_ks, mask=m_t, other=0), 0)
    # link prices of the source's side (TOPO): query host to source, each task's key host to source
    node_s = i_s // PER_NODE
    if RELAY:  # NVLink unless the source is the relay, InfiniBand when it is its node's only consumer
        n_nodes = P // PER_NODE
        n_node = (RS // P) * GU * n_nodes  # cells of one [B, G*U, N] node table
        o_nb = i_b * GU * n_nodes
        cross_is = i // PER_NODE != node_s
        sole_q = tl.load(nodes_ptr + 4 * n_node + o_nb + u * n_nodes + node_s) == 1
        w_is = (tl.where(cross_is & (i_s % PER_NODE == i % PER_NODE), 0, W_NV)
                + tl.where(cross_is & sole_q, W_IB, 0)).to(tl.int64)
        cross_js = j_t // PER_NODE != node_s  # [1, BLOCK_S]
        sole_k = tl.load(nodes_ptr + 5 * n_node + o_nb + kv_u * n_nodes + node_s, mask=m_t, other=0) == 1
        w_js = (tl.where(cross_js & (i_s % PER_NODE == j_t % PER_NODE), 0, W_NV)
                + tl.where(cross_js & sole_k, W_IB, 0)).to(tl.int64)
    else:
        w_is = tl.where(i // PER_NODE == node_s, W_NV, W_IB).to(tl.int64)
        w_js = tl.where(j_t // PER_NODE == node_s, W_NV, W_IB).to(tl.int64)  # [1, BLOCK_S]

    # the bottleneck rank (first on ties) and the ranks' current bytes
    vol = tl.load(vol_ptr + o_row + o_p, mask=m_p, other=-1)
    bn = tl.min(tl.min(tl.where(vol == tl.max(tl.max(vol, axis=1), axis=0), o_p, BLOCK_P), axis=1), axis=0)
    bnv = tl.load(bneck_ptr + i_b)
    thr = tl.load(thr_ptr + i_b)
    q_cur = tl.load(qlen_ptr + o_cell + u * P + i_s)
    send_i, recv_i = tl.load(send_ptr + o_row + i), tl.load(recv_ptr + o_row + i)
    send_s, recv_s = tl.load(send_ptr + o_row + i_s), tl.load(recv_ptr + o_row + i_s)
    send_bn, recv_bn = tl.load(send_ptr + o_row + bn), tl.load(recv_ptr + o_row + bn)
    zero = tl.zeros([], tl.int64)
    if TRAINING:  # the backward's volumes, its bottleneck rank, and each phase's second largest volume
        bsend_i, brecv_i = tl.load(bsend_ptr + o_row + i), tl.load(brecv_ptr + o_row + i)
        bsend_s, brecv_s = tl.load(bsend_ptr + o_row + i_s), tl.load(brecv_ptr + o_row + i_s)
        bvol = tl.load(bvol_ptr + o_row + o_p, mask=m_p, other=-1)
        b_bn = tl.min(tl.min(tl.where(bvol == tl.max(tl.max(bvol, axis=1), axis=0), o_p, BLOCK_P), axis=1), axis=0)
        bwv = tl.load(bwd_bneck_ptr + i_b)
        f_2nd = tl.max(tl.max(tl.where(o_p == bn, -1, vol), axis=1), axis=0)
        b_2nd = tl.max(tl.max(tl.where(o_p == b_bn, -1, bvol), axis=1), axis=0)
    else:
        bsend_i, brecv_i, bsend_s, brecv_s, b_bn, bwv, f_2nd, b_2nd = zero, zero, zero, zero, zero, zero, zero, zero
    if CAPS:
        qout_i, kout_i, kout_s = tl.load(qout_ptr + o_row + i), tl.load(kout_ptr + o_row + i), tl.load(kout_ptr + o_row + i_s)
        qin_cap, kin_cap = tl.load(caps_ptr + i_b), tl.load(caps_ptr + RS // P + i_b)
        qout_cap, kout_cap = tl.load(caps_ptr + 2 * (RS // P) + i_b), tl.load(caps_ptr + 3 * (RS // P) + i_b)
    else:
        qout_i, kout_i, kout_s, qin_cap, kin_cap, qout_cap, kout_cap = zero, zero, zero, zero, zero, zero, zero

    # the best (destination, size) over the tiles, in the twin's order d * 2 + size, first index on
    # ties: a tile replaces the best so far only with a lower score (tile 0 always, so a unit with
    # no valid move reports destination 0, size 0 as the twin's argmin does)
    best_score = tl.full([], float("inf"), tl.float64)
    best_idx = tl.zeros([], tl.int64)
    best_ok = tl.zeros([], tl.int32)
    best_dest = tl.zeros([], tl.int64)
    best_area = tl.zeros([], tl.int64)
    best_ds = tl.zeros([], tl.int64)
    best_dr = tl.zeros([], tl.int64)
    best_dbs = tl.zeros([], tl.int64)
    best_dbr = tl.zeros([], tl.int64)
    best_dqi = tl.zeros([], tl.int64)
    best_dki = tl.zeros([], tl.int64)
    for d0 in range(0, D + extra, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D] destinations of this tile
        m_d = o_d < D + extra
        d_win = tl.load(dests_ptr + (o_row + i_s) * D + o_d, mask=o_d < D, other=0)
        d_of = tl.where(o_d == D, key_host, tl.where(o_d == D + 1, i, tl.where(o_d == D + 2, holder,
                                                                                tl.where(o_d == D + 3, node_peer,
                                                                                         d_win))))
        d_of = tl.where(m_d, d_of, 0)
        node_d = d_of // PER_NODE
        if RELAY:  # the relay's NVLink hop (none to the relay itself) and the node's InfiniBand crossing
            cross_d = i // PER_NODE != node_d  # [BLOCK_D]
            w_id = tl.where(cross_d & (d_of % PER_NODE == i % PER_NODE), 0, W_NV).to(tl.int64)
            ib_d = tl.where(cross_d, W_IB, 0).to(tl.int64)
            o_qn = o_nb + u * n_nodes + node_d
            qn_lo_d = tl.load(nodes_ptr + o_qn, mask=m_d, other=0)
            qn_hi_d = tl.load(nodes_ptr + n_node + o_qn, mask=m_d, other=0)
            cross_jd = j_t // PER_NODE != node_d[:, None]  # [BLOCK_D, BLOCK_S]
            w_jd = tl.where(cross_jd & (d_of[:, None] % PER_NODE == j_t % PER_NODE), 0, W_NV).to(tl.int64)
        else:
            w_id = tl.where(i // PER_NODE == node_d, W_NV, W_IB).to(tl.int64)  # [BLOCK_D]
            w_jd = tl.where(j_t // PER_NODE == node_d[:, None], W_NV, W_IB).to(tl.int64)  # [BLOCK_D, BLOCK_S]
        room = tl.load(headroom_ptr + o_row + d_of, mask=m_d, other=0)
        fit = mine & (after <= room[:, None]) & m_d[:, None]  # [BLOCK_D, BLOCK_S]
        inc0 = fit & first_only
        inc1 = fit & still_over
        # key columns: growth of each task's KV unit hull at each destination
        m_dp = m_d[:, None] & m_t
        o_kd = o_cell + kv_u * P + d_of[:, None]  # [BLOCK_D, BLOCK_S]
        k_grow_t = _union_growth(tl.load(k_lo_ptr + o_kd, mask=m_dp, other=0),
                                 tl.load(k_hi_ptr + o_kd, mask=m_dp, other=0), klo_t, khi_t)
        k_grow_t = tl.where(j_t == d_of[:, None], 0, k_grow_t)
        if RELAY:  # each task's key columns added to the hull at the destination's node, IB-priced
            o_kn = o_nb + kv_u * n_nodes + node_d[:, None]
            kn_grow_t = _union_growth(tl.load(nodes_ptr + 2 * n_node + o_kn, mask=m_dp, other=0),
                                      tl.load(nodes_ptr + 3 * n_node + o_kn, mask=m_dp, other=0), klo_t, khi_t)
            kx_t = tl.where(mine & cross_jd, kn_grow_t * W_IB, 0)
        else:
            ib_d = tl.zeros_like(d_of)
            qn_lo_d = ib_d
            qn_hi_d = ib_d
            kx_t = tl.zeros_like(k_grow_t)
        qlo_d = tl.load(q_lo_ptr + o_cell + u * P + d_of, mask=m_d, other=0)
        qhi_d = tl.load(q_hi_ptr + o_cell + u * P + d_of, mask=m_d, other=0)
        send_d = tl.load(send_ptr + o_row + d_of, mask=m_d, other=0)
        recv_d = tl.load(recv_ptr + o_row + d_of, mask=m_d, other=0)
        zero_d = tl.zeros_like(recv_d)
        if TRAINING:
            bsend_d = tl.load(bsend_ptr + o_row + d_of, mask=m_d, other=0)
            brecv_d = tl.load(brecv_ptr + o_row + d_of, mask=m_d, other=0)
        else:
            bsend_d, brecv_d = zero_d, zero_d
        if CAPS:
            qin_d = tl.load(qin_ptr + o_row + d_of, mask=m_d, other=0)
            kin_d = tl.load(kin_ptr + o_row + d_of, mask=m_d, other=0)
        else:
            qin_d, kin_d = zero_d, zero_d

        ok0, score0, area0, ds0, dr0, dbs0, dbr0, dqi0, dki0 = _price(
            inc0, mine, t_area, qlo_t, qhi_t, k_free_t, j_t, j_send, j_recv, j_bsend, j_brecv, j_kout, k_grow_t,
            d_of, qlo_d, qhi_d, send_d, recv_d, bsend_d, brecv_d, qin_d, kin_d,
            i_s, i, bn, q_cur, send_i, recv_i, send_s, recv_s, send_bn, recv_bn, bnv, bal, exc, thr,
            bsend_i, brecv_i, bsend_s, brecv_s, qout_i, kout_i, kout_s, b_bn, bwv, f_2nd, b_2nd,
            Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES, qin_cap, kin_cap, qout_cap, kout_cap,
            w_id, w_is, w_jd, w_js, ib_d, qn_lo_d, qn_hi_d, kx_t, SIDEWAYS, TRAINING, CAPS, TILES, BLOCK_D, BLOCK_P,
            BLOCK_TL, TOPO, RELAY)
        ok1, score1, area1, ds1, dr1, dbs1, dbr1, dqi1, dki1 = _price(
            inc1, mine, t_area, qlo_t, qhi_t, k_free_t, j_t, j_send, j_recv, j_bsend, j_brecv, j_kout, k_grow_t,
            d_of, qlo_d, qhi_d, send_d, recv_d, bsend_d, brecv_d, qin_d, kin_d,
            i_s, i, bn, q_cur, send_i, recv_i, send_s, recv_s, send_bn, recv_bn, bnv, bal, exc, thr,
            bsend_i, brecv_i, bsend_s, brecv_s, qout_i, kout_i, kout_s, b_bn, bwv, f_2nd, b_2nd,
            Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES, qin_cap, kin_cap, qout_cap, kout_cap,
            w_id, w_is, w_jd, w_js, ib_d, qn_lo_d, qn_hi_d, kx_t, SIDEWAYS, TRAINING, CAPS, TILES, BLOCK_D, BLOCK_P,
            BLOCK_TL, TOPO, RELAY)

        score0 = tl.where(m_d, score0, float("inf"))
        score1 = tl.where(m_d, score1, float("inf"))
        t_score = tl.minimum(tl.min(score0, axis=0), tl.min(score1, axis=0))
        n_pad = 2 * (D + extra)
        t_idx = tl.minimum(tl.min(tl.where(m_d & (score0 == t_score), 2 * o_d, n_pad), axis=0),
                           tl.min(tl.where(m_d & (score1 == t_score), 2 * o_d + 1, n_pad), axis=0))
        size1 = (t_idx % 2) == 1
        row = o_d == t_idx // 2  # [BLOCK_D]
        take = (t_score < best_score) | (d0 == 0)
        best_score = tl.where(take, t_score, best_score)
        best_idx = tl.where(take, t_idx, best_idx)
        best_ok = tl.where(take, tl.sum(tl.where(row, tl.where(size1, ok1, ok0), 0).to(tl.int32), axis=0),
                           best_ok)
        best_dest = tl.where(take, tl.sum(tl.where(row, d_of, 0), axis=0), best_dest)
        best_area = tl.where(take, tl.sum(tl.where(row, tl.where(size1, area1, area0), 0), axis=0), best_area)
        best_ds = tl.where(take, tl.sum(tl.where(row, tl.where(size1, ds1, ds0), 0), axis=0), best_ds)
        best_dr = tl.where(take, tl.sum(tl.where(row, tl.where(size1, dr1, dr0), 0), axis=0), best_dr)
        best_dbs = tl.where(take, tl.sum(tl.where(row, tl.where(size1, dbs1, dbs0), 0), axis=0), best_dbs)
        best_dbr = tl.where(take, tl.sum(tl.where(row, tl.where(size1, dbr1, dbr0), 0), axis=0), best_dbr)
        best_dqi = tl.where(take, tl.sum(tl.where(row, tl.where(size1, dqi1, dqi0), 0), axis=0), best_dqi)
        best_dki = tl.where(take, tl.sum(tl.where(row, tl.where(size1, dki1, dki0), 0), axis=0), best_dki)

    o_out = (o_row + i_s) * K + i_k  # proposal index s * K + k of variant b
    ok_out = best_ok > 0
    if HAS_UNITS:
        ok_out = ok_out & (i_k < tl.load(units_ptr + i_b))
    tl.store(ok_ptr + o_out, ok_out)
    tl.store(score_ptr + o_out, best_score)
    tl.store(dest_ptr + o_out, best_dest)
    tl.store(moved_area_ptr + o_out, best_area)
    tl.store(dsend_ptr + o_out, best_ds)
    tl.store(drecv_ptr + o_out, best_dr)
    tl.store(dx_ptr + o_out, best_dbs)
    tl.store(dx_ptr + RS * K + o_out, best_dbr)
    tl.store(dx_ptr + 2 * RS * K + o_out, best_dqi)
    tl.store(dx_ptr + 3 * RS * K + o_out, best_dki)
    # the chosen bundle's tasks, in the variant's order: the prefix of the best size at the best destination
    room_best = tl.load(headroom_ptr + o_row + best_dest)
    if TILES == 1:  # [1, BLOCK_P]
        fit = mine & (after <= room_best)
        moved = tl.where((best_idx % 2) == 1, fit & still_over, fit & first_only)
        tl.store(tasks_out_ptr + o_out * P + o_p, tl.where(moved, tid, T), mask=m_p)
    else:  # [1, BLOCK_M]
        fit_s = mine_s & (after_s <= room_best)
        still_s = tl.where(bal, after_s - t_area_s < exc, True)
        moved_s = tl.where((best_idx % 2) == 1, fit_s & still_s, fit_s & first_s & single_ok)
        tl.debug_barrier()  # every slot of the row was read back above
        tl.store(tasks_out_ptr + o_out * U + o_m, tl.where(moved_s, tid_s, T), mask=m_m)


def bundle_proposals_triton(tasks: Tasks, st: State, cap, excess, balance, threshold,
                            units_per_rank, n_dests, dests_per_variant=None, order_per_variant=None,
                            sideways: bool = False, singles: bool = False, caps: torch.Tensor | None = None) -> Proposals:
    """Each offered QO unit's best bundle move (Triton twin of ``bundle_proposals``).

    tasks:          Tasks of the solve (T = G * U * U tasks, U = n * P units per group).
    st:             State of the current assignments (B variants).
    cap:            0-dim or [B, 1] int64, the largest load a destination may take.
    excess:         [B, P] int64 load above ``cap``.
    balance:        [B] bool, True while the variant is unbalanced.
    threshold:      [B] float64 balance-phase limit on any touched rank's bytes.
    units_per_rank: host int, units each source offers (K = min(it, G*U)).
    n_dests:        host int, window destinations per unit (D = min(it, P)).
    dests_per_variant, order_per_variant: optional [B] int64, each variant's
                    window width and task order (index into TASK_ORDERS).
    sideways:       host bool, sideways bottleneck-phase moves (as the twin).
    singles:        host bool, balance-phase single-task bundles (as the twin).
    Returns a Proposals with N = P * K: ok [B, N] bool, score [B, N] float64,
    dest/source/area/dest_send/dest_recv [B, N] int64, tasks [B, N, U] int64
    (T where unused) — equal to the torch twin's.
    """
    G, P, U, T = tasks.G, tasks.P, tasks.U, tasks.T
    tiles = tasks.tiles
    B, dev = st.rank.shape[0], st.rank.device
    K, D = min(units_per_rank, G * U), min(n_dests, P)
    ranks = torch.arange(P, device=dev)
    unit, headroom, dests = offers_triton(tasks, st, cap, units_per_rank, n_dests, dests_per_variant)
    unit, headroom = unit.contiguous(), headroom.contiguous()

    order_b = torch.zeros((B,), dtype=torch.int64, device=dev) if order_per_variant is None \
        else order_per_variant.contiguous()
    N = P * K
    ok = torch.empty((B, N), dtype=torch.bool, device=dev)
    score = torch.empty((B, N), dtype=torch.float64, device=dev)
    dest, area, dest_send, dest_recv = (torch.empty((B, N), dtype=torch.int64, device=dev) for _ in range(4))
    dx = torch.empty((4, B, N), dtype=torch.int64, device=dev)  # dest_bsend, dest_brecv, dest_qin, dest_kin
    moved = torch.empty((B, N, U), dtype=torch.int64, device=dev)
    source = ranks.repeat_interleave(K, output_size=N).expand(B, -1)
    out = Proposals(ok=ok, score=score, dest=dest, source=source, area=area, dest_send=dest_send,
                    dest_recv=dest_recv, tasks=moved, dest_bsend=dx[0], dest_brecv=dx[1], dest_qin=dx[2],
                    dest_kin=dx[3])
    if dev.type == "meta":  # shapes only: there is no data to run the kernel on
        return out
    c = lambda t: t.contiguous()  # noqa: E731  (no copy for the Triton state's tensors)
    _bundle_kernel[(B, P, K)](
        st.rank, tasks.area, tasks.qlo, tasks.qhi, tasks.klo, tasks.khi,
        c(tasks.unit_tasks), order_b, unit, c(dests),
        headroom, c(excess), rank_table(st),
        c(balance), c(st.bottleneck), c(st.bwd_bottleneck), c(threshold),
        c(st.q_lo), c(st.q_hi), c(st.k_lo), c(st.k_hi), c(st.qlen), c(st.klen), c(st.kcount),
        ok, score, dest, area, dest_send, dest_recv, dx, moved, ok if caps is None else caps.contiguous(),
        T, P, K, D, G * U, B * P,
        st.rank.stride(0), tasks.area.stride(0), tasks.qlo.stride(0), tasks.klo.stride(0),
        *byte_prices(tasks), *link_prices(tasks), st.bottleneck if st.nodes is None else c(st.nodes),
        BLOCK_P=triton.next_power_of_2(P), BLOCK_D=dest_tile(D, tiles), SIDEWAYS=bool(sideways),
        SINGLES=bool(singles), TRAINING=tasks.training, CAPS=caps is not None, TILES=tiles,
        BLOCK_M=triton.next_power_of_2(U), BLOCK_TL=triton.next_power_of_2(tiles), TOPO=tasks.links is not None,
        RELAY=tasks.relays,
        num_warps=8,
        enable_fp_fusion=False,  # no fused multiply-add: scores round like the twin's separate ops
    )
    return out
    c = lambda t: t.contiguous()  # noqa: E731  (no copy for the Triton state's tensors)
    _bundle_kernel[(B, P, K)](
        st.rank, tasks.area, tasks.qlo, tasks.qhi, tasks.klo, tasks.khi,
        c(tasks.unit_tasks), order_b, unit, c(dests),
        headroom, c(excess), c(st.send), c(st.recv), c(st.vol),
        c(balance), c(st.bottleneck), c(threshold),
        c(st.q_lo), c(st.q_hi), c(st.k_lo), c(st.k_hi), c(st.qlen), c(st.klen), c(st.kcount),
        ok, score, dest, area, dest_send, dest_recv, moved,
        T, P, K, D, G * U,
        st.rank.stride(0), tasks.area.stride(0), tasks.qlo.stride(0), tasks.klo.stride(0),
        tasks.q, tasks.o, tasks.kv,
        BLOCK_P=triton.next_power_of_2(P), BLOCK_D=dest_tile(D, tiles), SIDEWAYS=bool(sideways),
        SINGLES=bool(singles), TILES=tiles, BLOCK_M=triton.next_power_of_2(U), BLOCK_TL=triton.next_power_of_2(tiles), num_warps=8,
        enable_fp_fusion=False,  # no fused multiply-add: scores round like the twin's separate ops
    )
    return out
