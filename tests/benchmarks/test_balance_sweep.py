"""benchmarks/balance_sweep.py at a small size: a row per bound, the time-aware solve's row equal to
the fixed bound it chose, the plans cached, and a bad bound the parser's error."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def sweep():
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("_bench_balance", _BENCH / "balance_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)


def test_balance_sweep_small(sweep, tmp_path):
    args = ["--P", "16", "--kinds", "full", "--tokens", "64", "--mus", "1.05,1.10", "--auto",
            "--plan-cache", str(tmp_path / "plans"), "--json", str(tmp_path / "r.json"), "--md", str(tmp_path / "r.md")]
    rows = sweep.main(args)
    fixed = [r for r in rows if r["solve"] == "relay solve"]
    auto, = [r for r in rows if r["solve"] == sweep.AUTO]
    assert [r["mu"] for r in fixed] == [1.05, 1.10]
    assert all(r["imbalance"] <= r["mu"] + 1e-9 and r["best_ms"] == min(r["s1_ms"], r["s4_ms"]) for r in fixed)
    chosen, = [r for r in fixed if r["mu"] == pytest.approx(auto["mu"])]
    assert auto["s4_ms"] == chosen["s4_ms"] and auto["imbalance"] == chosen["imbalance"]
    assert "simulated" in (tmp_path / "r.md").read_text()
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 3
    assert len(list((tmp_path / "plans").glob("full_P16_s0_c64_*.pt"))) == 3
    again = sweep.main(args)  # read back from the cache: the same figures, no solve
    assert [r["best_ms"] for r in again] == [r["best_ms"] for r in rows] and all(r["solve_s"] is None for r in again)


@pytest.mark.parametrize("bad", [["--mus", "0.9"], ["--mus", "x"], ["--seeds", "-1"]])
def test_balance_sweep_bad_arguments(sweep, bad, capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--P", "16"] + bad)
    assert bad[0] in capsys.readouterr().err


def test_best_and_auto_rows(sweep):
    """The summaries: per cell the lowest step (ties: the larger bound) against mu = 1.10, and the
    time-aware row against both."""
    cell = dict(kind="full", P=16, seed=0, usp_ms=20.0, usp_bal_ms=10.0)
    rows = [dict(cell, solve="relay solve", mu=mu, best_ms=ms) for mu, ms in ((1.02, 9.0), (1.06, 9.0), (1.10, 12.0))]
    rows.append(dict(cell, solve=sweep.AUTO, mu=1.10, best_ms=12.0, vs_default=1.0))
    best, = sweep.best_rows(rows)
    assert (best["mu"], best["default_ms"], best["usp_target"]) == (1.06, 12.0, 0.85)
    auto, = sweep.auto_rows(rows)
    assert (auto["oracle_mu"], auto["oracle_ms"], auto["default_ms"]) == (1.06, 9.0, 12.0)
    assert auto["vs_oracle"] == pytest.approx(12.0 / 9.0)
