"""The layer simulator: exact times of hand-worked schedules, and the ideal bound as a floor."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusolver import SolverConfig, block_areas
from gpusolver.masks import full_mask, varlen_causal_mask
from gpusolver.plan import build_plan
from gpusolver.sim import SimOp, run_ops, simulate, simulate_baseline
from gpusolver.sim.layer import ideal_seconds
from gpusolver.topology import Topology

D, HQ, HKV = 32, 4, 2


def _config(P, **kw):
    return SolverConfig(cp_size=P, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D, dtype=torch.float32, **kw)


def _plan(mask, P, assignment, **kw):
    config = _config(P, **kw)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg = torch.where(areas.area > 0, torch.as_tensor(assignment, dtype=torch.int32), -1)
    return build_plan(mask, areas, asg, config), areas


def _two_rank_plan():
    # two documents of 48 and 80 tokens over 2 ranks of 64: blocks (0,0), (1,0), (1,1) are non-empty;
    # group 0 computes task (1, 0) on rank 0 (Q of chunk 1 travels), group 1 on rank 1 (K, V of chunk 0 travel)
    mask = varlen_causal_mask([48, 80])
    G = HKV
    asg = torch.zeros(G, 2, 2, dtype=torch.int32)
    asg[:, 1, 1] = 1
    asg[0, 1, 0], asg[1, 1, 0] = 0, 1
    return _plan(mask, 2, asg, num_stages=1)  # the two-stage layer the schedule below is worked out for


def _by_hand(plan, areas, topo, inter):
    """The two-rank schedule worked out on paper: casts back to back on the comm stream while stage 0
    runs, stage 1 after both, then the reduce; backward: dO cast awaited, both stages, dQ then dK, dV."""
    cost = plan.cost
    bw = (topo.ib_gbps if inter else topo.nvlink_gbps) * 1e9
    lat = (topo.ib_latency_us if inter else topo.nvlink_latency_us) * 1e-6
    qs, ks = plan.comm.qo_split.tolist(), plan.comm.kv_split.tolist()

    def a2a(split, row, back=False):  # busiest link side of a 2-rank exchange
        return lat + max(split[0][1], split[1][0]) * row / bw if max(split[0][1], split[1][0]) else lat

    a, st = plan.assignment.long(), plan.task_stage.long()
    area = areas.area

    def compute(r, s, phase):
        entries = int(area[(a == r) & (st == s)].sum())
        return 4 * D * cost.hq * entries * (2.5 if phase == "bwd" else 1.0) / (topo.attn_tflops * 1e12)

    cast = a2a(qs, cost.q_fwd) + a2a(ks, cost.kv_fwd)
    fwd = max(max(compute(r, 0, "fwd"), cast) + compute(r, 1, "fwd") for r in range(2)) + a2a(qs, cost.o_fwd)
    bwd = (a2a(qs, cost.q_bwd) + max(compute(r, 0, "bwd") + compute(r, 1, "bwd") for r in range(2))
           + a2a(qs, cost.dq_bwd) + a2a(ks, cost.dkv_bwd))
    return fwd * 1e3, bwd * 1e3


@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes"])
def test_two_ranks_exact(nodes):
    plan, areas = _two_rank_plan()
    assert int(plan.comm.qo_split[1, 0]) > 0 and int(plan.comm.kv_split[0, 1]) > 0  # both kinds travel
    topo = Topology(ranks_per_node=2 // nodes, nvlink_gbps=2.0, ib_gbps=0.5, attn_tflops=1e-3,
                    nvlink_latency_us=3.0, ib_latency_us=7.0)
    t = simulate(plan, topo)
    fwd, bwd = _by_hand(plan, areas, topo, inter=nodes == 2)
    assert t.fwd_ms == pytest.approx(fwd, rel=1e-12)
    assert t.bwd_ms == pytest.approx(bwd, rel=1e-12)
    assert t.step_ms == pytest.approx(fwd + bwd, rel=1e-12)
    assert t.ideal_ms <= t.step_ms and t.compute_ms <= t.step_ms
    lanes = {i.lane for i in t.fwd.timeline}
    assert ("ib send" in lanes) == (nodes == 2) and ("nvlink send" in lanes) == (nodes == 1)


def test_p2p_sends_one_by_one():
    # rank 0 sends 100 B to 1 and to 2 on one NVLink send side: the second waits for the first;
    # rank 3's 50 B to rank 2 go first, while rank 2's receive side is still free. "p2p" (the runtime's
    # TorchGroup p2p): a rank is done when its incoming rows are; rank 0 and 3 only send, done at once
    topo = Topology(ranks_per_node=4, nvlink_gbps=1e-7, ib_gbps=1.0, attn_tflops=1.0)  # 100 B/s
    ops = [SimOp("x", "comm", transfers=((0, 1, 100), (0, 2, 100), (3, 2, 50)), mode="p2p")]
    run = run_ops(ops, 4, topo)
    assert run.end["x"] == pytest.approx([0.0, 1.0, 2.0, 0.0])
    a2a = run_ops([SimOp("x", "comm", transfers=ops[0].transfers, mode="a2a")], 4, topo)
    assert a2a.end["x"] == pytest.approx([2.0] * 4)  # the busiest side (rank 0's send: 200 B)


def test_p2p_batch_waits_for_the_sends_too():
    """One handle for the batch (NCCL's coalesced p2p): the same placement, but a rank is done when its
    sends have landed too (rank 0: its second 100 B at 2 s; rank 3: its 50 B at 0.5 s)."""
    topo = Topology(ranks_per_node=4, nvlink_gbps=1e-7, ib_gbps=1.0, attn_tflops=1.0)  # 100 B/s
    moves = ((0, 1, 100), (0, 2, 100), (3, 2, 50))
    run = run_ops([SimOp("x", "comm", transfers=moves, mode="p2p-batch")], 4, topo)
    assert run.end["x"] == pytest.approx([2.0, 1.0, 2.0, 0.5])
    with pytest.raises(ValueError, match="mode must be"):
        run_ops([SimOp("x", "comm", transfers=moves, mode="p2p-recv")], 4, topo)


def test_what_if_transports_never_slower_and_bounded():
    """A sub-stage plan across two nodes: waiting on the receives only (p2p against p2p-batch), then
    reduces on their own stream too, do not lengthen its simulated step, which stays at or above the ideal bound."""
    P = 4
    mask = varlen_causal_mask([40, 100, 60, 56])
    config = _config(P, num_stages=3)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg = torch.where(areas.area > 0, (torch.arange(P).view(1, 1, P) + torch.arange(P).view(1, P, 1)) % P, -1)
    topo = Topology(ranks_per_node=2, nvlink_gbps=2.0, ib_gbps=0.5, attn_tflops=1e-3)
    plan = build_plan(mask, areas, asg.expand_as(areas.area).to(torch.int32), config, topology=topo)
    base = simulate(plan, topo, comm="p2p-batch")
    recv = simulate(plan, topo, comm="p2p")
    both = simulate(plan, topo, comm="p2p", reduce_stream=True)
    assert both.step_ms <= recv.step_ms * (1 + 1e-12) and recv.step_ms <= base.step_ms * (1 + 1e-12)
    assert both.step_ms >= both.ideal_ms * (1 - 1e-12) and both.ideal_ms == base.ideal_ms
    with pytest.raises(ValueError, match="comm must be"):
        simulate(plan, topo, comm="p2q")


def test_rail_routing_spreads_a_hosts_sends_over_its_nodes_nics():
    """Rank 0 sends 100 B to each rank of the other node. Through its own NIC the four go one after
    another (done at 1, 2, 3, 4 s); routed on the destination's rail (NCCL's point-to-point) each leaves
    through the NIC of rank 0's node-mate at the destination's local index, after an NVLink hop that
    holds rank 0's NVLink send side 0.01 s per transfer, so they land at 1, 1, 1.01 and 1.02 s."""
    own = Topology(ranks_per_node=4, nvlink_gbps=1e-5, ib_gbps=1e-7, attn_tflops=1.0)  # 10^4 and 100 B/s
    rail = dataclasses.replace(own, rail_routing=True)
    moves = tuple((0, d, 100) for d in range(4, 8))
    for mode in ("p2p", "p2p-batch"):
        assert run_ops([SimOp("x", "comm", transfers=moves, mode=mode)], 8, own).end["x"][4:] == \
            pytest.approx([1.0, 2.0, 3.0, 4.0])
        run = run_ops([SimOp("x", "comm", transfers=moves, mode=mode)], 8, rail)
        assert run.end["x"][4:] == pytest.approx([1.0, 1.0, 1.01, 1.02])
    sent = sorted((i.rank, i.start) for i in run.intervals if i.lane == "ib send")
    assert [r for r, _ in sent] == [0, 1, 2, 3] and [t for _, t in sent] == pytest.approx([0.0, 0.0, 0.01, 0.02])
    hops = sorted(i.rank for i in run.intervals if i.lane == "nvlink recv")
    assert hops == [1, 2, 3]  # the NVLink hop lands on the rail GPUs; rank 4 shares rank 0's rail
    # an all-to-all-v: each side moves its share back to back; the busiest is one NIC's 100 B (1 s)
    # against rank 0's NIC's 400 B (4 s) without rail routing
    assert run_ops([SimOp("x", "comm", transfers=moves)], 8, rail).end["x"] == pytest.approx([1.0] * 8)
    assert run_ops([SimOp("x", "comm", transfers=moves)], 8, own).end["x"] == pytest.approx([4.0] * 8)
    # the ideal bound prices the same sides
    assert ideal_seconds([0.0] * 8, moves, own, 8) == pytest.approx(4.0)
    assert ideal_seconds([0.0] * 8, moves, rail, 8) == pytest.approx(1.0)


@pytest.mark.parametrize("slow_link", [False, True], ids=["compute-bound", "link-bound"])
def test_ring_of_four_exact(slow_link):
    P, c = 4, 64
    config = SolverConfig(cp_size=P, num_heads_q=2, num_heads_kv=2, head_dim=D, dtype=torch.float32)
    topo = Topology(ranks_per_node=4, nvlink_gbps=10.0 if slow_link else 100.0, ib_gbps=1.0, attn_tflops=1.0)
    t = simulate_baseline("ring", full_mask(P * c), config, topo)
    T = 4 * D * 2 * c * c / 1e12                 # one ring step's attention forward (a full c x c block)
    Tb = 2.5 * T
    H = c * 2 * 2 * D * 4 / (topo.nvlink_gbps * 1e9)   # one K, V block hop (also one dK, dV hop)
    if slow_link:
        assert H > T
        assert t.fwd_ms == pytest.approx(1e3 * (3 * H + T), rel=1e-12)
    else:
        assert 2 * H <= Tb and H <= T
        assert t.fwd_ms == pytest.approx(1e3 * 4 * T, rel=1e-12)
        # the dK, dV accumulator moves after steps 1..3 (the last hop home), sharing the links with K, V
        assert t.bwd_ms == pytest.approx(1e3 * (4 * Tb + H), rel=1e-12)


def test_usp_balanced_never_slower_and_bad_input():
    P = 8
    mask = varlen_causal_mask([100, 300, 112])
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=8, head_dim=D, dtype=torch.float32)
    topo = Topology(ranks_per_node=4, nvlink_gbps=50.0, ib_gbps=5.0, attn_tflops=1e-2)
    usp = simulate_baseline("usp", mask, config, topo)
    bal = simulate_baseline("usp_balanced", mask, config, topo)
    assert bal.compute_ms <= usp.compute_ms + 1e-12
    with pytest.raises(ValueError, match="kind"):
        simulate_baseline("zigzag", mask, config, topo)
    with pytest.raises(ValueError, match="cp_size = 8"):
        simulate_baseline("usp", mask, config, Topology(ranks_per_node=3, nvlink_gbps=1.0, ib_gbps=1.0,
                                                         attn_tflops=1.0))
    with pytest.raises(TypeError, match="topology"):
        simulate(None, "h200_hgx")


@settings(max_examples=12, deadline=None)
@given(P=st.sampled_from([2, 4]), rpn=st.sampled_from([1, 2, 4]), seed=st.integers(0, 10_000),
       comm=st.sampled_from(["a2a", "p2p"]), lat=st.sampled_from([0.0, 5.0]))
def test_never_below_the_ideal_bound(P, rpn, seed, comm, lat):
    g = torch.Generator().manual_seed(seed)
    S = 16 * P
    cuts = sorted(set(torch.randint(1, S, (3,), generator=g).tolist()))
    mask = varlen_causal_mask([b - a for a, b in zip([0, *cuts], [*cuts, S])])
    plan, _ = _plan(mask, P, torch.randint(0, P, (HKV, P, P), generator=g))
    topo = Topology(ranks_per_node=min(rpn, P), nvlink_gbps=float(torch.randint(1, 50, (1,), generator=g)),
                    ib_gbps=1.0, attn_tflops=1e-3, nvlink_latency_us=lat, ib_latency_us=2 * lat)
    t = simulate(plan, topo, comm=comm)
    for p in ("fwd", "bwd"):
        pt = getattr(t, p)
        assert pt.ms >= pt.ideal_ms * (1 - 1e-12) and pt.ideal_ms >= pt.compute_ms * (1 - 1e-12)
        assert torch.equal(torch.tensor(pt.pair_bytes, dtype=torch.int64), plan.pair_bytes(p))
