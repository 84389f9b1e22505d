"""benchmarks/solver_quality.py, solver_latency.py and solver_sweep.py: quick modes run in-process and
write complete tables and JSON; the launch counter sees aten ops, host reads and Triton launches."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from gpusolver.areas import block_areas, block_areas_torch, block_areas_triton
from gpusolver.config import SolverConfig
from gpusolver.masks import packed_documents
from gpusolver.solver.device import solve_device
from tests._testing import assert_close

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def benches():
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    try:
        yield {name: _load(name) for name in ("_common", "solver_quality", "solver_latency", "solver_sweep")}
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)  # main() sets 1 thread
        for name in ("_common", "solver_quality", "solver_latency", "solver_sweep"):
            sys.modules.pop(f"_bench_{name}", None)


def _header(text: str, first: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def _finite(row: dict, keys) -> None:
    for k in keys:
        assert isinstance(row[k], (int, float)) and math.isfinite(row[k]), f"{k} = {row[k]!r}"


def test_quality_quick(benches, tmp_path, capsys):
    mod = benches["solver_quality"]
    path = tmp_path / "out" / "q.json"
    payload = mod.main(["--quick", "--P", "4", "--json", str(path)])
    text = capsys.readouterr().out
    headers = [h for h, _, _ in mod.SUMMARY_COLUMNS]
    assert _header(text, "kind") == headers  # the summary comes first
    assert "fwd vs USP %" in headers and "dev/ref fwd" in headers and "balanced %" in headers
    assert "−62…−70 %" in text and "Anchor" in text

    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(payload))
    rows = data["rows"]
    assert [(r["kind"], r["solver"]) for r in rows] == [
        ("causal", "reference"), ("causal", "device"), ("full", "reference"), ("full", "device")]
    for r in rows:
        assert r["P"] == 4 and r["seed"] == 0
        _finite(r, ("imbalance", "fwd_bytes", "bwd_bytes", "fwd_vs_usp_pct", "bwd_vs_usp_pct",
                    "fwd_vs_owner", "bwd_vs_owner", "solve_ms", "usp_fwd_bytes", "owner_fwd_bytes"))
        assert r["imbalance"] >= 1.0 and r["fwd_bytes"] > 0 and r["solve_ms"] > 0
        assert r["fwd_vs_usp_pct"] == pytest.approx(100 * (r["fwd_bytes"] / r["usp_fwd_bytes"] - 1))
        assert r["fwd_vs_owner"] == pytest.approx(r["fwd_bytes"] / r["owner_fwd_bytes"])
    for ref, dev in zip(rows[::2], rows[1::2]):
        assert dev["dev_over_ref_fwd"] == pytest.approx(dev["fwd_bytes"] / ref["fwd_bytes"])
        assert ref["dev_over_ref_fwd"] is None

    summary = data["summary"]
    assert [(s["kind"], s["solver"]) for s in summary] == [
        (k, s) for k in ("causal", "full") for s in ("reference", "device", "owner-computes", "usp")]
    for s in summary:
        _finite(s, ("fwd_mb", "bwd_mb", "fwd_vs_usp_pct", "fwd_vs_owner"))
        assert s["runs"] == 1
    by = {(s["kind"], s["solver"]): s for s in summary}
    assert by["causal", "usp"]["fwd_vs_usp_pct"] == 0.0 and by["full", "owner-computes"]["fwd_vs_owner"] == 1.0
    assert by["causal", "device"]["dev_over_ref_fwd"] == pytest.approx(rows[1]["dev_over_ref_fwd"])
    assert by["causal", "device"]["balanced_pct"] == 100.0 * rows[1]["balanced"]


def test_latency_quick(benches, tmp_path, capsys):
    mod = benches["solver_latency"]
    path = tmp_path / "l.json"
    mod.main(["--quick", "--P", "4", "--repeats", "1", "--no-cuda", "--threads", "1,2", "--json", str(path)])
    text = capsys.readouterr().out
    assert _header(text, "kind") == [h for h, _, _ in mod.COLUMNS]
    data = json.loads(path.read_text())
    assert data["config"]["P"] == [4] and data["config"]["cuda"] is False and data["config"]["threads"] == [1, 2]
    row, row2 = data["rows"]
    assert row["backend"] == "cpu/torch" and row["P"] == 4 and row2["backend"] == "cpu/torch 2 threads"
    assert row2["fwd_device_bytes"] == row["fwd_device_bytes"] and torch.get_num_threads() == 1
    _finite(row, ("areas_ms", "solve_ms", "total_ms", "ref_ms", "imbalance_device", "imbalance_reference",
                  "fwd_dev_over_ref", "bwd_dev_over_ref"))
    assert row["total_ms"] == pytest.approx(row["areas_ms"] + row["solve_ms"])
    # the torch path is sync-free: no host reads anywhere from the mask to the assignment
    assert row["host_reads"] == 0 and row["triton_launches"] == 0 and row["triton_hooked"]
    assert row["areas_launches"] > 0 and row["solve_launches"] > 0
    assert row["launches"] == row["areas_launches"] + row["solve_launches"]
    assert row["solve_ops"]["aten_ops"] >= row["solve_ops"]["view_ops"] >= 0
    assert row["fwd_dev_over_ref"] == pytest.approx(row["fwd_device_bytes"] / row["fwd_reference_bytes"])


def test_launch_counter_counts_host_reads_and_views(benches):
    LaunchCounter = benches["_common"].LaunchCounter
    x = torch.arange(6.0)
    with LaunchCounter() as c:
        y = x.view(2, 3).sum()
        y.item()
        (x > 2).nonzero()
    assert c.host_reads == 2  # .item() and nonzero
    assert c.view_ops >= 1 and c.aten_ops >= 5
    assert c.launches == c.aten_ops - c.view_ops
    # reads that reach no op on a CPU tensor (on a GPU they copy first): counted too, once each
    import numpy as np
    with LaunchCounter() as c:
        x.tolist()
        x.numpy()
        np.asarray(x)                      # __array__, which calls numpy(): one read
        bool(x[1] > 0)
        int(x[2])
    assert c.host_reads == 5 and c.by_op["tolist/numpy"] == 3
    assert "tolist" not in torch.Tensor.__dict__  # unpatched on exit


def test_launch_counter_counts_device_to_host_copies(benches):
    """A copy from a device to the CPU is a host read (fake CUDA tensors stand in for a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    is_host_copy = benches["_common"]._is_host_copy
    with FakeTensorMode(allow_non_fake_inputs=True):
        gpu, cpu = torch.empty(3, device="cuda"), torch.empty(3)
    aten = torch.ops.aten
    assert is_host_copy(aten._to_copy.default, (gpu,), {}, cpu)          # .cpu(), .to("cpu")
    assert is_host_copy(aten.copy_.default, (cpu, gpu), {}, cpu)          # cpu_tensor.copy_(gpu_tensor)
    assert not is_host_copy(aten.copy_.default, (gpu, cpu), {}, gpu)      # host to device: no read
    assert not is_host_copy(aten._to_copy.default, (cpu,), {}, cpu)
    assert not is_host_copy(aten.add.Tensor, (gpu,), {}, cpu)


def test_launch_counter_counts_triton_launches(benches):
    common = benches["_common"]
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    runs = (JITFunction.run, InterpretedFunction.run)
    mask = packed_documents(64, seed=1)
    with common.LaunchCounter() as c:
        tri = block_areas_triton(mask, 2, 1)
    assert c.triton_hooked and c.triton_launches == 1 and c.note == ""
    assert (JITFunction.run, InterpretedFunction.run) == runs  # unpatched on exit
    ref = block_areas_torch(mask, 2, 1)
    assert_close("area", ref.area, tri.area)


def test_markdown_and_json_helpers(benches, tmp_path):
    common = benches["_common"]
    table = common.markdown_table([{"a": "x", "b": 1.5, "c": None, "d": True}],
                                  [("A", "a", ""), ("B", "b", ".2f"), ("C", "c", ".1f"), ("D", "d", "")])
    assert table.splitlines() == ["| A | B | C | D |", "|:---|---:|---:|:---|", "| x | 1.50 | — | yes |"]
    path = common.write_json(tmp_path / "new" / "x.json", {"v": float("inf"), "w": [1.0, float("nan")]})
    assert json.loads(path.read_text()) == {"v": None, "w": [1.0, None]}
    assert common.parse_list("8, 16", int) == [8, 16]
    with pytest.raises(ValueError, match="--P: 'x'"):
        common.parse_list("8,x", int, name="--P")
    with pytest.raises(ValueError, match="'diag' is not one of"):
        common.parse_list("causal,diag", str, allowed=("causal", "full"), name="--kinds")
    with pytest.raises(ValueError, match="kind must be one of"):
        common.make_mask("diag", 4, 0)
    # one sequence over all ranks: a single slice of the whole length
    seq = common.make_mask("causal-seq", 4, 0, tokens_per_rank=16)
    assert seq.q_ranges.tolist() == [[0, 64]] and seq.k_ranges.tolist() == [[0, 64]]
    assert seq.attn_type.tolist() != common.make_mask("full-seq", 4, 0, tokens_per_rank=16).attn_type.tolist()


def test_sweep_counts_masks_above_the_reference(benches, tmp_path, capsys):
    mod = benches["solver_sweep"]
    path = tmp_path / "s.json"
    payload = mod.main(["--P", "2,3", "--seeds", "2", "--tokens-per-rank", "1024", "--heads", "8:2",
                        "--json", str(path)])
    text = capsys.readouterr().out
    assert _header(text, "P") == [h for h, _, _ in mod.SUMMARY_COLUMNS]
    rows, summary = payload["rows"], payload["summary"]
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(rows))
    assert len(rows) == 2 * 2 * 2 and [s["P"] for s in summary] == [2, 3]
    for s in summary:
        rs = [r for r in rows if r["P"] == s["P"]]
        assert s["masks"] == 4 and s["above"] == sum(r["dev_bytes"] > r["ref_bytes"] for r in rs)
        assert s["ref_balanced"] == sum(r["ref_balanced"] for r in rs)
    for r in rows:  # the training step by default; no ratio where the reference moves nothing
        assert r["measure"] == "step" and r["dev_bytes"] == r["dev_step_bytes"] and r["ref_bytes"] == r["ref_step_bytes"]
        assert r["ratio"] == (pytest.approx(r["dev_bytes"] / r["ref_bytes"]) if r["ref_bytes"] else None)
    assert any(r["ref_bytes"] for r in rows)


def test_bad_cli_arguments_exit(benches):
    with pytest.raises(SystemExit):
        benches["solver_quality"].main(["--kinds", "causal,diag"])
    with pytest.raises(SystemExit):
        benches["solver_sweep"].main(["--heads", "64"])
    with pytest.raises(SystemExit):
        benches["solver_latency"].main(["--repeats", "0"])


def test_launch_formula_equals_a_counted_solve(benches, tmp_path):
    """The benchmark's per-solve count (fixed + rounds x per round + restarts x per restart, from
    short solves) equals the launches counted over one real default solve, rounds and restarts
    included (the torch path: a full solve takes a second here)."""
    common = benches["_common"]
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    try:
        mod = _load("solver_launches")
        payload = mod.main(["--P", "2", "--paths", "torch", "--json", str(tmp_path / "l.json")])
        (row,) = payload["rows"]
        config = SolverConfig(cp_size=2)
        areas = block_areas(common.make_mask("causal", 2, seed=0), 2, config.head_groups, impl="torch")
        with common.LaunchCounter() as c:
            solve_device(areas, config, impl="torch")
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
        sys.modules.pop("_bench_solver_launches", None)
    assert row["restarts"] == 2  # rounds 8 and 16 of 24 at P = 2
    assert c.launches == row["per_solve"] and c.host_reads == row["host_reads"] == 0


def test_triton_paths_launch_a_static_loop(benches):
    """Counted on real short solves of a small problem: the Triton path launches the same kernels
    every round (a few, against the torch path's hundreds), the persistent path nothing per round."""
    common = benches["_common"]
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = SolverConfig(cp_size=2, num_heads_q=4, num_heads_kv=1, head_dim=64)
        areas = block_areas(common.make_mask("causal", 2, seed=0, tokens_per_rank=64), 2, 1, impl="torch")

        def count(impl, rounds):
            with common.LaunchCounter() as c:
                solve_device(areas, config, impl=impl, rounds=rounds, restart_every=0)
            assert c.host_reads == 0, (impl, rounds, c.by_op)
            return c

        tri = [count("triton", r) for r in (0, 1, 2)]
        per_round = tri[1].launches - tri[0].launches
        assert per_round == tri[2].launches - tri[1].launches > 0
        assert tri[2].triton_launches - tri[1].triton_launches == tri[1].triton_launches - tri[0].triton_launches > 0
        torch_round = count("torch", 2).launches - count("torch", 1).launches
        assert 10 * per_round < torch_round
        pers = [count("persistent", r) for r in (0, 2)]
        # per pricing rule (the training objective runs two) the transposed and Ulysses starts, the
        # round loop and its winner's state (two kernels): none per round
        assert pers[0].launches == pers[1].launches and pers[1].triton_launches <= 10
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("bound_tiles", [1, 2])
def test_optimality_gap_quick(tmp_path, bound_tiles):
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    md = tmp_path / "gap.md"
    tiled = ["--tiles", "2", "--bound-tiles", "2"] if bound_tiles == 2 else []
    try:
        payload = _load("optimality_gap").main(["--seeds", "1", "--time-limit", "2", "--kinds", "causal", *tiled,
                                                "--json", str(tmp_path / "gap.json"), "--md", str(md)])
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
        sys.modules.pop("_bench_optimality_gap", None)
    rows = payload["rows"]
    assert [(r["kind"], r["P"]) for r in rows] == [("causal", 4), ("causal", 8)]
    for r in rows:
        # a lower bound: no plan (the MILP's own, the reference's, the device solver's) moves less
        plans = [v for v in (r["milp_mb"], r["reference_mb"], r["device_mb"], r.get("tiled_mb")) if v is not None]
        assert r["bound_tiles"] == bound_tiles
        assert r["lower_mb"] <= min(plans) + 1e-9
        if bound_tiles == 2:  # the tiled plan has its own gap to the tiled bound
            assert r["lower_mb"] > 0 and r["tiled_gap"] == pytest.approx(r["tiled_mb"] / r["lower_mb"])
        assert r["device_gap"] >= 1.0 - 1e-9 and r["reference_gap"] >= 1.0 - 1e-9
    text = md.read_text()
    assert text.startswith("## Optimality gap") and text.count("| causal |") == 2
