"""Relay transport (``Plan.relay``): both hops forward and backward equal dense attention, and the
groups' byte counters equal ``Plan.pair_bytes`` per phase and hop.

Plans: the CPU reference solver's assignment (``tight_plan``), rebuilt with a topology whose
nodes are smaller than the group, so the same assignment runs with direct and with relay
transport.
"""
from dataclasses import replace

import pytest
import torch

from gpusolver.areas import block_areas
from gpusolver.capacity import relay_rows
from gpusolver.plan import IMBALANCED, Plan
from gpusolver.plan.build import build_plan
from gpusolver.plan.relay import DIRECT, FAN_OUT, SELF
from gpusolver.plan.schedule import PHASES, backward_ops, forward_ops, hop_phase
from gpusolver.runtime import DynamicCPAttention, PlanCache, dist_attn, shard, unshard
from gpusolver.sim import simulate
from gpusolver.topology import Topology
from groupcomm import LocalGroup, TorchGroup
from tests._dist import run_ranks
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import (ATOL, D, RTOL, make_config, make_inputs, make_mask, reference,
                                            tight_plan)
from tests.gpusolver.runtime._cases import few_solve_rounds  # noqa: F401 - fixture

KEYS = ("out", "lse", "dq", "dk", "dv")


def _topology(per_node: int) -> Topology:
    return Topology(ranks_per_node=per_node, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0, name="test")


def _plans(name, P, per_node, c=16, Hq=4, Hkv=2, tiles=1, keep=True, seed=None, num_stages=1, **relay_kw):
    """(direct plan, relay plan, mask, config) of one reference-solver assignment (``num_stages``
    sub-stages: ``test_relay_stages``)."""
    mask = make_mask(name, P * c, seed=P if seed is None else seed)
    # no local tail: relay plans take none, and the stage-0 slice capacity is sized from the direct plan
    config = make_config(P, Hq, Hkv, True, tiles, keep_forward_buffers=keep, num_stages=num_stages, local_tail=0)
    direct, tight = tight_plan(mask, config)
    areas = block_areas(mask, P, config.head_groups, impl="torch", tiles=tiles)
    # sub-stage plans relay only when asked (relay_transport)
    relayed = replace(tight, topology=_topology(per_node), ib_relay=True if num_stages > 1 else None)
    rows = relay_rows(relayed, c, per_node, **relay_kw) if relay_kw else None
    plan = build_plan(mask, areas, direct.assignment, relayed, relay_rows=rows).validate(ignore=IMBALANCED)
    return direct, plan, mask, relayed


def _run(plan, group, inputs, keep=True):
    q, k, v, d_out, d_lse = inputs
    qs, ks, vs = (shard(x, group).requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group, keep_forward_buffers=keep)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    return dict(zip(KEYS, (out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad)))


def _check_bytes(plan, group, phases):
    for phase in phases:
        for hop in (0, 1, 2, 3):
            want = plan.pair_bytes(phase, hop=hop)
            got = group.pair_traffic(hop_phase(phase, hop))
            assert torch.equal(got, want), f"{phase} hop {hop}: counted {int(got.sum())}, plan {int(want.sum())}"


def _check_layer(plan, mask, seed, keep=True, label=""):
    """The relay layer on ``LocalGroup`` equals dense attention, forward and backward, and every
    hop's counted bytes are the plan's."""
    P = plan.comm.cp_size
    inputs = make_inputs(P * 16, 4, 2, seed=seed)
    ref = reference(mask, *inputs)
    group = LocalGroup(P)
    got = _run(plan, group, inputs, keep=keep)
    for key in KEYS:
        assert_close(f"{label}{key}", ref[key], unshard(got[key], group), atol=ATOL, rtol=RTOL)
    _check_bytes(plan, group, PHASES)


def _check_hops(plan, per_node):
    """Hop 1 crosses nodes only, hop 2 stays inside a node, and relaying never adds IB bytes."""
    P = plan.comm.cp_size
    node = torch.arange(P) // per_node
    cross = node[:, None] != node[None, :]
    for kind in ("qo", "kv"):
        route = plan.relay.route(kind)
        assert int((route.split(1) * ~cross).sum()) == 0 and int((route.split(2) * cross).sum()) == 0
        assert int((route.split(3) * cross).sum()) == 0  # the pre-hop to the egress stays in the node
        if not plan.relay.egress:
            assert int(route.split(3).sum()) == 0
        split = plan.comm.qo_split if kind == "qo" else plan.comm.kv_split
        ib = (route.split(0) + route.split(1)) * cross
        assert int(ib.sum()) <= int((split * cross).sum())
        # every remote row a consumer holds came one way: direct, fanned out, or read by the relay itself
        via = route.via
        rng = plan.comm.qo_range if kind == "qo" else plan.comm.kv_range
        used = rng[..., 1] > rng[..., 0]
        assert torch.equal(used, (via == DIRECT) | (via == FAN_OUT) | (via == SELF))


# (mask, P, ranks per node): 2 and 4 nodes at P = 16
CASES = [("docs-causal", 16, 8), ("docs-full", 16, 4)]  # 4 nodes of 4: the egress spread acts


@pytest.mark.parametrize("name,P,per_node", CASES, ids=[f"{m}-P{P}-nodes{P // n}" for m, P, n in CASES])
def test_relay_equals_reference(name, P, per_node):
    direct, plan, mask, _ = _plans(name, P, per_node)
    assert plan.relay is not None
    for kind in ("qo", "kv"):  # both hops carry rows of both kinds
        assert int(plan.relay.route(kind).split(1).sum()) > 0 and int(plan.relay.route(kind).split(2).sum()) > 0
    _check_hops(plan, per_node)
    assert plan.relay.egress  # every node count: a crossing may leave by another NIC of its node
    if plan.relay.egress:  # the spread acts: some rows reach their NIC over the pre-hop
        for kind in ("qo", "kv"):
            assert int(plan.relay.route(kind).split(3).sum()) > 0
    _check_layer(plan, mask, seed=P)


def test_relay_state_prices_the_plans_hops():
    """The solver's relay count (``state.relay.relay_hops``) of the plan's assignment, on the plan's
    rails, equals the plan's rows per pair and link class on four nodes of four: InfiniBand = hop 1
    plus direct rows across nodes, NVLink = direct rows inside a node, the fan-out and the pre-hop
    to the egress."""
    from gpusolver.solver.core import Tasks
    from gpusolver.solver.state.ref import state
    from gpusolver.solver.state.relay import relay_hops

    P, per_node = 16, 4
    _, plan, mask, config = _plans("random", P, per_node, tiles=2)
    tasks = Tasks(block_areas(mask, P, config.head_groups, impl="torch", tiles=2), config)
    a = plan.assignment.long().reshape(-1)
    st = state(tasks, torch.cat((torch.where(a >= 0, a, P), torch.tensor([P]))).view(1, -1))
    node = torch.arange(P) // per_node
    inside = node[:, None] == node[None, :]
    for kind, cells in (("qo", (st.qlen, st.q_lo, st.q_hi)), ("kv", (st.klen, st.k_lo, st.k_hi))):
        nv, ib = relay_hops(tasks, *cells, rails=plan.relay.rails)[:, 0]
        route = plan.relay.route(kind)
        assert int(route.split(3).sum()) > 0
        assert torch.equal(nv, route.split(0) * inside + route.split(2) + route.split(3)), kind
        assert torch.equal(ib, route.split(1) + route.split(0) * ~inside), kind


def test_relay_matched_rails():
    """More than two nodes: per node offset d each rail carries as many of a node's crossings
    towards node A + d (L at a time, one per rail), the same rails every build; two nodes: matched
    too, with and without sub-stages; without an egress every unit on its host's own rail."""
    from gpusolver.plan.relay import matched_rails

    P, per_node = 16, 4
    _, plan, _, config = _plans("docs-full", P, per_node)
    rails, N = plan.relay.rails, P // per_node
    G, U, _ = rails.shape
    node = torch.arange(U) // plan.comm.tiles // per_node
    own = (torch.arange(U) // plan.comm.tiles % per_node)[None, :, None].expand(G, U, N)
    assert not torch.equal(rails, own)  # the matching won
    for A in range(N):
        for d in range(1, N):  # every rail carries as many of node A's crossings to A + d
            counts = torch.bincount(rails[:, node == A, (A + d) % N].reshape(-1), minlength=per_node)
            assert counts.tolist() == [G * plan.comm.tiles] * per_node, (A, d)
    assert torch.equal(matched_rails(plan.comm, per_node, config.cost()), rails)
    # two nodes: matched as well, at one remote stage and with sub-stages; without an egress
    # (``build_relay_meta(egress=False)``) every unit keeps its host's own rail
    from gpusolver.capacity import relay_rows
    from gpusolver.plan.relay import build_relay_meta

    for S in (1, 4):
        _, two, _, two_config = _plans("docs-causal", P, 8, num_stages=S)
        G2, U2, _ = two.relay.rails.shape
        own2 = (torch.arange(U2) // two.comm.tiles % 8)[None, :, None].expand(G2, U2, 2)
        assert two.relay.egress and torch.equal(two.relay.rails, matched_rails(two.comm, 8, two_config.cost()))
        assert not torch.equal(two.relay.rails, own2), S  # the matching won here too
    off = build_relay_meta(two.comm, 8, relay_rows(two_config, two.comm.chunk, 8), two_config.cost(), egress=False)
    assert not off.egress and torch.equal(off.rails, own2)
    assert int(off.route("kv").split(3).sum()) == 0


def _ib_senders(plan, kind, per_node):
    """{(g, unit, node): the rank that sent its hop 1} of one kind, read from the routing."""
    route = plan.relay.route(kind)
    hull = route.hull_range[..., 1] - route.hull_range[..., 0]  # [G, U, P(relay)]
    return {(g, u, r // per_node): int(route.hop1_sender[g, u, r]) for g, u, r in hull.nonzero().tolist()}


@pytest.mark.slow
def test_relay_egress_fallback_and_shared_slots():
    """Five nodes of two (N - 1 > L: an egress other than the host carries one unit's slot to two
    nodes and merges what comes back) with egress buffers too small for all slots (the rest
    leaves from the host's own NIC): still exact, bytes still the plan's, and every IB sender is
    the egress or, past the room, the host."""
    P, per_node = 10, 2
    # QO relay buffers at their worst case (every other node's same-rail chunk): every QO (unit, node)
    # is relayed, so that a QO egress slot serves two nodes below
    qo_room = dict(qo_relay=2 * 16 * (P // per_node - 1))  # G = 2 head groups of c = 16 tokens
    _, full, _, _ = _plans("docs-full", P, per_node, keep=False, **qo_room)
    assert full.relay.egress
    half = int(full.relay.kv.egress_split.sum(0).max()) // 2
    assert half > 0
    _, plan, mask, config = _plans("docs-full", P, per_node, keep=False, kv_egress=half, **qo_room)
    assert config.head_groups == 2
    host = plan.comm.unit_host()
    rails = plan.relay.rails

    def egress(g, u, node):
        return int(host[u]) // per_node * per_node + int(rails[g, u, node])

    senders = _ib_senders(plan, "kv", per_node)
    spread = sum(s == egress(g, u, node) != int(host[u]) for (g, u, node), s in senders.items())
    fallback = sum(s == int(host[u]) != egress(g, u, node) for (g, u, node), s in senders.items())
    assert spread > 0 and fallback > 0
    assert all(s in (int(host[u]), egress(g, u, node)) for (g, u, node), s in senders.items())
    route = plan.relay.kv
    hull = route.hull_range[..., 1] - route.hull_range[..., 0]
    for g, u, r in hull.nonzero().tolist():  # the relay is on the egress's rail
        assert r % per_node == int(rails[g, u, r // per_node])
    assert int(plan.relay.kv.egress_split.sum(0).max()) <= half
    shared = {}  # (QO's egress buffers have all their room)
    for (g, u, node), s in _ib_senders(plan, "qo", per_node).items():
        if s != int(host[u]):
            shared.setdefault((g, u, s), set()).add(node)
    assert max(len(nodes) for nodes in shared.values()) == 2  # a slot serving two nodes
    _check_layer(plan, mask, seed=5, keep=False)


def test_relay_recast_tiles_and_capacity():
    """Forward buffers cast again (Q with dO, K and V relayed again), two tiles per chunk, and relay
    buffers too small for everything (the rest goes direct): still exact, bytes still the plan's."""
    P, per_node = 8, 2
    _, full, _, _ = _plans("random", P, per_node, tiles=2, keep=False)
    half = int(full.relay.kv.relay_rows.max()) // 2  # the fullest relay gets half its KV rows' room
    _, plan, mask, config = _plans("random", P, per_node, tiles=2, keep=False, kv_relay=half)
    via = plan.relay.kv.via
    node = torch.arange(P) // per_node
    host = plan.comm.unit_host()
    cross = (node[host][:, None] != node[None, :])
    assert int(((via == DIRECT) & cross).sum()) > 0 and int((via == FAN_OUT).sum()) > 0  # some of each
    assert 0 < int(plan.relay.kv.relay_rows.max()) <= half
    _check_layer(plan, mask, seed=3, keep=False)
    assert int(plan.pair_bytes("bwd.kv", hop=1).sum()) > 0  # K and V really went through the relays again


@pytest.mark.parametrize("name,P,per_node", [("docs-causal", 32, 16), ("docs-full", 32, 8), ("window", 16, 4),
                                             ("random", 32, 8)])
def test_relay_equals_reference_sweep(name, P, per_node):
    for keep in (True, False):  # the plan's CommCost prices the backward's protocol
        _, plan, mask, _ = _plans(name, P, per_node, keep=keep)
        _check_hops(plan, per_node)
        _check_layer(plan, mask, seed=P, keep=keep, label=f"keep={keep} ")


def test_relay_off_is_todays_plan():
    """ib_relay=False on a multi-node topology, and a topology of one node, build today's plan bit for bit."""
    P = 8
    direct, _, mask, config = _plans("docs-causal", P, 4)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    for cfg in (replace(config, ib_relay=False), replace(config, topology=_topology(8)),
                replace(config, topology=None)):
        plan = build_plan(mask, areas, direct.assignment, cfg)
        assert plan.relay is None
        for part in ("comm", "calc"):
            a, b = getattr(plan, part), getattr(direct, part)
            for f in a.__dataclass_fields__:
                x, y = getattr(a, f), getattr(b, f)
                assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f"{part}.{f} differs"
        assert forward_ops(2) == tuple(o for o in forward_ops(2) if o.hop == 0)
        assert torch.equal(plan.pair_bytes("fwd", hop=0), plan.pair_bytes("fwd"))
        assert int(plan.pair_bytes("fwd", hop=1).sum()) == 0


def test_relay_deterministic_and_saved(tmp_path):
    """Two runs give the same bits; the plan survives save / load with its relay routing."""
    P = 4
    _, plan, mask, _ = _plans("docs-causal", P, 2)
    inputs = make_inputs(P * 16, 4, 2, seed=1)
    a, b = _run(plan, LocalGroup(P), inputs), _run(plan, LocalGroup(P), inputs)
    for key in KEYS:
        assert torch.equal(a[key], b[key]), key
    plan.save(tmp_path / "p.pt")
    back = Plan.load(tmp_path / "p.pt")
    assert back.relay is not None and torch.equal(back.relay.kv.via, plan.relay.kv.via)
    assert torch.equal(back.pair_bytes("fwd", hop=1), plan.pair_bytes("fwd", hop=1))


def test_relay_simulated_per_link():
    """The simulator prices the relay hops: its pass bytes equal the plan's; hop 1 lands on NICs only."""
    P, per_node = 16, 4
    _, plan, _, _ = _plans("docs-causal", P, per_node)
    t = simulate(plan, _topology(per_node))
    for phase, passed in (("fwd", t.fwd), ("bwd", t.bwd)):
        assert torch.equal(torch.tensor(passed.pair_bytes), plan.pair_bytes(phase))
    ops = forward_ops(2, relay=True)
    assert [op.name for op in ops if op.hop == 1 and op.collective] == ["fwd.cast.qo:hop1", "fwd.cast.kv:hop1",
                                                                        "fwd.reduce.o:hop1"]
    lanes = {i.lane for i in t.fwd.timeline if i.label in ("fwd.qo", "fwd.kv", "fwd.o")}
    assert {"ib send", "nvlink send"} <= lanes


def test_relay_bad_input():
    P = 8
    mask = make_mask("docs-causal", P * 16, seed=0)
    topo = _topology(4)
    with pytest.raises(ValueError, match="ib_relay=True.*sparse plan"):
        from gpusolver.plan.build import relay_transport
        relay_transport(make_config(P, 4, 2, topology=topo, ib_relay=True), sparse=True)
    # sub-stage plans relay when asked (``test_relay_stages``), and their solve prices what runs
    cfg = make_config(P, 4, 2, topology=topo, num_stages=2)
    assert not cfg.relays and not relay_transport(cfg)
    assert replace(cfg, ib_relay=True).relays and relay_transport(replace(cfg, ib_relay=True))
    _, plan, _, _ = _plans("docs-causal", P, 4)
    with pytest.raises(ValueError, match="hop must be"):
        plan.pair_bytes("fwd", hop=4)
    with pytest.raises(ValueError, match="branches=2"):
        forward_ops(3, 2, relay=True)
    with pytest.raises(ValueError, match="unknown buffers"):
        relay_rows(cfg, 16, 4, qo_relays=3)
    with pytest.raises(ValueError, match="qo_relay must be a non-negative int"):
        relay_rows(cfg, 16, 4, qo_relay=-1)
    assert backward_ops(2, True, relay=True)[0].name == "bwd.delta"
    # relay keeps whole kinds: the budget keeps no part of the KV buffer there, and asking for one is
    # an error, not a layer that silently keeps it all
    from gpusolver.capacity import keep_for_budget
    relayed = make_config(P, 4, 2, topology=topo, num_stages=1)
    assert relayed.memory_budget == 1.5 and keep_for_budget(relayed, 16).kept_kv_rows is None
    assert keep_for_budget(replace(relayed, ib_relay=False), 16).kept_kv_rows is not None
    q = torch.randn(P, 16, 4, D)
    k = torch.randn(P, 16, 2, D)
    with pytest.raises(ValueError, match="kept_kv_rows=1 keeps part of the KV buffer"):
        dist_attn(q, k, k, plan, LocalGroup(P), kept_kv_rows=1)


def check_layer_on_meta(**config_kw):
    """DynamicCPAttention (P = 4, two nodes of 2) solved, routed and run forward and backward on meta:
    no host read anywhere, outputs and grads of the config's shapes."""
    from tests.gpusolver.runtime._cases import meta_layer_step

    P, c, Hq, Hkv = 4, 16, 4, 2
    layer = DynamicCPAttention(LocalGroup(P), make_config(P, Hq, Hkv, topology=_topology(2), **config_kw),
                               plan_cache=PlanCache())
    meta_layer_step(layer, P, c, Hq, Hkv)


@pytest.mark.usefixtures("few_solve_rounds")
def test_relay_layer_on_meta():
    """DynamicCPAttention on a two-node topology: solve, relay routing, both hops and backward on meta
    (one remote stage, where relay is the default)."""
    check_layer_on_meta(num_stages=1)


def _gloo_rank(rank, P, transport):
    import gpusolver.runtime.relayed as relayed

    c, Hq, Hkv = 16, 4, 2
    _, plan, mask, _ = _plans("docs-full", P, 2, c=c, Hq=Hq, Hkv=Hkv, seed=8)
    group = TorchGroup(transport=transport)
    # the rows of every hop's receive buffer (each cast's recv_capacity) and of each receive buffer
    # in the plan's layout (what the hops' rows are gathered into)
    casts, laid = [], []
    cast, assemble = relayed.group_cast, relayed._assemble_into

    def recorded_cast(tensors, index, split, rows, *args, **kwargs):
        casts.append(rows)
        return cast(tensors, index, split, rows, *args, **kwargs)

    def recorded_assemble(x, *args, **kwargs):
        laid.append(x.shape[0])
        return assemble(x, *args, **kwargs)

    relayed.group_cast, relayed._assemble_into = recorded_cast, recorded_assemble
    q, k, v, d_out, d_lse = make_inputs(P * c, Hq, Hkv, seed=8)
    qs, ks, vs = (shard(x, group).clone().requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    counted = {(ph, h): group.traffic(hop_phase(ph, h)) for ph in PHASES for h in (0, 1, 2, 3)}
    want = {(ph, h): (int(plan.pair_bytes(ph, hop=h)[rank].sum()), int(plan.pair_bytes(ph, hop=h)[:, rank].sum()))
            for ph in PHASES for h in (0, 1, 2, 3)}
    # this rank's fills: each hop's received rows, and the layout's
    route = plan.relay.route
    hop_fills = {int(route(kind).split(h)[:, rank].sum()) for kind in ("qo", "kv") for h in (0, 1, 2, 3)}
    layout_fills = (int(plan.comm.qo_recv_rows[rank]), int(plan.comm.kv_recv_rows[rank]))
    caps = (plan.comm.qo_recv_capacity, plan.comm.kv_recv_capacity)
    return {"got": dict(zip(KEYS, (out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad))),
            "counted": counted, "want": want, "ib": int(plan.pair_bytes("fwd", hop=1).sum()),
            "rows": (set(casts), hop_fills, set(laid), layout_fills, caps)}


@pytest.mark.parametrize("transport", ["a2a", "p2p"])
def test_relay_gloo_two_nodes_of_two(transport):
    """The relay layer with one remote stage on gloo (two nodes of two) equals dense attention, counts
    the plan's bytes per hop, and on TorchGroup receives at each rank's fill: every hop's buffer at
    the rows that hop brings, each receive buffer in the plan's layout at the rows it holds."""
    P, c = 4, 16
    results = run_ranks(_gloo_rank, P, transport, timeout=120)
    ref = reference(make_mask("docs-full", P * c, seed=8), *make_inputs(P * c, 4, 2, seed=8))
    assert results[0]["ib"] > 0  # rows crossed by relay
    for rank, res in enumerate(results):
        rows = slice(rank * c, (rank + 1) * c)
        for key in KEYS:
            assert_close(f"rank {rank} {key}", ref[key][rows], res["got"][key], atol=ATOL, rtol=RTOL)
        assert res["counted"] == res["want"], f"rank {rank}"
        casts, hop_fills, laid, layout_fills, _ = res["rows"]
        assert casts <= hop_fills and laid == set(layout_fills), f"rank {rank}: {res['rows']}"
    assert any(f < cap for r in results for f, cap in zip(r["rows"][3], r["rows"][4])), \
        "no receive buffer below its capacity: the case checks nothing"


def test_relay_layer_equals_reference():
    """DynamicCPAttention solves on a topology of two nodes of two and runs the relay plan it built
    (one remote stage: relay's default there; the default sub-stages keep direct transport)."""
    from gpusolver.plan.build import relay_transport

    P, c, Hq, Hkv = 4, 16, 4, 2
    assert not relay_transport(make_config(P, Hq, Hkv, topology=_topology(2)))
    mask = make_mask("docs-full", P * c, seed=8)
    group = LocalGroup(P)
    layer = DynamicCPAttention(group, make_config(P, Hq, Hkv, topology=_topology(2), num_stages=1),
                               plan_cache=PlanCache())
    q, k, v, d_out, d_lse = make_inputs(P * c, Hq, Hkv, seed=8)
    qs, ks, vs = (shard(x, group).requires_grad_() for x in (q, k, v))
    out, lse = layer(qs, ks, vs, mask, return_lse=True)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    assert int(sum(group.traffic(hop_phase("fwd.kv", 1))[0])) + int(sum(group.traffic(hop_phase("fwd.qo", 1))[0])) > 0
    ref = reference(mask, q, k, v, d_out, d_lse)
    for key, t in zip(KEYS, (out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad)):
        assert_close(key, ref[key], unshard(t, group), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_relay_layer_compiles_once(num_stages):
    """torch.compile(fullgraph=True) of a relay layer, one remote stage or sub-stages (whose
    comm-side merges run inline off CUDA): one graph for two masks, equal to eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from gpusolver.masks import varlen_causal_mask

    P, c = 4, 16
    config = make_config(P, 2, 1, topology=_topology(2), num_stages=num_stages, ib_relay=True)
    group = LocalGroup(P)
    layer = DynamicCPAttention(group, config, plan_cache=PlanCache())
    eager = DynamicCPAttention(group, config, plan_cache=PlanCache())
    qs, ks, vs = (shard(x, group) for x in make_inputs(P * c, 2, 1)[:3])
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(lambda q, k, v, m: layer(q, k, v, m), backend=counter, fullgraph=True)
    for lengths in ([10, 6, 16, 32], [20, 12, 32]):
        mask = varlen_causal_mask(lengths, pad_to=6)
        assert_close("out", eager(qs, ks, vs, mask), run(qs, ks, vs, mask), atol=ATOL, rtol=RTOL)
    assert counter.frame_count == 1
