"""benchmarks/capacity_sweep.py: every buffer is set as asked, the base row is the ratios' 1, and the
peak saving is plan.memory()'s."""
import json

from tests.benchmarks._load import load_bench


def test_caps_reach_the_plan_and_the_summary(tmp_path, capsys):
    mod = load_bench("capacity_sweep.py")
    from gpusolver.capacity import buffer_rows
    from gpusolver.topology import h200_hgx

    c = 64
    config = mod.capped_config(16, dict(zip(mod.BUFFERS, mod.COMBINED["b"])), h200_hgx, c)
    unit = config.head_groups * c
    assert buffer_rows(config, c).as_tuple() == (int(1.5 * unit), 8 * unit, 2 * unit, 8 * unit)
    base = mod.capped_config(16, mod.BASE, h200_hgx, c)
    assert buffer_rows(base, c).as_tuple() == (2 * unit, 13 * unit, 3 * unit, 15 * unit)  # KV send: P - 1
    assert set(mod.cap_sets(24)) == {"base", "a", "b", "c", "d"} and "c" not in mod.cap_sets(48)

    md, js = tmp_path / "caps.md", tmp_path / "caps.json"
    rows = mod.main(["--P", "16", "--kinds", "full,causal-seq", "--seeds", "1", "--sets", "b",
                     "--tokens-per-rank", str(c), "--plan-cache", str(tmp_path / "plans"), "--md", str(md),
                     "--json", str(js)])
    assert [(r["kind"], r["set"]) for r in rows] == [("full", "base"), ("full", "b"), ("causal-seq", "base"),
                                                      ("causal-seq", "b")]
    assert all(r["vs_base"] == 1.0 for r in rows if r["set"] == "base")
    assert len(list((tmp_path / "plans").glob("*_caps1.5-8-2-8*.pt"))) == 2  # one cached plan per (mask, caps)
    summary = {s["set"]: s for s in json.loads(js.read_text())["summary"]}
    b = rows[1]
    assert abs(summary["b"]["saving"] - (1 - b["peak_mb"] / rows[0]["peak_mb"])) < 1e-12
    assert b["peak_mb"] < rows[0]["peak_mb"] and b["fill_kv_recv"] <= 8 + 1e-9
    text = md.read_text()
    assert "simulated" in text and "Sets that meet the bar" in text and "Command:" in text
    assert "step / base median (sim)" in capsys.readouterr().out

