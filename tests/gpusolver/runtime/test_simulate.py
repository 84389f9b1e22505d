"""Plans executed end to end (all ranks in one process) equal dense attention."""
import pytest
import torch

from attn_kernels.reference import dense_attn
from gpusolver import SolverConfig, block_areas, evaluate, solve
from gpusolver.metrics import owner_computes_assignment
from gpusolver.masks import causal_mask, full_mask, packed_documents, sliding_window_mask, varlen_full_mask
from gpusolver.runtime import group_major, simulate_forward, ungroup
from tests._solves import shared_solve
from tests._testing import assert_close


def _qkv(S, Hq, Hkv, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(S, Hq, D, generator=gen), torch.randn(S, Hkv, D, generator=gen),
            torch.randn(S, Hkv, D, generator=gen))


def test_group_major_round_trip():
    x = torch.arange(6 * 4 * 2, dtype=torch.float32).view(6, 4, 2)  # S = 6, H = 4, D = 2
    rows = group_major(x, rank=1, chunk=3, groups=2)
    assert rows.shape == (6, 2, 2)
    assert torch.equal(rows[0], x[3, 0:2]) and torch.equal(rows[3 + 2], x[5, 2:4])  # row g*c + t
    assert torch.equal(ungroup(rows, 3, 2), x[3:6])


@pytest.mark.parametrize("solver,stages", [("device", "auto"), ("reference", "auto"), ("device", 1)])
@pytest.mark.parametrize("name,P,G", [("packed-causal", 4, 2), ("packed-full", 3, 2), ("causal", 4, 1),
                                      ("window", 2, 2), ("docs-full", 4, 2)])
def test_plan_forward_equals_dense_attention(solver, stages, name, P, G):
    S = 48 * P
    mask = {"packed-causal": lambda: packed_documents(S, seed=3),
            "packed-full": lambda: packed_documents(S, seed=4, causal=False),
            "causal": lambda: causal_mask(S),
            "window": lambda: sliding_window_mask(S, 20),
            "docs-full": lambda: varlen_full_mask([10, 70, S - 80])}[name]()
    Hq, Hkv, D = 4 * G, G, 32
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32,
                          num_stages=stages)
    plan = shared_solve(mask, config, solver=solver)
    assert plan.comm.num_stages == (5 if stages == "auto" else 1)  # the default: sub-stages and the local tail
    q, k, v = _qkv(S, Hq, Hkv, D)
    out, lse = simulate_forward(plan, q, k, v)
    ref_out, ref_lse = dense_attn(q, k, v, mask.to_dense())
    assert_close("out", ref_out, out, atol=1e-4, rtol=1e-4)
    assert_close("lse", ref_lse, lse, atol=1e-4, rtol=1e-4)
    # where owner-computes is unbalanced the plan moves work, so the exchange was exercised
    # chunk_tiles="auto": the plan's units are tiles of c / n tokens, unit i hosted by rank i // n
    n = plan.assignment.shape[1] // P
    areas = block_areas(mask, P, G, impl="torch", tiles=n)
    owner = evaluate(areas, owner_computes_assignment(areas), config.cost())
    if owner.imbalance.item() > config.imbalance_tol:
        host = torch.arange(P * n) // n
        moved = (plan.assignment >= 0) & (plan.assignment != host.view(1, P * n, 1))
        assert moved.any() and int(plan.comm.qo_split.sum()) > 0


@pytest.mark.parametrize("solver", ["device", "reference"])
@pytest.mark.parametrize("name,P,G,tiles", [("packed-causal", 4, 2, 2), ("packed-full", 3, 2, 2),
                                            ("causal", 2, 1, 4), ("causal", 4, 1, 2), ("window", 4, 1, 3)])
def test_tiled_plan_forward_equals_dense_attention(solver, name, P, G, tiles):
    # sub-chunk tiles: units of c / n tokens, ranges and buffers per tile, pieces cut at tile borders
    S = 48 * P
    mask = {"packed-causal": lambda: packed_documents(S, seed=3),
            "packed-full": lambda: packed_documents(S, seed=4, causal=False),
            "causal": lambda: causal_mask(S),
            "window": lambda: sliding_window_mask(S, 20)}[name]()
    Hq, Hkv, D = 4 * G, G, 32
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32,
                          chunk_tiles=tiles)
    plan = shared_solve(mask, config, solver=solver)
    assert plan.assignment.shape == (G, P * tiles, P * tiles)
    q, k, v = _qkv(S, Hq, Hkv, D)
    out, lse = simulate_forward(plan, q, k, v)
    ref_out, ref_lse = dense_attn(q, k, v, mask.to_dense())
    assert_close("out", ref_out, out, atol=1e-4, rtol=1e-4)
    assert_close("lse", ref_lse, lse, atol=1e-4, rtol=1e-4)
    if solver == "device" and name == "causal":
        # owner-computes is unbalanced: the tiled search split some chunk pair's tiles over ranks
        a = plan.assignment.view(G, P, tiles, P, tiles).permute(0, 1, 3, 2, 4).reshape(G, P, P, -1).long()
        split = (a.amax(-1) >= 0) & (torch.where(a >= 0, a, P).amin(-1) != a.amax(-1))
        assert split.any() and int(plan.comm.qo_split.sum()) > 0


def test_transposed_plan_forward_equals_dense_attention():
    """One full-attention sequence over 6 ranks, one query head per KV head: owner-computes is
    balanced but gathers K/V from every rank; the plan ships query rows to their head group's
    rank instead (the transposed start), moves fewer bytes, and computes the same attention."""
    P, G, D = 6, 2, 32
    S = 32 * P
    mask = full_mask(S)
    config = SolverConfig(cp_size=P, num_heads_q=G, num_heads_kv=G, head_dim=D, dtype=torch.float32)
    plan = solve(mask, config)
    areas = block_areas(mask, P, G, impl="torch", tiles=plan.assignment.shape[1] // P)
    owner = evaluate(areas, owner_computes_assignment(areas), config.cost())
    assert evaluate(areas, plan.assignment, config.cost()).fwd_bottleneck < owner.fwd_bottleneck
    assert int(plan.comm.qo_split.sum()) > 0
    q, k, v = _qkv(S, G, G, D)
    out, lse = simulate_forward(plan, q, k, v)
    ref_out, ref_lse = dense_attn(q, k, v, mask.to_dense())
    assert_close("out", ref_out, out, atol=1e-4, rtol=1e-4)
    assert_close("lse", ref_lse, lse, atol=1e-4, rtol=1e-4)


def test_plan_gradients_equal_dense_attention():
    # autograd through the simulated exchange, both stages and the merges: the gradients a
    # distributed backward must reproduce (dQ back to query hosts, dK and dV to key hosts)
    P, G, S, D = 4, 2, 192, 32
    mask = packed_documents(S, seed=3)
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, head_dim=D, dtype=torch.float32)
    # the plan of test_plan_forward_equals_dense_attention[packed-causal-4-2-device]: solved once
    plan = shared_solve(mask, config, solver="device")
    q, k, v = (t.requires_grad_() for t in _qkv(S, 4 * G, G, D, seed=1))
    w = torch.randn(S, 4 * G, D, generator=torch.Generator().manual_seed(2))
    out, _ = simulate_forward(plan, q, k, v)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_out, _ = dense_attn(q, k, v, mask.to_dense())
    ref_grads = torch.autograd.grad((ref_out * w).sum(), (q, k, v))
    for name, ref, got in zip(("dq", "dk", "dv"), ref_grads, grads):
        assert_close(name, ref, got, atol=1e-4, rtol=1e-4)
