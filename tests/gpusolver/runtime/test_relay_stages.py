"""Relay transport with S > 1 sub-stages (``Plan.relay.num_stages``): each sub-stage's casts and
reduces relayed on their own, forward and backward equal dense attention, and the groups' byte
counters equal ``Plan.pair_bytes`` per phase, sub-stage and hop.

Plans: the CPU reference solver's assignment (``test_relay._plans``) with ``num_stages = S``.
The fast tier runs one two-node and one four-node case on ``LocalGroup`` and one gloo case; the
sweep over masks, node counts and S is in the slow tier.
"""
import weakref

import pytest
import torch

from gpusolver.capacity import relay_rows
from gpusolver.plan import Plan
from gpusolver.plan.build import build_plan, relay_transport
from gpusolver.plan.schedule import COMM, COMPUTE, PHASES, REDUCE, WAIT, backward_ops, forward_ops, hop_phase
from gpusolver.runtime import dist_attn, shard
from gpusolver.runtime.pipelined import stage_phase
from gpusolver.sim import simulate
from groupcomm import LocalGroup, TorchGroup
from tests._dist import run_ranks
from tests._operand_rows import record_operand_rows
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import ATOL, RTOL, make_config, make_inputs, make_mask, reference
from tests.gpusolver.runtime.test_relay import KEYS, _plans, _run, _topology, check_layer_on_meta
from tests.gpusolver.runtime._cases import few_solve_rounds  # noqa: F401 - fixture


def _stage_plans(name, P, per_node, S, keep=True, **kw):
    return _plans(name, P, per_node, keep=keep, num_stages=S, **kw)


def _check_stage_bytes(plan, group):
    """Every hop of every sub-stage counted as the plan's, and the sub-stages sum to the phase's."""
    S = plan.num_stages
    for phase in PHASES:
        for hop in (0, 1, 2, 3):
            total = torch.zeros_like(plan.pair_bytes(phase, hop=hop))
            for s in range(1, S + 1):
                want = plan.pair_bytes(phase, stage=s, hop=hop)
                got = group.pair_traffic(hop_phase(stage_phase(phase, s), hop))
                assert torch.equal(got, want), f"{phase} stage {s} hop {hop}: counted {int(got.sum())}, " \
                                               f"plan {int(want.sum())}"
                total += got
            assert torch.equal(total, plan.pair_bytes(phase, hop=hop)), f"{phase} hop {hop}"


def _check_stage_layer(plan, mask, seed, keep=True, label=""):
    P = plan.comm.cp_size
    inputs = make_inputs(P * 16, 4, 2, seed=seed)
    ref = reference(mask, *inputs)
    group = LocalGroup(P)
    got = _run(plan, group, inputs, keep=keep)
    from gpusolver.runtime import unshard
    for key in KEYS:
        assert_close(f"{label}{key}", ref[key], unshard(got[key], group), atol=ATOL, rtol=RTOL)
    _check_stage_bytes(plan, group)


def _check_routes(plan):
    """Every sub-stage's cast relays some rows over InfiniBand, hop 1 crosses nodes only, hop 2 stays
    inside one, and per sub-stage every transfer of that cast reaches its consumer one way."""
    from gpusolver.plan.relay import NOTHING

    P, L = plan.comm.cp_size, plan.relay.ranks_per_node
    node = torch.arange(P) // L
    cross = node[:, None] != node[None, :]
    assert plan.relay.num_stages == plan.num_stages > 1
    for kind in ("qo", "kv"):
        first, last = (plan.comm.qo_stage if kind == "qo" else plan.comm.kv_stage).unbind(-1)
        for s in range(1, plan.num_stages + 1):
            for which, st in (("cast", first), ("return", last)):
                route = plan.relay.stage(kind, s, which)
                assert int((route.split(1) * ~cross).sum()) == 0 and int((route.split(2) * cross).sum()) == 0
                assert torch.equal(route.via != NOTHING, st == s), (kind, s, which)
        assert sum(int(plan.relay.stage(kind, s).split(1).sum()) for s in range(1, plan.num_stages + 1)) > 0


# (mask, P, ranks per node, S): 2 nodes and 4 nodes (egress pre-hop) in the fast tier
CASES = [("docs-causal", 16, 8, 2), ("docs-full", 16, 4, 4)]


def _check_crossings(plan, mask, config):
    """The S casts cross InfiniBand as the one-stage relay plan of the same assignment does (each
    (unit, node) once, in the first sub-stage its node needs it), and the relay and egress
    buffers fill as much as its own."""
    from dataclasses import replace

    from gpusolver.areas import block_areas

    areas = block_areas(mask, config.cp_size, config.head_groups, impl="torch")
    one = build_plan(mask, areas, plan.assignment, replace(config, num_stages=1))
    assert one.relay.egress == plan.relay.egress
    S = plan.num_stages
    for kind in ("qo", "kv"):
        casts = [plan.relay.stage(kind, s) for s in range(1, S + 1)]
        for hop in (1, 3):
            assert torch.equal(sum(c.split(hop) for c in casts), one.relay.route(kind).split(hop)), (kind, hop)
        assert torch.equal(sum(c.relay_rows for c in casts), one.relay.route(kind).relay_rows), kind
        # every transfer in exactly one cast, by the way the one-stage plan sends it
        from gpusolver.plan.relay import NOTHING
        assert torch.equal(sum((c.via != NOTHING).long() for c in casts), (one.relay.route(kind).via != NOTHING).long())
        assert torch.equal(sum(torch.where(c.via != NOTHING, c.via, 0) for c in casts), one.relay.route(kind).via)


@pytest.mark.parametrize("name,P,per_node,S", CASES, ids=[f"{m}-P{P}-nodes{P // n}-S{S}" for m, P, n, S in CASES])
def test_relay_stages_equal_reference(name, P, per_node, S):
    _, plan, mask, config = _stage_plans(name, P, per_node, S)
    assert plan.relay.egress
    _check_routes(plan)
    _check_crossings(plan, mask, config)
    _check_stage_layer(plan, mask, seed=P)


SWEEP = [(m, 16, n, S, keep) for m in ("docs-causal", "docs-full") for n in (8, 4) for S in (2, 4)
         for keep in (True, False) if (m, 16, n, S) not in CASES or not keep]


@pytest.mark.parametrize("name,P,per_node,S,keep", SWEEP,
                         ids=[f"{m}-P{P}-nodes{P // n}-S{S}-{'keep' if k else 'recast'}" for m, P, n, S, k in SWEEP])
def test_relay_stages_sweep(name, P, per_node, S, keep):
    _, plan, mask, _ = _stage_plans(name, P, per_node, S, keep=keep)
    _check_routes(plan)
    _check_stage_layer(plan, mask, seed=P, keep=keep, label=f"keep={keep} ")


def test_relay_stages_capacity_shared():
    """The S casts share each relay buffer: with room for half the fullest relay's KV rows, the
    sub-stages together stay within it (the rest goes direct), and the layer stays exact."""
    P, per_node, S = 8, 4, 2
    _, full, _, _ = _stage_plans("random", P, per_node, S, keep=False)
    fill = sum(full.relay.stage("kv", s).relay_rows for s in range(1, S + 1))
    half = int(fill.max()) // 2
    assert half > 0
    _, plan, mask, _ = _stage_plans("random", P, per_node, S, keep=False, kv_relay=half)
    fill = sum(plan.relay.stage("kv", s).relay_rows for s in range(1, S + 1))
    assert 0 < int(fill.max()) <= half
    for s in range(1, S + 1):  # each reduce's relay accumulator has the whole room
        assert int(plan.relay.stage("kv", s, "return").relay_rows.max()) <= half
    _check_stage_layer(plan, mask, seed=3, keep=False)


def test_relay_stages_schedule_and_sim(tmp_path):
    """The op lists name every hop of every sub-stage once; no compute wait on a reduce hop directly
    follows its issue (but the last sub-stage's, with nothing left to hide behind); the simulator's
    bytes are the plan's; save / load keeps the routes."""
    for egress in (False, True):
        for ops in (forward_ops(5, relay=True, egress=egress), backward_ops(5, False, relay=True, egress=egress)):
            names = [op.name for op in ops]
            assert len(names) == len(set(names))
            hops = {(op.phase, op.stages, op.hop) for op in ops if op.collective}
            assert {h for _, _, h in hops} == ({0, 1, 2, 3} if egress else {0, 1, 2})
            for i, op in enumerate(ops):  # a wait on a reduce hop never directly follows its issue
                if op.kind == WAIT and op.back and i:
                    assert ops[i - 1].name != op.deps[0] or op.stages[0] == 4, op.name
    _, plan, _, _ = _stage_plans("docs-full", 16, 4, 2)
    t = simulate(plan, _topology(4), comm="p2p")
    for phase, passed in (("fwd", t.fwd), ("bwd", t.bwd)):
        assert torch.equal(torch.tensor(passed.pair_bytes), plan.pair_bytes(phase))
    assert [op for op in forward_ops(3, relay=True) if op.kind == REDUCE and op.hop == 1]
    plan.save(tmp_path / "p.pt")
    back = Plan.load(tmp_path / "p.pt")
    assert back.relay.num_stages == 2
    assert torch.equal(back.relay.stage("kv", 2, "return").via, plan.relay.stage("kv", 2, "return").via)
    assert torch.equal(back.pair_bytes("bwd", stage=2, hop=1), plan.pair_bytes("bwd", stage=2, hop=1))


def _forwarding_waits(ops):
    """The waits whose result a later hop forwards (a relay's or an egress's merge): the deps of
    the reduces of hop 1 and hop 3 that depend on a wait."""
    names = {op.name: op for op in ops}
    return {d for op in ops if op.kind == REDUCE and op.hop in (1, 3) for d in op.deps if names[d].kind == WAIT}


def test_relay_stages_merges_on_comm_stream():
    """The relays' and egresses' merges wait on the comm stream (only what is queued after them
    there waits), every other wait on the compute stream, and nothing on the compute stream
    depends on a comm-stream wait."""
    for egress in (False, True):
        for S, reduces, ops in ((4, 1, forward_ops(5, relay=True, egress=egress)),
                                (4, 2, backward_ops(5, True, relay=True, egress=egress)),
                                (2, 2, backward_ops(3, False, relay=True, egress=egress))):
            merges = _forwarding_waits(ops)  # per sub-stage and reduce: the relay's, and the egress's
            assert len(merges) == S * reduces * (2 if egress else 1)
            assert {op.name for op in ops if op.kind == WAIT and op.stream == COMM} == merges
            names = {op.name: op for op in ops}
            for op in ops:
                if op.stream == COMPUTE:
                    assert not set(op.deps) & merges, op.name
                if op.kind == REDUCE and op.hop in (1, 3):  # fed by its own sub-stage's merge
                    (dep,) = op.deps
                    assert names[dep].stages == op.stages and names[dep].phase == op.phase


def test_relay_stages_merges_hide_behind_compute():
    """Priced by the simulator, the comm-stream merges end each pass no later than the same op
    lists with those waits on the compute stream (the schedule before), and earlier where attention
    is long: a relay no longer holds its node's partials until its own next attention ends."""
    from dataclasses import replace

    from gpusolver.sim.layer import _priced, pass_time
    from gpusolver.topology import Topology

    P, per_node = 16, 4
    _, plan, _, _ = _stage_plans("docs-full", P, per_node, 4)
    slow = Topology(ranks_per_node=per_node, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=0.1, name="slow")
    for phase in ("fwd", "bwd"):
        ops = _priced(plan, phase, slow, plan.cost, True, "p2p")
        before = [replace(op, stream=COMPUTE) if op.stream == COMM and not op.collective else op for op in ops]
        assert any(op.stream == COMM and not op.collective for op in ops)
        now, then = pass_time(ops, P, slow).ms, pass_time(before, P, slow).ms
        assert now < then, (phase, now, then)


def test_relay_stages_when_asked():
    """ib_relay True relays sub-stage plans; None (default) and False keep direct (relay is simulated
    worse than direct by more than 2 % in three P = 16 cells at S = 4); bad stage arguments are named."""
    topo = _topology(4)
    assert not relay_transport(make_config(8, 4, 2, topology=topo, num_stages=4))
    assert relay_transport(make_config(8, 4, 2, topology=topo, num_stages=1))
    assert relay_transport(make_config(8, 4, 2, topology=topo, num_stages=2, ib_relay=True))
    assert not relay_transport(make_config(8, 4, 2, topology=topo, num_stages=2, ib_relay=False))
    _, plan, _, _ = _stage_plans("docs-causal", 8, 4, 2)
    with pytest.raises(ValueError, match="stage must be an int in \\[1, 2\\]"):
        plan.relay.stage("qo", 3)
    with pytest.raises(ValueError, match="which must be"):
        plan.relay.stage("qo", 1, "back")
    with pytest.raises(ValueError, match="unknown buffers"):
        relay_rows(make_config(8, 4, 2, topology=topo), 16, 4, qo_relays=3)


@pytest.mark.usefixtures("few_solve_rounds")
def test_relay_stages_layer_on_meta():
    """DynamicCPAttention with sub-stages on a two-node topology: solve, per-stage relay, backward on meta."""
    check_layer_on_meta(num_stages=2, ib_relay=True)


def _gloo_rank(rank, P, transport):
    c, Hq, Hkv, S = 16, 4, 2, 2
    _, plan, mask, _ = _stage_plans("docs-full", P, 2, S, c=c, Hq=Hq, Hkv=Hkv, seed=8)
    import gpusolver.runtime.relay_stages as relay_stages

    group = TorchGroup(transport=transport)
    seen = record_operand_rows()  # X's receive rows, the running out and sums, the egress buffers
    gathered, gather = [], relay_stages._gather_remote  # the rows of each reduce's buffer

    def recorded(x, idx, n, lead, dtype):
        gathered.append(idx.shape[0])
        return gather(x, idx, n, lead, dtype)

    relay_stages._gather_remote = recorded
    q, k, v, d_out, d_lse = make_inputs(P * c, Hq, Hkv, seed=8)
    qs, ks, vs = (shard(x, group).clone().requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    keys = [(ph, s, h) for ph in PHASES for s in range(1, S + 1) for h in (0, 1, 2, 3)]
    counted = {key: group.traffic(hop_phase(stage_phase(key[0], key[1]), key[2])) for key in keys}
    want = {}
    for ph, s, h in keys:
        pb = plan.pair_bytes(ph, stage=s, hop=h)
        want[ph, s, h] = (int(pb[rank].sum()), int(pb[:, rank].sum()))
    # this rank's fills: X's receive rows per kind and each egress buffer's (hop 3), from the plan
    relay = plan.relay
    egress = {int(sum(relay.stage(kind, s, "cast").split(3)[:, rank].sum() for s in range(1, S + 1)))
              for kind in ("qo", "kv")}
    fills = {int(plan.comm.qo_recv_rows[rank]), int(plan.comm.kv_recv_rows[rank])} | egress
    caps = (plan.comm.qo_recv_capacity, plan.comm.kv_recv_capacity)
    back = {kind: [int(x) for x in plan.comm.stage_split(kind, "return")[:, :, rank].sum(1)] for kind in ("qo", "kv")}
    returned = sorted([n for n in back["qo"] for _ in range(3)] + [n for n in back["kv"] for _ in range(2)])
    return {"got": dict(zip(KEYS, (out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad))),
            "counted": counted, "want": want, "ib": int(plan.pair_bytes("fwd", hop=1).sum()),
            "rows": (set(seen), fills, caps), "gathered": (sorted(gathered), returned)}


def test_relay_stages_gloo_two_nodes_of_two():
    P, c = 4, 16
    results = run_ranks(_gloo_rank, P, "p2p", timeout=120)
    ref = reference(make_mask("docs-full", P * c, seed=8), *make_inputs(P * c, 4, 2, seed=8))
    assert results[0]["ib"] > 0  # rows crossed by relay
    for rank, res in enumerate(results):
        rows = slice(rank * c, (rank + 1) * c)
        for key in KEYS:
            assert_close(f"rank {rank} {key}", ref[key][rows], res["got"][key], atol=ATOL, rtol=RTOL)
        assert res["counted"] == res["want"], f"rank {rank}"
        # on TorchGroup every operand, sum and egress buffer holds this rank's fill, not a capacity
        seen, fills, _ = res["rows"]
        assert seen <= fills, f"rank {rank}: operand rows {sorted(seen)}, fills {sorted(fills)}"
        # and each reduce's partials (forward O and lse, backward dQ, dK and dV) the rows it returns
        assert res["gathered"][0] == res["gathered"][1], f"rank {rank}: gathered {res['gathered']}"
    assert any(max(r["rows"][0]) < min(r["rows"][2]) for r in results), "no rank below the capacity"


def test_relay_stages_hold_one_sub_stage_of_partials(monkeypatch):
    """A sub-stage's partials, gathered for its reduce, are dropped once its relay hop (2) and its
    direct hop (0) have taken their rows: when the next ones are gathered, none of an earlier
    sub-stage's are alive (they were held to the end of the pass). The direct hop home reduces
    straight into the host's running rows (``group_reduce(inplace=True)``), so no returned result
    waits for the end of the pass either; the relay hop merges onto the relay's own rows, out of place."""
    import gpusolver.runtime.relay_stages as relay_stages
    from tests.gpusolver.runtime._cases import make_inputs
    from tests.gpusolver.runtime.test_relay import _run

    _, plan, mask, _ = _stage_plans("docs-full", 16, 4, 4)
    alive, at_gather = [], []
    gather = relay_stages._gather_remote

    def tracked(*a, **k):
        out = gather(*a, **k)
        at_gather.append(sum(alive))
        alive.append(1)
        weakref.finalize(out, alive.__setitem__, len(alive) - 1, 0)
        return out

    issued = []
    reduce = relay_stages.group_reduce

    def recorded(*a, phase, inplace=False, **k):
        issued.append((phase, inplace))
        return reduce(*a, phase=phase, inplace=inplace, **k)

    monkeypatch.setattr(relay_stages, "_gather_remote", tracked)
    monkeypatch.setattr(relay_stages, "group_reduce", recorded)
    _run(plan, LocalGroup(16), make_inputs(16 * 16, 4, 2, seed=3))
    S = plan.num_stages
    assert len(at_gather) == 2 * S + 3 * S  # fwd: out, lse per sub-stage; bwd: dq, and dk, dv
    # the sub-stage's own tensors (out then lse; dq; dk then dv) may be alive, no earlier sub-stage's
    assert at_gather == [0, 1] * S + [0, 0, 1] * S, at_gather
    direct = [inplace for phase, inplace in issued if ":hop" not in phase]
    relayed = [inplace for phase, inplace in issued if ":hop2" in phase]
    assert len(direct) == 3 * S and all(direct)  # fwd.o, bwd.dq, bwd.dkv per sub-stage
    assert len(relayed) == 3 * S and not any(relayed)
