"""The device solver's whole round loop in one persistent Triton kernel.

``solve_rounds_persistent`` runs every round of every variant of
``device.run_variants`` (sideways moves and restarts included) in a single
launch and equals it exactly (the best assignment and key of each variant). It calls
the same kernel bodies the per-step launchers use (``state``, ``offers``,
``bundle``, ``accept`` and ``track``'s ``kernel.py``), one after the other,
so the twins stay one piece of code:

    init (the start assignment, unit slots) -> for each round:
        state (reset, task scatter, bytes per rank) -> threshold (round 0), track
        -> [restart rounds: best state -> its state -> bottleneck rank's tasks home
            -> state -> track]
        -> offers per source -> bundle per (source, unit slot) -> accept and apply

The grid is ``(B * W,)``: W workers per variant split each step's programs
(tiles, ranks, sources, unit slots) between them, and meet at a barrier
between steps. With ``W == 1`` the barrier is a plain ``tl.debug_barrier``
(the program's threads see each other's global writes). With ``W > 1`` it is
also a counter per variant: each worker's first thread adds one with release
semantics and spins on an acquire load until all W arrived; the launch is
cooperative, so the runtime either makes every worker resident or refuses
the launch (a spin barrier must never wait for a worker that is not
running). The Triton interpreter runs programs one after the other, so it
only runs ``W == 1``. The state's scatter atomics are relaxed; the one
gpu-scope fence after the scatter (``_sync(..., FENCE=True)``) makes their
results visible to the reads that follow (with W > 1 the barrier's
release/acquire pair does it).

Acceptance (one block of all N proposals per variant) and tracking run on
worker 0 of each variant; the moves are applied to the assignment in place.

Shape legend: B variants, W workers per variant, G head groups, P ranks,
n sub-chunk tiles per rank (TILES), U = n * P units per group (unit u on rank
u // n), T = G * U * U tasks, K units offered per source, D window
destinations, N = P * K proposals per variant.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpusolver.solver.accept.kernel import _BLOCK_J, _accept_variant
from gpusolver.solver.bundle.kernel import _bundle_unit, dest_tile
from gpusolver.solver.core import _BIG, Tasks
from gpusolver.solver.offers.kernel import _offers_source, task_block, unit_block
from gpusolver.solver.state.kernel import _state_bytes_rank, _state_tile, byte_prices
from gpusolver.solver.track.kernel import _BLOCK_C, _track_variant

_BIG_T = tl.constexpr(_BIG)
# Tasks per scatter tile.
_BLOCK_T = 1024
# Warps per program. ptxas (sm_90, P = 64, G = 8, the large-P portfolio's blocks) with 8 warps:
# 255 registers, 1.3 KB of stack, 180 spill stores, so one 256-thread program fills an SM's
# register file and the cooperative grid needs every SM idle; narrower dest or accept tiles
# change nothing (BLOCK_D 2..8, BLOCK_J 4..16: still 255). With 16 warps: 64 registers (1.7 KB
# of stack, 144 spill stores), a quarter of the register file per program.
_NUM_WARPS = 16
# Share of the SMs the persistent grid takes by default: it cannot overlap with anything on
# the SMs it holds, so half stay free for communication kernels.
_SM_SHARE = 0.5


@triton.jit
def _i64(x):
    """x as an int64 scalar (loop indices are plain ints in the interpreter, int32 when compiled)."""
    return tl.zeros([], tl.int64) + x


@triton.jit
def _sync(bar_ptr, phase, W: tl.constexpr, FENCE: tl.constexpr = False):
    """Barrier ``phase`` (1, 2, ...) of one variant's W workers.

    FENCE: after relaxed atomics. With W == 1 one gpu-scope acquire-release
    (an atomic add of 0 to the barrier counter, which W == 1 never reads)
    drops the SM's stale L1 lines of the cells the atomics changed in L2;
    with W > 1 the barrier's acquire poll does it already."""
    tl.debug_barrier()
    if W > 1:
        tl.atomic_add(bar_ptr, 1, sem="release")
        while tl.atomic_add(bar_ptr, 0, sem="acquire") < phase * W:
            pass
        tl.debug_barrier()
    elif FENCE:
        tl.atomic_add(bar_ptr, 0, sem="acq_rel", scope="gpu")
        tl.debug_barrier()


@triton.jit
def _state_pass(a_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, lo_ptr, acc_ptr, len_ptr, bar, phase,
                i_b, w, T, P, G, B, stride_a, stride_area, stride_q, stride_k, Q_BYTES, O_BYTES, KV_BYTES,
                QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_C: tl.constexpr, TILES: tl.constexpr):
    """The state of variant i_b's assignment (``state_triton``'s buffers), by its W workers.

    Resets the variant's hulls and sums, scatters its tasks, then bytes per rank;
    three barriers. Returns the barrier phase reached."""
    cells = T // TILES  # [G*U, P] cells per variant
    n = B * cells
    for c0 in range(w * BLOCK_C, cells, W * BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        m_c = o_c < cells
        o_cell = i_b * cells + o_c
        tl.store(lo_ptr + o_cell, tl.full([BLOCK_C], _BIG_T, tl.int64), mask=m_c)
        tl.store(lo_ptr + n + o_cell, tl.full([BLOCK_C], _BIG_T, tl.int64), mask=m_c)
        tl.store(acc_ptr + o_cell, tl.zeros([BLOCK_C], tl.int64), mask=m_c)
        tl.store(acc_ptr + n + o_cell, tl.zeros([BLOCK_C], tl.int64), mask=m_c)
        tl.store(acc_ptr + 2 * n + o_cell, tl.zeros([BLOCK_C], tl.int64), mask=m_c)
    if w == 0:
        o_p = tl.arange(0, BLOCK_P)
        tl.store(acc_ptr + 3 * n + i_b * P + o_p, tl.zeros([BLOCK_P], tl.int64), mask=o_p < P)
        tl.store(acc_ptr + 3 * n + B * P + i_b, 0)
        tl.store(acc_ptr + 3 * n + B * P + B + i_b, 0)
    phase += 1
    _sync(bar, phase, W)
    for i_t in range(w, tl.cdiv(T, BLOCK_T), W):
        _state_tile(a_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, lo_ptr, acc_ptr,
                    i_t, i_b, T, P, B, stride_a, stride_area, stride_q, stride_k, BLOCK_T, TILES)
    phase += 1
    _sync(bar, phase, W, True)
    for i_r in range(w, P, W):
        _state_bytes_rank(lo_ptr, acc_ptr, len_ptr, len_ptr + 2 * n, acc_ptr + 3 * n + B * P, i_b, _i64(i_r), B, G, P,
                          Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES, BLOCK_G, BLOCK_P, TILES,
                          1, 1, 1, False)  # plain bytes: the persistent path refuses a topology
    phase += 1
    _sync(bar, phase, W, True)  # the bottlenecks' atomic max
    return phase


@triton.jit
def _rounds_kernel(
    a_ptr,  # [B, T+1] int64 scratch: the current assignment (column T is a dummy)
    best_a_ptr,  # [B, T+1] int64 out: each variant's best assignment
    best_key_ptr,  # [B] int64 out: its key (balanced first, then the lower bottleneck)
    area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr,  # [T] int64 each (strided)
    start_ptr,  # [T] or [B, T] int64 contiguous (HAS_START only): the start rank of each non-empty task
    stride_start,  # T for a start per variant, 0 for a shared one
    unit_tasks_ptr,  # [2, G*U, U] int64 contiguous
    order_ptr, width_ptr, units_ptr,  # [B] int64: task order, window width, units offered
    scale_ptr,  # [B] fp64: threshold scale of each variant (inf = unbounded)
    cap_ptr,  # 0-dim int64: the largest balanced load
    lo_ptr, acc_ptr, len_ptr,  # state scratch, laid out as in ``state_triton``
    thr_ptr, limit_ptr,  # [B] fp64 scratch
    excess_ptr, headroom_ptr,  # [B, P] int64 scratch
    balance_ptr, stuck_ptr,  # [B] bool scratch
    dest_cap_ptr,  # [B] int64 scratch
    unit_ptr, dests_ptr,  # [B, P, K], [B, P, D] int64 scratch
    ok_ptr, fits_ptr, keep_ptr,  # [B, N] bool scratch
    score_ptr,  # [B, N] fp64 scratch
    dest_ptr, source_ptr, parea_ptr, dsend_ptr, drecv_ptr,  # [B, N] int64 scratch
    ptasks_ptr,  # [B, N, U] int64 scratch
    dx_ptr,  # [4, B, N] int64 scratch: each proposal's destination bsend, brecv, QO and KV rows in
    caps_ptr,  # [4, B] int64 scratch (CAPS): each variant's QO / KV receive and send rows for its moves
    bar_ptr,  # [B] int32, zero-initialised: barrier counters
    ROUNDS, RESTART_EVERY, T, P, G, B, K, D,
    stride_area, stride_q, stride_k,
    Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES, QIN_CAP, KIN_CAP, QOUT_CAP, KOUT_CAP,
    W: tl.constexpr, SIDEWAYS: tl.constexpr, SINGLES: tl.constexpr, TRAINING: tl.constexpr, CAPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_GP: tl.constexpr,
    BLOCK_U: tl.constexpr, BLOCK_JU: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
    TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TL: tl.constexpr, HAS_START: tl.constexpr,
):
    pid = tl.program_id(0)
    i_b = (pid // W).to(tl.int64)
    w = pid % W
    U = P * TILES
    GU = G * U
    N = P * K
    n = B * (T // TILES)  # cells of one [B, G*U, P] buffer
    stride_a = T + 1
    bar = bar_ptr + i_b
    phase = 0
    # buffers of the state (see state_triton): lo = q_lo, k_lo; acc = q_hi, k_hi, kcount, load,
    # bottleneck, backward bottleneck; len = qlen, klen, then the rank table (``rank_table``: send,
    # recv, vol, bsend, brecv, bvol, q_out, q_in, k_out, k_in, planes B * P apart)
    RS = B * P
    load_ptr = acc_ptr + 3 * n
    bneck_ptr = acc_ptr + 3 * n + RS
    bwd_bneck_ptr = bneck_ptr + B
    send_ptr = len_ptr + 2 * n
    recv_ptr = send_ptr + RS
    vol_ptr = recv_ptr + RS
    bvol_ptr = send_ptr + 5 * RS

    # the start (the given ranks, or owner-computes: every task on its query host; P for empty
    # tasks) and each proposal's source
    for c0 in range(w * BLOCK_C, T + 1, W * BLOCK_C):
        o_c = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
        m_c = o_c < T + 1
        b_area = tl.load(area_ptr + o_c * stride_area, mask=o_c < T, other=0)
        if HAS_START:
            b_start = tl.load(start_ptr + i_b * stride_start + o_c, mask=o_c < T, other=P)
        else:
            b_start = ((o_c // U) % U) // TILES
        tl.store(a_ptr + i_b * stride_a + o_c, tl.where(b_area > 0, b_start, P), mask=m_c)
    for c0 in range(w * BLOCK_N, N, W * BLOCK_N):
        o_c = c0 + tl.arange(0, BLOCK_N)
        tl.store(source_ptr + i_b * N + o_c, _i64(o_c // K), mask=o_c < N)
    if w == 0:
        tl.store(stuck_ptr + i_b, False)
        tl.store(best_key_ptr + i_b, _BIG_T)
    phase += 1
    _sync(bar, phase, W)

    for rnd in range(0, ROUNDS + 1):
        phase = _state_pass(a_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, lo_ptr, acc_ptr, len_ptr, bar,
                            phase, i_b, w, T, P, G, B, stride_a, stride_area, stride_q, stride_k,
                            Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
                            W, BLOCK_T, BLOCK_G, BLOCK_P, BLOCK_C, TILES)

        # round 0, the variant's start, is its threshold's base; then the best state and the round's limits
        if w == 0:
            if rnd == 0:
                scale = tl.load(scale_ptr + i_b)
                if TRAINING:
                    base = (tl.load(bneck_ptr + i_b) + tl.load(bwd_bneck_ptr + i_b)).to(tl.float64)
                else:
                    base = tl.load(bneck_ptr + i_b).to(tl.float64)
                tl.store(thr_ptr + i_b, tl.where(scale == float("inf"), tl.full([], _BIG_T, tl.int64).to(tl.float64),
                                                 base * scale + 1.0))
                if CAPS:  # the buffers hold the variant's moves when its start fits them (``device.start_caps``)
                    o_p = tl.arange(0, BLOCK_P)
                    o_r = i_b * P + o_p
                    m_r = o_p < P
                    # buffer by buffer: the plan's when the start fits it, else none
                    q_in = tl.max(tl.load(send_ptr + 7 * RS + o_r, mask=m_r, other=0), axis=0)
                    k_in = tl.max(tl.load(send_ptr + 9 * RS + o_r, mask=m_r, other=0), axis=0)
                    q_out = tl.max(tl.load(send_ptr + 6 * RS + o_r, mask=m_r, other=0), axis=0)
                    k_out = tl.max(tl.load(send_ptr + 8 * RS + o_r, mask=m_r, other=0), axis=0)
                    tl.store(caps_ptr + i_b, tl.where(q_in <= QIN_CAP, _i64(QIN_CAP), _BIG_T))
                    tl.store(caps_ptr + B + i_b, tl.where(k_in <= KIN_CAP, _i64(KIN_CAP), _BIG_T))
                    tl.store(caps_ptr + 2 * B + i_b, tl.where(q_out <= QOUT_CAP, _i64(QOUT_CAP), _BIG_T))
                    tl.store(caps_ptr + 3 * B + i_b, tl.where(k_out <= KOUT_CAP, _i64(KOUT_CAP), _BIG_T))
                tl.debug_barrier()
            _track_variant(a_ptr, best_a_ptr, load_ptr, bneck_ptr, cap_ptr, stuck_ptr, thr_ptr, best_key_ptr,
                           dest_cap_ptr, balance_ptr, limit_ptr, excess_ptr, bwd_bneck_ptr, send_ptr,
                           i_b, P, T, RS, QIN_CAP, KIN_CAP, QOUT_CAP, KOUT_CAP, stride_a, stride_a, P, BLOCK_P, BLOCK_C,
                           TRAINING, CAPS)
        phase += 1
        _sync(bar, phase, W)

        # only a balanced variant restarts (``device.run_variants``); every worker of the variant reads the
        # same best key after the barrier above, so they all take the same branch
        again = tl.load(best_key_ptr + i_b) < _BIG_T // 2
        if (rnd > 0) & (rnd < ROUNDS) & (rnd % RESTART_EVERY == 0) & again:
            # restart from the best state with its bottleneck rank's tasks, and those whose query unit it
            # hosts, back on their query host
            for c0 in range(w * BLOCK_C, T + 1, W * BLOCK_C):
                o_c = c0 + tl.arange(0, BLOCK_C)
                m_c = o_c < T + 1
                tl.store(a_ptr + i_b * stride_a + o_c, tl.load(best_a_ptr + i_b * stride_a + o_c, mask=m_c), mask=m_c)
            phase += 1
            _sync(bar, phase, W)
            phase = _state_pass(a_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, lo_ptr, acc_ptr, len_ptr, bar,
                                phase, i_b, w, T, P, G, B, stride_a, stride_area, stride_q, stride_k,
                                Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
                                W, BLOCK_T, BLOCK_G, BLOCK_P, BLOCK_C, TILES)
            o_p = tl.arange(0, BLOCK_P)
            b_vol = tl.load(vol_ptr + i_b * P + o_p, mask=o_p < P, other=-1)
            if TRAINING:  # the rank with most bytes over both phases (``core.step_vol``)
                b_vol += tl.load(bvol_ptr + i_b * P + o_p, mask=o_p < P, other=0)
            bn = tl.min(tl.where(b_vol == tl.max(b_vol, axis=0), o_p, BLOCK_P), axis=0)  # first on ties
            for c0 in range(w * BLOCK_C, T, W * BLOCK_C):
                o_c = c0 + tl.arange(0, BLOCK_C)
                m_c = o_c < T
                b_a = tl.load(a_ptr + i_b * stride_a + o_c, mask=m_c, other=0)
                b_area = tl.load(area_ptr + o_c * stride_area, mask=m_c, other=0)
                home = tl.where(b_area > 0, ((o_c // U) % U) // TILES, P)
                tl.store(a_ptr + i_b * stride_a + o_c, tl.where((b_a == bn) | (home == bn), home, b_a), mask=m_c)
            if w == 0:
                tl.store(stuck_ptr + i_b, False)
            phase += 1
            _sync(bar, phase, W)
            phase = _state_pass(a_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, lo_ptr, acc_ptr, len_ptr, bar,
                                phase, i_b, w, T, P, G, B, stride_a, stride_area, stride_q, stride_k,
                                Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
                                W, BLOCK_T, BLOCK_G, BLOCK_P, BLOCK_C, TILES)
            if w == 0:
                _track_variant(a_ptr, best_a_ptr, load_ptr, bneck_ptr, cap_ptr, stuck_ptr, thr_ptr, best_key_ptr,
                               dest_cap_ptr, balance_ptr, limit_ptr, excess_ptr, bwd_bneck_ptr, send_ptr,
                               i_b, P, T, RS, QIN_CAP, KIN_CAP, QOUT_CAP, KOUT_CAP, stride_a, stride_a, P,
                               BLOCK_P, BLOCK_C, TRAINING, CAPS)
            phase += 1
            _sync(bar, phase, W)

        if rnd < ROUNDS:
            for i_s in range(w, P, W):
                _offers_source(a_ptr, area_ptr, load_ptr, dest_cap_ptr, width_ptr, unit_ptr, headroom_ptr,
                               dests_ptr, i_b, _i64(i_s), P, U, GU, K, D, stride_a, stride_area, P, 1,
                               BLOCK_P, BLOCK_GP, BLOCK_U, BLOCK_JU, BLOCK_W, True)
            phase += 1
            _sync(bar, phase, W)
            for i_sk in range(w, N, W):
                _bundle_unit(a_ptr, area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr, unit_tasks_ptr, order_ptr,
                             unit_ptr, dests_ptr, headroom_ptr, excess_ptr, send_ptr,
                             balance_ptr, bneck_ptr, bwd_bneck_ptr, thr_ptr,
                             lo_ptr, acc_ptr, lo_ptr + n, acc_ptr + n, len_ptr, len_ptr + n, acc_ptr + 2 * n,
                             ok_ptr, score_ptr, dest_ptr, parea_ptr, dsend_ptr, drecv_ptr, dx_ptr, ptasks_ptr,
                             units_ptr, caps_ptr, i_b, _i64(i_sk // K), _i64(i_sk % K),
                             T, P, K, D, GU, RS, stride_a, stride_area, stride_q, stride_k,
                             Q_BYTES, O_BYTES, KV_BYTES, QB_BYTES, DQ_BYTES, KVB_BYTES, DKV_BYTES,
                             BLOCK_P, BLOCK_D, True, SIDEWAYS, SINGLES, TRAINING, CAPS, TILES, BLOCK_M, BLOCK_TL,
                             1, 1, 1, False)  # plain bytes: the persistent path refuses a topology
            phase += 1
            _sync(bar, phase, W)
            if w == 0:
                _accept_variant(score_ptr, ok_ptr, dest_ptr, source_ptr, parea_ptr, dsend_ptr, drecv_ptr,
                                load_ptr, send_ptr, recv_ptr, excess_ptr, dest_cap_ptr, limit_ptr, balance_ptr,
                                fits_ptr, keep_ptr, stuck_ptr, ptasks_ptr, a_ptr, dx_ptr, send_ptr, bneck_ptr,
                                bwd_bneck_ptr, caps_ptr, i_b, N, P, U, T, RS,
                                N, N, N, N, N, N, N, P, P, P, P, 1, stride_a,
                                BLOCK_N, BLOCK_J, BLOCK_M, True, TRAINING, CAPS)
            phase += 1
            _sync(bar, phase, W)


def default_workers(variants: int, proposals: int, device) -> int:
    """Workers per variant: 1 off CUDA (or interpreted); on CUDA one program per SM for all variants
    together on at most ``_SM_SHARE`` of the SMs (a cooperative launch must fit the device at
    once; the rest stay free for the layer's collectives and attention), at most one per proposal
    slot."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(proposals, int(sms * _SM_SHARE) // max(variants, 1)))


def solve_rounds_persistent(tasks: Tasks, cap: torch.Tensor, tables: torch.Tensor, scales: torch.Tensor,
                            K: int, D: int, rounds: int, workers: int = 1, sideways: bool = False,
                            restart_every: int = 0, start: torch.Tensor | None = None, singles: bool = False):
    """All rounds of all variants in one launch (Triton twin of ``device.run_variants``).

    tasks:   Tasks of the solve (T = G * U * U tasks, U = n * P units per group).
    cap:     0-dim int64, the largest balanced load.
    tables:  [3, B] int64 per-variant task order (index into TASK_ORDERS),
             window width (<= D) and units offered (<= K).
    scales:  [B] fp64 threshold scales (inf = unbounded).
    K, D:    host ints, unit slots per source and window destinations.
    rounds:  host int, rounds of moves.
    workers: host int W, programs per variant (1 under the Triton interpreter;
             more needs a cooperative launch on a GPU).
    sideways, restart_every, singles: the local search's extras, as ``run_variants``.
    start:   optional [T] (shared) or [B, T] (per variant) int64 or int32 start rank of
             each non-empty task, as ``start.ref.variant_starts`` gives; None: owner-computes (every
             task on its query host).
    Returns (best_A [B, T+1] int64, best_key [B] int64), equal to
    ``run_variants`` with the same strategies in columns [0, T) and in the key.
    """
    G, P, U, T = tasks.G, tasks.P, tasks.U, tasks.T
    tiles = tasks.tiles
    B, dev = scales.shape[0], scales.device
    if start is not None and (tuple(start.shape) not in ((T,), (B, T)) or start.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"start must be an int64 or int32 [T] = [{T}] or [B, T] = [{B}, {T}] tensor, "
                         f"got {start.dtype} {tuple(start.shape)}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers > 1 and (dev.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        raise ValueError(f"workers={workers} needs a cooperative launch on a CUDA device; use workers=1 on {dev}")
    N = P * K
    empty = lambda *shape, dtype=torch.int64: torch.empty(shape, dtype=dtype, device=dev)  # noqa: E731
    A, best_A = empty(B, T + 1), empty(B, T + 1)
    best_key = empty(B)
    if dev.type == "meta":  # shapes only: there is no data to run the kernel on
        return best_A, best_key
    n = B * G * U * P  # cells of one [B, G*U, P] buffer
    lo, acc, lens = empty(2 * n), empty(3 * n + B * P + 2 * B), empty(2 * n + 10 * B * P)
    thr, limit = empty(B, dtype=torch.float64), empty(B, dtype=torch.float64)
    excess, headroom = empty(B, P), empty(B, P)
    balance, stuck = empty(B, dtype=torch.bool), empty(B, dtype=torch.bool)
    dest_cap = empty(B)
    unit, dests = empty(B, P, K), empty(B, P, D)
    ok, fits, keep = (empty(B, N, dtype=torch.bool) for _ in range(3))
    score = empty(B, N, dtype=torch.float64)
    dest, source, parea, dsend, drecv = (empty(B, N) for _ in range(5))
    ptasks = empty(B, N, U)
    dx = empty(4, B, N)
    caps = empty(4, B)
    bar = torch.zeros((B,), dtype=torch.int32, device=dev)
    order, width, units = tables.contiguous().unbind(0)
    block_gp = triton.next_power_of_2(G * U)
    block_n = triton.next_power_of_2(N)
    extra = {"launch_cooperative_grid": True} if workers > 1 else {}
    _rounds_kernel[(B * workers,)](
        A, best_A, best_key, tasks.area, tasks.qlo, tasks.qhi, tasks.klo, tasks.khi,
        tasks.area if start is None else start.to(torch.int64).contiguous(),  # unused pointer when None
        T if start is not None and start.dim() == 2 else 0,  # start row stride: 0 when shared
        tasks.unit_tasks.contiguous(), order, width, units, scales.contiguous(), cap,
        lo, acc, lens, thr, limit, excess, headroom, balance, stuck, dest_cap, unit, dests,
        ok, fits, keep, score, dest, source, parea, dsend, drecv, ptasks, dx, caps, bar,
        rounds, restart_every if restart_every > 0 else rounds + 1, T, P, G, B, K, D,
        tasks.area.stride(0), tasks.qlo.stride(0), tasks.klo.stride(0),
        *byte_prices(tasks), *tasks.buffer_rows,
        W=workers, SIDEWAYS=bool(sideways), SINGLES=bool(singles), TRAINING=tasks.training, CAPS=tasks.caps,
        BLOCK_T=min(_BLOCK_T, triton.next_power_of_2(T)), BLOCK_G=triton.next_power_of_2(G),
        BLOCK_P=triton.next_power_of_2(P), BLOCK_GP=block_gp, BLOCK_U=unit_block(block_gp),
        BLOCK_JU=task_block(block_gp, U),
        BLOCK_W=triton.next_power_of_2(D), BLOCK_D=dest_tile(D, tiles), BLOCK_N=block_n,
        BLOCK_J=min(_BLOCK_J, block_n), BLOCK_C=min(_BLOCK_C, triton.next_power_of_2(T + 1)),
        TILES=tiles, BLOCK_M=triton.next_power_of_2(U), BLOCK_TL=triton.next_power_of_2(tiles),
        HAS_START=start is not None,
        enable_fp_fusion=False,  # no fused multiply-add: thresholds and scores round like the twin's
        num_warps=_NUM_WARPS,
        **extra,
    )
    return best_A, best_key
