"""benchmarks/critical_path_bench.py at a small size: the chain's parts add up to each pass."""
import json
import math

import pytest

from tests.benchmarks._load import load_bench


def test_critical_path_bench_quick(tmp_path, capsys):
    mod = load_bench("critical_path_bench.py")
    path = tmp_path / "c.json"
    mod.main(["--P", "16", "--kinds", "causal", "--tokens", "256", "--ib-scale", "2", "--json", str(path)])
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "Summed over the masks" in text
    out = json.loads(path.read_text())
    (row,) = out["rows"]
    assert row["vs_ideal"] >= 1 - 1e-9
    assert "With 2x the InfiniBand bandwidth" in text and "step (IB x 2) / ideal" in text
    assert 0 < row["ib_vs_step"] <= 1 + 1e-9  # more bandwidth never slows the same plan here
    assert row["ib_vs_ideal"] == pytest.approx(row["ib_vs_step"] * row["vs_ideal"])
    for name in ("fwd", "bwd"):
        assert math.isfinite(row[f"{name}_ms"]) and 0 <= row[f"{name}_compute_pct"] <= 100 + 1e-9
        assert 0 <= row[f"{name}_idle_ms"] <= row[f"{name}_ms"] + 1e-9
        parts = [t for t in out["totals"] if t["pass"] == name]
        assert sum(t["ms"] for t in parts) == pytest.approx(row[f"{name}_ms"], rel=1e-9)  # one mask: the chain is the pass
    for bad in (["--comm", "smoke-signals"], ["--ib-scale", "0"], ["--imbalance-tol", "0.9"]):
        with pytest.raises(SystemExit):
            mod.main(bad + ["--json", str(path)])


def test_critical_path_bench_solves_at_the_bound_asked(tmp_path):
    mod = load_bench("critical_path_bench.py")
    rows = {}
    for mu in ("1.05", "1.5"):
        path = tmp_path / f"c{mu}.json"
        mod.main(["--P", "16", "--kinds", "causal", "--tokens", "256", "--imbalance-tol", mu, "--json", str(path),
                  "--plan-cache", str(tmp_path / "plans")])
        (rows[mu],) = json.loads(path.read_text())["rows"]
    assert sorted(p.name for p in (tmp_path / "plans").iterdir())[0].endswith(".pt")
    assert len(list((tmp_path / "plans").iterdir())) == 2  # a plan per bound, not one overwritten
    assert rows["1.05"]["fwd_ms"] + rows["1.05"]["bwd_ms"] != rows["1.5"]["fwd_ms"] + rows["1.5"]["bwd_ms"]
