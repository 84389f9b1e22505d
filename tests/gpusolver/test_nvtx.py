"""NVTX ranges: nothing when off; when on, ordered custom ops that survive torch.compile(fullgraph=True)."""
from __future__ import annotations

import pytest
import torch

from gpusolver import nvtx
from gpusolver.masks import varlen_causal_mask
from gpusolver.runtime import DynamicCPAttention, PlanCache, shard
from groupcomm import LocalGroup
from tests.gpusolver.runtime._cases import doc_lengths, make_config


@pytest.fixture
def ranges(monkeypatch):
    """Turn the ranges on and record every push / pop the ops make (as if CUDA were there)."""
    calls = []
    monkeypatch.setattr(nvtx, "_cuda_nvtx", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    prev = nvtx.set_enabled(True)
    torch._dynamo.reset()
    yield calls
    nvtx.set_enabled(prev)
    torch._dynamo.reset()


def _f(x):
    with nvtx.nvtx_range("attn/a"):
        y = x.sin()
    with nvtx.nvtx_range("comm/b"):
        with nvtx.nvtx_range("comm/c"):
            z = y * 2
    return z.sum()


def _graph_targets(backend_calls):
    def backend(gm, example_inputs):
        backend_calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    return backend


def test_off_by_default_and_absent_from_graphs():
    assert not nvtx.enabled()  # the test run does not set GPUSOLVER_NVTX
    targets = []
    torch._dynamo.reset()
    torch.compile(_f, fullgraph=True, backend=_graph_targets(targets))(torch.randn(4))
    assert targets and not any("nvtx" in t for t in targets)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_ranges_survive_compile_fullgraph(ranges, backend):
    x = torch.randn(8, requires_grad=True)
    out = torch.compile(_f, fullgraph=True, backend=backend)(x)
    out.backward()
    assert ranges == ["attn/a", "pop", "comm/b", "comm/c", "pop", "pop"]
    assert torch.allclose(out, _f(x.detach())) and torch.allclose(x.grad, 2 * x.detach().cos())


def test_ops_are_in_the_traced_graph(ranges):
    targets = []
    torch.compile(_f, fullgraph=True, backend=_graph_targets(targets))(torch.randn(4))
    assert sum("nvtx_push" in t for t in targets) == 3 and sum("nvtx_pop" in t for t in targets) == 3


def test_noop_without_cuda():
    prev = nvtx.set_enabled(True)
    try:
        assert _f(torch.ones(3)).item() == pytest.approx(6 * torch.sin(torch.tensor(1.0)).item())
    finally:
        nvtx.set_enabled(prev)


def test_compiled_layer_with_ranges(ranges):
    """A DynamicCPAttention layer (solve, routes, casts, stages, reduces) compiled with the ranges on."""
    P, c, Hq, Hkv = 2, 16, 4, 2
    mask = varlen_causal_mask(doc_lengths(P * c, 2))
    group = LocalGroup(P)
    # the two-stage layer's range names
    attn = DynamicCPAttention(group, make_config(P, Hq, Hkv, num_stages=1), plan_cache=PlanCache())
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard(torch.randn(P * c, h, 32, generator=g), group).requires_grad_() for h in (Hq, Hkv, Hkv))

    def layer(q, k, v):
        return attn(q, k, v, mask)

    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v)
    out.sum().backward()
    pushed = [n for n in ranges if n != "pop"]
    assert len(pushed) == ranges.count("pop")
    for name in ("layer/default", "solve/metas", "solve/routes", "comm/cast fwd.qo", "comm/cast fwd.kv", "attn/fwd stage0",
                 "attn/fwd stage1", "comm/reduce fwd.o", "attn/bwd stage1", "comm/reduce bwd.dkv"):
        assert name in pushed, name
    ranges.clear()
    nvtx.set_enabled(False)
    torch._dynamo.reset()
    ref = layer(q.detach(), k.detach(), v.detach())
    assert ranges == [] and torch.allclose(ref, out, atol=1e-5)
