"""benchmarks/relay_fill.py: the relay buffers' fills it prints are the routes' own, within the capacities."""
import torch

from tests.benchmarks._load import load_bench


def test_fills_are_the_routes_rows_within_capacity(tmp_path, capsys):
    mod = load_bench("relay_fill.py")
    md = tmp_path / "fill.md"
    args = ["--P", "16", "--kinds", "causal", "--tokens-per-rank", "64", "--plan-cache", str(tmp_path / "plans")]
    one = mod.main(args + ["--md", str(md)])
    two = mod.main(args + ["--stages", "2"])  # the same assignment, from the cache
    (row,) = one
    assert row["kv_relay"] > 0  # this mask crosses nodes by relay: the checks below are not 0 <= x
    for kind in ("qo", "kv"):
        for b in mod.BUFFERS:
            assert 0 <= row[f"{kind}_{b}"] <= row[f"{kind}_{b}_cap"], (kind, b)
            # sub-stages split the same transfers over their casts and cross each hull once: the
            # shared buffers hold what the one-stage plan's hold
            assert two[0][f"{kind}_{b}"] == row[f"{kind}_{b}"], (kind, b)
    assert "Largest fill / capacity per P" in md.read_text() and "KV relay" in capsys.readouterr().out


def test_relay_fill_counts_each_hop_at_its_receiver():
    """relay: the hop-1 rows each rank receives; fan: the hop-2 rows it sends; egress: the hop-3 rows
    it receives (the split matrices' columns and rows)."""
    from gpusolver import SolverConfig, block_areas
    from gpusolver.masks import varlen_causal_mask
    from gpusolver.plan.build import build_plan
    from gpusolver.solve import solve_assignment
    from gpusolver.topology import Topology

    mod = load_bench("relay_fill.py")
    topo = Topology(ranks_per_node=4, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0, name="test")
    config = SolverConfig(cp_size=8, num_heads_q=4, num_heads_kv=2, head_dim=16, topology=topo,
                          ib_relay=True, num_stages=1)
    mask = varlen_causal_mask([200, 56, 120, 136])
    areas = block_areas(mask, 8, config.head_groups, impl="torch")
    plan = build_plan(mask, areas, solve_assignment(areas, config, impl="torch"), config)
    unit = config.head_groups * 64
    fill = mod.relay_fill(plan, unit)
    for kind in ("qo", "kv"):
        route = plan.relay.route(kind)
        assert fill[f"{kind}_relay"] == int(route.split(1).sum(0).max()) / unit
        assert fill[f"{kind}_fan"] == int(route.split(2).sum(1).max()) / unit
        assert fill[f"{kind}_egress"] == int(route.split(3).sum(0).max()) / unit
    assert torch.equal(plan.relay.route("kv").relay_rows, plan.relay.route("kv").split(1).sum(0))
