"""Relay transport: each (unit, remote node) crosses InfiniBand once and fans out over NVLink.

Shape legend: G head groups, P ranks, L ranks per node, N = P / L nodes, n tiles
per chunk, U = n * P units (unit u on host u // n), c tokens per chunk.

``CommMeta`` says which rows of each unit every consumer ends up holding, and
where in its receive buffer (the layout CalcMeta and the kernels read). A
``RelayMeta`` says how those rows get there, per kind (QO, KV):

- hop 0 (direct): the host sends the consumer its rows itself, as without
  relay. Every intra-node transfer goes this way, and so does every
  inter-node transfer whose (unit, node) is not relayed.
- rails (``matched_rails``; ``build_relay_meta(egress=False)`` turns them off): each (unit, remote node
  B) crossing uses one rail l, leaving from the egress ``e = A * L + l`` of its
  host's node A and landing on the relay ``r = B * L + l``. By default l is the
  host's own local index (``Topology.relay_rank``, what the solver prices); with
  an egress the plan matches crossings to rails per node pair, by
  their forward bytes, to spread a node's InfiniBand bytes over its NICs on
  both sides, and keeps the matching only when it lowers the busiest NIC.
- hop 3 (NVLink pre-hop): host h moves each unit's rows bound for remote node B
  to its egress e when e != h, one slot per (unit, e) (the hull of the hulls of
  the nodes it serves), into e's egress buffer (hosts ascending, g, tile).
- hop 1 (InfiniBand): for each unit u and each other node B with consumers of
  u, the egress sends the **hull** of the rows B's consumers need, once, to
  the relay r (rail-aligned with the egress), into r's
  relay buffer (senders ascending, then host, g, tile), read from its local rows
  (its own units) or its egress buffer (its node's other hosts').
- hop 2 (NVLink): r sends each other consumer c in B its own rows, read from
  the relay buffer, into c's fan-out buffer (relays ascending, then host, g,
  tile); r itself, if a consumer, copies them from its relay buffer.

Each consumer then assembles its receive buffer (today's layout) from its
direct buffer, its fan-out buffer and its relay buffer: one gather. Way back,
the reverse: partials go consumer -> relay (hop 2) and are merged there
(log-sum-exp or sum, the relay's own partial first, then sources ascending),
then relay -> egress (hop 1, once per (unit, node)), where the egress merges
what its slot's nodes send back (the way back of a slot serving several nodes)
before hop 3 takes it to the host; the host merges direct results first, then
those of its own NIC, then those of its egresses.

Why hulls and not unions: each consumer's rows are already one interval per
(unit, destination) (``transfer_ranges``), so a hull keeps one interval per
(unit, node) in the relay buffer, static offsets by prefix sums, and every
hop-2 transfer a contiguous slice of it. A (unit, node) is relayed only when
its hull is no longer than its consumers' rows together, so a relay never
moves more InfiniBand bytes than direct transport would.

Capacities (``capacity.relay_rows``): a relay's buffer (hop-1 rows received),
its fan-out send list (hop-2 rows sent) and an egress buffer (hop-3 rows
received) per kind. Candidates are taken in relay-buffer order (sender by the
rule, host, g, tile) and relayed while both prefix sums fit; every later
candidate of that relay goes direct (never dropped, no host read). Egress slots
are taken in egress-buffer order while the prefix fits; a (unit, node) whose
slot does not fit leaves from its host's own NIC (to the same relay). A host's
direct and hop-3 sends never exceed the plan's send rows; a hop-1 send list
holds its own hulls (within the send rows) and its slots' (at most
ceil((N - 1) / L) times the egress buffer); direct and fan-out receives never
exceed the receive rows, so the other capacities hold as they did.

Sub-stages (``CommMeta.num_stages`` S > 1, ``stage_relay_routes``): the casts are the one-stage
route of all transfers, each consumer's rows moving in its own cast and each (unit, node)'s hull
crossing once, in the first cast its node needs it (``staged_casts``); each hop's receiving buffer
is shared by the S casts at per-cast rows. Reduce s is ``relay_route`` of the transfers returning
in s. See docs/design/layers.md, "Relay transport with sub-stages".

Sync-free: static shapes, no host reads; the same tensors on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gpusolver.plan.gather import send_index

NOTHING, DIRECT, FAN_OUT, SELF = 0, 1, 2, 3  # RelayRoute.via: how a transfer reaches its consumer
HOPS = (0, 1, 2, 3)


@dataclass(frozen=True)
class RelayRoute:
    """One kind's routing under relay transport (all ranks at once).

    via:           [G, U, P(dest)] int64 — NOTHING, DIRECT (hop 0), FAN_OUT (hop 1 then hop 2)
                   or SELF (hop 1 to dest, which is the relay).
    direct_range:  [G, U, P, 2] int64 chunk-local rows sent by hop 0 ([0, 0) elsewhere).
    direct_offset: [G, U, P] int64 start in dest's direct buffer ((host, g, tile) order).
    direct_split:  [P(src), P(dst)] int64 hop-0 rows.
    hull_range:    [G, U, P(relay), 2] int64 rows host -> relay by hop 1 ([0, 0) elsewhere).
    relay_offset:  [G, U, P(relay)] int64 start in the relay's buffer.
    hop1_split:    [P, P] int64 hop-1 rows (host -> relay).
    relay_rows:    [P] int64 relay-buffer fill of each rank.
    fan_offset:    [G, U, P(dest)] int64 start in dest's fan-out buffer (FAN_OUT only).
    fan_start:     [G, U, P(dest)] int64 row of the relay's buffer where dest's rows start
                   (FAN_OUT and SELF).
    relay_of:      [G, U, P(dest)] int64 — the relay of unit (g, u) for dest's node.
    hop2_split:    [P, P] int64 hop-2 rows (relay -> consumer).
    relay_capacity, fan_capacity: rows of a relay's buffer and of its fan-out send list (host ints).
    hop1_sender:   [G, U, P(relay)] int64 the rank that sends hop 1 (the egress, or the host).
    hop1_src:      [G, U, P(relay)] int64 its first row in concat(local rows, egress buffer).
    egress_range:  [G, U, P(egress), 2] int64 rows host -> egress by hop 3 ([0, 0) elsewhere).
    egress_split:  [P, P] int64 hop-3 rows (host -> egress).
    egress_capacity, hop1_capacity: rows of an egress buffer and of a hop-1 send list (host ints).
    """

    via: torch.Tensor
    direct_range: torch.Tensor
    direct_offset: torch.Tensor
    direct_split: torch.Tensor
    hull_range: torch.Tensor
    relay_offset: torch.Tensor
    hop1_split: torch.Tensor
    relay_rows: torch.Tensor
    fan_offset: torch.Tensor
    fan_start: torch.Tensor
    relay_of: torch.Tensor
    hop2_split: torch.Tensor
    relay_capacity: int
    fan_capacity: int
    hop1_sender: torch.Tensor
    hop1_src: torch.Tensor
    egress_range: torch.Tensor
    egress_split: torch.Tensor
    egress_capacity: int
    hop1_capacity: int

    def split(self, hop: int) -> torch.Tensor:
        """[P, P] int64 rows of hop 0, 1, 2 or 3 (host -> consumer direction)."""
        return (self.direct_split, self.hop1_split, self.hop2_split, self.egress_split)[_hop(hop)]


@dataclass(frozen=True)
class RelayMeta:
    """Both kinds' relay routing and the node size they were built for.

    With one remote stage ``qo`` / ``kv`` route every cast and, reversed, every reduce. With
    ``num_stages`` S > 1 (``stage_relay_routes``) they hold the S casts' routes stacked (every
    tensor with a leading ``[S]``) and ``qo_back`` / ``kv_back`` the S reduces' routes; ``stage``
    gives one of them as a plain ``RelayRoute``.
    """

    qo: RelayRoute
    kv: RelayRoute
    ranks_per_node: int
    egress: bool = False  # hop 3 (the NVLink pre-hop to the egress) runs: every relay plan by default
    rails: torch.Tensor | None = None  # [G, U, N] int64 the rail of each (unit, node) crossing
    num_stages: int = 1
    qo_back: RelayRoute | None = None
    kv_back: RelayRoute | None = None

    def route(self, kind: str) -> RelayRoute:
        if kind not in ("qo", "kv"):
            raise ValueError(f"kind must be 'qo' or 'kv', got {kind!r}")
        return self.qo if kind == "qo" else self.kv

    def stage(self, kind: str, stage: int = 1, which: str = "cast") -> RelayRoute:
        """The route of sub-stage ``stage``'s cast (``which="cast"``) or reduce (``"return"``)."""
        route = self.route(kind)
        if which not in ("cast", "return"):
            raise ValueError(f"which must be 'cast' or 'return', got {which!r}")
        if isinstance(stage, bool) or not isinstance(stage, int) or not 1 <= stage <= self.num_stages:
            raise ValueError(f"stage must be an int in [1, {self.num_stages}], got {stage!r}")
        if self.num_stages == 1:
            return route
        if which == "return":
            route = self.qo_back if kind == "qo" else self.kv_back
        return route_at(route, stage - 1)


def stack_routes(routes: list[RelayRoute]) -> RelayRoute:
    """One ``RelayRoute`` whose tensors stack ``routes``' (a leading ``[S]``); host ints are shared."""
    out = {}
    for name in RelayRoute.__dataclass_fields__:
        vals = [getattr(r, name) for r in routes]
        out[name] = torch.stack(vals) if isinstance(vals[0], torch.Tensor) else vals[0]
    return RelayRoute(**out)


def route_at(stacked: RelayRoute, i: int) -> RelayRoute:
    """Entry ``i`` of a ``stack_routes`` route (views)."""
    return RelayRoute(**{name: (v[i] if isinstance(v, torch.Tensor) else v)
                         for name, v in ((n, getattr(stacked, n)) for n in RelayRoute.__dataclass_fields__)})


def _hop(hop) -> int:
    if hop not in HOPS or isinstance(hop, bool):
        raise ValueError(f"hop must be 0 (direct), 1 (InfiniBand), 2 (NVLink fan-out) or 3 (NVLink "
                         f"pre-hop to the egress), got {hop!r}")
    return hop


def _offsets(length: torch.Tensor, tiles: int) -> torch.Tensor:
    """[G, U, P] exclusive prefix sums of ``length`` over (host, g, tile) per destination: the
    receive-buffer order of every collective (``comm_meta``'s, which imports ``plan.meta``)."""
    G, U, P = length.shape
    by_dest = length.view(G, P, tiles, P).permute(3, 1, 0, 2).reshape(P, U * G)    # [dest, (host, g, tile)]
    excl = by_dest.cumsum(-1) - by_dest
    return excl.view(P, P, G, tiles).permute(2, 1, 3, 0).reshape(G, U, P)


def _offsets_by(length: torch.Tensor, key: torch.Tensor, tiles: int) -> torch.Tensor:
    """[G, U, P] exclusive prefix sums of ``length`` per destination over (key, host, g, tile):
    the receive order of a collective whose source of (g, u, dest) is rank ``key`` (``[U, P]`` or
    ``[G, U, P]`` int64; sources ascending, each sending in (host, g, tile) order)."""
    G, U, P = length.shape
    u = torch.arange(U, device=length.device)
    base = (u // tiles * G + torch.arange(G, device=length.device)[:, None]) * tiles + u % tiles  # [G, U]
    k = (key.expand(G, U, P) * (G * U) + base[..., None]).permute(2, 0, 1).reshape(P, G * U)
    order = k.argsort(dim=1)
    sorted_len = length.permute(2, 0, 1).reshape(P, G * U).gather(1, order)
    excl = torch.empty_like(sorted_len).scatter_(1, order, sorted_len.cumsum(1) - sorted_len)
    return excl.view(P, G, U).permute(1, 2, 0)


def _by_source(length: torch.Tensor, tiles: int) -> torch.Tensor:
    G, U, P = length.shape
    return length.sum(0).view(P, tiles, P).sum(1)


def _pair_sum(src: torch.Tensor, dst: torch.Tensor, length: torch.Tensor, P: int) -> torch.Tensor:
    """[P, P] int64: ``length`` summed per (``src``, ``dst``) pair (broadcast [G, U, P] tensors)."""
    src, dst, length = torch.broadcast_tensors(src, dst, length)
    out = torch.zeros(P * P, dtype=torch.int64, device=length.device)
    return out.scatter_add_(0, (src * P + dst).reshape(-1), length.reshape(-1)).view(P, P)


def relay_route(rng: torch.Tensor, tiles: int, ranks_per_node: int, relay_capacity: int,
                fan_capacity: int, egress_capacity: int = 0, chunk: int = 0, send_capacity: int = 0,
                rails: torch.Tensor | None = None, base: dict | None = None) -> RelayRoute:
    """The relay routing of one kind's transfers ``rng [G, U, P, 2]`` (``CommMeta.qo_range`` / ``kv_range``).

    chunk / send_capacity: rows per head group of a rank's local rows / the plan's send rows of
    this kind (where hop-1 sources and the egress send list's size start).
    base: one sub-stage's cast among several sharing each receiving buffer (``stage_relay_routes``):
    ``{"direct", "fan", "relay", "egress"}`` -> ``[P]`` int64, the rows of each rank's direct,
    fan-out, relay and egress buffer that earlier sub-stages fill; this route's rows start after
    them and must fit in what is left (the relay and egress buffers' prefixes). None: all zero."""
    G, U, P, _ = rng.shape
    L, n = ranks_per_node, tiles
    N = P // L
    dev = rng.device
    zero = torch.zeros(P, dtype=torch.int64, device=dev)
    first = {k: zero for k in ("direct", "fan", "relay", "egress")} if base is None else base
    host = torch.arange(U, device=dev) // n                                   # [U]
    node_h = host // L
    node_d = torch.arange(P, device=dev) // L                                 # [P]
    nodes = torch.arange(N, device=dev)
    length = rng[..., 1] - rng[..., 0]                                        # [G, U, P]
    used = length > 0
    big = torch.iinfo(torch.int64).max
    lo = torch.where(used, rng[..., 0], big).view(G, U, N, L).amin(-1)        # [G, U, N]
    hi = torch.where(used, rng[..., 1], 0).view(G, U, N, L).amax(-1)
    total = length.view(G, U, N, L).sum(-1)
    hull = (hi - lo).clamp(min=0)
    other = node_h[:, None] != nodes[None, :]                                 # [U, N]
    cand = (total > 0) & other & (hull <= total)
    # the rail of each (g, unit, node): the host's own local index, or the plan's (``matched_rails``)
    spread = (host % L)[None, :, None].expand(G, U, N) if rails is None else rails
    egress_n = torch.where(other, node_h[:, None] * L + spread, host[:, None])  # [G, U, N] egress
    relay_n = torch.where(other, nodes[None, :] * L + spread, host[:, None])  # [G, U, N] relay
    own = length.gather(2, relay_n)                                           # the relay's own rows
    ranks = torch.arange(P, device=dev)
    at_relay = relay_n[..., None] == ranks                                    # [G, U, N, P]

    def place(x: torch.Tensor) -> torch.Tensor:  # [G, U, N] -> [G, U, P(relay)]
        return torch.where(at_relay, x[..., None], 0).sum(2)

    want = place(torch.where(cand, hull, 0))
    fan = place(torch.where(cand, total - own, 0))
    # a prefix in relay-buffer order (senders as by the rule) is relayed: both prefix sums within the
    # relay's capacities; the sum of what is taken fits whatever order the buffer ends up in
    sender_key = egress_n.index_select(2, node_d)                             # [G, U, P(relay)]
    fits = ((_offsets_by(want, sender_key, n) + want <= relay_capacity - first["relay"])
            & (_offsets_by(fan, sender_key, n) + fan <= fan_capacity))
    ok = cand & torch.where(at_relay, fits[:, :, None, :], False).any(-1)     # [G, U, N]

    # egress slots: one per (g, u, egress rank other than the host), the hull of its nodes' hulls
    forward = ok & (egress_n != host[:, None])
    e_idx = egress_n
    e_lo = torch.full((G, U, P), big, dtype=torch.int64, device=dev).scatter_reduce(
        2, e_idx, torch.where(forward, lo, big), "amin")
    e_hi = torch.zeros((G, U, P), dtype=torch.int64, device=dev).scatter_reduce(
        2, e_idx, torch.where(forward, hi, 0), "amax")
    e_len = (e_hi - e_lo).clamp(min=0)
    slot_ok = (e_len > 0) & (_offsets(e_len, n) + e_len <= egress_capacity - first["egress"])  # a prefix
    pre_len = torch.where(slot_ok, e_len, 0)
    pre_lo = torch.where(slot_ok, e_lo, 0)
    pre_offset = _offsets(pre_len, n) + first["egress"]
    via_egress = forward & slot_ok.gather(2, e_idx)                           # [G, U, N]
    sender_n = torch.where(via_egress, egress_n, host[:, None])               # who sends hop 1

    hull_len = place(torch.where(ok, hull, 0))
    hull_lo = place(torch.where(ok, lo, 0))
    hull_range = torch.stack((hull_lo, hull_lo + hull_len), -1)
    sender = place(torch.where(ok, sender_n, 0))                              # [G, U, P(relay)]
    relay_offset = _offsets_by(hull_len, sender, n) + first["relay"]
    # hop-1 source row in concat(sender's local rows [G * chunk], its egress buffer)
    g_idx = torch.arange(G, device=dev)[:, None, None]
    from_egress = pre_offset.gather(2, sender) + hull_lo - pre_lo.gather(2, sender) + G * chunk
    hop1_src = torch.where(sender == host[:, None], g_idx * chunk + hull_lo, from_egress)
    hop1_src = torch.where(hull_len > 0, hop1_src, 0)

    relay_of = relay_n.index_select(2, node_d)                                # [G, U, P(dest)]
    relayed = ok.index_select(2, node_d) & used                               # [G, U, P]
    is_self = relay_of == ranks                                               # [G, U, P]
    via = torch.where(~used, NOTHING, torch.where(relayed, torch.where(is_self, SELF, FAN_OUT), DIRECT))
    direct_len = torch.where(via == DIRECT, length, 0)
    fan_len = torch.where(via == FAN_OUT, length, 0)
    # where dest's rows start in its relay's buffer
    base = relay_offset.gather(2, relay_of)
    fan_start = torch.where(relayed, base + rng[..., 0] - lo.index_select(2, node_d), 0)
    # fan-out buffer order on dest: relays ascending, then host ascending, g, tile
    fan_offset = _offsets_by(fan_len, relay_of, n) + first["fan"]
    per_slot = -(-max(N - 1, 0) // L)  # nodes an egress slot serves at most
    return RelayRoute(
        via=via, direct_range=torch.where((via == DIRECT)[..., None], rng, 0),
        direct_offset=_offsets(direct_len, n) + first["direct"], direct_split=_by_source(direct_len, n),
        hull_range=hull_range, relay_offset=relay_offset, hop1_split=_pair_sum(sender, ranks, hull_len, P),
        relay_rows=hull_len.sum((0, 1)), fan_offset=torch.where(via == FAN_OUT, fan_offset, 0),
        fan_start=fan_start, relay_of=relay_of, hop2_split=_pair_sum(relay_of, ranks, fan_len, P),
        relay_capacity=int(relay_capacity), fan_capacity=int(fan_capacity),
        hop1_sender=sender, hop1_src=hop1_src, egress_range=torch.stack((pre_lo, pre_lo + pre_len), -1),
        egress_split=_by_source(pre_len, n), egress_capacity=int(egress_capacity),
        hop1_capacity=int(send_capacity) + per_slot * int(egress_capacity))


def _hull_rows(rng: torch.Tensor, tiles: int, L: int) -> torch.Tensor:
    """[G, U, N] int64 rows of each unit's node hull at each remote node where it is a relay
    candidate (no longer than its consumers' rows together), else 0."""
    G, U, P, _ = rng.shape
    N = P // L
    length = rng[..., 1] - rng[..., 0]
    used = length > 0
    big = torch.iinfo(torch.int64).max
    lo = torch.where(used, rng[..., 0], big).view(G, U, N, L).amin(-1)
    hi = torch.where(used, rng[..., 1], 0).view(G, U, N, L).amax(-1)
    total = length.view(G, U, N, L).sum(-1)
    hull = (hi - lo).clamp(min=0)
    host = torch.arange(U, device=rng.device) // tiles
    other = (host // L)[:, None] != torch.arange(N, device=rng.device)
    return torch.where((total > 0) & other & (hull <= total), hull, 0)


def matched_rails(comm, L: int, cost) -> torch.Tensor:
    """[G, U, N] int64 the rail (local index of egress and relay) of each unit's crossing to each
    node. Node offset by offset (d = 1..N-1: node A to A + d, a permutation of the nodes, so each
    NIC is one round's sender and receiver side once), each node's crossings largest first, L at
    a time, one per rail, the largest onto the rail least loaded so far on both nodes (forward
    bytes, the larger of sent and received). Each unit's own local index instead when that
    leaves the busiest NIC no busier (sync-free: the choice is a ``torch.where``)."""
    P, G, U, n = comm.cp_size, comm.qo_range.shape[0], comm.qo_range.shape[1], comm.tiles
    N, K = P // L, G * L * n  # nodes; crossings of one node towards one other node
    dev = comm.qo_range.device
    q, kv = _hull_rows(comm.qo_range, n, L), _hull_rows(comm.kv_range, n, L)
    down = q * int(cost.q_fwd) + kv * int(cost.kv_fwd)   # egress -> relay
    up = q * int(cost.o_fwd)                             # relay -> egress
    per_node = lambda x: x.view(G, N, L * n, N).permute(1, 0, 2, 3).reshape(N, K, N)  # noqa: E731
    d_items, u_items = per_node(down), per_node(up)
    rail_items = torch.zeros((N, K, N), dtype=torch.int64, device=dev)
    send = torch.zeros(N, L, dtype=torch.int64, device=dev)
    recv = torch.zeros(N, L, dtype=torch.int64, device=dev)
    A = torch.arange(N, device=dev)
    for d in range(1, N):
        B = (A + d) % N
        x_dn, x_up = d_items[A, :, B], u_items[A, :, B]  # [N(A), K]
        order = (x_dn + x_up).argsort(dim=1, descending=True, stable=True)
        for k in range(0, K, L):
            idx = order[:, k:k + L]                                                   # [N, L] crossings
            busy = torch.maximum(send, recv)
            rail = torch.maximum(busy, busy.index_select(0, B)).argsort(dim=1, stable=True)  # [N, L]
            c_dn, c_up = x_dn.gather(1, idx), x_up.gather(1, idx)
            s_add = torch.zeros_like(send).scatter_add_(1, rail, c_dn)
            r_add = torch.zeros_like(recv).scatter_add_(1, rail, c_up)
            send = send + s_add + torch.zeros_like(send).index_add_(0, B, r_add)
            recv = recv + r_add + torch.zeros_like(recv).index_add_(0, B, s_add)
            rail_items[A[:, None], idx, B[:, None]] = rail
    host = torch.arange(U, device=dev) // n
    own = (host % L)[None, :, None].expand(G, U, N)
    rails = rail_items.view(N, G, L * n, N).permute(1, 0, 2, 3).reshape(G, U, N)
    rails = torch.where((host // L)[None, :, None] == torch.arange(N, device=dev), own, rails)
    better = torch.maximum(send, recv).max() < _rail_peak(own, down, up, n, L).max()
    return torch.where(better, rails, own)


def _rail_peak(rails: torch.Tensor, down: torch.Tensor, up: torch.Tensor, tiles: int, L: int) -> torch.Tensor:
    """[P] int64 the larger of each NIC's forward send and receive bytes under ``rails`` [G, U, N]."""
    G, U, N = rails.shape
    dev = rails.device
    host = torch.arange(U, device=dev) // tiles
    src = (host // L * L)[None, :, None] + rails                      # egress
    dst = torch.arange(N, device=dev) * L + rails                      # relay
    P = N * L
    send = torch.zeros(P, dtype=torch.int64, device=dev).index_add_(0, src.reshape(-1), down.reshape(-1))
    send.index_add_(0, dst.reshape(-1), up.reshape(-1))
    recv = torch.zeros(P, dtype=torch.int64, device=dev).index_add_(0, src.reshape(-1), up.reshape(-1))
    recv.index_add_(0, dst.reshape(-1), down.reshape(-1))
    return torch.maximum(send, recv)


def staged_casts(comm, whole: RelayRoute, first: torch.Tensor, S: int, rng: torch.Tensor) -> list[RelayRoute]:
    """The S casts of one kind of a ``CommMeta`` with sub-stages, from ``whole``, the one-stage
    route of all its transfers (``relay_route``): which (unit, node) is relayed, its hull, relay,
    rail and egress slot, and which consumer takes which way are ``whole``'s; the sub-stages only
    say when each moves.

    first: ``[G, U, P]`` int64 the cast of each transfer (``CommMeta.*_stage[..., 0]``, 0 none);
    rng: the kind's transfers ``[G, U, P, 2]`` (``CommMeta.qo_range`` / ``kv_range``).
    A consumer's direct (hop 0) or fan-out (hop 2) rows travel in its own cast ``first``; a (unit,
    node)'s hull crosses InfiniBand (hop 1) once, in the first cast any consumer of that node needs
    it (so the relay holds it when the later ones fan out), and an egress slot moves (hop 3) in the
    first cast any of its crossings does. Each hop's receiving buffer is shared by the S casts:
    cast s's rows land after casts 1..s-1's (the starts folded into the offsets below), so the
    relay and egress buffers hold what ``whole``'s do and its capacities hold as they are.
    """
    G, U, P = whole.via.shape
    n = U // P
    dev = first.device
    big = torch.iinfo(torch.int64).max
    ranks = torch.arange(P, device=dev)
    host = torch.arange(U, device=dev) // n
    relayed = (whole.via == FAN_OUT) | (whole.via == SELF)
    length = rng[..., 1] - rng[..., 0]
    hull_len = whole.hull_range[..., 1] - whole.hull_range[..., 0]                 # [G, U, P(relay)]
    hull_lo = whole.hull_range[..., 0]
    s0 = torch.full_like(hull_len, big).scatter_reduce(2, whole.relay_of, torch.where(relayed, first, big), "amin")
    s0 = torch.where(hull_len > 0, s0, 0)                                           # the crossing's cast
    sender = whole.hop1_sender
    via_egress = (hull_len > 0) & (sender != host[None, :, None])
    pre_len = whole.egress_range[..., 1] - whole.egress_range[..., 0]               # [G, U, P(egress)]
    pre_lo = whole.egress_range[..., 0]
    e0 = torch.full_like(pre_len, big).scatter_reduce(2, sender, torch.where(via_egress, s0, big), "amin")
    e0 = torch.where(pre_len > 0, e0, 0)                                            # the slot's cast
    zero = torch.zeros(P, dtype=torch.int64, device=dev)
    used = {k: zero for k in ("direct", "fan", "relay", "egress")}
    relay_offset = torch.zeros_like(hull_len)
    pre_offset = torch.zeros_like(pre_len)
    per = []
    for s in range(1, S + 1):  # each hop's rows of cast s after those of casts 1..s-1
        h_s = torch.where(s0 == s, hull_len, 0)
        p_s = torch.where(e0 == s, pre_len, 0)
        relay_offset = torch.where(s0 == s, _offsets_by(h_s, sender, n) + used["relay"], relay_offset)
        pre_offset = torch.where(e0 == s, _offsets(p_s, n) + used["egress"], pre_offset)
        via = torch.where(first == s, whole.via, NOTHING)
        d_len = torch.where(via == DIRECT, length, 0)
        f_len = torch.where(via == FAN_OUT, length, 0)
        per.append(dict(via=via, d_len=d_len, f_len=f_len, h_s=h_s, p_s=p_s, d0=used["direct"], f0=used["fan"]))
        used = {"direct": used["direct"] + _by_source(d_len, n).sum(0),
                "fan": used["fan"] + _pair_sum(whole.relay_of, ranks, f_len, P).sum(0),
                "relay": used["relay"] + h_s.sum((0, 1)), "egress": used["egress"] + _by_source(p_s, n).sum(0)}
    g_idx = torch.arange(G, device=dev)[:, None, None]
    from_egress = pre_offset.gather(2, sender) + hull_lo - pre_lo.gather(2, sender) + G * comm.chunk
    hop1_src = torch.where(hull_len > 0, torch.where(via_egress, from_egress, g_idx * comm.chunk + hull_lo), 0)
    fan_start = torch.where(relayed, relay_offset.gather(2, whole.relay_of) + rng[..., 0]
                            - hull_lo.gather(2, whole.relay_of), 0)
    casts = []
    for s, x in enumerate(per, start=1):
        via, d_len, f_len, h_s, p_s = x["via"], x["d_len"], x["f_len"], x["h_s"], x["p_s"]
        rel = (via == FAN_OUT) | (via == SELF)
        casts.append(replace(
            whole, via=via, direct_range=torch.where((via == DIRECT)[..., None], rng, 0),
            direct_offset=_offsets(d_len, n) + x["d0"], direct_split=_by_source(d_len, n),
            hull_range=torch.where((s0 == s)[..., None], whole.hull_range, 0), relay_offset=relay_offset,
            hop1_split=_pair_sum(sender, ranks, h_s, P), relay_rows=h_s.sum((0, 1)),
            fan_offset=torch.where(via == FAN_OUT, _offsets_by(f_len, whole.relay_of, n) + x["f0"], 0),
            fan_start=torch.where(rel, fan_start, 0), hop2_split=_pair_sum(whole.relay_of, ranks, f_len, P),
            hop1_src=hop1_src, egress_range=torch.where((e0 == s)[..., None], whole.egress_range, 0),
            egress_split=_by_source(p_s, n)))
    return casts


def stage_relay_routes(comm, kind: str, tiles: int, L: int, rows, egress: bool,
                       rails: torch.Tensor) -> tuple[RelayRoute, RelayRoute]:
    """(casts, reduces) of one kind of a ``CommMeta`` with S > 1 sub-stages, each ``stack_routes``'d.

    Casts: ``staged_casts`` of the one-stage route of all the kind's transfers (each (unit, node)
    crosses InfiniBand once, in the first sub-stage its node needs it; the relay, egress and
    fan-out buffers and their capacities are the one-stage route's). Reduce s routes the transfers
    whose last task is in s (``CommMeta.*_stage[..., 1] == s``) by ``relay_route`` on those alone:
    partials cross back once per (unit, node) and sub-stage, with the hull of the rows returning
    in s, merged on the relay first; a reduce's relay and egress accumulators live while that
    reduce does, so each has the capacities whole."""
    rng = comm.qo_range if kind == "qo" else comm.kv_range
    first, last = (comm.qo_stage if kind == "qo" else comm.kv_stage).unbind(-1)
    S = comm.num_stages
    args = (tiles, L, rows.relay(kind), rows.fan(kind), rows.egress(kind) if egress else 0, comm.chunk,
            comm.buffers.send(kind), rails)
    whole = relay_route(rng, *args)
    casts = staged_casts(comm, whole, first, S, rng)
    backs = [relay_route(torch.where((last == s)[..., None], rng, 0), *args) for s in range(1, S + 1)]
    return stack_routes(casts), stack_routes(backs)


def build_relay_meta(comm, ranks_per_node: int, rows, cost=None, egress: bool = True) -> RelayMeta:
    """Relay routing of both kinds of ``comm`` (a ``CommMeta``; with S > 1 sub-stages per sub-stage,
    ``stage_relay_routes``) for nodes of ``ranks_per_node``; ``rows`` a ``capacity.RelayRows``;
    ``egress``: whether crossings may leave by an egress (hop 3) on rails matched to spread a
    node's crossings over its NICs (``matched_rails``), the default at every node count and S; off,
    each host sends its own crossings. With two nodes the matching halved the busiest NIC's forward
    bytes on the P = 16 benchmark masks (causal seed 1: 88 to 49 MB per GPU at S = 1,
    ``benchmarks/results/ib_floor.md``) and lowered the simulated step in 4 of 6 of them (S = 1:
    6-16 %, ``stages_bench_topo.md``; S = 4 relay: 1-10 %, the other two unchanged, CHANGELOG)."""
    P = comm.cp_size
    if P % ranks_per_node or P <= ranks_per_node:
        raise ValueError(f"relay transport needs whole nodes of ranks_per_node = {ranks_per_node} and more "
                         f"than one of them, got cp_size = {P}")
    N, L = P // ranks_per_node, ranks_per_node
    egress = bool(egress)
    G, U = comm.qo_range.shape[:2]
    own = (torch.arange(U, device=comm.qo_range.device) // comm.tiles % L)[None, :, None]
    rails = (matched_rails(comm, ranks_per_node, cost) if egress and cost is not None
             else own.repeat(G, 1, N))
    if comm.num_stages > 1:
        (qo, qo_back), (kv, kv_back) = (stage_relay_routes(comm, k, comm.tiles, L, rows, egress, rails)
                                        for k in ("qo", "kv"))
        return RelayMeta(qo=qo, kv=kv, ranks_per_node=L, egress=egress, rails=rails, num_stages=comm.num_stages,
                         qo_back=qo_back, kv_back=kv_back)
    routes = {k: relay_route(comm.qo_range if k == "qo" else comm.kv_range, comm.tiles, ranks_per_node,
                             rows.relay(k), rows.fan(k), rows.egress(k) if egress else 0, comm.chunk,
                             comm.buffers.send(k), rails) for k in ("qo", "kv")}
    return RelayMeta(qo=routes["qo"], kv=routes["kv"], ranks_per_node=ranks_per_node, egress=egress, rails=rails)


# --- the gather lists the collectives and the assembly read (built on demand, per rank) ---------------


def segment_gather(start: torch.Tensor, length: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[capacity]`` int64: segment k (in order) gives rows ``start[k] + t``, t < ``length[k]``; -1 past the last."""
    ends = length.cumsum(0)
    starts = ends - length
    pos = torch.arange(capacity, device=length.device)
    seg = torch.searchsorted(ends, pos, right=True).clamp_(max=length.numel() - 1)
    return torch.where(pos < ends[-1:], start[seg] + pos - starts[seg], -1)


def hop_send_index(comm, route: RelayRoute, kind: str, hop: int, rank: int) -> torch.Tensor:
    """Send list of ``rank`` in hop 0 or 3 (gather indices into its group-major local rows,
    ``[send_cap(kind)]``), in hop 1 (into concat(local rows, egress buffer), ``[hop1_capacity]``)
    or in hop 2 (into its relay buffer, ``[fan_capacity]``); int64, -1 padded."""
    _hop(hop)
    G, U, P = route.via.shape
    n = U // P
    # (dest, host, g, tile): the order of the rows each dest receives from this rank
    order = lambda x: x.view(G, P, n, P).permute(3, 1, 0, 2).reshape(-1)  # noqa: E731
    if hop in (0, 3):
        rng = route.direct_range if hop == 0 else route.egress_range
        return send_index(rng[:, rank * n:(rank + 1) * n], comm.chunk, comm.buffers.send(kind))
    if hop == 1:
        length = route.hull_range[..., 1] - route.hull_range[..., 0]
        length = torch.where(route.hop1_sender == rank, length, 0)
        return segment_gather(order(route.hop1_src), order(length), route.hop1_capacity)
    mine = (route.via == FAN_OUT) & (route.relay_of == rank)                 # [G, U, P]
    length = torch.where(mine, transfer_length(comm, kind), 0)
    return segment_gather(order(route.fan_start), order(length), route.fan_capacity)


def transfer_length(comm, kind: str) -> torch.Tensor:
    rng = comm.qo_range if kind == "qo" else comm.kv_range
    return rng[..., 1] - rng[..., 0]


def assemble_index(comm, route: RelayRoute, kind: str, rank: int) -> torch.Tensor:
    """``[recv_cap]`` int64: row p of ``rank``'s receive buffer (``CommMeta``'s layout) is row
    ``index[p]`` of ``concat(direct buffer [recv_cap], fan-out buffer [recv_cap], relay buffer
    [relay_capacity])``; -1 past the fill."""
    cap = comm.buffers.recv(kind)
    G, U, P = route.via.shape
    n = U // P
    length = transfer_length(comm, kind)[:, :, rank]
    via = route.via[:, :, rank]
    src = torch.where(via == DIRECT, route.direct_offset[:, :, rank],
                      torch.where(via == FAN_OUT, cap + route.fan_offset[:, :, rank],
                                  2 * cap + route.fan_start[:, :, rank]))
    order = lambda x: x.reshape(G, P, n).permute(1, 0, 2).reshape(-1)  # noqa: E731  (host, g, tile)
    return segment_gather(order(src), order(torch.where(via != NOTHING, length, 0)), cap)


def shifted(index: torch.Tensor, start) -> torch.Tensor:
    """``index`` (``[cap]``, a stage's rows from its row 0) moved to start at row ``start`` of the
    same ``[cap]`` buffer: -1 before it and past the fill."""
    k = torch.arange(index.shape[0], device=index.device) - start
    return torch.where(k >= 0, index[k.clamp(min=0)], -1)


def inverse_index(index: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]`` int64 inverse of a gather list without repeats: ``inv[index[p]] = p``; -1 elsewhere."""
    dump = torch.where(index >= 0, index, size)
    inv = torch.full((size + 1,), -1, dtype=torch.int64, device=index.device)
    inv.scatter_(0, dump, torch.arange(index.numel(), device=index.device))
    return inv[:size]
