"""benchmarks/local_tail_bench.py at a small size: the same plan with and without the local tail."""
import json
import math

import pytest

from tests.benchmarks._load import load_bench


def test_local_tail_bench_quick(tmp_path, capsys):
    mod = load_bench("local_tail_bench.py")
    path = tmp_path / "t.json"
    mod.main(["--P", "16", "--kinds", "causal", "--tokens", "256", "--stages", "2", "--tails", "0.5",
              "--comm", "a2a,p2p", "--json", str(path)])
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "Summary over the masks" in text
    rows = json.loads(path.read_text())["rows"]
    assert [(r["tail"], r["comm"], r["sub_stages"]) for r in rows] == [
        (0.0, "a2a", 2), (0.0, "p2p", 2), (0.5, "a2a", 3), (0.5, "p2p", 3)]
    for r in rows:
        assert math.isfinite(r["step_ms"]) and r["step_ms"] >= r["ideal_ms"] * (1 - 1e-9)
        base = next(b for b in rows if b["tail"] == 0.0 and b["comm"] == r["comm"])
        assert r["vs_none"] == pytest.approx(r["step_ms"] / base["step_ms"])
        assert r["ideal_ms"] == pytest.approx(base["ideal_ms"])  # the same work and bytes
    with pytest.raises(SystemExit):
        mod.main(["--stages", "1", "--json", str(path)])
