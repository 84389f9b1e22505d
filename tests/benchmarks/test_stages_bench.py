"""benchmarks/stages_bench.py on one small mask: every (S, transport) row, ratios against S = 1, the summary."""
import json
import math

import pytest

from tests.benchmarks._load import load_bench


def _load():
    return load_bench("stages_bench.py")


def test_stages_bench_quick(tmp_path, capsys):
    mod = _load()
    path = tmp_path / "s.json"
    mod.main(["--P", "8", "--kinds", "causal", "--tokens-per-rank", "256", "--stages", "1,2", "--json", str(path)])
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "Summary over the masks" in text
    rows = json.loads(path.read_text())["rows"]
    assert [(r["S"], r["comm"]) for r in rows] == [(1, "a2a"), (1, "p2p"), (2, "a2a"), (2, "p2p")]
    for r in rows:
        assert math.isfinite(r["step_ms"]) and r["step_ms"] >= r["ideal_ms"] * (1 - 1e-9)
        # fwd 3 S, bwd 3 S (kept buffers), S > 1 with the local tail's empty sub-stage too
        assert r["collectives"] == (6 if r["S"] == 1 else 18)
    assert rows[0]["vs_s1"] == 1.0 and rows[2]["vs_s1"] == rows[2]["step_ms"] / rows[0]["step_ms"]


def test_stages_bench_solves_on_the_topology(tmp_path, capsys):
    """--solve-topology solves with SolverConfig(topology=...) and caches that assignment apart from
    the topology-free one (the two solves give different plans, so they must not share a file); its
    file names the default mu across nodes (1.05) and the buffer capacities sized for P = 16 across
    nodes (1.5 / 8 / 2 / 8 G·c) and the kept buffers its solve priced (the memory budget's), so plans
    cached at 1.10, at other capacities or priced for another backward are not read for it."""
    mod = _load()
    cache = tmp_path / "plans"
    # each solve priced the backward the memory budget gives at c = 64: part of Q kept, priced as kept
    topo_file = "causal_P16_s0_c64_topo_mu1.05_caps1.5-8-2-8.pt"
    free_file = "causal_P16_s0_c64.pt"
    args = ["--P", "16", "--kinds", "causal", "--tokens-per-rank", "64", "--stages", "1,4", "--comm", "a2a,p2p",
            "--plan-cache", str(cache)]
    rows = mod.main(args + ["--solve-topology", "--json", str(tmp_path / "t.json")])
    assert "solved on the topology" in capsys.readouterr().out
    assert sorted(p.name for p in cache.iterdir()) == [topo_file]
    mod.main(args + ["--json", str(tmp_path / "n.json")])
    assert "solved without a topology" in capsys.readouterr().out
    assert sorted(p.name for p in cache.iterdir()) == [free_file, topo_file]
    from gpusolver.plan.io import load_plan_config
    topo = load_plan_config(cache / topo_file)
    assert topo.topology is not None and topo.imbalance_tol == 1.05 and topo.auto_mu
    assert load_plan_config(cache / free_file).topology is None
    for r in rows:
        assert math.isfinite(r["step_ms"]) and r["step_ms"] >= r["ideal_ms"] * (1 - 1e-9)


def test_stages_bench_needs_the_a2a_baseline(capsys):
    with pytest.raises(SystemExit):
        _load().main(["--P", "8", "--comm", "p2p"])
    assert "--comm must include a2a" in capsys.readouterr().err
