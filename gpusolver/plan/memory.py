"""What a plan's collective buffers take per rank: forward peak, backward peak, kept between them.

Host ints from static shapes only (the capacities, heads, head dim and dtype), so a plan on
any device, meta included, is priced the same. The buffers are what ``dist_attn`` receives
into (``group_cast``) and what partial results come back into (``group_reduce``), each at
its capacity's rows (``CommMeta.buffers``), group-major rows of ``hq = Hq / G`` query heads
and ``hkv = Hkv / G`` KV heads, activations of ``b`` bytes:

    forward   QO recv * Q (hq D b) + KV recv * (K, V) (2 hkv D b)
              + QO send * (partial O hq D b + fp32 lse 4 hq)         [all live at the reduce]
    backward  QO recv * (dO hq D b + fp32 lse and delta 8 hq)
              + QO recv * Q + KV recv * (K, V)                        [kept, or cast again]
              + QO send * dQ (hq D b) + KV send * (dK, dV) (2 hkv D b) [all live at the dK, dV reduce]
    kept      QO recv * Q if the helper keeps Q, + KV recv * (K, V) if it keeps K and V (of the
              KV buffer its first ``kept_kv_rows`` rows only, when given: the rest is cast again
              into a buffer of the remaining rows, so the backward peak is the same)

With S remote sub-stages (``num_stages``) the terms are the same: the S casts of a kind land
in one buffer at the plan's capacity, each at its own rows (``CommMeta.stage_base``), and the
S reduces in flight at once hold no more than one send list between them (``TorchGroup``
returns into buffers of the rows each reduce really returns; ``LocalGroup`` and
``SymmMemGroup`` finish each reduce before the next starts).

Not counted: the layer's own activations (its q, k, v, out and lse, which plain attention
keeps too) and the runtime's work around the buffers (the local rows that share stage 1's
operand tensor with each buffer, stage 1's outputs over those rows, the reduce's merge: its
outputs, and on the torch path its fp32 sums over the host's rows and a piece of a window of
returned rows), which ``benchmarks/layer_memory.py`` measures (``--fused-reduce``: the fused
merge of a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpusolver.problem import kept_kinds

@dataclass(frozen=True)
class BufferMemory:
    """Bytes per rank of one layer's collective buffers (host ints).

    fwd_peak: receive buffers plus the buffer partial O and lse come back into.
    bwd_peak: the backward's receive and return buffers, the kept ones included.
    kept:     held from the layer's forward to its backward.
    """

    fwd_peak: int
    bwd_peak: int
    kept: int


def buffer_memory(comm, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype: torch.dtype,
                  keep=True, kept_kv_rows: int | None = None) -> BufferMemory:
    """``BufferMemory`` of a ``CommMeta``'s buffers for the given heads, head dim and dtype;
    ``kept_kv_rows``: of a kept KV buffer only its first rows (the rest is cast again)."""
    G = comm.head_groups
    if num_heads_q % G or num_heads_kv % G:
        raise ValueError(f"num_heads_q={num_heads_q} and num_heads_kv={num_heads_kv} must be multiples of the "
                         f"plan's G = {G} head groups")
    hq, hkv = num_heads_q // G, num_heads_kv // G
    b = torch.empty((), dtype=dtype).element_size()
    q_row, kv_row = hq * head_dim * b, 2 * hkv * head_dim * b
    rows = comm.buffers
    q_buf, kv_buf = rows.qo_recv * q_row, rows.kv_recv * kv_row  # shared by the sub-stages
    fwd = q_buf + kv_buf + rows.qo_send * (q_row + 4 * hq)
    bwd = rows.qo_recv * (q_row + 8 * hq) + q_buf + kv_buf + rows.qo_send * q_row + rows.kv_send * kv_row
    kinds = kept_kinds(keep)
    kv_kept = kv_buf if kept_kv_rows is None else min(kept_kv_rows, rows.kv_recv) * kv_row
    kept = (q_buf if "qo" in kinds else 0) + (kv_kept if "kv" in kinds else 0)
    return BufferMemory(fwd_peak=fwd, bwd_peak=bwd, kept=kept)
