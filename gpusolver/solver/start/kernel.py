"""Triton "transpose" and "ulysses" starts (twin of ``start.ref.transpose_start``).

One program per QO unit (g, u) reads the unit's U tasks in tiles, sums the
remote key tokens they need and takes the hull of their query rows, decides
whether the unit starts transposed (on its head group's rank of its aligned
block of G ranks) or on its query host, and writes that rank for all its
tasks. Integer sums and min/max: equal to the twin entry for entry.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpusolver.solver.core import _BIG, Tasks

_BIG_T = tl.constexpr(_BIG)
_BLOCK_J = 256


@triton.jit
def _transpose_start_kernel(
    area_ptr, qlo_ptr, qhi_ptr, klo_ptr, khi_ptr,  # [T] int64 each (strided)
    out_ptr,  # [T] int64: the start rank of each task
    U, P, G,
    stride_a, stride_q, stride_k,
    Q_BYTES, O_BYTES, KV_BYTES,
    TILES: tl.constexpr, BLOCK_J: tl.constexpr, EVERY_UNIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # QO unit g * U + u
    g = row // U
    host = (row % U) // TILES
    kv_tokens = tl.zeros([BLOCK_J], dtype=tl.int64)
    q_lo = tl.full([BLOCK_J], _BIG_T, tl.int64)
    q_hi = tl.zeros([BLOCK_J], dtype=tl.int64)
    for j0 in range(0, U, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J).to(tl.int64)
        t = row * U + j
        m = j < U
        valid = tl.load(area_ptr + t * stride_a, mask=m, other=0) > 0
        lo = tl.load(qlo_ptr + t * stride_q, mask=m, other=0)
        hi = tl.load(qhi_ptr + t * stride_q, mask=m, other=0)
        k_lo = tl.load(klo_ptr + t * stride_k, mask=m, other=0)
        k_hi = tl.load(khi_ptr + t * stride_k, mask=m, other=0)
        remote = valid & (j // TILES != host)
        kv_tokens += tl.where(remote, k_hi - k_lo, 0)
        q_lo = tl.minimum(q_lo, tl.where(valid, lo, _BIG_T))
        q_hi = tl.maximum(q_hi, tl.where(valid, hi, 0))
    q_len = tl.maximum(tl.max(q_hi, 0) - tl.min(q_lo, 0), 0)
    flip = (tl.sum(kv_tokens, 0) * KV_BYTES > q_len * (Q_BYTES + O_BYTES)) | EVERY_UNIT
    block = (host // G) * G
    target = block + g % tl.minimum(P - block, G)
    rank = tl.where(flip, target, host)
    for j0 in range(0, U, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J).to(tl.int64)
        tl.store(out_ptr + row * U + j, tl.zeros([BLOCK_J], dtype=tl.int64) + rank, mask=j < U)


def transpose_start_triton(tasks: Tasks, every_unit: bool = False) -> torch.Tensor:
    """[T] int64 start rank of each task, equal to ``transpose_start(tasks, every_unit)`` (one
    launch; ``every_unit``: the "ulysses" start)."""
    G, P, U, T = tasks.G, tasks.P, tasks.U, tasks.T
    out = torch.empty(T, dtype=torch.int64, device=tasks.area.device)
    if out.device.type == "meta":  # shapes only
        return out
    _transpose_start_kernel[(G * U,)](
        tasks.area, tasks.qlo, tasks.qhi, tasks.klo, tasks.khi, out,
        U, P, G,
        tasks.area.stride(0), tasks.qlo.stride(0), tasks.klo.stride(0),
        tasks.q, tasks.o, tasks.kv,
        TILES=tasks.tiles, BLOCK_J=min(_BLOCK_J, triton.next_power_of_2(U)), EVERY_UNIT=bool(every_unit),
    )
    return out
