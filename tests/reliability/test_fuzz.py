"""The fuzz harness: hypothesis over every layer (``make fuzz`` runs thousands of cases; CI a
bounded, derandomized subset; ``_cases.budget``).

Properties:
- masks: host validation and the device flags agree on every generated mask, corrupted or not;
  the pairwise overlap check agrees with a dense coverage count;
- areas: every valid (q, k) entry is counted once (dense counts; exact Python counts up to
  millions of tokens), torch and Triton equal;
- plans: from any assignment and any capacity, every valid (group, q, k) entry is computed
  exactly once (the stage tables mapped back through the receive layout), or the status says
  which capacity overflowed;
- the solve (P 1-128, up to 2^24 tokens, tiles, G): the same plan on every run, shapes that
  depend on the configuration only (equal to a meta-device run), metrics equal evaluate();
- kernels and the layer: outputs equal the dense reference; with zero queries exp(lse) is the
  number of keys each row attends, so no entry is dropped or computed twice;
- collectives and sparse selections: both backends give the same bits; selection areas count
  every kept (q, k) once.
"""
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

from attn_kernels import flex_attn
from attn_kernels.reference import dense_attn
from gpusolver import SolverConfig, block_areas, errors, evaluate
from gpusolver.areas import block_sparse_areas, token_topk_areas
from gpusolver.masks import AttnSlices
from gpusolver.masks.sparse import BlockSparseMask, TokenTopKMask
from gpusolver.masks.validation import validate_slices
from gpusolver.plan import BUFFER_OVERFLOW, CALC_OVERFLOW, IMBALANCED, build_plan
from gpusolver.runtime import dist_attn, shard, unshard
from gpusolver.runtime.dist_attn import plan_digest
from gpusolver.solve import solve
from groupcomm import LocalGroup, group_cast, group_reduce
from tests._testing import assert_close
from tests.groupcomm._cases import random_routing
from tests.reliability._cases import D, budget, clean_flags
from tests.reliability._fuzz import dense, dense_layer_reference, make_mask, mask_rows, masks, plan_coverage, slice_area

SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _quiet():
    warnings.simplefilter("ignore")


# ------------------------------------------------------------------ masks: validation and flags agree


CORRUPTIONS = ("none", "reverse", "negative", "past-S", "type", "duplicate-row", "shifted-copy")


def _corrupt(mask: AttnSlices, how: str, row: int) -> AttnSlices:
    q, k, t = (x.clone() for x in (mask.q_ranges, mask.k_ranges, mask.attn_type))
    flat_q, flat_k, flat_t = q.view(-1, 2), k.view(-1, 2), t.view(-1)
    r = row % flat_t.numel()
    S = mask.total_seqlen_q
    if how == "reverse":
        flat_q[r] = torch.tensor([flat_q[r, 1] + 1, flat_q[r, 1]])
    elif how == "negative":
        flat_k[r, 0] = -1 - r % 3
    elif how == "past-S":
        flat_k[r, 1] = S + 1 + r % 5
    elif how == "type":
        flat_t[r] = 4 + r % 3 if r % 2 else -1
    elif how in ("duplicate-row", "shifted-copy"):
        live = ((flat_q[:, 1] > flat_q[:, 0]) & (flat_k[:, 1] > flat_k[:, 0])).nonzero()[:, 0]
        if live.numel():
            src, dst = int(live[r % live.numel()]), (r + 1) % flat_t.numel()
            flat_q[dst], flat_k[dst], flat_t[dst] = flat_q[src], flat_k[src], FULL_IF(how, flat_t[src])
    return AttnSlices(q, k, t, S, S)


def FULL_IF(how, code):
    return code if how == "duplicate-row" else torch.zeros_like(code)  # a FULL copy overlaps any live slice


@settings(max_examples=budget(25, 3000), suppress_health_check=SLOW)
@given(m=masks(), S=st.integers(1, 48), how=st.sampled_from(CORRUPTIONS), row=st.integers(0, 2 ** 10))
def test_validation_and_device_flags_agree(m, S, how, row):
    mask = _corrupt(make_mask(S=S, **m), how, row)
    try:
        validate_slices(mask)
        host = None
    except ValueError as e:
        host = str(e)
    with clean_flags():
        errors.record_slices("solve", mask, overlap=True, impl="triton" if row % 2 else "torch")
        flagged = errors.pending()
    assert (host is None) == (not flagged), f"validate: {host!r}; flags: {[f['message'] for f in flagged]}"
    # overlap: the pairwise check against a dense coverage count
    try:
        validate_slices(mask, check_overlap=False)
    except ValueError:
        return  # out-of-range rows have no dense form
    overlapping = host is not None
    assert overlapping == any(bool((_dense_rows(mask, g) > 1).any()) for g in range(2 if mask.grouped else 1)), host


def _dense_rows(mask: AttnSlices, g: int) -> np.ndarray:
    """[S, S] count of the slices of group g covering each entry (overlaps count twice)."""
    q = mask.q_ranges[g] if mask.grouped else mask.q_ranges
    k = mask.k_ranges[g] if mask.grouped else mask.k_ranges
    t = mask.attn_type[g] if mask.grouped else mask.attn_type
    S = mask.total_seqlen_q
    out = np.zeros((S, S), dtype=np.int64)
    for i in range(t.numel()):
        one = AttnSlices(q[i:i + 1].clone(), k[i:i + 1].clone(), t[i:i + 1].clone(), S, S)
        out += one.to_dense().numpy()
    return out


# ------------------------------------------------------------------ areas: every entry once


@settings(max_examples=budget(25, 3000), suppress_health_check=SLOW)
@given(m=masks(), P=st.integers(1, 6), c=st.integers(1, 12), tiles=st.sampled_from([1, 2, 3]),
       triton=st.booleans())
def test_areas_count_every_entry_once(m, P, c, tiles, triton):
    S = P * c * tiles
    mask = make_mask(S=S, **m)
    G = 2 if mask.grouped else 1
    areas = block_areas(mask, P, G, impl="triton" if triton else "torch", tiles=tiles)
    U, u = P * tiles, c
    blocks = dense(mask, G).view(G, U, u, U, u).sum((2, 4))
    assert torch.equal(areas.area, blocks)


@settings(max_examples=budget(6, 400), suppress_health_check=SLOW)
@given(kind=st.sampled_from(["causal-docs", "full-docs", "window", "causal-range", "mixed-docs"]),
       log_s=st.integers(16, 24), P=st.sampled_from([1, 2, 8, 32, 128]), seed=st.integers(0, 2 ** 20))
def test_areas_at_millions_of_tokens(kind, log_s, P, seed):
    """Exact Python counts (int64 areas, past int32 totals) up to S = 2^24."""
    S = 1 << log_s
    rows = mask_rows(kind, S, seed)[:4096]
    rows = [r for r in rows if r[1] <= S]
    t = torch.tensor(rows, dtype=torch.int32)
    mask = AttnSlices(t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous(), S, S)
    areas = block_areas(mask, P)
    assert int(areas.area.sum()) == slice_area(rows)


# ------------------------------------------------------------------ plans: every entry exactly once


def _random_assignment(areas, P: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, P, areas.area.shape, generator=g)
    return torch.where(areas.area > 0, a, -1).to(torch.int32)


@settings(max_examples=budget(20, 2000), suppress_health_check=SLOW)
@given(m=masks(max_s=64), P=st.integers(1, 5), c=st.integers(1, 10), tiles=st.sampled_from([1, 2]),
       seed=st.integers(0, 2 ** 20), tight=st.booleans(), flatten=st.booleans())
def test_plan_computes_every_entry_exactly_once(m, P, c, tiles, seed, tight, flatten):
    S = P * c * tiles
    mask = make_mask(S=S, **m)
    G = 2 if (mask.grouped or flatten) else 1
    config = SolverConfig(cp_size=P, num_heads_q=2 * G, num_heads_kv=G, head_dim=D, dtype=torch.float32,
                          chunk_tiles=tiles, head_group_flatten=G > 1,
                          num_stages=1)  # plan_coverage reads the two-stage layout
    areas = block_areas(mask, P, G, tiles=tiles)
    assignment = _random_assignment(areas, P, seed)
    # a random assignment is no solver's plan: the default buffers (sized to what solves fill) need
    # not hold it, the worst case always does
    worst = G * areas.rank_tokens * (P - 1)
    plan = build_plan(mask, areas, assignment, config, recv_capacity=worst, send_capacity=worst)
    status = int(plan.status) & ~IMBALANCED
    assert status == 0, plan.validate(ignore=IMBALANCED)
    assert np.array_equal(plan_coverage(plan, S), dense(mask, G).numpy())
    assert torch.equal(plan.metrics.load, evaluate(areas, assignment, config.cost()).load)
    if tight:  # smaller capacities: overflow flagged exactly when the need passes them
        need = int(plan.calc.needed_rows.max())
        rows = max(int(plan.comm.qo_recv_rows.max()), int(plan.comm.kv_recv_rows.max()),
                   int(plan.comm.qo_split.sum(1).max()), int(plan.comm.kv_split.sum(1).max()))
        g = np.random.default_rng(seed)
        stage_cap, row_cap = int(g.integers(1, need + 2)), int(g.integers(0, rows + 2))
        small = build_plan(mask, areas, assignment, config, recv_capacity=row_cap, send_capacity=row_cap)
        small_stage = build_plan(mask, areas, assignment,
                                 config.replaced(max_stage_slices=stage_cap))
        assert bool(int(small.status) & BUFFER_OVERFLOW) == (rows > row_cap)
        assert bool(int(small_stage.status) & CALC_OVERFLOW) == (need > stage_cap)
        if not int(small.status) & BUFFER_OVERFLOW:
            assert np.array_equal(plan_coverage(small, S), dense(mask, G).numpy())


# ------------------------------------------------------------------ the solve: determinism, static shapes


def _plan_tensors(plan) -> dict:
    c, m = plan.calc, plan.comm
    return {"assignment": plan.assignment, "status": plan.status, "q_ranges": c.q_ranges, "k_ranges": c.k_ranges,
            "attn_type": c.attn_type, "num_rows": c.num_rows, "needed_rows": c.needed_rows,
            "qo_range": m.qo_range, "kv_range": m.kv_range, "qo_split": m.qo_split, "kv_split": m.kv_split,
            "qo_recv_offset": m.qo_recv_offset, "kv_recv_offset": m.kv_recv_offset, "load": plan.metrics.load}


@settings(max_examples=budget(3, 200), suppress_health_check=SLOW)
@given(kind=st.sampled_from(["causal-docs", "full-docs", "mixed-docs", "window", "causal-range", "full-range",
                             "one-token-docs", "empty"]),
       P=st.sampled_from([1, 2, 3, 4, 8, 16, 32, 64, 128]), log_c=st.integers(4, 17), G=st.sampled_from([1, 2, 8]),
       tiles=st.sampled_from([1, 1, 2]), seed=st.integers(0, 2 ** 20), solver=st.sampled_from(["device", "reference"]))
def test_solve_is_deterministic_with_static_shapes(kind, P, log_c, G, tiles, seed, solver):
    c = 1 << log_c
    S = P * c
    assume(S <= 1 << 24 and (kind != "one-token-docs" or S <= 1 << 12))
    assume(P * P * G * tiles * tiles <= 64 * 64 * 8)           # keeps one torch-path solve within seconds
    mask = make_mask(kind, S, seed)
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, head_dim=128, chunk_tiles=tiles)
    with warnings.catch_warnings():
        _quiet()
        first = solve(mask, config, solver=solver, validate=False)
        again = solve(mask, config, solver=solver, validate=False)
    a, b = _plan_tensors(first), _plan_tensors(again)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs between two runs"
    assert int(plan_digest(first)) == int(plan_digest(again))
    areas = block_areas(mask, P, G, tiles=tiles)
    assert int(areas.area.sum()) == G * slice_area(mask_rows(kind, S, seed)) or kind == "empty"
    assert torch.equal(evaluate(areas, first.assignment, config.cost()).fwd_bottleneck, first.metrics.fwd_bottleneck)
    assert int(first.status) & ~IMBALANCED & ~BUFFER_OVERFLOW == 0
    asg = first.assignment
    assert bool(((asg >= 0) & (asg < P) | (areas.area == 0)).all()) and bool(((asg == -1) | (areas.area > 0)).all())
    if solver == "device":  # shapes are a function of the configuration: a meta-device solve agrees
        meta = AttnSlices(*(x.to("meta") for x in (mask.q_ranges, mask.k_ranges, mask.attn_type)), S, S)
        shapes = {k: v.shape for k, v in _plan_tensors(solve(meta, config, validate=False)).items()}
        assert shapes == {k: v.shape for k, v in a.items()}


# ------------------------------------------------------------------ kernels and the layer against dense attention


@settings(max_examples=budget(6, 600), suppress_health_check=SLOW)
@given(m=masks(groups=False), Tq=st.integers(1, 70), extra_k=st.integers(0, 20), Hkv=st.sampled_from([1, 2]),
       backend=st.sampled_from(["torch", "triton"]), seed=st.integers(0, 2 ** 16))
def test_kernels_equal_dense_attention(m, Tq, extra_k, Hkv, backend, seed):
    mask = make_mask(S=Tq, **m)
    Tk = Tq + extra_k  # keys past the mask's S: never attended
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(Tq, 2 * Hkv, D, generator=g), torch.randn(Tk, Hkv, D, generator=g), \
        torch.randn(Tk, Hkv, D, generator=g)
    sl = (mask.q_ranges, mask.k_ranges, mask.attn_type)
    dm = torch.zeros(Tq, Tk, dtype=torch.bool)
    dm[:, :Tq] = mask.to_dense()
    out, lse = flex_attn(q, k, v, *sl, backend=backend)
    ref_out, ref_lse = dense_attn(q.double(), k.double(), v.double(), dm)
    assert_close("out", ref_out.float(), out, atol=2e-5, rtol=1e-4)
    assert_close("lse", ref_lse, lse, atol=2e-5, rtol=1e-4)
    # zero queries: every score is 0, so exp(lse) counts the keys each row attends (once each)
    _, lse0 = flex_attn(torch.zeros_like(q), k, v, *sl, backend=backend)
    counts = dm.sum(1, keepdim=True).double().expand(Tq, 2 * Hkv)
    assert torch.equal(torch.exp(lse0.double()).round(), counts)


@settings(max_examples=budget(4, 300), suppress_health_check=SLOW)
@given(m=masks(max_s=64), P=st.integers(1, 4), c=st.integers(2, 12), Hkv=st.sampled_from([1, 2]),
       seed=st.integers(0, 2 ** 16), impl=st.sampled_from(["torch", "triton"]))
# a random assignment past the default buffers (rank 3 receives 6 QO rows, the default holds 4)
@example(m=dict(kind="full-range", seed=0, groups=0, pad=0, shuffle=False), P=4, c=2, Hkv=1, seed=0, impl="torch")
def test_layer_equals_dense_attention(m, P, c, Hkv, seed, impl):
    S = P * c
    mask = make_mask(S=S, **m)
    G = 2 if mask.grouped else Hkv
    Hkv = G
    # a random assignment is no solver's plan: buffers at the worst case, which holds any of them
    config = SolverConfig(cp_size=P, num_heads_q=2 * G, num_heads_kv=G, head_dim=D, dtype=torch.float32,
                          max_recv_rows=G * c * (P - 1))
    areas = block_areas(mask, P, G)
    plan = build_plan(mask, areas, _random_assignment(areas, P, seed), config)
    group = LocalGroup(P, impl=impl)
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(S, 2 * G, D, generator=g), torch.randn(S, G, D, generator=g), torch.randn(S, G, D, generator=g)
    d_out = torch.randn(S, 2 * G, D, generator=g)
    leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
    out, lse = dist_attn(*leaves, plan, group)
    out.backward(shard(d_out, group))
    got = [unshard(t.detach(), group) for t in (out, lse, *(x.grad for x in leaves))]
    ref = dense_layer_reference(mask, G, q, k, v, d_out)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ref, got):
        assert_close(name, a, b, atol=2e-5, rtol=1e-4)
    zero = dist_attn(torch.zeros_like(leaves[0]), leaves[1].detach(), leaves[2].detach(), plan, group)[1]
    # two query heads a group
    counts = torch.stack([dense(mask, G)[grp].sum(1) for grp in range(G)], 1).repeat_interleave(2, 1).double()
    assert torch.equal(torch.exp(unshard(zero, group).double()).round(), counts)


# ------------------------------------------------------------------ collectives and sparse selections


@settings(max_examples=budget(10, 1000), suppress_health_check=SLOW)
@given(P=st.integers(1, 6), N=st.integers(1, 9), seed=st.integers(0, 2 ** 20))
def test_collective_backends_agree_and_route_every_row(P, N, seed):
    r = random_routing(P, N, seed)
    rows = torch.randn(P, N, 3, generator=torch.Generator().manual_seed(seed))
    a = group_cast([rows], r.send_index, r.split, r.recv_capacity, LocalGroup(P))
    b = group_cast([rows], r.send_index, r.split, r.recv_capacity, LocalGroup(P, impl="triton"))
    assert torch.equal(a[0], b[0])
    ones = [torch.ones(P, r.recv_capacity, 1)]
    back = group_reduce(ones, r.send_index, r.split, [torch.zeros(P, N, 1)], LocalGroup(P), op="sum")[0]
    sent = torch.zeros(P, N)
    for s in range(P):
        for p in range(int(r.split[s].sum())):
            sent[s, int(r.send_index[s, p])] += 1
    assert torch.equal(back[..., 0], sent)     # every row sent comes back once per destination


@settings(max_examples=budget(15, 2000), suppress_health_check=SLOW)
@given(P=st.integers(1, 4), c=st.integers(1, 12), k=st.integers(1, 6), block=st.integers(1, 9),
       Hkv=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 20))
def test_sparse_selection_areas_count_each_kept_entry_once(P, c, k, block, Hkv, seed):
    T = P * c
    g = np.random.default_rng(seed)
    topk = np.full((T, k), -1)
    for t in range(T):
        pick = g.permutation(T)[:k]                   # distinct keys, future ones included (dropped)
        n = int(g.integers(0, len(pick) + 1))
        topk[t, :n] = pick[:n]
    tk = TokenTopKMask(torch.tensor(topk, dtype=torch.int32), T)
    areas = token_topk_areas(tk.topk_indices, P)
    dm = tk.to_dense().long()
    assert torch.equal(areas.area[0], dm.view(P, c, P, c).sum((1, 3)))
    nb = math.ceil(T / block)
    bi = np.full((T, Hkv, min(k, nb)), -1)
    for t in range(T):
        for h in range(Hkv):
            n = int(g.integers(0, min(bi.shape[2], nb) + 1))
            bi[t, h, :n] = g.permutation(nb)[:n]
    bs = BlockSparseMask(torch.tensor(bi, dtype=torch.int32), block, T)
    areas = block_sparse_areas(bs.block_indices, block, P, head_groups=Hkv)
    for h in range(Hkv):
        assert torch.equal(areas.area[h], bs.to_dense(h).long().view(P, c, P, c).sum((1, 3)))
