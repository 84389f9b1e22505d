"""benchmarks/ib_floor.py: one cell end to end, its floor below every plan it prints."""
from tests.benchmarks._load import load_bench


def test_one_cell_prints_floors_below_the_plans(tmp_path, capsys):
    mod = load_bench("ib_floor.py")
    md = tmp_path / "floor.md"
    rows = mod.main(["--P", "16", "--kinds", "causal", "--tokens", "64", "--md", str(md)])
    (row,) = rows
    assert row["floor_fwd_mb"] > 0  # this mask has to cross nodes: the check below is not 0 <= x
    for name in ("today", "topo", "relay"):
        assert row[f"{name}_fwd_mb"] >= row["floor_fwd_mb"] * (1 - 1e-6)
        assert row[f"{name}_ib_ms"] >= row["floor_ib_ms"] * (1 - 1e-6)
    assert "floor / USP" in md.read_text() and "reachable" in capsys.readouterr().out
