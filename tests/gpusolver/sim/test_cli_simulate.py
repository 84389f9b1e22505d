"""``python -m gpusolver simulate``: the printed table and the timeline PNG."""
import pytest

from gpusolver.__main__ import main


def _ours(text):
    """(fwd, bwd, step) ms of the printed "ours" row."""
    ours = next(line for line in text.splitlines() if line.startswith("ours "))
    return tuple(float(x) for x in ours.split()[1:4])


def test_simulate_prints_and_draws(tmp_path, capsys):
    out = tmp_path / "tl.png"
    assert main(["simulate", "-P", "2", "--tokens-per-rank", "64", "--heads", "4:2", "--head-dim", "32",
                 "--dtype", "float32", "--topology", "single_node", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text
    assert "S = 4 sub-stage(s) and the local tail over p2p" in text  # the defaults: num_stages="auto", local_tail, p2p
    for row in ("ours", "USP", "balanced USP", "ideal bound (ours)"):
        assert f"\n{row} " in text
    fwd, bwd, step = _ours(text)
    # this toy plan moves no rows: over p2p nothing waits on a latency and the step rounds to 0 ms
    ideal = next(line for line in text.splitlines() if line.startswith("ideal bound (ours)"))
    assert step == pytest.approx(fwd + bwd, abs=2e-3) and step >= float(ideal.split()[5])
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_simulate_runs_the_old_defaults_when_asked(capsys):
    assert main(["simulate", "-P", "2", "--tokens-per-rank", "64", "--heads", "4:2", "--head-dim", "32",
                 "--dtype", "float32", "--topology", "single_node", "--stages", "1", "--comm", "a2a",
                 "--out", ""]) == 0
    text = capsys.readouterr().out
    assert "S = 1 sub-stage(s) over a2a" in text
    fwd, bwd, step = _ours(text)
    assert step == pytest.approx(fwd + bwd, abs=2e-3) and step > 0  # each all-to-all-v pays its latency


def test_simulate_rejects_a_group_the_topology_cannot_hold():
    with pytest.raises(SystemExit, match="cp_size = 12"):
        main(["simulate", "-P", "12", "--tokens-per-rank", "64", "--heads", "4:2", "--head-dim", "32", "--out", ""])


def test_simulate_routes_inter_node_sends_on_the_rail_unless_told_not_to(capsys):
    """Across nodes the preset routes sends as NCCL does; ``--own-nic`` sends through each GPU's own NIC.
    With 8 KV heads USP's Ulysses spans a node and its ring hops between ranks of one local index, on
    their rail already, so its row is the same either way."""
    argv = ["simulate", "-P", "16", "--tokens-per-rank", "64", "--heads", "16:8", "--head-dim", "32",
            "--dtype", "float32", "--out", ""]
    texts = []
    for extra in ([], ["--own-nic"]):
        assert main(argv + extra) == 0
        texts.append(capsys.readouterr().out)
    rail, own = texts
    assert "inter-node sends on the destination's rail" in rail and "own NIC" in own
    usp = [next(line for line in t.splitlines() if line.startswith("USP ")).split()[1:4] for t in texts]
    assert usp[0] == usp[1]  # fwd, bwd and step ms


def test_simulate_prints_the_critical_path_when_asked(capsys):
    """Across two nodes the forward's chain shows where its time went, in simulated ms that add up."""
    assert main(["simulate", "-P", "16", "--tokens-per-rank", "64", "--heads", "16:8", "--head-dim", "32",
                 "--dtype", "float32", "--out", "", "--critical-path"]) == 0
    text = capsys.readouterr().out
    fwd, bwd, _ = _ours(text)
    for name, ms in (("forward", fwd), ("backward", bwd)):
        line = next(x for x in text.splitlines() if x.startswith(f"ours, {name} ("))
        assert "critical path (simulated): compute" in line
        parts = [float(p.split()[1]) for p in line.split(": ", 2)[2].split(", ")]  # compute, transfer, latency ms
        assert sum(parts) == pytest.approx(ms, abs=2e-3)
