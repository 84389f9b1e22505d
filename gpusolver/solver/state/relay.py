"""Torch twin of the relay transport's tokens per rank and link class (``Tasks.relays``).

Under relay transport a unit ``u`` hosted on rank ``h`` reaches the consumers of its own node
directly over NVLink, and each remote node B with consumers once over InfiniBand: the hull of
what B's consumers need leaves through ``Topology.egress_rank(h, B, N)`` (``h`` moves it there
over NVLink first when that is another rank of its node) to ``Topology.relay_rank(h, B, N)``
(rail-aligned with the egress), which keeps its own rows and forwards each other consumer's
over NVLink. Partial
results come back the same two hops, merged on the relay, so each direction of a unit's
traffic has the same tokens per link: "out" counts the tokens a rank sends towards the
consumers, "in" those it receives from the host's side, and the bytes of every phase follow
from them as for direct transport (``state.ref``).

``relay_tokens`` is the reference the Triton state kernel (kernel.py, ``RELAY``) equals.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import _BIG, Tasks
from gpusolver.topology import egress_local


def node_hulls(tasks: Tasks, length, lo, hi):
    """Each unit's hull and consumer count at each node: (lo, hi, count) [B, G*U, N] int64.

    length, lo, hi: [B, G*U, P] of one kind (travelling tokens, 0 at the host; hull bounds).
    The host's own cell is left out (it needs nothing sent), so an empty hull is (_BIG, 0)."""
    B, GU, P = length.shape
    R = tasks.links[0]
    at_host = tasks.unit_host[:, None] == torch.arange(P, device=length.device)
    n_lo = torch.where(at_host, _BIG, lo).view(B, GU, P // R, R).amin(3)
    n_hi = torch.where(at_host, 0, hi).view(B, GU, P // R, R).amax(3)
    count = (length > 0).view(B, GU, P // R, R).sum(3)
    return n_lo, n_hi, count


def relay_ranks(tasks: Tasks, dev):
    """(egress, relay) [G*U, N] int64 of each unit and node (``Topology.egress_rank`` /
    ``relay_rank``: the host itself on its own node), and ``spread`` [G*U, N] their local index."""
    R, P = tasks.links[0], tasks.P
    N = P // R
    host = tasks.unit_host
    nodes = torch.arange(N, device=dev)
    spread = egress_local(host[:, None] % R, host[:, None] // R, nodes, N, R)
    remote = (host // R)[:, None] != nodes
    egress = torch.where(remote, (host // R * R)[:, None] + spread, host[:, None])
    relay = torch.where(remote, nodes * R + spread, host[:, None])
    return egress, relay, spread


def relay_tokens(tasks: Tasks, length, lo, hi):
    """Tokens of one unit kind per rank and link class under relay transport.

    length, lo, hi: [B, G*U, P] (``node_hulls``). Returns ((nv_out, nv_in, ib_out, ib_in)
    [B, P] int64 each, node tables (lo, hi, count) [B, G*U, N]): NVLink out is the host's rows
    to its own node's consumers, its node hulls to egresses other than itself (the pre-hop),
    plus a relay's to the other consumers of its node; NVLink in every consumer's rows but a
    relay's own, plus an egress's pre-hop hulls; InfiniBand out the egresses' node hulls, in
    the relays'."""
    B, GU, P = length.shape
    R = tasks.links[0]
    N = P // R
    dev = length.device
    ranks, nodes = torch.arange(P, device=dev), torch.arange(N, device=dev)
    host = tasks.unit_host  # [G*U]
    n_lo, n_hi, count = node_hulls(tasks, length, lo, hi)
    remote = (host // R)[:, None] != nodes  # [G*U, N] the node is not the host's
    n_len = torch.where(remote, (n_hi - n_lo).clamp(min=0), 0)  # [B, G*U, N] InfiniBand tokens
    egress, relay, spread = relay_ranks(tasks, dev)
    pre = torch.where(egress != host[:, None], n_len, 0)  # [B, G*U, N] the host's NVLink pre-hop
    same = (host // R)[:, None] == ranks // R  # [G*U, P] the rank is on the host's node
    is_relay = ~same & (ranks % R == spread.index_select(1, ranks // R))  # [G*U, P] the rank relays the unit
    by_host = lambda x: torch.zeros((B, P), dtype=torch.int64, device=dev).scatter_add(  # noqa: E731
        1, host.expand(B, -1), x)
    by = lambda at, x: torch.zeros((B, P), dtype=torch.int64, device=dev).scatter_add(  # noqa: E731
        1, at.reshape(1, -1).expand(B, -1), x.reshape(B, -1))
    fan = torch.where(same | is_relay, 0, length).view(B, GU, N, R).sum(3)  # [B, G*U, N] relay to consumers
    nv_out = by_host(torch.where(same, length, 0).sum(2) + pre.sum(2)) + by(relay, fan)
    nv_in = torch.where(is_relay, 0, length).sum(1) + by(egress, pre)
    ib_out, ib_in = by(egress, n_len), by(relay, n_len)
    return (nv_out, nv_in, ib_out, ib_in), (n_lo, n_hi, count)


def relay_weighted(tasks: Tasks, length, lo, hi):
    """(out, in) [B, P] link-weighted tokens of one kind under relay transport, and its node
    tables (``relay_tokens``)."""
    _, w_nv, w_ib = tasks.links
    (nv_out, nv_in, ib_out, ib_in), tables = relay_tokens(tasks, length, lo, hi)
    return nv_out * w_nv + ib_out * w_ib, nv_in * w_nv + ib_in * w_ib, tables


def relay_hops(tasks: Tasks, length, lo, hi):
    """[2(NVLink, InfiniBand), B, P(src), P(dst)] int64 tokens of one kind each hop of the relay
    transport moves towards the consumers (results travel the same hops back): the host to
    its own node's consumers and each remote node's hull to that node's egress (when not the
    host), the egress to the relay (the node hull), the relay to that node's other consumers.
    Row and column sums are ``relay_tokens``' out and in."""
    B, GU, P = length.shape
    R = tasks.links[0]
    N = P // R
    dev = length.device
    ranks, nodes = torch.arange(P, device=dev), torch.arange(N, device=dev)
    host = tasks.unit_host
    n_lo, n_hi, _ = node_hulls(tasks, length, lo, hi)
    remote = (host // R)[:, None] != nodes
    n_len = torch.where(remote, (n_hi - n_lo).clamp(min=0), 0)  # [B, G*U, N]
    egress, relay, spread = relay_ranks(tasks, dev)
    same = (host // R)[:, None] == ranks // R
    is_relay = ~same & (ranks % R == spread.index_select(1, ranks // R))
    sender = torch.where(same, host[:, None], relay.repeat_interleave(R, dim=1))  # [G*U, P] who sends each cell

    def pairs(src, dst, x):
        return torch.zeros((B, P * P), dtype=torch.int64, device=dev).scatter_add(
            1, (src * P + dst).reshape(1, -1).expand(B, -1), x.reshape(B, -1))

    nv = pairs(sender, ranks, torch.where(is_relay, 0, length)) + pairs(
        host[:, None].expand(-1, N), egress, torch.where(egress != host[:, None], n_len, 0))
    ib = pairs(egress, relay, n_len)
    return torch.stack((nv.view(B, P, P), ib.view(B, P, P)))
