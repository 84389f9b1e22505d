"""benchmarks/relay_bench.py at a small size: it writes its table and JSON, and relay never moves more
InfiniBand bytes than direct transport on the same assignment."""
import importlib.util
import json
import sys
from pathlib import Path

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
                        "--md", str(tmp_path / "r.md")])
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
    direct, relay = out["rows"]
    assert (direct["transport"], relay["transport"]) == ("direct", "relay")
    assert relay["ib_fwd_mb"] <= direct["ib_fwd_mb"] and relay["ib_vs_direct"] <= 1.0
    assert 0 < relay["relayed"] <= 1 and direct["relayed"] is None
    assert "simulated" in (tmp_path / "r.md").read_text()
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 2
    assert list((tmp_path / "plans").glob("full_P16_s0_c64.pt"))  # today's plan cached for the next run
    assert "| full | 16 | relay |" in capsys.readouterr().out
