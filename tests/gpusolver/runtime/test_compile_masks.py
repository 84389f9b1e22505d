"""A compiled ``DynamicCPAttention`` is correct for any sequence of masks (DESIGN.md rule 7).

One compile, then calls over three masks of one shape with repeats (A A B C B A),
each against eager layers on the same mask; the compiled function must not
recompile when the mask changes (the solve stays in the graph). Layers use a
cache of their own or the process-wide default, which may hold an eager entry
of the mask under the same name: the sharing a compiled model must not turn
into a stale plan. Compiles cost seconds (aot_eager) to minutes (inductor on
this CPU), so only one case is in the default tier.
"""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from gpusolver.masks import varlen_causal_mask
from gpusolver.masks.sparse import TokenTopKMask
from gpusolver.masks import dsa_topk_indices
from gpusolver.runtime import DynamicCPAttention, PlanCache, shard
from gpusolver.runtime.module import default_plan_cache
from groupcomm import LocalGroup
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import ATOL, RTOL, make_config, make_inputs

P, C, HQ, HKV = 2, 16, 2, 1  # P = 2: tracing unrolls the LocalGroup's loop over ranks
S = P * C
ORDER = (0, 0, 1, 2, 1, 0)  # three masks, each seen again after another


def _slice_masks():
    # the same row count R for all three (padding rows), so the graph's input shapes do not change
    return [varlen_causal_mask(d, pad_to=6) for d in ([10, 6, 16], [20, 12], [3, 9, 4, 16])]


def _sparse_masks():
    return [TokenTopKMask(dsa_topk_indices(S, 6, seed=s), S) for s in (1, 2, 3)]


def _layers(cache: str, n: int, num_stages="auto"):
    # the default num_stages ("auto": S = 4 sub-stages for slice masks), where a sub-stage's cast
    # can have a rank that sends no row: the tied int8 argmax inductor's CPU code got wrong (CHANGELOG)
    config = make_config(P, HQ, HKV, num_stages=num_stages)
    group = LocalGroup(P)
    if cache == "shared":  # the process-wide default
        default_plan_cache().clear()
        return group, [DynamicCPAttention(group, config) for _ in range(n)]
    return group, [DynamicCPAttention(group, config, plan_cache=PlanCache()) for _ in range(n)]


def _stack(layers, q, k, v, mask):
    out = q
    for layer in layers:  # every layer under the default mask_name: one cache entry for all
        out = out + layer(out, k, v, mask)
    return out


def _check_sequence(masks, backend: str, cache: str, layers: int = 1, grads: bool = False,
                    num_stages="auto"):
    group, compiled_layers = _layers(cache, layers, num_stages)
    q, k, v, d_out, _ = (shard(x, group) for x in make_inputs(S, HQ, HKV, seed=7))

    def leaves():
        return [x.clone().requires_grad_(grads) for x in (q, k, v)]

    refs = {}
    for i in sorted(set(ORDER)):  # eager, fresh layers and caches: the result of this mask alone
        x = leaves()
        out = _stack(_layers("own", layers, num_stages)[1], *x, masks[i])
        if grads:
            (out * d_out).sum().backward()
        refs[i] = [out.detach()] + ([t.grad for t in x] if grads else [])
    if cache == "shared":
        _stack(compiled_layers, q, k, v, masks[1])  # an eager call leaves a cache entry before the compile
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(lambda *a: _stack(compiled_layers, *a), fullgraph=True, backend=counter)
    for n, i in enumerate(ORDER):
        x = leaves()
        out = compiled(*x, masks[i])
        if grads:
            (out * d_out).sum().backward()
        got = [out.detach()] + ([t.grad for t in x] if grads else [])
        for name, a, b in zip(("out", "dq", "dk", "dv"), refs[i], got):
            assert_close(f"call {n} (mask {i}) {name}", a, b, atol=ATOL, rtol=RTOL)
    # one graph for every mask: the plan is computed inside it, never read from the cache
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for {len(set(ORDER))} masks"


@pytest.mark.filterwarnings("ignore:imbalance_tol")
def test_slices_aot_eager_shared_cache():
    """The process-wide cache holds an eager entry of the mask under the name when the compile starts."""
    _check_sequence(_slice_masks(), "aot_eager", "shared")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:imbalance_tol")
def test_slices_aot_eager_own_cache_grads():
    """Two layers share their own cache under one name; out and grads for every call."""
    _check_sequence(_slice_masks(), "aot_eager", "own", layers=2, grads=True)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:imbalance_tol")
@pytest.mark.parametrize("cache", ["own", "shared"])
def test_slices_inductor(cache):
    _check_sequence(_slice_masks(), "inductor", cache)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:imbalance_tol")
@pytest.mark.parametrize("num_stages", [1, 2], ids=["S1", "S2"])
def test_slices_inductor_stages(num_stages):
    """Explicit S next to the default's 4: one remote stage and two sub-stages."""
    _check_sequence(_slice_masks(), "inductor", "own", num_stages=num_stages)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:imbalance_tol")
@pytest.mark.parametrize("cache", ["own", "shared"])
def test_sparse_aot_eager(cache):
    _check_sequence(_sparse_masks(), "aot_eager", cache, grads=cache == "own")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:imbalance_tol")
def test_sparse_inductor():
    _check_sequence(_sparse_masks(), "inductor", "shared")


@pytest.mark.filterwarnings("ignore:imbalance_tol")
def test_cache_misses_after_an_in_place_write():
    """Eager: the cache keys on the mask object and its tensors' versions, so a mask whose
    tensors were rewritten in place solves again instead of reusing the old plan."""
    group, (layer,) = _layers("own", 1)
    q, k, v, _, _ = (shard(x, group) for x in make_inputs(S, HQ, HKV, seed=7))
    b = _slice_masks()[1]
    mask = varlen_causal_mask([10, 6, 16], pad_to=6)
    first = layer(q, k, v, mask)
    assert layer(q, k, v, mask) is not None and layer.plan_cache.solves == 1  # a hit
    for t, src in ((mask.q_ranges, b.q_ranges), (mask.k_ranges, b.k_ranges), (mask.attn_type, b.attn_type)):
        t.copy_(src)  # the same object now holds mask b's values
    got = layer(q, k, v, mask)
    assert layer.plan_cache.solves == 2
    ref = DynamicCPAttention(group, layer.config, plan_cache=PlanCache())(q, k, v, b)
    assert_close("out after the write", ref, got, atol=ATOL, rtol=RTOL)
    assert not torch.allclose(first, got)  # the two masks give different attention


@pytest.mark.filterwarnings("ignore:imbalance_tol")
def test_inference_mask_is_never_cached():
    """An inference tensor has no version counter, so a write to it could not be seen: no entry."""
    group, (layer,) = _layers("own", 1)
    q, k, v, _, _ = (shard(x, group) for x in make_inputs(S, HQ, HKV, seed=7))
    with torch.inference_mode():
        mask = varlen_causal_mask([10, 6, 16], pad_to=6)
        layer(q, k, v, mask)
        layer(q, k, v, mask)
    assert layer.plan_cache.solves == 2
