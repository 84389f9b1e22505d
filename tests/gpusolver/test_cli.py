"""The command line: every subcommand on tiny inputs, --help, and one-line errors for bad arguments."""
from __future__ import annotations

import contextlib
import io
import os

import pytest

from gpusolver.__main__ import main
from tests._dist import run_ranks

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COMMANDS = ("demo", "show", "solve", "quality", "bench")


def assert_png(path, min_bytes: int = 5_000) -> None:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) >= min_bytes, f"{path} holds only {len(data)} bytes"


def test_demo_runs_layers_and_writes_the_picture(capsys, tmp_path):
    png = tmp_path / "demo.png"
    assert main(["demo", "-P", "4", "--tokens-per-rank", "32", "--layers", "2", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| layer | slices | solve ms | imbalance | fwd KiB | fwd vs USP | fwd vs ring |" in out
    assert "| step KiB | step vs USP | step vs ring |" in out  # fwd + bwd, the training objective
    assert out.count("| yes |") == 2  # both layers' bytes equal their plans'
    assert "every layer matches the single-process reference" in out
    assert "come from the benchmarks" in out
    assert_png(png)


@pytest.mark.parametrize("mask", ["docs-full", "window", "prefix"])
def test_demo_mask_kinds(capsys, mask):
    assert main(["demo", "-P", "2", "--tokens-per-rank", "32", "--layers", "1", "--heads", "4:4",
                 "--mask", mask, "--out", ""]) == 0
    assert "every layer matches" in capsys.readouterr().out


def test_demo_profile_pass_without_reference(capsys):
    assert main(["demo", "-P", "2", "--tokens-per-rank", "32", "--layers", "1", "--no-check", "--profile",
                 "--out", ""]) == 0
    out = capsys.readouterr().out
    assert "(no reference check) the group moved exactly the plans' bytes" in out
    assert "profiled pass (NVTX ranges on" in out and "| - | - | yes |" in out


def _demo_rank(rank: int, P: int) -> tuple[int, str]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(P), LOCAL_RANK=str(rank))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = main(["demo", "--tokens-per-rank", "32", "--layers", "2", "--device", "cpu", "--out", ""])
    return code, buf.getvalue()


def test_demo_under_torchrun_env_on_gloo():
    results = run_ranks(_demo_rank, 2, timeout=120)
    assert [code for code, _ in results] == [0, 0]
    leader, other = results[0][1], results[1][1]
    assert "P = 2 on 2 ranks under torchrun (TorchGroup)" in leader
    assert "every layer matches" in leader and leader.count("| yes |") == 2
    assert other == ""  # only rank 0 prints


def test_show_from_mask_and_from_saved_plan(capsys, tmp_path):
    png, saved = tmp_path / "plan.png", tmp_path / "plan.pt"
    assert main(["show", "-P", "4", "--tokens-per-rank", "256", "--heads", "8:2", "--out", str(png)]) == 0
    assert_png(png)
    assert main(["solve", "-P", "4", "--tokens-per-rank", "256", "--heads", "16:4", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "fwd bottleneck" in out and "status:" in out and str(saved) in out
    png2 = tmp_path / "saved.png"
    assert main(["show", "--plan", str(saved), "--out", str(png2)]) == 0
    assert_png(png2)


def test_solve_reference_and_tiles(capsys):
    main(["solve", "-P", "2", "--tokens-per-rank", "512", "--mask", "docs-full", "--solver", "reference"])
    out = capsys.readouterr().out
    assert "reference solver" in out and "fwd bottleneck" in out
    main(["solve", "-P", "2", "--tokens-per-rank", "256", "--tiles", "2"])
    assert "fwd bottleneck" in capsys.readouterr().out


def test_quality_prints_the_comparison(capsys):
    main(["quality", "-P", "4", "--tokens-per-rank", "1024"])
    out = capsys.readouterr().out
    assert "| gpusolver device |" in out and "| gpusolver reference |" in out and "| usp |" in out
    assert "status: OK" in out


def test_quality_on_sparse_indexer_masks_and_tiles(capsys):
    for kind, title in (("nsa", "NSA block selection"), ("dsa", "DSA token top-k")):
        main(["quality", "--mask", kind, "-P", "4", "--tokens-per-rank", "256"])
        out = capsys.readouterr().out
        assert out.startswith(title) and "| gpusolver device |" in out and "| usp |" in out
        assert "status:" not in out  # sparse masks get assignments, not plans
    main(["quality", "-P", "2", "--tokens-per-rank", "256", "--tiles", "2"])
    assert "| gpusolver device, 2 tiles per chunk |" in capsys.readouterr().out


def test_bench_writes_one_report(tmp_path, capsys):
    report = tmp_path / "report.md"
    assert main(["bench", "--quick", "--only", "quality", "--out", str(report)]) == 0
    text = report.read_text()
    assert text.startswith("# gpusolver benchmark report\n\n- machine: ")
    assert "| quality | ok |" in text and "`python benchmarks/solver_quality.py --P 8 --seeds 1`" in text
    assert "Solver quality" in text and "/tmp" not in text.split("## quality")[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_on_every_subcommand(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert f"usage: gpusolver {command}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["demo", "-P", "0"], "must be >= 1"),
    (["demo", "--heads", "8:3"], "multiple of Hkv"),
    (["demo", "--heads", "eight"], "expected Hq:Hkv"),
    (["demo", "--head-dim", "48"], "invalid choice"),
    (["demo", "--dtype", "int8"], "dtype must be one of"),
    (["demo", "--mask", "zigzag"], "invalid choice"),
    (["demo", "--layers", "-1"], "must be >= 1"),
    (["demo", "--device", "tpu"], "device"),
    (["demo", "--tokens-per-rank", "4096"], "keep S <= 16384"),
    (["solve", "-P", "1000"], "MAX_CP_SIZE"),
    (["solve", "-P", "4", "--tokens-per-rank", "3", "--tiles", "2"], "divisible"),
    (["show", "--plan", "/nonexistent/plan.pt"], "no such file"),
    (["frobnicate"], "invalid choice"),
    (["bench", "--timeout", "0"], "must be >= 1"),
    ([], "required"),
])
def test_bad_arguments_give_one_line_errors(capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if "error:" in ln]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err
