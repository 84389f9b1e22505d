"""benchmarks/kernel_bench.py: the CPU smoke mode runs and prints a full table; FLOP areas are exact."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from attn_kernels.reference import slices_to_dense

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kernel_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kernel_bench"] = mod  # dataclasses look the module up by name
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("kernel_bench", None)


@pytest.mark.parametrize("name", ["full", "causal", "varlen_causal"])
def test_mask_area_is_exact(bench, name):
    qr, kr, t = bench.MASKS[name].slices(200)
    assert bench.mask_area(qr, kr, t) == int(slices_to_dense(qr, kr, t, 200, 200).sum())


def test_smoke_prints_table(bench, capsys):
    rows = bench.main(["--smoke"])
    text = capsys.readouterr().out
    assert len(rows) == 3 * 3
    for name in ("full", "causal", "varlen_causal"):
        row = next(r for r in rows if r["mask"] == name and r["impl"] == "flex_attn")
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["fwd_tflops"] > 0
        assert name in text
    assert "flex_attention" in text and "sdpa" in text
    varlen_sdpa = next(r for r in rows if r["mask"] == "varlen_causal" and r["impl"] == "sdpa")
    assert varlen_sdpa["fwd_ms"] is None and varlen_sdpa["note"]
    assert torch.isfinite(torch.tensor([r["fwd_ms"] for r in rows if r["fwd_ms"] is not None])).all()


def test_static_stage_cost_without_compiles(bench, capsys):
    rows = bench.main(["--static", "--cp", "4", "--tokens-per-rank", "256", "--no-compile"])
    text = capsys.readouterr().out
    assert "slice visits" in text and "full-scan visits" in text
    assert {(r["mask"], r["stage"], r["kernel"]) for r in rows} == {
        (m, s, k) for m in ("causal", "full") for s in (0, 1) for k in ("fwd", "dq", "dkdv")}
    for r in rows:
        # the work list visits only real (slice, block) pairs; the full scan visits every padded row
        assert 0 < r["visits"] < r["old_visits"]
        assert r["iterations"] > 0 and 0.0 <= r["interior"] <= 1.0
    fwd = [r for r in rows if r["kernel"] == "fwd"]
    # forward: same program block as the full scan, so the same inner iterations
    assert all(r["iterations"] == r["old_iterations"] for r in fwd)
