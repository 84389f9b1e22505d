"""Triton accept step (twins of ``accept.ref.accept`` and ``accept.ref.accept_apply``).

* ``accept_triton(prop, st, dest_cap, limit, excess, balance)``: which
  proposals to apply, [B, N] bool.
* ``accept_apply_triton(A, prop, st, dest_cap, limit, excess, balance)``:
  the same, then the accepted tasks move to their destinations in A, in
  place (the round loop drops the old assignment); the variants that found no
  move while unbalanced.

On ``device="meta"`` the launchers allocate their outputs and skip the kernel.

One program per variant holds all N proposals as one block. The torch twin
sorts twice (score order, then destination or source runs) and takes
segmented running sums; here the order is a comparison instead: proposal j
comes before proposal i when its score is lower, or equal with a lower index
(``torch.sort(stable=True)``'s order), so i's running sum within its
destination is the sum over the j that come no later than i and share its
destination, an [N, BLOCK_J] masked sum per chunk of j. Integer sums are
exact in any order, so the result does not depend on the chunking, and
nothing is atomic.

Shape legend: B variants, P ranks, T tasks, N proposals per variant
(N = P * K), M task slots per proposal (M = U, the units per group: P, or
n * P with n sub-chunk tiles per rank).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpusolver.solver.core import Proposals, State
from gpusolver.solver.state.kernel import rank_table

# Proposals j compared with all N proposals i at once: [BLOCK_N, BLOCK_J] tiles. With
# N = 256 (P = 64, 4 units) and 8 warps, ptxas (sm_90) reports no spills for 16; 64 spilled.
_BLOCK_J = 16


@triton.jit
def _before(s_i, s_j, o_i, o_j):
    """[BLOCK_N, BLOCK_J] bool: j sorts no later than i in stable ascending order (NaN last)."""
    nan_i = s_i != s_i
    nan_j = s_j != s_j
    by_value = (s_j < s_i) | ((s_j == s_i) & (o_j <= o_i))
    return tl.where(nan_i | nan_j, tl.where(nan_i & nan_j, o_j <= o_i, nan_i), by_value)


@triton.jit
def _accept_kernel(
    score_ptr,  # [B, N] fp64
    ok_ptr,  # [B, N] bool
    dest_ptr, source_ptr, area_ptr, dsend_ptr, drecv_ptr,  # [B, N] int64
    load_ptr, send_ptr, recv_ptr, excess_ptr,  # [B, P] int64
    cap_ptr,  # [B] int64 (stride stride_cap, 0 when shared): the largest load a destination may take
    limit_ptr,  # [B] fp64: the largest send/recv bytes a destination may reach
    bal_ptr,  # [B] bool
    fits_ptr,  # [B, N] bool scratch: accepted by the destinations
    keep_ptr,  # [B, N] bool out
    stuck_ptr,  # [B] bool out: balancing and nothing accepted
    tasks_ptr,  # [B, N, M] int64 contiguous (APPLY only): task ids, T where unused
    a_ptr,  # [B, T+1] int64 (APPLY only): the assignment, updated in place
    dx_ptr,  # [4, B, N] int64 contiguous (TRAINING or CAPS): the destination's bsend, brecv, QO and KV rows in
    ranks_ptr,  # [10, B, P] int64 (TRAINING or CAPS; planes RS apart): ``state.kernel.rank_table``
    bneck_ptr, bwd_bneck_ptr,  # [B] int64 (TRAINING): the forward and backward bottlenecks
    caps_ptr,  # [2, B] int64 (CAPS; rows RS / P apart): each variant's QO and KV receive rows per rank
    N, P, M, T, RS,
    stride_score, stride_ok, stride_dest, stride_src, stride_area, stride_ds, stride_dr,  # row strides
    stride_load, stride_send, stride_recv, stride_exc, stride_cap, stride_a,
    BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr, APPLY: tl.constexpr,
    TRAINING: tl.constexpr, CAPS: tl.constexpr,
):
    _accept_variant(score_ptr, ok_ptr, dest_ptr, source_ptr, area_ptr, dsend_ptr, drecv_ptr,
                    load_ptr, send_ptr, recv_ptr, excess_ptr, cap_ptr, limit_ptr, bal_ptr, fits_ptr, keep_ptr,
                    stuck_ptr, tasks_ptr, a_ptr, dx_ptr, ranks_ptr, bneck_ptr, bwd_bneck_ptr, caps_ptr,
                    tl.program_id(0).to(tl.int64), N, P, M, T, RS,
                    stride_score, stride_ok, stride_dest, stride_src, stride_area, stride_ds, stride_dr,
                    stride_load, stride_send, stride_recv, stride_exc, stride_cap, stride_a,
                    BLOCK_N, BLOCK_J, BLOCK_M, APPLY, TRAINING, CAPS)


@triton.jit
def _accept_variant(
    score_ptr, ok_ptr, dest_ptr, source_ptr, area_ptr, dsend_ptr, drecv_ptr,
    load_ptr, send_ptr, recv_ptr, excess_ptr, cap_ptr, limit_ptr, bal_ptr, fits_ptr, keep_ptr,
    stuck_ptr, tasks_ptr, a_ptr, dx_ptr, ranks_ptr, bneck_ptr, bwd_bneck_ptr, caps_ptr, i_b, N, P, M, T, RS,
    stride_score, stride_ok, stride_dest, stride_src, stride_area, stride_ds, stride_dr,
    stride_load, stride_send, stride_recv, stride_exc, stride_cap, stride_a,
    BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr, APPLY: tl.constexpr,
    TRAINING: tl.constexpr, CAPS: tl.constexpr,
):
    """Variant ``i_b`` (int64) of ``_accept_kernel`` (its arguments). With APPLY the moves land in
    place: a task moves at most once per round (proposals of one variant move disjoint tasks)."""
    tl.static_assert(BLOCK_N % BLOCK_J == 0)
    o_i = tl.arange(0, BLOCK_N)  # [BLOCK_N] proposals i
    m_i = o_i < N
    # [BLOCK_N]
    b_score = tl.load(score_ptr + i_b * stride_score + o_i, mask=m_i, other=0.0)
    b_ok = (tl.load(ok_ptr + i_b * stride_ok + o_i, mask=m_i, other=0).to(tl.int32) != 0) & m_i
    b_dest = tl.where(b_ok, tl.load(dest_ptr + i_b * stride_dest + o_i, mask=m_i, other=0), P)
    b_area = tl.where(b_ok, tl.load(area_ptr + i_b * stride_area + o_i, mask=m_i, other=0), 0)

    # destination side: running sums of area and bytes within each destination, in score order
    r_area = tl.zeros([BLOCK_N], dtype=tl.int64)
    r_send = tl.zeros([BLOCK_N], dtype=tl.int64)
    r_recv = tl.zeros([BLOCK_N], dtype=tl.int64)
    r_bs = tl.zeros([BLOCK_N], dtype=tl.int64)
    r_br = tl.zeros([BLOCK_N], dtype=tl.int64)
    r_qi = tl.zeros([BLOCK_N], dtype=tl.int64)
    r_ki = tl.zeros([BLOCK_N], dtype=tl.int64)
    NB = RS // P * N  # B * N, the planes of dx
    for j0 in range(0, N, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)  # [BLOCK_J]
        m_j = o_j < N
        s_j = tl.load(score_ptr + i_b * stride_score + o_j, mask=m_j, other=0.0)
        ok_j = (tl.load(ok_ptr + i_b * stride_ok + o_j, mask=m_j, other=0).to(tl.int32) != 0) & m_j
        d_j = tl.where(ok_j, tl.load(dest_ptr + i_b * stride_dest + o_j, mask=m_j, other=0), P)
        a_j = tl.where(ok_j, tl.load(area_ptr + i_b * stride_area + o_j, mask=m_j, other=0), 0)
        ds_j = tl.where(ok_j, tl.load(dsend_ptr + i_b * stride_ds + o_j, mask=m_j, other=0), 0)
        dr_j = tl.where(ok_j, tl.load(drecv_ptr + i_b * stride_dr + o_j, mask=m_j, other=0), 0)
        # [BLOCK_N, BLOCK_J]
        w = (_before(b_score[:, None], s_j[None, :], o_i[:, None], o_j[None, :])
             & (d_j[None, :] == b_dest[:, None]) & m_j[None, :])
        r_area += tl.sum(tl.where(w, a_j[None, :], 0), axis=1)
        r_send += tl.sum(tl.where(w, ds_j[None, :], 0), axis=1)
        r_recv += tl.sum(tl.where(w, dr_j[None, :], 0), axis=1)
        if TRAINING:
            bs_j = tl.where(ok_j, tl.load(dx_ptr + i_b * N + o_j, mask=m_j, other=0), 0)
            br_j = tl.where(ok_j, tl.load(dx_ptr + NB + i_b * N + o_j, mask=m_j, other=0), 0)
            r_bs += tl.sum(tl.where(w, bs_j[None, :], 0), axis=1)
            r_br += tl.sum(tl.where(w, br_j[None, :], 0), axis=1)
        if CAPS:
            qi_j = tl.where(ok_j, tl.load(dx_ptr + 2 * NB + i_b * N + o_j, mask=m_j, other=0), 0)
            ki_j = tl.where(ok_j, tl.load(dx_ptr + 3 * NB + i_b * N + o_j, mask=m_j, other=0), 0)
            r_qi += tl.sum(tl.where(w, qi_j[None, :], 0), axis=1)
            r_ki += tl.sum(tl.where(w, ki_j[None, :], 0), axis=1)
    m_d = b_ok & (b_dest < P)
    load_d = tl.load(load_ptr + i_b * stride_load + b_dest, mask=m_d, other=0)
    send_d = tl.load(send_ptr + i_b * stride_send + b_dest, mask=m_d, other=0)
    recv_d = tl.load(recv_ptr + i_b * stride_recv + b_dest, mask=m_d, other=0)
    cap = tl.load(cap_ptr + i_b * stride_cap)
    lim = tl.load(limit_ptr + i_b)
    fits = load_d + r_area <= cap
    if TRAINING:  # forward plus backward within the threshold, then each below its bottleneck
        o_d = i_b * P + b_dest
        fwd = tl.maximum(send_d + r_send, recv_d + r_recv)
        bwd = tl.maximum(tl.load(ranks_ptr + 3 * RS + o_d, mask=m_d, other=0) + r_bs,
                         tl.load(ranks_ptr + 4 * RS + o_d, mask=m_d, other=0) + r_br)
        bal_t = tl.load(bal_ptr + i_b).to(tl.int32) != 0
        fits = fits & tl.where(bal_t, (fwd + bwd).to(tl.float64) <= lim,
                               (fwd < tl.load(bneck_ptr + i_b)) & (bwd < tl.load(bwd_bneck_ptr + i_b)))
    else:
        fits = fits & ((send_d + r_send).to(tl.float64) <= lim) & ((recv_d + r_recv).to(tl.float64) <= lim)
    if CAPS:  # the rows the destination receives stay within the buffer, or do not grow
        o_d = i_b * P + b_dest
        qin_d = tl.load(ranks_ptr + 7 * RS + o_d, mask=m_d, other=0)
        kin_d = tl.load(ranks_ptr + 9 * RS + o_d, mask=m_d, other=0)
        q_cap, k_cap = tl.load(caps_ptr + i_b), tl.load(caps_ptr + RS // P + i_b)
        fits = fits & ((qin_d + r_qi <= q_cap) | (r_qi <= 0)) & ((kin_d + r_ki <= k_cap) | (r_ki <= 0))
    b_ok = b_ok & fits
    tl.store(fits_ptr + i_b * N + o_i, b_ok, mask=m_i)
    tl.debug_barrier()  # every lane's accepted flag is visible before the source pass reads it

    # source side (balance phase): keep accepted proposals in score order until the excess is covered
    b_src = tl.where(b_ok, tl.load(source_ptr + i_b * stride_src + o_i, mask=m_i, other=0), P)
    b_area = tl.where(b_ok, b_area, 0)
    r_src = tl.zeros([BLOCK_N], dtype=tl.int64)
    for j0 in range(0, N, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)  # [BLOCK_J]
        m_j = o_j < N
        s_j = tl.load(score_ptr + i_b * stride_score + o_j, mask=m_j, other=0.0)
        ok_j = (tl.load(fits_ptr + i_b * N + o_j, mask=m_j, other=0).to(tl.int32) != 0) & m_j
        src_j = tl.where(ok_j, tl.load(source_ptr + i_b * stride_src + o_j, mask=m_j, other=0), P)
        a_j = tl.where(ok_j, tl.load(area_ptr + i_b * stride_area + o_j, mask=m_j, other=0), 0)
        # [BLOCK_N, BLOCK_J]
        w = (_before(b_score[:, None], s_j[None, :], o_i[:, None], o_j[None, :])
             & (src_j[None, :] == b_src[:, None]) & m_j[None, :])
        r_src += tl.sum(tl.where(w, a_j[None, :], 0), axis=1)
    need = tl.load(excess_ptr + i_b * stride_exc + b_src, mask=b_ok & (b_src < P), other=0)
    bal = tl.load(bal_ptr + i_b).to(tl.int32) != 0
    keep = b_ok & ((r_src - b_area < need) | (bal == 0))
    tl.store(keep_ptr + i_b * N + o_i, keep, mask=m_i)
    n_keep = tl.sum(keep.to(tl.int32), axis=0)
    tl.store(stuck_ptr + i_b, bal & (n_keep == 0))

    if APPLY:
        # each kept proposal's tasks to its destination
        tl.debug_barrier()  # keep flags are visible
        o_m = tl.arange(0, BLOCK_M)
        for j0 in range(0, N, BLOCK_J):
            o_j = j0 + tl.arange(0, BLOCK_J)  # [BLOCK_J]
            m_j = o_j < N
            keep_j = (tl.load(keep_ptr + i_b * N + o_j, mask=m_j, other=0).to(tl.int32) != 0) & m_j
            d_j = tl.load(dest_ptr + i_b * stride_dest + o_j, mask=m_j, other=0)
            # [BLOCK_J, BLOCK_M]
            m_jm = keep_j[:, None] & (o_m[None, :] < M)
            tid = tl.load(tasks_ptr + (i_b * N + o_j[:, None]) * M + o_m[None, :], mask=m_jm, other=T)
            tl.store(a_ptr + i_b * stride_a + tid, d_j[:, None] + tl.zeros_like(tid), mask=m_jm & (tid < T))


def _launch(prop: Proposals, st: State, dest_cap, limit, excess, balance, A=None, training: bool = False,
            recv_caps: torch.Tensor | None = None):
    """Shared launcher: (keep [B, N] bool, stuck [B] bool); with A, the moves land in A."""
    B, N = prop.ok.shape
    P = st.load.shape[1]
    dev = prop.ok.device
    cap = torch.broadcast_to(torch.as_tensor(dest_cap, device=dev), (B, 1)).reshape(B)
    fits = torch.empty((B, N), dtype=torch.bool, device=dev)
    keep = torch.empty((B, N), dtype=torch.bool, device=dev)
    stuck = torch.empty((B,), dtype=torch.bool, device=dev)
    if A is None:
        tasks, a, M, T, stride_a = keep, keep, 1, 0, 0  # unused pointers
    else:
        if A.stride(1) != 1:
            raise ValueError("A must be dense along its task dim (it is updated in place)")
        tasks, a = prop.tasks.contiguous(), A
        M, T, stride_a = tasks.shape[2], A.shape[1] - 1, A.stride(0)
    # [B, N] and [B, P] rows may be strided (source is an expanded row); the last dim must be dense
    rows = (prop.score, prop.ok, prop.dest, prop.source, prop.area, prop.dest_send, prop.dest_recv,
            st.load, st.send, st.recv, excess)
    rows = tuple(t if t.stride(1) == 1 else t.contiguous() for t in rows)
    if dev.type == "meta":  # shapes only: there is no data to run the kernel on
        return keep, stuck
    caps = recv_caps is not None
    if training or caps:
        dx = _proposal_table(prop)
        ranks = rank_table(st)
        bneck, bwd_bneck = st.bottleneck.contiguous(), st.bwd_bottleneck.contiguous()
    else:
        dx, ranks, bneck, bwd_bneck = keep, keep, keep, keep  # unused pointers
    block_n = triton.next_power_of_2(N)
    _accept_kernel[(B,)](
        *rows, cap, limit.contiguous(), balance.contiguous(), fits, keep, stuck, tasks, a, dx, ranks, bneck, bwd_bneck,
        recv_caps.contiguous() if caps else keep, N, P, M, T, B * P,
        *(t.stride(0) for t in rows), cap.stride(0), stride_a,
        BLOCK_N=block_n, BLOCK_J=min(_BLOCK_J, block_n), BLOCK_M=triton.next_power_of_2(M),
        APPLY=A is not None, TRAINING=bool(training), CAPS=caps, num_warps=8,
    )
    return keep, stuck


def _proposal_table(prop: Proposals) -> torch.Tensor:
    """The destination deltas dest_bsend, dest_brecv, dest_qin, dest_kin as one [4, B, N] int64
    table: the bundle kernel's own buffer when it made them, else a stacked copy."""
    planes = (prop.dest_bsend, prop.dest_brecv, prop.dest_qin, prop.dest_kin)
    B, N = prop.ok.shape
    base = planes[0]
    if all(t.is_contiguous() and t.data_ptr() == base.data_ptr() + k * B * N * 8 for k, t in enumerate(planes)):
        return base.as_strided((4, B, N), (B * N, N, 1))
    return torch.stack(planes)


def accept_triton(prop: Proposals, st: State, dest_cap, limit, excess, balance, training: bool = False,
                  recv_caps: torch.Tensor | None = None) -> torch.Tensor:
    """Which proposals to apply (Triton twin of ``accept``): [B, N] bool.

    prop:     Proposals, [B, N] fields (score fp64, ok bool, dest/source/area/
              dest_send/dest_recv int64).
    st:       State of the current assignments; reads load/send/recv [B, P] int64.
    dest_cap: 0-dim, [B] or [B, 1] int64, the largest load a destination may take.
    limit:    [B] fp64, the largest send and recv bytes a destination may reach.
    excess:   [B, P] int64, load above the cap of each source.
    balance:  [B] bool, True while the variant is unbalanced.
    training, recv_caps: the objective and the receive buffers, as ``accept.ref.accept``.
    Each destination accepts proposals in score order (index breaks ties)
    while its load and bytes stay within limits; then, while balancing, each
    source keeps its accepted proposals in score order until its excess is
    covered. One kernel launch, equal to the twin entry for entry.
    """
    return _launch(prop, st, dest_cap, limit, excess, balance, None, training, recv_caps)[0]


def accept_apply_triton(A: torch.Tensor, prop: Proposals, st: State, dest_cap, limit, excess, balance,
                        training: bool = False, recv_caps: torch.Tensor | None = None):
    """Triton twin of ``accept_apply``: one kernel launch that moves the accepted tasks in A, in place.

    A: [B, T+1] int64, dense rows; prop.tasks [B, N, M] int64 (T where unused).
    Returns (A, updated: columns [0, T) equal the twin's A_next; stuck [B] bool).
    """
    _, stuck = _launch(prop, st, dest_cap, limit, excess, balance, A, training, recv_caps)
    return A, stuck
