"""The critical path of a simulated pass: worked by hand, and contiguous from 0 to the pass's end."""
import dataclasses

import pytest
import torch

from gpusolver import SolverConfig, block_areas, solve
from gpusolver.masks import varlen_causal_mask
from gpusolver.sim import SimOp, run_ops, simulate, simulate_baseline
from gpusolver.sim.critical import critical_path, describe, summary
from gpusolver.topology import Topology

# 100 B/s inside a node, 25 B/s across; 0.1 s per transfer inside a node
TOPO = Topology(ranks_per_node=2, nvlink_gbps=1e-7, ib_gbps=2.5e-8, attn_tflops=1.0, nvlink_latency_us=1e5)


def _kinds(path):
    return [(s.kind, s.rank, s.label, pytest.approx(s.start), pytest.approx(s.end)) for s in path]


def test_compute_posting_latency_transfer_compute_by_hand():
    """Rank 1 posts its receive at 0.5 s, rank 0 its send at 1.0 s (after its longer compute): the 200 B
    leave 0.1 s later and land at 3.1 s; rank 1 then computes 0.25 s. The chain: rank 0's compute (the
    later poster), the latency, the transfer, rank 1's compute."""
    ops = [SimOp("a", "compute", duration=(1.0, 0.5), label="a"),
           SimOp("x", "comm", deps=("a",), transfers=((0, 1, 200),), mode="p2p", label="x"),
           SimOp("w", "compute", deps=("x",)),
           SimOp("b", "compute", deps=("w",), duration=(0.1, 0.25), label="b")]
    run = run_ops(ops, 2, TOPO)
    assert run.makespan == pytest.approx(3.35)
    path = critical_path(run, ops)
    assert _kinds(path) == [("compute", 0, "a", 0.0, 1.0), ("latency", 0, "x", 1.0, 1.1),
                            ("transfer", 1, "x", 1.1, 3.1), ("compute", 1, "b", 3.1, 3.35)]
    assert path[2].src == 0 and path[2].nbytes == 200 and path[2].link == "nvlink"
    parts = summary(path)
    assert parts["compute"] == pytest.approx(1.25) and parts["latency"] == pytest.approx(0.1)
    assert parts["transfers"] == {("x", "nvlink"): pytest.approx(2.0)}


def test_a_busy_link_hands_the_chain_to_the_transfer_ahead():
    """Rank 0 sends 100 B to rank 1, then 100 B to rank 2 through its one NVLink send side (no
    latency): the second waits for the first, so rank 2's end is the two transfers back to back."""
    topo = Topology(ranks_per_node=4, nvlink_gbps=1e-7, ib_gbps=1e-7, attn_tflops=1.0)
    ops = [SimOp("x", "comm", transfers=((0, 1, 100), (0, 2, 100)), mode="p2p", label="x")]
    run = run_ops(ops, 4, topo)
    assert run.end["x"] == pytest.approx([0.0, 1.0, 2.0, 0.0])
    path = critical_path(run, ops)
    assert [(s.kind, s.src, s.rank, s.link) for s in path] == [("transfer", 0, 1, "nvlink"), ("transfer", 0, 2, "nvlink")]
    assert [s.start for s in path] == pytest.approx([0.0, 1.0]) and path[-1].end == pytest.approx(2.0)


def test_an_all_to_all_waits_for_its_last_poster_and_busiest_side():
    ops = [SimOp("a", "compute", duration=(0.5, 2.0)),
           SimOp("x", "comm", deps=("a",), transfers=((0, 1, 100), (1, 0, 50)), mode="a2a", label="x")]
    run = run_ops(ops, 2, TOPO)
    path = critical_path(run, ops)
    # rank 1 posts last (2.0 s), the latency, then rank 0's send side (100 B, the busiest) for 1 s
    assert _kinds(path) == [("compute", 1, "a", 0.0, 2.0), ("latency", 1, "x", 2.0, 2.1),
                            ("transfer", -1, "x", 2.1, 3.1)]


def _contiguous(path, ms):
    assert path and path[0].start == pytest.approx(0.0, abs=1e-12)
    assert path[-1].end * 1e3 == pytest.approx(ms, rel=1e-12)
    for a, b in zip(path, path[1:]):
        assert b.start == pytest.approx(a.end, abs=1e-12), (a, b)
    assert sum(summary(path)[k] for k in ("compute", "transfer", "latency")) * 1e3 == pytest.approx(ms, rel=1e-9)


@pytest.mark.parametrize("comm", ["p2p", "a2a", "p2p-batch"])
@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_every_pass_is_covered_from_zero_to_its_end(comm, relay):
    """A solved plan across two nodes (sub-stages and the local tail, or relay transport) and the
    baselines: each pass's path runs from 0 to its end without a gap, and its parts add up to it."""
    topo = Topology(ranks_per_node=2, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=1e-3, nvlink_latency_us=10.0,
                    ib_latency_us=20.0, rail_routing=True)
    P = 4
    config = SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=2, head_dim=32, dtype=torch.float32, topology=topo,
                          ib_relay=relay)
    mask = varlen_causal_mask([40, 150, 66])
    plan = solve(mask, config)
    assert bool(plan.relay is not None) == relay
    layer = simulate(plan, topo, comm=comm)
    d = layer.to_dict()
    for name in ("fwd", "bwd"):
        assert sum(d[f"critical_{name}_{k}_ms"] for k in ("compute", "transfer", "latency")) == \
            pytest.approx(d[f"{name}_ms"], rel=1e-9)
    for pt in (layer.fwd, layer.bwd):
        _contiguous(pt.critical, pt.ms)
        assert any(s.kind != "compute" for s in pt.critical) or pt.ms == pytest.approx(pt.compute_ms)
        assert describe(pt.critical)[0].startswith("critical path (simulated): compute")
    areas = block_areas(mask, P, 1, impl="torch")
    for kind in ("usp", "usp_balanced", "ring"):
        base = simulate_baseline(kind, mask, dataclasses.replace(config, ib_relay=None), topo, areas=areas)
        for pt in (base.fwd, base.bwd):
            _contiguous(pt.critical, pt.ms)


def test_nothing_ran():
    assert critical_path(run_ops([], 2, TOPO), []) == []
    assert describe([]) == ["critical path: nothing ran"]


def test_the_timeline_traces_the_critical_path(tmp_path):
    """The PNG draws with the chain over it, across nodes (transfers on the receive rows) and over a2a."""
    from gpusolver.sim.timeline import draw_timeline

    topo = Topology(ranks_per_node=2, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=1e-3, ib_latency_us=20.0)
    config = SolverConfig(cp_size=4, num_heads_q=4, num_heads_kv=2, head_dim=32, dtype=torch.float32, topology=topo)
    plan = solve(varlen_causal_mask([40, 150, 66]), config)
    for comm in ("p2p", "a2a"):
        layer = simulate(plan, topo, comm=comm)
        assert any(s.kind == "transfer" and s.rank >= 0 for s in layer.fwd.critical + layer.bwd.critical) or comm == "a2a"
        out = tmp_path / f"{comm}.png"
        draw_timeline(layer, out, title=comm)
        assert out.read_bytes()[:4] == b"\x89PNG"
