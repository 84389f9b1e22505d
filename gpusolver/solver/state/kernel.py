"""Triton state step (twin of ``state.ref.state``).

One kernel over tiles of the ``T = G * U * U`` tasks of each variant
scatters every task into the hulls of its (QO unit, rank) and (KV unit,
rank) cells with integer atomic min/max, and into the rank loads and KV-unit
task counts with integer atomic adds. Integer min/max/add commute, so the
result does not depend on the order the atomics land in, and no atomic needs
ordering: they are relaxed (the default acq_rel fences every one), and a
reader in the same launch (the persistent kernel) fences once after the
scatter (``rounds._sync``). A second kernel, one program per (variant,
rank), turns the hulls of the units that rank hosts and receives into
travelling lengths and the rank's send/recv bytes, and folds the bottleneck
with an integer atomic max.

Shape legend: B variants, G head groups, P ranks, n sub-chunk tiles per rank
(TILES), U = n * P units per group (unit u on rank u // n), T = G * U * U
tasks. n = 1 compiles to the untiled kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpusolver.solver.core import _BIG, State, Tasks

@triton.jit
def _state_kernel(
    rank_ptr,  # [B, T] int64 (row stride stride_rb), P for empty tasks
    area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr,  # [T] int64 each (strided)
    lo_ptr,  # [2, B, G*U, P] int64, _BIG-initialised: q_lo, k_lo
    acc_ptr,  # [3, B, G*U, P] then [B, P] int64, zero-initialised: q_hi, k_hi, kcount, load
    T, P, B,
    stride_rb, stride_a, stride_q, stride_k,
    BLOCK_T: tl.constexpr, TILES: tl.constexpr,
):
    _state_tile(rank_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, lo_ptr, acc_ptr,
                tl.program_id(0), tl.program_id(1).to(tl.int64), T, P, B,
                stride_rb, stride_a, stride_q, stride_k, BLOCK_T, TILES)


@triton.jit
def _state_tile(rank_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, lo_ptr, acc_ptr,
                i_t, i_b, T, P, B, stride_rb, stride_a, stride_q, stride_k, BLOCK_T: tl.constexpr,
                TILES: tl.constexpr):
    """Tile ``i_t`` of variant ``i_b`` of ``_state_kernel`` (its arguments; i_b int64)."""
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
    m_t = o_t < T
    b_rank = tl.load(rank_ptr + i_b * stride_rb + o_t, mask=m_t, other=0)
    # tasks on the dummy rank P fall into the discarded column of the torch twin: skip them
    m_t = m_t & (b_rank < P)
    b_area = tl.load(area_ptr + o_t * stride_a, mask=m_t, other=0)
    b_qlo = tl.load(qlo_ptr + o_t * stride_q, mask=m_t, other=0)
    b_qhi = tl.load(qhi_ptr + o_t * stride_q, mask=m_t, other=0)
    b_klo = tl.load(klo_ptr + o_t * stride_k, mask=m_t, other=0)
    b_khi = tl.load(khi_ptr + o_t * stride_k, mask=m_t, other=0)
    # task (g, i, j) over U = TILES * P units: QO unit g*U + i, KV unit g*U + j
    U = P * TILES
    o_g = o_t // (U * U)
    o_qu = o_g * U + (o_t // U) % U
    o_ku = o_g * U + o_t % U
    cells = T // TILES  # cells of one variant's [G*U, P] table (G*U*U = T)
    n_cell = B * cells  # cells of one [B, G*U, P] buffer
    o_q = i_b * cells + o_qu * P + b_rank  # [BLOCK_T] cell (variant, QO unit, rank)
    o_k = i_b * cells + o_ku * P + b_rank
    tl.atomic_min(lo_ptr + o_q, b_qlo, mask=m_t, sem="relaxed")
    tl.atomic_max(acc_ptr + o_q, b_qhi, mask=m_t, sem="relaxed")
    tl.atomic_min(lo_ptr + n_cell + o_k, b_klo, mask=m_t, sem="relaxed")
    tl.atomic_max(acc_ptr + n_cell + o_k, b_khi, mask=m_t, sem="relaxed")
    tl.atomic_add(acc_ptr + 2 * n_cell + o_k, (b_area > 0).to(tl.int64), mask=m_t, sem="relaxed")
    tl.atomic_add(acc_ptr + 3 * n_cell + i_b * P + b_rank, b_area, mask=m_t, sem="relaxed")


@triton.jit
def _state_bytes_kernel(
    lo_ptr,  # [2, B, G*U, P] int64: q_lo, k_lo
    hi_ptr,  # [2, B, G*U, P] int64: q_hi, k_hi
    len_ptr,  # [2, B, G*U, P] int64 out: qlen, klen
    bytes_ptr,  # [10, B, P] int64 out: send, recv, vol (forward), bsend, brecv, bvol (backward),
    # then the rows q_out, q_in, k_out, k_in
    bneck_ptr,  # [2, B] int64, zero-initialised: max over ranks of vol, of bvol
    B, G, P,
    Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
    PER_NODE, W_NV, W_IB,  # TOPO only: ranks per node and the price of a byte inside and across nodes
    nodes_ptr,  # RELAY only: [6, B, G*U, N] int64 out, the node tables (``State.nodes``)
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, TILES: tl.constexpr, TOPO: tl.constexpr,
    RELAY: tl.constexpr, BLOCK_R: tl.constexpr,
):
    _state_bytes_rank(lo_ptr, hi_ptr, len_ptr, bytes_ptr, bneck_ptr,
                      tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), B, G, P,
                      Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES, BLOCK_G, BLOCK_P, TILES,
                      PER_NODE, W_NV, W_IB, TOPO, nodes_ptr, RELAY, BLOCK_R)


@triton.jit
def _node_hull(lo_ptr, hi_ptr, o_cell, m_cell):
    """Hull (lo, hi) [BLOCK_G] and travelling cells [BLOCK_G] of a [BLOCK_G, BLOCK_R] tile of
    cells (masked ones empty), and the cells' lengths."""
    c_lo = tl.load(lo_ptr + o_cell, mask=m_cell, other=_BIG)
    c_hi = tl.load(hi_ptr + o_cell, mask=m_cell, other=0)
    c_len = tl.where(m_cell, tl.maximum(c_hi - c_lo, 0), 0)
    return tl.min(c_lo, axis=1), tl.max(c_hi, axis=1), tl.sum((c_len > 0).to(tl.int64), axis=1), c_len


@triton.jit
def _relay_tokens(lo_ptr, hi_ptr, n_lo_ptr, n_hi_ptr, n_cnt_ptr, i_b, i_r, G, P, U,
                  PER_NODE, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, TILES: tl.constexpr):
    """Rank ``i_r``'s inter-node tokens of one kind (hulls at ``lo_ptr``/``hi_ptr``) under relay
    transport (``state.relay``): (ib_out, ib_in, nv_fan_out, nv_in) int64, the last two its NVLink
    tokens as a relay and from relays; writes the node tables of the units it hosts
    (``state.relay.node_hulls``: [B, G*U, N] lo, hi, count)."""
    o_g1 = tl.arange(0, BLOCK_G).to(tl.int64)  # [BLOCK_G]
    m_g1 = o_g1 < G
    o_g = o_g1[:, None]  # [BLOCK_G, 1]
    o_r = tl.arange(0, BLOCK_R).to(tl.int64)[None, :]  # [1, BLOCK_R] local index in a node
    m_gr = (o_g < G) & (o_r < PER_NODE)
    N = P // PER_NODE
    my_node = i_r // PER_NODE
    me = i_r % PER_NODE
    GU = G * U
    ib_out = tl.zeros([], tl.int64)
    ib_in = tl.zeros([], tl.int64)
    fan = tl.zeros([], tl.int64)
    nv_in = tl.zeros([], tl.int64)
    for m in range(0, N):
        remote = m != my_node
        for t in tl.static_range(TILES):
            # as host: the unit's hull at node m, over its ranks but r itself; relayed when that
            # hull is no longer than the node's rows together, else each consumer's rows go direct
            o_h = i_b * GU * P + (o_g * U + i_r * TILES + t) * P + m * PER_NODE + o_r
            n_lo, n_hi, n_cnt, c_len = _node_hull(lo_ptr, hi_ptr, o_h, m_gr & (m * PER_NODE + o_r != i_r))
            o_n = (i_b * GU + o_g1 * U + i_r * TILES + t) * N + m
            tl.store(n_lo_ptr + o_n, n_lo, mask=m_g1)
            tl.store(n_hi_ptr + o_n, n_hi, mask=m_g1)
            tl.store(n_cnt_ptr + o_n, n_cnt, mask=m_g1)
            total = tl.sum(c_len, axis=1)
            hull = tl.maximum(n_hi - n_lo, 0)
            relayed = (total > 0) & (hull <= total)
            ib_out += tl.sum(tl.where(m_g1 & remote, tl.where(relayed, hull, total), 0), axis=0)
        # as consumer or relay: every host k of node m, its units at r's node
        for k in range(0, PER_NODE):
            for t in tl.static_range(TILES):
                o_l = i_b * GU * P + (o_g * U + (m * PER_NODE + k) * TILES + t) * P + my_node * PER_NODE + o_r
                l_lo, l_hi, _, l_len = _node_hull(lo_ptr, hi_ptr, o_l, m_gr & remote)
                total = tl.sum(l_len, axis=1)
                relayed = (total > 0) & (tl.maximum(l_hi - l_lo, 0) <= total)
                mine = tl.sum(tl.where(o_r == me, l_len, 0), axis=1)  # r's own rows
                is_relay = k == me
                ib_in += tl.sum(tl.where(m_g1, tl.where(relayed, tl.where(is_relay, tl.maximum(l_hi - l_lo, 0), 0),
                                                        mine), 0), axis=0)
                fan += tl.sum(tl.where(m_g1 & relayed & is_relay, total - mine, 0), axis=0)
                nv_in += tl.sum(tl.where(m_g1 & relayed & (k != me), mine, 0), axis=0)
    return ib_out, ib_in, fan, nv_in


@triton.jit
def _state_bytes_rank(lo_ptr, hi_ptr, len_ptr, bytes_ptr, bneck_ptr, i_b, i_r, B, G, P,
                      Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
                      BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, TILES: tl.constexpr,
                      PER_NODE=1, W_NV=1, W_IB=1, TOPO: tl.constexpr = False, nodes_ptr=None,
                      RELAY: tl.constexpr = False, BLOCK_R: tl.constexpr = 1):
    """Rank ``i_r`` of variant ``i_b`` of ``_state_bytes_kernel`` (its arguments; indices int64).

    Unit ``u`` of a group lives on rank ``u // TILES``; one ``[BLOCK_G, BLOCK_P]`` tile per tile offset t.
    With TOPO the bytes price each token by its link (rank r and rank o_p on one node or not),
    the rows stay plain; with RELAY by the relay transport's hops (``state.relay``): the tiles
    count the NVLink tokens of direct and fanned-out rows, ``_relay_tokens`` the InfiniBand
    ones and the relay's fan-out."""
    o_g = tl.arange(0, BLOCK_G).to(tl.int64)[:, None]  # [BLOCK_G, 1]
    o_p = tl.arange(0, BLOCK_P).to(tl.int64)[None, :]  # [1, BLOCK_P]
    m_gp = (o_g < G) & (o_p < P)
    U = P * TILES
    n_cell = B * G * U * P
    at_host = o_p == i_r  # row: destination r is the host; column: host o_p is r. Nothing travels
    q_out = tl.zeros([], tl.int64)
    k_out = tl.zeros([], tl.int64)
    q_in = tl.zeros([], tl.int64)
    k_in = tl.zeros([], tl.int64)
    if TOPO:  # link-weighted tokens for the bytes; the link of r and o_p is the same both ways
        same = i_r // PER_NODE == o_p // PER_NODE
        if RELAY:  # the tiles' NVLink tokens inside the host's node; ``_relay_tokens`` the others
            w = tl.where(same, W_NV, 0).to(tl.int64)  # [1, BLOCK_P]
            w_in = w
        else:
            w = tl.where(same, W_NV, W_IB).to(tl.int64)  # [1, BLOCK_P]
            w_in = w
        wq_out = tl.zeros([], tl.int64)
        wk_out = tl.zeros([], tl.int64)
        wq_in = tl.zeros([], tl.int64)
        wk_in = tl.zeros([], tl.int64)
    for t in tl.static_range(TILES):
        # [BLOCK_G, BLOCK_P] cells: unit t of rank r (all destinations), and unit t of every rank at rank r
        o_row = i_b * G * U * P + (o_g * U + i_r * TILES + t) * P + o_p
        o_col = i_b * G * U * P + (o_g * U + o_p * TILES + t) * P + i_r
        q_row = tl.where(at_host, 0, tl.maximum(tl.load(hi_ptr + o_row, mask=m_gp, other=0)
                                                 - tl.load(lo_ptr + o_row, mask=m_gp, other=0), 0))
        k_row = tl.where(at_host, 0, tl.maximum(tl.load(hi_ptr + n_cell + o_row, mask=m_gp, other=0)
                                                 - tl.load(lo_ptr + n_cell + o_row, mask=m_gp, other=0), 0))
        q_col = tl.where(at_host, 0, tl.maximum(tl.load(hi_ptr + o_col, mask=m_gp, other=0)
                                                 - tl.load(lo_ptr + o_col, mask=m_gp, other=0), 0))
        k_col = tl.where(at_host, 0, tl.maximum(tl.load(hi_ptr + n_cell + o_col, mask=m_gp, other=0)
                                                 - tl.load(lo_ptr + n_cell + o_col, mask=m_gp, other=0), 0))
        tl.store(len_ptr + o_row, q_row, mask=m_gp)
        tl.store(len_ptr + n_cell + o_row, k_row, mask=m_gp)
        q_out += tl.sum(tl.sum(tl.where(m_gp, q_row, 0), axis=1), axis=0)
        k_out += tl.sum(tl.sum(tl.where(m_gp, k_row, 0), axis=1), axis=0)
        q_in += tl.sum(tl.sum(tl.where(m_gp, q_col, 0), axis=1), axis=0)
        k_in += tl.sum(tl.sum(tl.where(m_gp, k_col, 0), axis=1), axis=0)
        if TOPO:
            wq_out += tl.sum(tl.sum(tl.where(m_gp, q_row * w, 0), axis=1), axis=0)
            wk_out += tl.sum(tl.sum(tl.where(m_gp, k_row * w, 0), axis=1), axis=0)
            wq_in += tl.sum(tl.sum(tl.where(m_gp, q_col * w_in, 0), axis=1), axis=0)
            wk_in += tl.sum(tl.sum(tl.where(m_gp, k_col * w_in, 0), axis=1), axis=0)
    if RELAY:  # the InfiniBand hops and the relay's fan-out (q: planes 0, k: planes 1 of lo/hi)
        n_node = B * G * U * (P // PER_NODE)
        q_ibo, q_ibi, q_fan, q_nvi = _relay_tokens(lo_ptr, hi_ptr, nodes_ptr, nodes_ptr + n_node,
                                                   nodes_ptr + 4 * n_node, i_b, i_r, G, P, U, PER_NODE,
                                                   BLOCK_G, BLOCK_R, TILES)
        k_ibo, k_ibi, k_fan, k_nvi = _relay_tokens(lo_ptr + n_cell, hi_ptr + n_cell, nodes_ptr + 2 * n_node,
                                                   nodes_ptr + 3 * n_node, nodes_ptr + 5 * n_node,
                                                   i_b, i_r, G, P, U, PER_NODE, BLOCK_G, BLOCK_R, TILES)
        wq_out += q_fan * W_NV + q_ibo * W_IB
        wq_in += q_nvi * W_NV + q_ibi * W_IB
        wk_out += k_fan * W_NV + k_ibo * W_IB
        wk_in += k_nvi * W_NV + k_ibi * W_IB
    if TOPO:
        qo, qi, ko, ki = wq_out, wq_in, wk_out, wk_in
    else:
        qo, qi, ko, ki = q_out, q_in, k_out, k_in
    send = qo * Q_BYTES + qi * O_BYTES + ko * KV_BYTES
    recv = qi * Q_BYTES + qo * O_BYTES + ki * KV_BYTES
    vol = tl.maximum(send, recv)
    bsend = qo * QB_BYTES + qi * DQ_BYTES + ko * KVB_BYTES + ki * DKV_BYTES
    brecv = qi * QB_BYTES + qo * DQ_BYTES + ki * KVB_BYTES + ko * DKV_BYTES
    bvol = tl.maximum(bsend, brecv)
    o_rank = i_b * P + i_r
    tl.store(bytes_ptr + o_rank, send)
    tl.store(bytes_ptr + B * P + o_rank, recv)
    tl.store(bytes_ptr + 2 * B * P + o_rank, vol)
    tl.store(bytes_ptr + 3 * B * P + o_rank, bsend)
    tl.store(bytes_ptr + 4 * B * P + o_rank, brecv)
    tl.store(bytes_ptr + 5 * B * P + o_rank, bvol)
    tl.store(bytes_ptr + 6 * B * P + o_rank, q_out)
    tl.store(bytes_ptr + 7 * B * P + o_rank, q_in)
    tl.store(bytes_ptr + 8 * B * P + o_rank, k_out)
    tl.store(bytes_ptr + 9 * B * P + o_rank, k_in)
    tl.atomic_max(bneck_ptr + i_b, vol, sem="relaxed")
    tl.atomic_max(bneck_ptr + B + i_b, bvol, sem="relaxed")


_RANK_FIELDS = ("send", "recv", "vol", "bsend", "brecv", "bvol", "q_out", "q_in", "k_out", "k_in")


def rank_table(st: State) -> torch.Tensor:
    """The per-rank bytes and rows of a state as one [10, B, P] int64 table (``_RANK_FIELDS`` in
    order; the kernels read plane k at k * B * P): the state's own buffer when ``state_triton``
    made it, else a stacked copy."""
    planes = [getattr(st, f) for f in _RANK_FIELDS]
    B, P = st.send.shape
    base = st.send
    if all(t.is_contiguous() and t.data_ptr() == base.data_ptr() + k * B * P * 8 for k, t in enumerate(planes)):
        return base.as_strided((len(planes), B, P), (B * P, P, 1))
    return torch.stack(planes)


def byte_prices(tasks: Tasks) -> tuple[int, ...]:
    """The seven bytes-per-token prices the kernels take, forward then backward (``Tasks``)."""
    return tasks.q, tasks.o, tasks.kv, tasks.qb, tasks.dqb, tasks.kvb, tasks.dkv


def link_prices(tasks: Tasks) -> tuple[int, int, int]:
    """(ranks per node, NVLink weight, InfiniBand weight) the kernels take (``Tasks.links``;
    unused ones without a topology)."""
    return (1, 1, 1) if tasks.links is None else tasks.links


def state_triton(tasks: Tasks, A: torch.Tensor) -> State:
    """Hulls, lengths, loads, forward and backward bytes of assignments A (Triton twin of ``state``).

    A: [B, T+1] int64 ranks in [0, P] (P = no rank; column T is a dummy).
    Returns a State whose tensors equal ``state(tasks, A)``'s exactly:
    q_lo/q_hi/k_lo/k_hi/qlen/klen/kcount [B, G*U, P] int64, send/recv/vol/bsend/
    brecv/bvol/load [B, P] int64, bottleneck/bwd_bottleneck [B] int64, rank [B, T]
    int64 (a view of A).
    Two kernels: the task scatter (atomics), then lengths and bytes per (variant, rank).
    """
    G, P, U, T = tasks.G, tasks.P, tasks.U, tasks.T
    rank = A[:, :T]
    B, dev = rank.shape[0], A.device
    n = B * G * U * P  # cells of one [B, G*U, P] buffer
    lo = torch.full((2 * n,), _BIG, dtype=torch.int64, device=dev)  # q_lo, k_lo
    # q_hi, k_hi, kcount, load, bottleneck (forward, backward)
    acc = torch.zeros(3 * n + B * P + 2 * B, dtype=torch.int64, device=dev)
    # qlen, klen, send, recv, vol, bsend, brecv, bvol, q_out, q_in, k_out, k_in
    out = torch.empty(2 * n + 10 * B * P, dtype=torch.int64, device=dev)
    bottleneck = acc[3 * n + B * P:]
    nodes = torch.empty((6, B, G * U, P // tasks.links[0]), dtype=torch.int64, device=dev) if tasks.relays else None
    if dev.type != "meta":  # on meta, shapes only: there is no data to run the kernels on
        _launch_state(tasks, rank, lo, acc, out, bottleneck, B, nodes)
    cells = lambda buf, k: buf[k * n:(k + 1) * n].view(B, G * U, P)  # noqa: E731
    ranks = lambda buf, k: buf[2 * n + k * B * P:2 * n + (k + 1) * B * P].view(B, P)  # noqa: E731
    return State(rank=rank, q_lo=cells(lo, 0), q_hi=cells(acc, 0), k_lo=cells(lo, 1), k_hi=cells(acc, 1),
                 qlen=cells(out, 0), klen=cells(out, 1), kcount=cells(acc, 2),
                 send=ranks(out, 0), recv=ranks(out, 1), vol=ranks(out, 2), bottleneck=bottleneck[:B],
                 load=acc[3 * n:3 * n + B * P].view(B, P), bsend=ranks(out, 3), brecv=ranks(out, 4),
                 bvol=ranks(out, 5), bwd_bottleneck=bottleneck[B:], q_out=ranks(out, 6), q_in=ranks(out, 7),
                 k_out=ranks(out, 8), k_in=ranks(out, 9), nodes=nodes)


def _launch_state(tasks: Tasks, rank, lo, acc, out, bottleneck, B, nodes=None):
    """The two launches of ``state_triton`` into its buffers."""
    G, P, U, T, tiles = tasks.G, tasks.P, tasks.U, tasks.T, tasks.tiles
    n = B * G * U * P
    block_t = min(1024, triton.next_power_of_2(T))
    _state_kernel[(triton.cdiv(T, block_t), B)](
        rank, tasks.area, tasks.qlo, tasks.qhi, tasks.klo, tasks.khi, lo, acc,
        T, P, B,
        rank.stride(0), tasks.area.stride(0), tasks.qlo.stride(0), tasks.klo.stride(0),
        BLOCK_T=block_t, TILES=tiles,
    )
    _state_bytes_kernel[(B, P)](
        lo, acc, out, out[2 * n:], bottleneck,
        B, G, P, *byte_prices(tasks), *link_prices(tasks), bottleneck if nodes is None else nodes,
        BLOCK_G=triton.next_power_of_2(G), BLOCK_P=triton.next_power_of_2(P), TILES=tiles,
        TOPO=tasks.links is not None, RELAY=tasks.relays, BLOCK_R=triton.next_power_of_2(link_prices(tasks)[0]),
    )
