"""Torch twin of the relay transport's tokens per rank and link class (``Tasks.relays``).

Under relay transport a unit ``u`` hosted on rank ``h`` reaches the consumers of its own node
directly over NVLink, and each remote node B with consumers once over InfiniBand: ``h`` sends
the hull of what B's consumers need to ``Topology.relay_rank(h, B)`` (the rank of B at ``h``'s
local index), which keeps its own rows and forwards each other consumer's over NVLink. As the
transport does (``plan.relay``), a (unit, node) is relayed only when that hull is no longer than
its consumers' rows together; otherwise each consumer's rows cross directly. (The transport
also sends a relay's candidates past its relay buffers directly; the solve assumes they fit.) Partial
results come back the same two hops, merged on the relay, so each direction of a unit's
traffic has the same tokens per link: "out" counts the tokens a rank sends towards the
consumers, "in" those it receives from the host's side, and the bytes of every phase follow
from them as for direct transport (``state.ref``).

``relay_tokens`` is the reference the Triton state kernel (kernel.py, ``RELAY``) equals.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import _BIG, Tasks


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


def _routes(tasks: Tasks, length, lo, hi):
    """What the relay rule decides for each (unit, node) and (unit, rank): (n_lo, n_hi, count,
    ib_hull [B, G*U, N] InfiniBand tokens of each relayed (unit, remote node), relayed [B, G*U, P]
    each cell's (unit, node) is relayed, direct [B, G*U, P] the cell crosses nodes directly, same,
    is_relay [G*U, P], relay [G*U, N]). A (unit, remote node) is relayed when its hull is no longer
    than its consumers' rows together (``plan.relay``); the others' rows cross one by one."""
    B, GU, P = length.shape
    R = tasks.links[0]
    N = P // R
    dev = length.device
    ranks, nodes = torch.arange(P, device=dev), torch.arange(N, device=dev)
    host = tasks.unit_host  # [G*U]
    n_lo, n_hi, count = node_hulls(tasks, length, lo, hi)
    remote = (host // R)[:, None] != nodes  # [G*U, N] the node is not the host's
    hull = (n_hi - n_lo).clamp(min=0)
    total = length.view(B, GU, N, R).sum(3)
    relayed_n = remote & (total > 0) & (hull <= total)  # [B, G*U, N]
    ib_hull = torch.where(relayed_n, hull, 0)
    relay = nodes * R + (host % R)[:, None]  # [G*U, N] Topology.relay_rank(host, node)
    same = (host // R)[:, None] == ranks // R  # [G*U, P] the rank is on the host's node
    is_relay = ~same & (ranks % R == (host % R)[:, None])  # [G*U, P] the rank relays the unit to its node
    relayed = relayed_n.repeat_interleave(R, dim=2)
    direct = ~same & ~relayed & (length > 0)
    return (n_lo, n_hi, count), ib_hull, relayed, direct, same, is_relay, relay


def relay_tokens(tasks: Tasks, length, lo, hi):
    """Tokens of one unit kind per rank and link class under relay transport.

    length, lo, hi: [B, G*U, P] (``node_hulls``). Returns ((nv_out, nv_in, ib_out, ib_in)
    [B, P] int64 each, node tables (lo, hi, count) [B, G*U, N]): NVLink carries the host's rows
    to its own node's consumers and a relay's to the other consumers of its node; InfiniBand
    the node hull of each relayed (unit, remote node), host to relay, and every other crossing
    row directly, host to consumer."""
    B, GU, P = length.shape
    R = tasks.links[0]
    dev = length.device
    host = tasks.unit_host
    tables, ib_hull, relayed, direct, same, is_relay, relay = _routes(tasks, length, lo, hi)
    by_host = lambda x: torch.zeros((B, P), dtype=torch.int64, device=dev).scatter_add(  # noqa: E731
        1, host.expand(B, -1), x)
    by_relay = lambda x: torch.zeros((B, P), dtype=torch.int64, device=dev).scatter_add(  # noqa: E731
        1, relay.view(1, -1).expand(B, -1), x.reshape(B, -1))
    fanned = relayed & ~is_relay  # [B, G*U, P] cells the relay forwards
    fan = torch.where(fanned, length, 0).view(B, GU, P // R, R).sum(3)  # [B, G*U, N]
    crossing = torch.where(direct, length, 0)
    nv_out = by_host(torch.where(same, length, 0).sum(2)) + by_relay(fan)
    nv_in = torch.where(same | fanned, length, 0).sum(1)
    ib_out = by_host(ib_hull.sum(2) + crossing.sum(2))
    ib_in = by_relay(ib_hull) + crossing.sum(1)
    return (nv_out, nv_in, ib_out, ib_in), tables


def relay_weighted(tasks: Tasks, length, lo, hi):
    """(out, in) [B, P] link-weighted tokens of one kind under relay transport, and its node
    tables (``relay_tokens``)."""
    _, w_nv, w_ib = tasks.links
    (nv_out, nv_in, ib_out, ib_in), tables = relay_tokens(tasks, length, lo, hi)
    return nv_out * w_nv + ib_out * w_ib, nv_in * w_nv + ib_in * w_ib, tables


def relay_hops(tasks: Tasks, length, lo, hi, rails=None):
    """[2(NVLink, InfiniBand), B, P(src), P(dst)] int64 tokens of one kind each hop of the relay
    transport moves towards the consumers (results travel the same hops back): the host to
    its own node's consumers, to each relayed remote node's relay (the node hull) and to every
    other crossing consumer, the relay to that node's other consumers. Row and column sums are
    ``relay_tokens``' out and in.

    rails: a plan's ``RelayMeta.rails`` ([G, U, N], the local index of the egress and relay
    of each unit's crossing to each node): then the hops that plan moves, the node hull
    leaving from the egress on that rail, and the host's pre-hop to each egress other than
    itself (one slot per (unit, egress): the hull of the node hulls it carries)."""
    B, GU, P = length.shape
    R = tasks.links[0]
    N = P // R
    dev = length.device
    ranks = torch.arange(P, device=dev)
    host = tasks.unit_host
    (n_lo, n_hi, _), ib_hull, relayed, direct, same, is_relay, relay = _routes(tasks, length, lo, hi)
    egress = host[:, None].expand(GU, N)
    if rails is not None:
        spread = rails.to(dev).reshape(GU, N)  # [G*U, N] (g-major, as tasks.unit_host)
        remote = (host // R)[:, None] != torch.arange(N, device=dev)
        relay = torch.where(remote, torch.arange(N, device=dev) * R + spread, relay)
        egress = torch.where(remote, (host // R * R)[:, None] + spread, egress)
        is_relay = ~same & (ranks % R == spread.index_select(1, ranks // R))
    pairs = lambda idx, x: torch.zeros((B, P * P), dtype=torch.int64, device=dev).scatter_add(  # noqa: E731
        1, idx.reshape(1, -1).expand(B, -1), x.reshape(B, -1)).view(B, P, P)
    sender = torch.where(same, host[:, None], relay.repeat_interleave(R, dim=1))  # [G*U, P] NVLink sender
    nv = pairs(sender * P + ranks, torch.where(same | (relayed & ~is_relay), length, 0))
    ib = pairs(egress * P + relay, ib_hull) + pairs(host[:, None] * P + ranks, torch.where(direct, length, 0))
    if rails is not None:  # the pre-hop: one slot per (unit, egress), the hull of its node hulls
        moved = (ib_hull > 0) & (egress != host[:, None])
        at = egress.expand(B, GU, N)
        s_lo = torch.full((B, GU, P), _BIG, dtype=torch.int64, device=dev).scatter_reduce(
            2, at, torch.where(moved, n_lo, _BIG), "amin")
        s_hi = torch.zeros((B, GU, P), dtype=torch.int64, device=dev).scatter_reduce(
            2, at, torch.where(moved, n_hi, 0), "amax")
        nv = nv + pairs(host[:, None] * P + ranks, (s_hi - s_lo).clamp(min=0))
    return torch.stack((nv, ib))
