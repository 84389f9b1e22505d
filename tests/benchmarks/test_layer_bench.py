"""benchmarks/layer_bench.py: one small run in-process writes every table, the simulated times are
consistent (never below the ideal bound, balanced USP never slower than USP), the plan cache gives the
same figures, and the bytes the LocalGroup counted in the real run equal the plan's, pair by pair."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from gpusolver.config import SolverConfig
from gpusolver.plan import plan_capacities

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("_bench_layer_bench", _BENCH / "layer_bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)  # main() sets 1 thread
        sys.modules.pop(spec.name, None)


def _header(text: str, first: str, second: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {first} | {second} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_layer_bench_small(bench, tmp_path, capsys):
    path, md = tmp_path / "out" / "layer.json", tmp_path / "out" / "layer.md"
    payload = bench.main(["--P", "4", "--seeds", "1", "--kinds", "causal", "--tokens-per-rank", "256",
                          "--real-P", "8", "--real-tokens-per-rank", "32", "--json", str(path), "--md", str(md)])
    text = capsys.readouterr().out
    assert md.read_text().strip() == text.strip()
    assert _header(text, "kind", "P")[:3] == ["kind", "P", "runs"]  # the summary comes first
    for columns, first, second in ((bench.SIM_COLUMNS, "kind", "P"), (bench.SUMMARY_COLUMNS, "kind", "P"),
                                   (bench.FILL_COLUMNS, "kind", "P"),
                                   (bench.MEMORY_COLUMNS, "P", "capacity"), (bench.REAL_COLUMNS, "kind", "keep")):
        headers = [h for h, _, _ in columns]
        assert any(ln.startswith("| " + " | ".join(headers) + " |") for ln in text.splitlines()), headers
    assert "SIMULATED" in text and "simulated (`gpusolver.sim`), not measured" in text

    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(payload))
    assert data["command"].startswith("python benchmarks/layer_bench.py --P 4") and data["machine"]
    (row,) = data["rows"]
    assert row["fwd_bytes_match_metrics"] and row["status"] & 4 == 0  # no BUFFER_OVERFLOW
    for k in ("solve_ms", "fwd_mb", "bwd_mb", "usp_fwd_mb", "ring_fwd_mb", "sim_fwd_ms", "sim_bwd_ms",
              "usp_fwd_ms", "usp_bwd_ms", "usp_bal_fwd_ms", "usp_bal_bwd_ms", "ideal_step_ms", "compute_ms"):
        assert isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] > 0, k
    assert row["sim_step_ms"] == pytest.approx(row["sim_fwd_ms"] + row["sim_bwd_ms"])
    assert row["sim_fwd_ms"] >= row["ideal_fwd_ms"] >= row["compute_fwd_ms"]
    assert row["sim_bwd_ms"] >= row["ideal_bwd_ms"] >= row["compute_bwd_ms"]
    assert row["usp_bal_step_ms"] <= row["usp_step_ms"] * (1 + 1e-12)
    assert row["step_vs_usp"] == pytest.approx(row["sim_step_ms"] / row["usp_step_ms"])
    assert 0 <= row["hidden_pct"] <= 100 and 0 <= row["stage0_pct"] <= 100

    (fill,) = data["fill"]
    # P = 4: each buffer's default is the worst case P - 1 but the QO receive buffer's, 2 G * c
    assert fill["fits"] and fill["kv_recv_cap"] == fill["qo_send_cap"] == fill["kv_send_cap"] == fill["worst"] == 3
    assert fill["qo_recv_cap"] == 2
    real = data["real_run"]
    assert [(r["kind"], r["keep"]) for r in real] == [("causal", True), ("causal", False)]
    for r in real:
        # P = 8: rows move (at P = 4 and 32 tokens per rank the plan keeps every task local)
        assert r["bytes_match"] and r["wall_ms"] > 0 and sum(r["counted"]["fwd.qo"][0]) > 0
        again = [0] * 8 if r["keep"] else r["counted"]["fwd.kv"][0]  # K, V travel again only without kept buffers
        assert r["counted"]["bwd.kv"][0] == again
    assert {m["capacity"] for m in data["memory"]} == {"default", "worst case"}
    assert data["gpu_stages"] == [] or torch.cuda.is_available()


def test_plan_cache_gives_the_same_figures(bench, tmp_path):
    topo = bench.Topology.preset("h200_hgx")
    kw = dict(topology=topo, plan_cache=tmp_path / "plans")
    first, _, _ = bench.run_instance("full", 2, 0, 64, **kw)
    # solved on the topology, priced as solve() prices it: the memory budget keeps Q whole and part of
    # K, V at c = 64, priced as kept, so the file is keeping everything's
    assert (tmp_path / "plans" / "full_P2_s0_c64_topo.pt").exists() and first["solve_ms"] > 0
    again, _, _ = bench.run_instance("full", 2, 0, 64, **kw)
    assert again["solve_ms"] is None  # loaded, not solved
    for k in ("sim_fwd_ms", "sim_bwd_ms", "usp_step_ms", "fwd_bytes", "bwd_bytes", "ideal_step_ms"):
        assert again[k] == first[k], k


def test_default_capacity():
    # per buffer min(worst case G * c * (P - 1), k * G * c) rows: k = 2 QO recv, 13 KV recv, 3 QO send, 16 KV send
    for P in (2, 4, 14, 16, 17, 64):
        _, rows = plan_capacities(SolverConfig(cp_size=P), 1, 100)
        assert rows.as_tuple() == tuple(min(P - 1, k) * 8 * 100 for k in (2, 13, 3, 16))
    _, rows = plan_capacities(SolverConfig(cp_size=64, max_recv_rows=1234), 1, 100)
    assert rows.as_tuple() == (1234,) * 4
    _, rows = plan_capacities(SolverConfig(cp_size=64, max_recv_rows=1234, max_kv_recv_rows=99), 1, 100)
    assert rows.as_tuple() == (1234, 99, 1234, 1234)


def test_real_run_counts_every_sub_stage(bench):
    """With S > 1 sub-stages the group counts each collective under its sub-stage's phase: the real
    run's check must add them up, stage by stage, or it reports a mismatch on a correct layer."""
    r = bench.real_run("causal", True, repeats=1, cp_size=8, tokens_per_rank=32)
    assert r["num_stages"] > 1
    assert r["bytes_match"]
    assert sum(r["counted"]["fwd.qo"][0]) > 0 and sum(r["counted"]["fwd.o"][1]) > 0
