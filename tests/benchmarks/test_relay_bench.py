"""benchmarks/relay_bench.py at a small size: it writes its table and JSON, and relay never moves more
InfiniBand bytes than direct transport on the same assignment."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_relay_bench_small(tmp_path, capsys):
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("_bench_relay", _BENCH / "relay_bench.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        out = mod.main(["--P", "16", "--kinds", "full", "--tokens", "64", "--no-topology-solve",
                        "--plan-cache", str(tmp_path / "plans"), "--json", str(tmp_path / "r.json"),
                        "--md", str(tmp_path / "r.md"), "--stages", "2", "--stages-json", str(tmp_path / "s.json"),
                        "--stages-md", str(tmp_path / "s.md")])
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
    direct, relay = out["rows"]
    assert (direct["transport"], relay["transport"]) == ("direct", "relay")
    assert relay["ib_fwd_mb"] <= direct["ib_fwd_mb"] and relay["ib_vs_direct"] <= 1.0
    assert 0 < relay["relayed"] <= 1 and direct["relayed"] is None
    assert "simulated" in (tmp_path / "r.md").read_text()
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 2
    # today's plan cached for the next run, named by what its solve priced: the budget keeps part of Q,
    # priced as kept (keeping everything's name)
    assert list((tmp_path / "plans").glob("full_P16_s0_c64.pt"))
    assert "| full | 16 | relay |" in capsys.readouterr().out
    # the step table: S = 1 and S = 2, direct and relay, next to USP and load-balanced USP
    steps = out["steps"]
    got = {(r["S"], r["transport"], r["comm"]) for r in steps}
    assert {(1, "direct", "a2a"), (1, "relay", "a2a"), (2, "direct", "p2p"), (2, "relay", "p2p"),
            (2, "relay", "a2a"), (None, "USP", ""), (None, "bal. USP", "")} <= got
    usp = next(r for r in steps if r["transport"] == "USP")
    assert all(abs(r["step_vs_usp"] - r["step_ms"] / usp["step_ms"]) < 1e-12 for r in steps)
    assert "SIMULATED" in (tmp_path / "s.md").read_text()


def test_relay_bench_pricing_small(tmp_path):
    """``--pricing`` at S = 4 (the default): the three (priced, runs) cases, (b) the default's own, (c) relay plans."""
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("_bench_relay_pricing", _BENCH / "relay_bench.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        out = mod.main(["--P", "16", "--kinds", "full", "--tokens", "64", "--pricing", "--stages", "4",
                        "--seeds", "0", "--plan-cache", str(tmp_path / "plans"),
                        "--pricing-json", str(tmp_path / "p.json"), "--pricing-md", str(tmp_path / "p.md")])
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
    rows = {r["case"]: r for r in out["pricing"]}
    assert [(rows[c]["priced"], rows[c]["runs"]) for c in ("(a)", "(b)", "(c)")] == [
        ("relay", "direct"), ("direct", "direct"), ("relay", "relay")]
    assert [rows[c]["default"] for c in ("(a)", "(b)", "(c)")] == [False, True, False]
    assert rows["(b)"]["step_vs_b"] == 1.0 and all(r["status"] == 0 for r in rows.values())
    assert all(abs(r["step_vs_usp"] - r["step_ms"] / r["usp_step_ms"]) < 1e-12 for r in rows.values())
    assert "SIMULATED" in (tmp_path / "p.md").read_text()
    assert len(json.loads((tmp_path / "p.json").read_text())["rows"]) == 3


def test_relay_bench_balance_small(tmp_path):
    """``--balance --balance-relay`` at S = 4: mu = 1.10 (b), imbalance_auto (d), a fixed tighter bound
    (e), and relay transport at mu = 1.10 (f) and at the tighter one (g) per cell, each plan within its
    bound, the solve seconds kept with the cached plan."""
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("_bench_relay_balance", _BENCH / "relay_bench.py")
    mod = importlib.util.module_from_spec(spec)
    argv = ["--P", "16", "--kinds", "full", "--tokens", "64", "--balance", "--balance-relay", "--balance-tols", "1.03",
            "--seeds", "0", "--plan-cache", str(tmp_path / "plans"),
            "--balance-json", str(tmp_path / "b.json"), "--balance-md", str(tmp_path / "b.md")]
    try:
        spec.loader.exec_module(mod)
        with pytest.raises(SystemExit):  # relay cases without the table they join
            mod.main(["--balance-relay"])
        out = mod.main(argv)
        again = mod.main(argv)  # read back from the plan cache
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
    rows = out["balance"]
    assert [(r["case"], r["config"]) for r in rows] == [
        ("(b)", "imbalance_tol=1.10"), ("(d)", "imbalance_auto=True"), ("(e)", "imbalance_tol=1.03"),
        ("(f)", "relay imbalance_tol=1.10"), ("(g)", "relay imbalance_tol=1.03")]
    b, d, e, f, g = rows
    assert b["mu"] == 1.10 and e["mu"] == 1.03 and d["mu"] in (1.10, 1.06, 1.04, 1.02)
    assert f["mu"] == 1.10 and g["mu"] == 1.03
    assert [r["transport"] for r in rows] == ["direct"] * 3 + ["relay"] * 2
    assert all(r["imbalance"] <= r["mu"] + 1e-9 and r["status"] == 0 for r in rows)
    assert b["step_vs_b"] == 1.0 and b["solve_vs_b"] == 1.0 and all(r["solve_s"] > 0 for r in rows)
    assert all(abs(r["step_vs_usp_bal"] - r["step_ms"] / r["usp_balanced_step_ms"]) < 1e-12 for r in rows)
    assert [r["solve_s"] for r in again["balance"]] == [r["solve_s"] for r in rows]
    assert len(list((tmp_path / "plans").glob("full_P16_s0_c64_h200_hgx_bal_*.pt"))) == 5
    assert len(list((tmp_path / "plans").glob("full_P16_s0_c64_h200_hgx_bal_relay_*.pt"))) == 2
    # the floor columns: the mask's (one per cell), the plan's busiest compute over it is the plan's imbalance
    assert len({r["floor_ms"] for r in rows}) == 1 and all(r["usp_target"] == 0.85 for r in rows)
    assert all(abs(r["compute_ms"] / r["floor_ms"] - r["imbalance"]) < 1e-6 for r in rows)
    assert all(abs(r["floor_vs_target"] - r["floor_ms"] / (0.85 * r["usp_step_ms"])) < 1e-12 for r in rows)
    assert all(r["ib_fwd_vs_usp"] > 0 and r["ib_vs_today"] > 0 and r["solve_vs_today"] > 0 for r in rows)
    assert len(list((tmp_path / "plans").glob("full_P16_s0_c64_today.pt"))) == 1
    text = (tmp_path / "b.md").read_text()
    assert "SIMULATED" in text and "| step / bal. USP |" in text and "| solve / (b) |" in text
    assert "| compute floor ms |" in text and "| floor / (target x USP) |" in text and "no plan reaches it" in text
    assert "(f) relay" in text and "(g) relay imbalance_tol=1.03" in text
    assert text.count("| full | 16 | 0 |") == 5
    assert len(json.loads((tmp_path / "b.json").read_text())["rows"]) == 5


def test_compute_floor_is_the_simulators_mean_compute():
    """``compute_floor_ms`` prices at the simulator's rates: load-balanced USP's busiest compute (every ring
    step at the mean area) is exactly the floor, and an owner-computes plan's simulated busiest compute over
    the floor is that plan's max / mean compute (so never below the floor)."""
    saved_path = list(sys.path)
    spec = importlib.util.spec_from_file_location("_bench_relay_floor", _BENCH / "relay_bench.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved_path
    from gpusolver.areas import block_areas
    from gpusolver.config import SolverConfig
    from gpusolver.metrics import owner_computes_assignment
    from gpusolver.plan.build import build_plan
    from gpusolver.sim import simulate, simulate_baseline
    from gpusolver.topology import Topology

    topo = Topology.preset("h200_hgx")
    mask = mod.make_mask("causal", 16, 0, tokens_per_rank=64)
    config = SolverConfig(cp_size=16)
    areas = block_areas(mask, 16, config.head_groups, impl="torch")
    floor = mod.compute_floor_ms(areas, config, topo)
    assert floor > 0
    # the head groups of the areas do not change it
    assert abs(mod.compute_floor_ms(block_areas(mask, 16, 1, impl="torch"), config, topo) - floor) <= 1e-9 * floor
    bal = simulate_baseline("usp_balanced", mask, config, topo)
    assert abs(bal.compute_ms - floor) <= 1e-9 * floor
    plan = build_plan(mask, areas, owner_computes_assignment(areas), config)
    busiest = simulate(plan, topo).compute_ms
    imbalance = float(plan.metrics.imbalance)
    assert imbalance > 1.01  # causal packed documents: owner-computes is uneven, so this is not 1 == 1
    assert abs(busiest / floor - imbalance) < 1e-6 and busiest >= floor
