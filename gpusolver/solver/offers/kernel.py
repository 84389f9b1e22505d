"""Triton offers step: each source's units and destination window.

``offers_triton(tasks, st, cap, units_per_rank, n_dests, dests_per_variant)``
is the twin of ``offers.ref.offers`` and equals it exactly, in one launch with
one program per (variant, source rank):

* The area of each QO unit on the source: unit ``u``'s tasks are the ``U``
  consecutive tasks ``u * U + j``, so the program sums, for every unit at
  once, the areas of those that sit on the source. No atomics.
* The heaviest units, ties by the lower index (the stable sort of the twin):
  unit ``u``'s place in that order is the count of units that are heavier, or
  as heavy with a lower index. Places are distinct, so the K first units are
  written to their places and every output slot is written once. The count is
  taken over ``[BLOCK_U, BLOCK_GP]`` tiles of unit pairs (BLOCK_GP covers the G * U units).
* The destination window: the same counting gives each rank's place by
  headroom (most first) and the source's place by load (most loaded first);
  window slot ``d`` holds the rank whose headroom place is
  ``(e * D_b // 2 + d) mod n_light``, from ``[BLOCK_D, BLOCK_P]`` tiles.

Integer counts and sums are exact, so the result does not depend on the tiling.

Shape legend: B variants, G head groups, P ranks, U = n * P units per group
(n sub-chunk tiles per rank), T = G * U * U tasks, G * U QO units, K units
offered per source, D destinations per window.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpusolver.solver.core import State, Tasks

# Unit pairs compared at once: BLOCK_U * BLOCK_GP <= _TILE.
_TILE = 4096


def unit_block(block_gp: int) -> int:
    """BLOCK_U: units ranked at once against all BLOCK_GP units."""
    return max(1, min(block_gp, _TILE // block_gp))


def task_block(block_gp: int, units: int) -> int:
    """BLOCK_JU: consecutive tasks of every unit summed at once."""
    return max(1, min(triton.next_power_of_2(units), _TILE // block_gp))


@triton.jit
def _floor_div(a, b):
    """Floor of a / b for b > 0, whatever rounding ``//`` does on negative integers."""
    q = a // b
    return tl.where(q * b > a, q - 1, q)


@triton.jit
def _offers_kernel(
    rank_ptr,  # [B, T] int64 (row stride stride_rb): rank of each task, P for none
    area_ptr,  # [T] int64 (stride stride_a)
    load_ptr,  # [B, P] int64 (row stride stride_load)
    cap_ptr,  # [B] int64 (stride stride_cap, 0 when shared): the largest load a destination may take
    width_ptr,  # [B] int64 (HAS_WIDTH only): each variant's window width
    unit_ptr,  # [B, P, K] int64 out
    headroom_ptr,  # [B, P] int64 out
    dests_ptr,  # [B, P, D] int64 out
    P, U, GP, K, D,
    stride_rb, stride_a, stride_load, stride_cap,
    BLOCK_P: tl.constexpr, BLOCK_GP: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_JU: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_WIDTH: tl.constexpr,
):
    _offers_source(rank_ptr, area_ptr, load_ptr, cap_ptr, width_ptr, unit_ptr, headroom_ptr, dests_ptr,
                   tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), P, U, GP, K, D,
                   stride_rb, stride_a, stride_load, stride_cap, BLOCK_P, BLOCK_GP, BLOCK_U, BLOCK_JU, BLOCK_D,
                   HAS_WIDTH)


@triton.jit
def _offers_source(rank_ptr, area_ptr, load_ptr, cap_ptr, width_ptr, unit_ptr, headroom_ptr, dests_ptr,
                   i_b, i_s, P, U, GP, K, D, stride_rb, stride_a, stride_load, stride_cap,
                   BLOCK_P: tl.constexpr, BLOCK_GP: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_JU: tl.constexpr,
                   BLOCK_D: tl.constexpr, HAS_WIDTH: tl.constexpr):
    """Program (i_b, i_s) of ``_offers_kernel`` (its arguments; indices int64). GP = G * U units of U tasks."""
    tl.static_assert(BLOCK_GP % BLOCK_U == 0)
    o_row = i_b * P + i_s  # (variant, source)

    # area of every QO unit on the source: unit v's tasks are v * U + j, j in [0, U)
    o_v = tl.arange(0, BLOCK_GP).to(tl.int64)  # [BLOCK_GP] units
    m_v = o_v < GP
    # [BLOCK_GP, BLOCK_JU] tiles, each row BLOCK_JU consecutive tasks of a unit: contiguous reads
    # (a pass per task j would read the assignment with a stride of U)
    b_ua = tl.zeros([BLOCK_GP], dtype=tl.int64)
    for j0 in range(0, U, BLOCK_JU):
        o_j = j0 + tl.arange(0, BLOCK_JU).to(tl.int64)  # [BLOCK_JU]
        o_t = o_v[:, None] * U + o_j[None, :]  # [BLOCK_GP, BLOCK_JU]
        m_t = m_v[:, None] & (o_j[None, :] < U)
        b_rank = tl.load(rank_ptr + i_b * stride_rb + o_t, mask=m_t, other=-1)
        b_area = tl.load(area_ptr + o_t * stride_a, mask=m_t, other=0)
        b_ua += tl.sum(tl.where(b_rank == i_s, b_area, 0), axis=1)

    # place of each unit in the order heaviest first, ties by the lower index; the K first are offered
    for u0 in range(0, GP, BLOCK_U):
        o_u = u0 + tl.arange(0, BLOCK_U).to(tl.int64)  # [BLOCK_U]
        m_u = o_u < GP
        # [BLOCK_U, BLOCK_GP]
        same = o_v[None, :] == o_u[:, None]
        b_ua_u = tl.sum(tl.where(same, b_ua[None, :], 0), axis=1)  # [BLOCK_U]
        ahead = m_v[None, :] & ((b_ua[None, :] > b_ua_u[:, None])
                                | ((b_ua[None, :] == b_ua_u[:, None]) & (o_v[None, :] < o_u[:, None])))
        pos = tl.sum(ahead.to(tl.int64), axis=1)  # [BLOCK_U]
        tl.store(unit_ptr + o_row * K + pos, o_u, mask=m_u & (pos < K))

    # headroom of every rank; the source's own entry is this program's output
    o_p = tl.arange(0, BLOCK_P).to(tl.int64)  # [BLOCK_P] ranks
    m_p = o_p < P
    cap = tl.load(cap_ptr + i_b * stride_cap)
    b_load = tl.load(load_ptr + i_b * stride_load + o_p, mask=m_p, other=0)
    b_room = cap - b_load
    load_s = tl.load(load_ptr + i_b * stride_load + i_s)
    tl.store(headroom_ptr + o_row, cap - load_s)
    # the source's place by load, most loaded first, ties by the lower index
    e = tl.sum((m_p & ((b_load > load_s) | ((b_load == load_s) & (o_p < i_s)))).to(tl.int64), axis=0)
    # each rank's place by headroom, most first, ties by the lower index: [BLOCK_P(r), BLOCK_P(q)]
    room_ahead = m_p[None, :] & ((b_room[None, :] > b_room[:, None])
                                 | ((b_room[None, :] == b_room[:, None]) & (o_p[None, :] < o_p[:, None])))
    by_room_pos = tl.sum(room_ahead.to(tl.int64), axis=1)  # [BLOCK_P]
    n_light = tl.maximum(tl.sum((m_p & (b_room > 0)).to(tl.int64), axis=0), 1)

    # the window: slot d holds the rank at place (e * width // 2 + (d if d < width else 0)) mod n_light
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D] slots
    m_d = o_d < D
    if HAS_WIDTH:
        width = tl.zeros_like(o_d) + tl.load(width_ptr + i_b)  # [BLOCK_D], one value
    else:
        width = tl.zeros_like(o_d) + D
    window = _floor_div(e * width, 2) + tl.where(o_d < width, o_d, 0)
    place = window - _floor_div(window, n_light) * n_light  # [BLOCK_D]
    # [BLOCK_D, BLOCK_P]
    at = m_p[None, :] & (by_room_pos[None, :] == place[:, None])
    dest = tl.sum(tl.where(at, o_p[None, :], 0), axis=1)
    tl.store(dests_ptr + o_row * D + o_d, dest, mask=m_d)


def offers_triton(tasks: Tasks, st: State, cap, units_per_rank: int, n_dests: int, dests_per_variant=None):
    """Each source's offered QO units and destination window (Triton twin of ``offers``).

    tasks:             Tasks of the solve; reads G, P, U and area [T] int64.
    st:                State of the current assignments; reads rank [B, T]
                       and load [B, P] int64 (rows may be strided views).
    cap:               0-dim, [B] or [B, 1] int64, the largest load a destination may take.
    units_per_rank:    host int, units each source offers (K = min(it, G*U)).
    n_dests:           host int, window destinations (D = min(it, P)).
    dests_per_variant: optional [B] int64, each variant's window width (<= D).
    Returns (unit [B, P, K] int64: each source's heaviest units, ties by the
    lower index; headroom [B, P] int64 = cap - load; dests [B, P, D] int64: the
    window of ranks by headroom), equal to the twin's. One kernel launch; on
    ``device="meta"`` only the outputs are allocated.
    """
    G, P, U = tasks.G, tasks.P, tasks.U
    B, dev = st.rank.shape[0], st.rank.device
    GP = G * U
    K, D = min(units_per_rank, GP), min(n_dests, P)
    if K < 1 or D < 1:
        raise ValueError(f"units_per_rank and n_dests must be >= 1, got {units_per_rank}, {n_dests}")
    if dests_per_variant is not None and tuple(dests_per_variant.shape) != (B,):
        raise ValueError(f"dests_per_variant must be [B] = [{B}], got {tuple(dests_per_variant.shape)}")
    cap_b = torch.as_tensor(cap, device=dev)
    if cap_b.numel() not in (1, B) or cap_b.dim() > 2:
        raise ValueError(f"cap must be 0-dim, [B] or [B, 1] with B = {B}, got {tuple(cap_b.shape)}")
    cap_b = torch.broadcast_to(cap_b.reshape(-1, 1), (B, 1)).reshape(B)  # a view: stride 0 when shared
    unit = torch.empty((B, P, K), dtype=torch.int64, device=dev)
    headroom = torch.empty((B, P), dtype=torch.int64, device=dev)
    dests = torch.empty((B, P, D), dtype=torch.int64, device=dev)
    if dev.type == "meta":  # shapes only: there is no data to run the kernel on
        return unit, headroom, dests
    rank = st.rank if st.rank.stride(1) == 1 else st.rank.contiguous()
    load = st.load if st.load.stride(1) == 1 else st.load.contiguous()
    width = unit if dests_per_variant is None else dests_per_variant.contiguous()  # unused pointer when None
    block_gp = triton.next_power_of_2(GP)
    _offers_kernel[(B, P)](
        rank, tasks.area, load, cap_b, width, unit, headroom, dests,
        P, U, GP, K, D,
        rank.stride(0), tasks.area.stride(0), load.stride(0), cap_b.stride(0),
        BLOCK_P=triton.next_power_of_2(P), BLOCK_GP=block_gp, BLOCK_U=unit_block(block_gp),
        BLOCK_JU=task_block(block_gp, U), BLOCK_D=triton.next_power_of_2(D), HAS_WIDTH=dests_per_variant is not None,
        num_warps=8,  # [BLOCK_U, BLOCK_GP] = [8, 512] tiles at P = 64: no spills with 8 warps (ptxas)
    )
    return unit, headroom, dests
