"""Triton track step (twin of ``track.ref.track``): each variant's best state and the round's limits.

One program per variant compares the state's key (balanced first, then the
lower bottleneck, or the lower max load) with the best so far and, only when
it is better, copies the assignment row into the best one: the row is
``G * U * U`` tasks (256 KB at P = 64, G = 8), and most rounds do not
improve. The best assignment and key are updated in place.

Shape legend: B variants, P ranks, T tasks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpusolver.solver.core import _BIG, OVER_CAPACITY, State
from gpusolver.solver.state.kernel import rank_table

_HALF_BIG = tl.constexpr(_BIG // 2)
_OVER_CAPACITY = tl.constexpr(OVER_CAPACITY)
# Tasks (of the assignment's row) copied per step.
_BLOCK_C = 1024


@triton.jit
def _track_kernel(
    a_ptr,  # [B, T+1] int64: the assignment (row stride stride_a)
    best_a_ptr,  # [B, T+1] int64, in place: best assignment so far (row stride stride_best_a)
    load_ptr,  # [B, P] int64
    bneck_ptr,  # [B] int64
    cap_ptr,  # 0-dim int64: the largest balanced load
    stuck_ptr,  # [B] bool
    thr_ptr,  # [B] fp64: balance-phase threshold
    best_key_ptr,  # [B] int64, in place
    dest_cap_ptr,  # [B] int64 out
    balance_ptr,  # [B] bool out
    limit_ptr,  # [B] fp64 out
    excess_ptr,  # [B, P] int64 out, contiguous
    bwd_bneck_ptr,  # [B] int64 (TRAINING): the backward bottleneck
    ranks_ptr,  # [10, B, P] int64 (CAPS; planes RS apart): ``state.kernel.rank_table``
    P, T, RS, QIN_CAP, KIN_CAP, QOUT_CAP, KOUT_CAP,
    stride_a, stride_best_a, stride_load,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, TRAINING: tl.constexpr, CAPS: tl.constexpr,
):
    _track_variant(a_ptr, best_a_ptr, load_ptr, bneck_ptr, cap_ptr, stuck_ptr, thr_ptr, best_key_ptr,
                   dest_cap_ptr, balance_ptr, limit_ptr, excess_ptr, bwd_bneck_ptr, ranks_ptr,
                   tl.program_id(0).to(tl.int64), P, T, RS, QIN_CAP, KIN_CAP, QOUT_CAP, KOUT_CAP,
                   stride_a, stride_best_a, stride_load, BLOCK_P, BLOCK_C, TRAINING, CAPS)


@triton.jit
def _track_variant(a_ptr, best_a_ptr, load_ptr, bneck_ptr, cap_ptr, stuck_ptr, thr_ptr, best_key_ptr,
                   dest_cap_ptr, balance_ptr, limit_ptr, excess_ptr, bwd_bneck_ptr, ranks_ptr,
                   i_b, P, T, RS, QIN_CAP, KIN_CAP, QOUT_CAP, KOUT_CAP, stride_a, stride_best_a, stride_load,
                   BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, TRAINING: tl.constexpr, CAPS: tl.constexpr):
    """Variant ``i_b`` (int64) of ``_track_kernel`` (its arguments)."""
    o_p = tl.arange(0, BLOCK_P)  # [BLOCK_P] ranks
    m_p = o_p < P
    b_load = tl.load(load_ptr + i_b * stride_load + o_p, mask=m_p, other=0)
    cap = tl.load(cap_ptr)
    bneck = tl.load(bneck_ptr + i_b)
    max_load = tl.max(tl.where(m_p, b_load, -_HALF_BIG), axis=0)
    balanced = max_load <= cap
    if TRAINING:  # the objective: forward plus backward bottleneck
        goal = bneck + tl.load(bwd_bneck_ptr + i_b)
    else:
        goal = bneck
    # balanced beats unbalanced, then the lower objective (or the lower max load); past a buffer last
    key = tl.where(balanced, goal, _HALF_BIG + max_load)
    if CAPS:
        o_r = i_b * P + o_p
        over = (tl.maximum(tl.load(ranks_ptr + 7 * RS + o_r, mask=m_p, other=0) - QIN_CAP, 0)
                + tl.maximum(tl.load(ranks_ptr + 9 * RS + o_r, mask=m_p, other=0) - KIN_CAP, 0)
                + tl.maximum(tl.load(ranks_ptr + 6 * RS + o_r, mask=m_p, other=0) - QOUT_CAP, 0)
                + tl.maximum(tl.load(ranks_ptr + 8 * RS + o_r, mask=m_p, other=0) - KOUT_CAP, 0))
        over = tl.sum(tl.where(m_p, over, 0), axis=0) > 0
        key = tl.where(over, tl.where(balanced, _OVER_CAPACITY + goal, _OVER_CAPACITY + (1 << 58) + max_load), key)
    best_key = tl.load(best_key_ptr + i_b)
    if key < best_key:  # the row is written only when the state improves
        tl.store(best_key_ptr + i_b, key)
        for c0 in range(0, T + 1, BLOCK_C):
            o_c = c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C]
            m_c = o_c < T + 1
            tl.store(best_a_ptr + i_b * stride_best_a + o_c, tl.load(a_ptr + i_b * stride_a + o_c, mask=m_c),
                     mask=m_c)
    tl.store(excess_ptr + i_b * P + o_p, b_load - cap, mask=m_p)
    tl.store(balance_ptr + i_b, balanced == 0)
    stuck = tl.load(stuck_ptr + i_b).to(tl.int32) != 0
    tl.store(dest_cap_ptr + i_b, tl.where(stuck, max_load - 1, cap))
    thr = tl.load(thr_ptr + i_b)
    tl.store(limit_ptr + i_b, tl.where(balanced, goal.to(tl.float64) - 1.0, thr))


def track_triton(A: torch.Tensor, st: State, cap: torch.Tensor, stuck: torch.Tensor, threshold: torch.Tensor,
                 best_A: torch.Tensor, best_key: torch.Tensor, training: bool = False, caps: tuple | None = None):
    """Triton twin of ``track``: one launch, one program per variant; same arguments and results
    (``training``, ``caps`` as ``track.ref.track``).

    ``best_A`` ([B, T+1] int64, dense rows) and ``best_key`` ([B] int64,
    contiguous) are updated in place and returned as the first two results.
    """
    B, T, P = A.shape[0], A.shape[1] - 1, st.load.shape[1]
    dev = A.device
    if best_A.stride(1) != 1 or not best_key.is_contiguous() or A.stride(1) != 1:
        raise ValueError("A, best_A and best_key must be dense (best_A and best_key are updated in place)")
    dest_cap = torch.empty((B, 1), dtype=torch.int64, device=dev)
    balance = torch.empty((B,), dtype=torch.bool, device=dev)
    limit = torch.empty((B,), dtype=torch.float64, device=dev)
    excess = torch.empty((B, P), dtype=torch.int64, device=dev)
    out = (best_A, best_key, excess, balance, dest_cap, limit)
    if dev.type == "meta":  # shapes only: there is no data to run the kernel on
        return out
    load = st.load if st.load.stride(1) == 1 else st.load.contiguous()
    c = lambda t: t.contiguous()  # noqa: E731
    rows = caps if caps is not None else (0, 0, 0, 0)
    _track_kernel[(B,)](
        A, best_A, load, c(st.bottleneck), c(cap), c(stuck), c(threshold), best_key,
        dest_cap, balance, limit, excess, c(st.bwd_bottleneck), rank_table(st) if caps is not None else load,
        P, T, B * P, *rows, A.stride(0), best_A.stride(0), load.stride(0),
        BLOCK_P=triton.next_power_of_2(P), BLOCK_C=min(_BLOCK_C, triton.next_power_of_2(T + 1)),
        TRAINING=bool(training), CAPS=caps is not None,
    )
    return out
