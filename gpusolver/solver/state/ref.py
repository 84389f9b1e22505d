"""Torch twin of the state step: hulls, lengths, loads and bytes of each variant's assignment.

``state(tasks, A)`` is the reference the Triton ``state_triton`` (kernel.py)
equals entry for entry.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import _BIG, State, Tasks
from gpusolver.solver.state.relay import relay_weighted


def _scatter_hull(tasks: Tasks, rank, lo, hi, unit):
    """Hull [lo, hi) of the needs of each (unit, rank): [B, G*U, P] each."""
    B, P = rank.shape[0], tasks.P
    key = unit * (P + 1) + rank
    n = tasks.G * tasks.U * (P + 1)
    h_lo = torch.full((B, n), _BIG, dtype=torch.int64, device=rank.device)
    h_hi = torch.zeros((B, n), dtype=torch.int64, device=rank.device)
    h_lo = h_lo.scatter_reduce(1, key, lo.expand(B, -1), "amin")
    h_hi = h_hi.scatter_reduce(1, key, hi.expand(B, -1), "amax")
    return h_lo.view(B, -1, P + 1)[..., :P], h_hi.view(B, -1, P + 1)[..., :P]


def state(tasks: Tasks, A: torch.Tensor) -> State:
    """Hulls, lengths, loads, and forward and backward bytes of assignments A [B, T+1] (column T a dummy)."""
    G, P, U, T = tasks.G, tasks.P, tasks.U, tasks.T
    rank = A[:, :T]
    B = rank.shape[0]
    q_lo, q_hi = _scatter_hull(tasks, rank, tasks.qlo, tasks.qhi, tasks.qo_unit)
    k_lo, k_hi = _scatter_hull(tasks, rank, tasks.klo, tasks.khi, tasks.kv_unit)
    ranks = torch.arange(P, device=A.device)
    at_host = tasks.unit_host[:, None] == ranks
    qlen = torch.where(at_host, 0, (q_hi - q_lo).clamp(min=0))
    klen = torch.where(at_host, 0, (k_hi - k_lo).clamp(min=0))
    n = tasks.tiles

    def host_dest_sums(qlen, klen):  # per rank: QO and KV tokens out (as host) and in (as destination)
        q4, k4 = qlen.view(B, G, P, n, P), klen.view(B, G, P, n, P)  # [B, G, host, tile, dest]
        return q4.sum(dim=(1, 3, 4)), q4.sum(dim=(1, 2, 3)), k4.sum(dim=(1, 3, 4)), k4.sum(dim=(1, 2, 3))

    q_out, q_in, k_out, k_in = host_dest_sums(qlen, klen)  # rows, for the buffers
    # bytes: with a topology each token priced by its link (``Tasks.links``), by the relay
    # transport's hops with ``Tasks.relays`` (``state.relay``), else plain
    nodes = None
    if tasks.relays:
        qo, qi, q_nodes = relay_weighted(tasks, qlen, q_lo, q_hi)
        ko, ki, k_nodes = relay_weighted(tasks, klen, k_lo, k_hi)
        nodes = torch.stack(q_nodes[:2] + k_nodes[:2] + (q_nodes[2], k_nodes[2]))
    else:
        qo, qi, ko, ki = (q_out, q_in, k_out, k_in) if tasks.links is None else \
            host_dest_sums(qlen * tasks.unit_dest_weight, klen * tasks.unit_dest_weight)
    send = qo * tasks.q + qi * tasks.o + ko * tasks.kv
    recv = qi * tasks.q + qo * tasks.o + ki * tasks.kv
    vol = torch.maximum(send, recv)
    # backward: dO out and dQ back per QO token, K/V out again (kv_bwd) and dK/dV back per KV token
    bsend = qo * tasks.qb + qi * tasks.dqb + ko * tasks.kvb + ki * tasks.dkv
    brecv = qi * tasks.qb + qo * tasks.dqb + ki * tasks.kvb + ko * tasks.dkv
    bvol = torch.maximum(bsend, brecv)
    load = torch.zeros((B, P + 1), dtype=torch.int64, device=A.device)
    load = load.scatter_add(1, rank, tasks.area.expand(B, -1))[:, :P]
    kcount = torch.zeros((B, G * U * (P + 1)), dtype=torch.int64, device=A.device)
    kcount = kcount.scatter_add(1, tasks.kv_unit * (P + 1) + rank, tasks.valid.long().expand(B, -1))
    kcount = kcount.view(B, G * U, P + 1)[..., :P]
    return State(rank, q_lo, q_hi, k_lo, k_hi, qlen, klen, kcount, send, recv, vol, vol.amax(1), load,
                 bsend, brecv, bvol, bvol.amax(1), q_out, q_in, k_out, k_in, nodes)

