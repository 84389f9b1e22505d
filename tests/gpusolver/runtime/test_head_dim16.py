"""A layer with head dim 16 (small models) runs end to end and equals dense attention."""
import pytest
import torch

from attn_kernels.reference import dense_attn
from gpusolver import SolverConfig
from gpusolver.runtime import DynamicCPAttention, PlanCache, shard, unshard
from groupcomm import LocalGroup
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import ATOL, RTOL, make_mask


@pytest.mark.filterwarnings("ignore:imbalance_tol")
def test_layer_with_head_dim_16_equals_dense():
    P, c, Hq, Hkv, D = 2, 16, 4, 2, 16
    S = P * c
    mask = make_mask("docs-causal", S, seed=4)
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32)
    group = LocalGroup(P)
    layer = DynamicCPAttention(group, config, solver="reference", plan_cache=PlanCache())
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(S, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    d_out = torch.randn(S, Hq, D, generator=g)
    leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
    out = unshard(layer(*leaves, mask), group)
    (out * d_out).sum().backward()
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = dense_attn(*ref_leaves, mask.to_dense())
    (ref * d_out.double()).sum().backward()
    assert_close("out", ref.float(), out, atol=ATOL, rtol=RTOL)
    for name, a, b in zip("qkv", ref_leaves, leaves):
        assert_close(f"d{name}", a.grad.float(), unshard(b.grad, group), atol=ATOL, rtol=RTOL)
