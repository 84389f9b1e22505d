"""Padded == unpadded, bit for bit, as a property: padding rows (an empty q or k range, anywhere in
the table, any type code) change nothing in the kernels' outputs and gradients, the block areas, the
solve, or the layer."""
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from attn_kernels import flex_attn
from gpusolver import SolverConfig, block_areas
from gpusolver.masks import AttnSlices
from gpusolver.plan import build_plan
from gpusolver.runtime import dist_attn, shard
from gpusolver.solve import solve_assignment
from groupcomm import LocalGroup
from tests.reliability._cases import D, budget
from tests.reliability._fuzz import make_mask

SLOW = [HealthCheck.too_slow]


def _pad(mask: AttnSlices, n: int, seed: int) -> AttnSlices:
    """``n`` padding rows at random positions: [s, s) query or key ranges of every kind."""
    rng = np.random.default_rng(seed)
    q, k, t = (x.tolist() for x in (mask.q_ranges, mask.k_ranges, mask.attn_type))
    S = mask.total_seqlen_q
    for _ in range(n):
        s = int(rng.integers(0, S + 1))
        e = int(rng.integers(s, S + 1))
        row = ([s, s], [0, e], int(rng.integers(0, 4))) if rng.random() < 0.5 \
            else ([0, e], [s, s], int(rng.integers(0, 4)))
        pos = int(rng.integers(0, len(t) + 1))
        q.insert(pos, row[0])
        k.insert(pos, row[1])
        t.insert(pos, row[2])
    as_t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return AttnSlices(as_t(q).reshape(-1, 2), as_t(k).reshape(-1, 2), as_t(t), S, S)


@settings(max_examples=budget(8, 500), suppress_health_check=SLOW)
@given(m=st.fixed_dictionaries({"kind": st.sampled_from(["random", "causal-docs", "full-docs", "window",
                                                          "one-token-docs", "empty"]),
                                 "seed": st.integers(0, 2 ** 20)}),
       T=st.integers(1, 64), n=st.integers(1, 6), backend=st.sampled_from(["torch", "triton"]),
       dtype=st.sampled_from([torch.float32, torch.float16]), pad_seed=st.integers(0, 2 ** 20))
def test_kernels_ignore_padding_rows(m, T, n, backend, dtype, pad_seed):
    mask = make_mask(S=T, **m)
    padded = _pad(mask, n, pad_seed)
    g = torch.Generator().manual_seed(pad_seed)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (4, 2, 2))
    dout = torch.randn(T, 4, D, generator=g).to(dtype)
    res = []
    for mk in (mask, padded):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = flex_attn(*leaves, mk.q_ranges, mk.k_ranges, mk.attn_type, backend=backend)
        out.backward(dout)
        res.append((out, lse, *(x.grad for x in leaves)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *res):
        assert torch.equal(a, b), f"{name} changed with {n} padding rows"


@settings(max_examples=budget(4, 200), suppress_health_check=SLOW)
@given(kind=st.sampled_from(["random", "causal-docs", "full-docs", "window"]), seed=st.integers(0, 2 ** 20),
       P=st.integers(1, 4), c=st.integers(2, 12), n=st.integers(1, 6), pad_seed=st.integers(0, 2 ** 20))
def test_solve_and_layer_ignore_padding_rows(kind, seed, P, c, n, pad_seed):
    S = P * c
    mask = make_mask(kind, S, seed)
    padded = _pad(mask, n, pad_seed)
    config = SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=2, head_dim=D, dtype=torch.float32)
    areas = [block_areas(mk, P, 2) for mk in (mask, padded)]
    for name in ("area", "q_need", "k_need"):
        assert torch.equal(getattr(areas[0], name), getattr(areas[1], name)), name
    assignment = solve_assignment(areas[0], config)
    assert torch.equal(assignment, solve_assignment(areas[1], config))
    group = LocalGroup(P)
    g = torch.Generator().manual_seed(pad_seed)
    q, k, v = (shard(torch.randn(S, h, D, generator=g), group) for h in (4, 2, 2))
    res = []
    for mk, ar in zip((mask, padded), areas):
        plan = build_plan(mk, ar, assignment, config)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = dist_attn(*leaves, plan, group)
        (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
        res.append((out, lse, *(x.grad for x in leaves)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *res):
        assert torch.equal(a, b), f"{name} changed with {n} padding rows"
