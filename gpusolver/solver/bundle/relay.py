"""Link-weighted prices of a bundle move's tokens under relay transport (torch twin's helpers).

A token a destination d gains of a unit hosted on i in another node costs the InfiniBand
weight for what it adds to the unit's hull at d's node (the relay's one crossing, priced at
the node's current hull, ``State.nodes``) plus the NVLink weight for the relay's hop to d
(none when d is the relay itself). A token the source s frees costs the NVLink weight unless
s is the relay, plus the InfiniBand weight when s is its node's only consumer of the unit (the
node's hull then shrinks with s's; with other consumers it is counted as not shrinking, a
lower bound, as the key columns freed are). Inside the host's node every token costs NVLink.

These prices are folded onto the move's touched ranks as direct transport's are (the relay's
own bytes are charged to the destination or the source), so a proposal is an approximation of
what the move changes; the state after the move (``state.ref``, exact) is what every round's
best-state tracking and the next round's prices read.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import State, Tasks


def _union_growth(cur_lo, cur_hi, lo, hi):
    """Tokens a hull [cur_lo, cur_hi) grows by when [lo, hi) joins it (lo < hi; an empty hull is
    (_BIG, 0)), int64."""
    return torch.maximum(cur_hi, hi) - torch.minimum(cur_lo, lo) - (cur_hi - cur_lo).clamp(min=0)


def _link_parts(tasks: Tasks, host, rank):
    """(cross, nv) for tokens of units hosted on ``host`` at ``rank`` (broadcast tensors): whether
    they cross nodes, and the NVLink weight of their last hop (0 when ``rank`` is the relay)."""
    R, w_nv, _ = tasks.links
    cross = host // R != rank // R
    return cross, torch.where(cross & (host % R == rank % R), 0, w_nv)


def _node_cell(tasks: Tasks, unit, rank):
    """Index of (unit, node of ``rank``) in a [G*U, N] node table."""
    R = tasks.links[0]
    return unit * (tasks.P // R) + rank // R


def relay_row_prices(tasks: Tasks, st: State, unit, i_of, s_of, d_of, b_lo, b_hi, q_grow, q_free, area,
                     gather_at):
    """(bq_grow, bq_free) [B, P, K, D1, 2] int64: the priced query rows the destination gains and
    the source frees (``bundle_proposals``' names). ``unit`` [B, P, K]; ``b_lo``/``b_hi`` the
    bundle's row hull, ``q_grow``/``q_free`` its plain tokens."""
    w_ib = tasks.links[2]
    q_n_lo, q_n_hi, q_count = st.nodes[0], st.nodes[1], st.nodes[4]
    shape = area.shape
    cross_d, nv_d = _link_parts(tasks, i_of, d_of)
    at_d = _node_cell(tasks, unit[..., None, None], d_of).expand(shape)
    n_grow = _union_growth(gather_at(q_n_lo, at_d), gather_at(q_n_hi, at_d), b_lo, b_hi)
    n_grow = torch.where((area > 0) & cross_d, n_grow, 0)
    cross_s, nv_s = _link_parts(tasks, i_of, s_of)
    sole = gather_at(q_count, _node_cell(tasks, unit[..., None, None], s_of).expand(shape)) == 1
    return n_grow * w_ib + q_grow * nv_d, q_free * (nv_s + torch.where(cross_s & sole, w_ib, 0))


def relay_key_prices(tasks: Tasks, st: State, kv_u, j_t, mine, d_of, s4, klo_t, khi_t, kg_t, kf_t, gather_at):
    """(bkg_t, bkf_t): each task's priced key columns gained at each destination [B, P, K, D1, U]
    and freed at the source [B, P, K, U] (``bundle_proposals``' names; ``kg_t``/``kf_t`` plain)."""
    R, _, w_ib = tasks.links
    N = tasks.P // R
    B, P, K, U = kv_u.shape
    k_n_lo, k_n_hi, k_count = st.nodes[2], st.nodes[3], st.nodes[5]
    # the node hull's growth per (task, node), then read at each destination's node: the D1
    # destinations share N nodes
    nodes = torch.arange(N, device=kv_u.device)
    at_n = kv_u[..., None] * N + nodes  # [B, P, K, U, N]
    n_grow = _union_growth(gather_at(k_n_lo, at_n), gather_at(k_n_hi, at_n), klo_t[..., None], khi_t[..., None])
    n_grow = torch.where(mine[..., None] & (j_t[..., None] // R != nodes), n_grow * w_ib, 0)
    D1 = d_of.shape[3]
    ib = n_grow.transpose(3, 4).gather(3, (d_of // R).expand(B, P, K, D1, U))  # [B, P, K, D1, U]
    _, nv_d = _link_parts(tasks, j_t[:, :, :, None, :], d_of)
    cross_s, nv_s = _link_parts(tasks, j_t, s4)
    sole = gather_at(k_count, _node_cell(tasks, kv_u, s4)) == 1
    return ib + kg_t.long() * nv_d, kf_t * (nv_s + torch.where(cross_s & sole, w_ib, 0))
