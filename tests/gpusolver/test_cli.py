"""The command line: demo and solve print their tables."""
from gpusolver.__main__ import main


def test_demo_prints_quality_table(capsys):
    main(["demo", "--cp-size", "4", "--tokens-per-rank", "1024"])
    out = capsys.readouterr().out
    assert "| gpusolver device |" in out and "| gpusolver reference |" in out and "| usp |" in out
    assert "status: OK" in out


def test_solve_prints_plan_summary(capsys):
    main(["solve", "-P", "2", "--tokens-per-rank", "512", "--full", "--solver", "reference"])
    out = capsys.readouterr().out
    assert "reference solver" in out and "fwd bottleneck" in out


def test_demo_on_sparse_indexer_masks(capsys):
    for kind, title in (("nsa", "NSA block selection"), ("dsa", "DSA token top-k")):
        main(["demo", "--mask", kind, "--cp-size", "4", "--tokens-per-rank", "256"])
        out = capsys.readouterr().out
        assert out.startswith(title) and "| gpusolver device |" in out and "| usp |" in out
        assert "status:" not in out  # sparse masks get assignments, not plans


def test_tiles_option(capsys):
    main(["demo", "--cp-size", "2", "--tokens-per-rank", "256", "--tiles", "2"])
    out = capsys.readouterr().out
    assert "| gpusolver device, 2 tiles per chunk |" in out and "status:" in out
    main(["solve", "-P", "2", "--tokens-per-rank", "256", "--tiles", "2"])
    assert "fwd bottleneck" in capsys.readouterr().out
    main(["demo", "--mask", "dsa", "--cp-size", "2", "--tokens-per-rank", "128", "--tiles", "2"])
    assert "| gpusolver device, 2 tiles per chunk |" in capsys.readouterr().out
