"""``python -m gpusolver simulate``: the printed table and the timeline PNG."""
import pytest

from gpusolver.__main__ import main


def test_simulate_prints_and_draws(tmp_path, capsys):
    out = tmp_path / "tl.png"
    assert main(["simulate", "-P", "2", "--tokens-per-rank", "64", "--heads", "4:2", "--head-dim", "32",
                 "--dtype", "float32", "--topology", "single_node", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text
    for row in ("ours", "USP", "balanced USP", "ideal bound (ours)"):
        assert f"\n{row} " in text
    ours = next(line for line in text.splitlines() if line.startswith("ours "))
    fwd, bwd, step = (float(x) for x in ours.split()[1:4])
    assert step == pytest.approx(fwd + bwd, abs=2e-3) and step > 0
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_simulate_rejects_a_group_the_topology_cannot_hold():
    with pytest.raises(SystemExit, match="cp_size = 12"):
        main(["simulate", "-P", "12", "--tokens-per-rank", "64", "--heads", "4:2", "--head-dim", "32", "--out", ""])
