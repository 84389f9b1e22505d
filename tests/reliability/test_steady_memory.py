"""Steady memory: 200 layers through LocalGroup, forward and backward, allocate nothing that stays.

On CPU there is no allocator counter like ``torch.cuda.memory_allocated``, so
the test measures what a leak would leave behind, after a warm-up and then
every 50 layers:

- the tensors alive and reachable from Python (``gc``), and the bytes of
  their distinct storages: a tensor kept by a cache, a counter, the flag
  table or a saved autograd graph shows up here;
- the Python heap (``tracemalloc``): lists, dicts and closures that grow.

Both must be flat from layer 50 to layer 200 (tensors and storage bytes
exactly). Half the layers run in sync-free mode (device flags recorded every
layer), and two masks alternate under two names (the plan cache holds both).

The layers run in a fresh interpreter: in a pytest worker, tensors that earlier
tests left in bounded caches are evicted while this test runs, and the count
would fall for reasons that have nothing to do with the layer.
"""
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import torch

from gpusolver import errors
from gpusolver.masks import sliding_window_mask, varlen_causal_mask
from gpusolver.runtime import DynamicCPAttention, PlanCache, shard
from groupcomm import LocalGroup
from tests.gpusolver.runtime._cases import make_config, make_inputs
from tests.reliability._cases import clean_flags, quiet

LAYERS = 200


def _live_tensors() -> tuple[int, int]:
    gc.collect()
    count, storages = 0, {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                count += 1
                st = obj.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - objects that refuse inspection are not tensors we made
            continue
    return count, sum(storages.values())


def measure_layers() -> dict:
    """Run LAYERS + 1 layers; return the plan cache's solves and a sample every 50 layers."""
    torch.set_num_threads(1)
    P, c, Hq, Hkv = 2, 24, 4, 2
    S = P * c
    group = LocalGroup(P)
    config = make_config(P, Hq, Hkv)
    cache = PlanCache()
    layers = {v: DynamicCPAttention(group, config, solver="reference", plan_cache=cache, validate=v)
              for v in (True, False)}
    masks = {"docs": varlen_causal_mask([20, 14, 14]), "swa": sliding_window_mask(S, 9)}
    q, k, v, d_out, _ = (shard(x, group) for x in make_inputs(S, Hq, Hkv))
    samples = []
    tracemalloc.start()
    try:
        with clean_flags(), quiet():
            for layer in range(LAYERS + 1):
                name = "docs" if layer % 2 else "swa"
                attn = layers[layer % 4 < 2]
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                out = attn(*leaves, masks[name], mask_name=name)
                out.backward(d_out)
                del out, leaves
                if layer % 50 == 0 and layer:
                    errors.check_errors()          # the flags stay clear: every layer is valid
                    samples.append((layer, *_live_tensors(), tracemalloc.get_traced_memory()[0]))
    finally:
        tracemalloc.stop()
    return {"solves": cache.solves, "samples": samples}


def test_two_hundred_layers_keep_memory_flat():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    code = "import json; from tests.reliability.test_steady_memory import measure_layers; print(json.dumps(measure_layers()))"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["solves"] == 2                   # two masks, one solve each, reused 199 times
    (_, t0, b0, h0), *rest = result["samples"]
    assert len(rest) == LAYERS // 50 - 1
    for layer, tensors, nbytes, heap in rest:
        assert tensors == t0, f"layer {layer}: {tensors} live tensors, {t0} at layer 50"
        assert nbytes == b0, f"layer {layer}: {nbytes} tensor bytes, {b0} at layer 50"
        # allocator free lists move a few KB either way; a leak of 200 B a layer would pass 30 KB here
        assert heap - h0 < 32 * 1024, f"layer {layer}: the Python heap grew by {heap - h0} bytes since layer 50"
