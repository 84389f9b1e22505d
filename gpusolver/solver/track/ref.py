"""Torch twin of the track step: each variant's best state so far and the round's limits.

``track`` is the reference the Triton ``track_triton`` (kernel.py) equals.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import State, objective, over_buffers, state_key


def track(A: torch.Tensor, st: State, cap: torch.Tensor, stuck: torch.Tensor, threshold: torch.Tensor,
          best_A: torch.Tensor, best_key: torch.Tensor, training: bool = False, caps: tuple | None = None):
    """Keep each variant's best state and set the round's limits (torch twin, the round loop's own lines).

    A, best_A: [B, T+1] int64 assignments (current, best so far).
    st:        State of A; reads load [B, P], the bottlenecks [B] and, with capacities,
               the rows [B, P].
    cap:       0-dim int64, the largest balanced load.
    stuck:     [B] bool, balancing variants that found no move last round.
    threshold: [B] fp64, balance-phase limit on any touched rank's bytes.
    best_key:  [B] int64 (``core.state_key``): within the buffers and balanced first (key =
               the objective, ``core.objective``), then unbalanced, then past a buffer.
    training:  the objective is forward plus backward bottleneck.
    caps:      (QO recv, KV recv, QO send, KV send) host ints, rows per rank (None: not checked).
    Returns (best_A [B, T+1] int64, best_key [B] int64, excess [B, P] int64,
    balance [B] bool, dest_cap [B, 1] int64, limit [B] fp64).
    """
    B = A.shape[0]
    max_load = st.load.amax(1)
    balanced = max_load <= cap
    goal = objective(st, training)
    over = None if caps is None else over_buffers(st, caps)
    key = state_key(balanced, goal, max_load, over)
    better = key < best_key
    best_key = torch.where(better, key, best_key)
    best_A = torch.where(better[:, None], A, best_A)
    excess = st.load - cap
    balance = ~balanced
    dest_cap = torch.where(stuck, max_load - 1, cap).view(B, 1)
    limit = torch.where(balance, threshold, goal.double() - 1)
    return best_A, best_key, excess, balance, dest_cap, limit

