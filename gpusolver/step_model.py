"""The modelled step: a plan's busiest attention and its bytes in one integer unit of time.

    step ~ w_area * max_r load_r + w_byte * bytes

The busiest rank's attention entries are priced at the topology's attention rate (the forward,
and with ``objective="training"`` the backward's FLOPs at its own rate); the bytes are
link-weighted (an NVLink byte weighs 1, an InfiniBand byte ``SolverConfig.link_weights``), so
bytes over the NVLink bandwidth are their time. Both terms are integers in units of 1 /
``TIME_SCALE`` NVLink byte-times: no float compare, so a choice made on this model is
bit-identical on every rank and path. The model is the no-overlap sum of the two; two choices
use it: the time-aware bound (``solver.balance``) and a sparse plan against owner-computes
(``plan.sparse.no_worse_than_owner``).
"""
from __future__ import annotations

from gpusolver.config import SolverConfig
from gpusolver.topology import Topology

__all__ = ["TIME_SCALE", "time_weights"]

# Units of the modelled step: 1 / TIME_SCALE of one NVLink byte's time (16: the attention weight
# rounds within 0.5 % on h200_hgx).
TIME_SCALE = 16
# Bounds of the terms, so the key stays within int64: the objective stays below 2^52
# (``solver.core.state_key``); a load is at most the whole sequence's entries, G * S^2.
OBJECTIVE_BOUND = 1 << 52
_KEY_BITS = 62


def time_weights(config: SolverConfig, total_seqlen: int, topology: Topology | None = None) -> tuple[int, int, int]:
    """(w_area, w_byte, shift): the step model's integer weights of one attention entry of the
    busiest rank and of one (link-weighted) byte, and the right shift both terms take so that
    ``w_area * (G * S^2 >> shift) + w_byte * (2^52 >> shift)`` stays below 2^62 (0 at every
    benchmark size).

    topology: the rates (attention FLOP/s, NVLink bandwidth); None: ``config.topology``, which
    must then be set.
    """
    topo = config.topology if topology is None else topology
    if topo is None:
        raise ValueError("time_weights needs config.topology (the attention rate and NVLink bandwidth)")
    cost = config.cost()
    flops = 4.0 * config.head_dim * cost.hq  # one entry of one head group, forward
    seconds = flops / (topo.attn_tflops * 1e12)
    if config.objective == "training":
        seconds += flops * topo.bwd_flops_ratio / (topo.bwd_attn_tflops * 1e12)
    w_area = max(1, round(seconds * topo.nvlink_gbps * 1e9 * TIME_SCALE))
    w_byte = TIME_SCALE
    bound = w_area * config.head_groups * total_seqlen * total_seqlen + w_byte * OBJECTIVE_BOUND
    return w_area, w_byte, max(0, bound.bit_length() - _KEY_BITS)
