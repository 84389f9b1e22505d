"""benchmarks/layer_memory.py on meta: the fused merge's own peak is its outputs (and the slot table),
the torch path's is more; the rest of the layer's figures do not depend on the merge."""
import importlib.util
import sys
from pathlib import Path

import torch

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "layer_memory.py"


def _load():
    spec = importlib.util.spec_from_file_location("_bench_layer_memory", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_fused_merge_allocates_its_outputs_only():
    lm = _load()
    P, c, Hq, Hkv, D = 4, 512, 16, 4, 64
    shapes = {"tokens_per_rank": c, "num_heads_q": Hq, "num_heads_kv": Hkv, "head_dim": D, "dtype": torch.bfloat16}
    rows = {fused: lm.measure("causal", P, shapes, "meta", fused=fused) for fused in (False, True)}
    config = lm.make_config(P, shapes)
    G = config.head_groups
    N, h = G * c, Hq // G                                   # host rows of a rank, query heads per group
    slots = (P * N * P + 1) * 4 / P                         # the int32 slot table, per rank
    out, lse = N * h * D * 2, N * h * 4                     # the merged O (bf16) and lse (fp32), per rank
    assert rows[True]["fwd_reduce"] == out + lse + slots
    assert rows[True]["bwd_reduce"] == out + slots          # dQ; dK, dV (fewer heads) are smaller
    assert rows[False]["fwd_reduce"] > rows[True]["fwd_reduce"]
    assert rows[False]["bwd_reduce"] > rows[True]["bwd_reduce"]
    for key in ("kept", "plan_kept", "plan_fwd", "plan_bwd"):
        assert rows[False][key] == rows[True][key], key
    assert (rows[False]["fused"], rows[True]["fused"]) == ("no", "yes")
