"""benchmarks/sparse_bench.py on tiny sizes: complete tables and JSON, exact sets never above hulls."""
import json
import sys

import pytest
import torch

from tests.benchmarks._load import load_bench


def _load():
    return load_bench("sparse_bench.py", "_bench_sparse")


def test_tiny_grid_writes_tables(tmp_path, monkeypatch):
    saved_path, saved_threads = list(sys.path), torch.get_num_threads()
    try:
        bench = _load()
        monkeypatch.setattr(bench, "DSA_TOPK", 24)
        monkeypatch.setattr(bench, "NSA_BLOCK", 16)
        monkeypatch.setattr(bench, "NSA_TOPN", 3)
        out = bench.main(["--dsa-P", "4", "--nsa-P", "4", "--tokens-per-rank", "128", "--big", "",
                          "--seeds", "0,1", "--one-seed", "dsa:4", "--json", str(tmp_path / "s.json"),
                          "--md", str(tmp_path / "s.md"), "--stages", "1,2",
                          "--stages-json", str(tmp_path / "st.json"), "--stages-md", str(tmp_path / "st.md")])
    finally:
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
        sys.modules.pop("_bench_sparse", None)
    rows = out["rows"]
    assert [(r["mask"].split()[0], r["G"], r["seed"]) for r in rows] == \
        [("DSA", 1, 0), ("DSA", 8, 0), ("NSA", 8, 0), ("NSA", 8, 1)]  # --one-seed: DSA runs seed 0 only
    for r in rows:
        assert r["fwd_exact"] <= r["fwd"] and r["owner_fwd_exact"] <= r["owner_fwd"]
        assert 0 < r["kv_exact_share"] <= 1 and r["imb"] >= 1.0
        assert ("fwd_blocks" in r) == r["mask"].startswith("NSA")  # NSA moves key blocks by default
        # moved bytes: hulls for DSA, key blocks (never above the hulls) for NSA
        moved = r["fwd_blocks"] + r["bwd_blocks"] if "fwd_blocks" in r else r["fwd"] + r["bwd"]
        assert r["moved_step"] == pytest.approx(moved) and r["priced_step"] == pytest.approx(r["fwd"] + r["bwd"])
        assert r["moved_step"] <= r["priced_step"]
    payload = json.loads((tmp_path / "s.json").read_text())
    assert payload["rows"] == json.loads(json.dumps(rows)) and payload["provenance"]["command"]
    text = (tmp_path / "s.md").read_text()
    assert "| DSA k=24 | 64:1 | 1 | 4 | 128 | 0 |" in text and "KV as hulls vs exact token sets" in text
    assert "| NSA n=3 l=16 | 64:8 | 4 | 128 | 2 |" in text  # over seeds: two NSA seeds in one row
    assert payload["provenance"]["commit"] in text and "DSA at c = 128 left out of this run" in text
    assert "### Where not to use the solver" in text and "NSA n=3 l=16, Hq:Hkv 64:8, P = 4, c = 128 (2 seeds)" in text
    # --stages: each returned plan built at S = 1 and 2 and simulated (a2a, p2p)
    stage_rows = out["stage_rows"]
    assert [(r["mask"].split()[0], r["G"], r["seed"], r["S"]) for r in stage_rows] == \
        [(m, g, seed, S) for m, g, seed in [("DSA", 1, 0), ("DSA", 8, 0), ("NSA", 8, 0), ("NSA", 8, 1)] for S in (1, 2)]
    for r in stage_rows:
        for comm in ("a2a", "p2p"):
            assert r[f"{comm}_step"] == pytest.approx(r[f"{comm}_fwd"] + r[f"{comm}_bwd"]) and r[f"{comm}_step"] > 0
            assert r[f"{comm}_vs_ideal"] >= 1.0 - 1e-9 and 0.0 <= r[f"{comm}_exposed"] <= 1.0
            assert r["S"] > 1 or r[f"{comm}_vs_S1"] == 1.0
            # over owner-computes' two-stage step: the same plan where owner-computes is returned
            assert r[f"{comm}_vs_owner"] > 0
            assert r["plan"] != "owner" or r["S"] > 1 or r[f"{comm}_vs_owner"] == pytest.approx(1.0)
    assert "simulated on `h200_hgx` (not measured)" in (tmp_path / "st.md").read_text()
    assert json.loads((tmp_path / "st.json").read_text())["rows"] == json.loads(json.dumps(stage_rows))
    again = bench.main(["--from-json", str(tmp_path / "s.json"), "--md", str(tmp_path / "again.md")])["text"]
    assert again == text  # the markdown is a function of the saved rows and provenance
