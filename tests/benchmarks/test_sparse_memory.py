"""benchmarks/sparse_memory.py on meta at a small shape: what the sparse layer (one remote stage or four
sub-stages) keeps when it casts again is plain attention's (q, k, v, out, lse) plus the selection as
given, one row per token (not one per head group: with G = 2 that would be twice the selection)."""
import pytest
import torch

from tests.benchmarks._load import load_bench

SHAPES = {"tokens_per_rank": 128, "num_heads_q": 8, "num_heads_kv": 2, "head_dim": 32, "dtype": torch.bfloat16}


@pytest.mark.parametrize("num_stages", [1, 4])
@pytest.mark.parametrize("kind,selection_bytes", [("dsa", 128 * 32 * 4), ("nsa", 128 * 2 * 4 * 4)])
def test_cast_again_keeps_plain_attention_and_the_selection(kind, selection_bytes, num_stages):
    sm = load_bench("sparse_memory.py")
    row = sm.measure(kind, 4, False, shapes=SHAPES, num_stages=num_stages, topk=32, top_n=4)
    plain = row["plain_mb"] * sm.MB
    assert row["kept_mb"] * sm.MB == pytest.approx(plain + selection_bytes, abs=0.5)
    kept = sm.measure(kind, 4, True, shapes=SHAPES, num_stages=num_stages, topk=32, top_n=4)
    assert kept["kept_mb"] > row["kept_mb"]  # the receive buffers of X besides
