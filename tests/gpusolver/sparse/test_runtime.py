"""sparse_dist_attn over LocalGroup (P = 8) and gloo (P = 2, 4) against single-process dense attention
built from the same indices; byte counters equal the plan's metrics; the layer on device="meta"."""
import pytest
import torch

from gpusolver.indexers import CompressedKeyIndexer, LightningIndexer
from gpusolver.masks.sparse import BlockSparseMask, NSALayerMask, TokenTopKMask
from gpusolver.plan.sparse import SparsePlan
from gpusolver.runtime import DynamicCPAttention, PlanCache, shard, unshard
from gpusolver.runtime.sparse_attn import local_selection, solve_sparse_sharded, sparse_dist_attn
from groupcomm import LocalGroup, TorchGroup
from tests._dist import run_ranks
from tests._testing import assert_close
from tests.gpusolver.sparse._cases import (ATOL, D, PHASES_BWD, PHASES_FWD, RTOL, branches, check_branches, loss,
                                           make_config, make_inputs, make_mask, reference, scatter_plan, traffic_sums)
from tests.gpusolver.runtime._cases import few_solve_rounds  # noqa: F401 - fixture

torch.set_num_threads(1)  # a loaded 2-core machine: many small ops run faster on one thread

# (mask kind, P, c, Hq, Hkv, flatten, tiles, keep, kv_block: None = hulls)
CASES = [
    ("dsa", 8, 16, 4, 2, True, 1, True, None),
    ("dsa", 8, 16, 2, 1, False, 2, False, None),
    ("dsa", 8, 16, 4, 2, True, 1, False, None),  # one selection for G = 2 head groups, cast again
    ("dsa", 8, 16, 4, 2, True, 1, True, 4),
    ("nsa", 8, 16, 4, 2, True, 1, False, None),
    ("nsa", 8, 16, 4, 2, False, 1, True, None),
    ("nsa", 8, 16, 4, 2, True, 2, True, 8),
    ("nsa", 8, 16, 4, 2, False, 1, False, 8),
    ("nsa-layer", 8, 16, 4, 2, True, 1, True, None),
]


@pytest.mark.parametrize("kind,P,c,Hq,Hkv,flatten,tiles,keep,kv_block", CASES,
                         ids=[f"{k}-P{P}-c{c}-Hq{hq}-Hkv{hkv}-{'flat' if f else 'G1'}-n{n}-{'keep' if kp else 'recast'}"
                              f"-{'hulls' if kb is None else f'blocks{kb}'}"
                              for k, P, c, hq, hkv, f, n, kp, kb in CASES])
def test_local_group_equals_dense(kind, P, c, Hq, Hkv, flatten, tiles, keep, kv_block):
    S = P * c
    mask = make_mask(kind, S, Hkv, seed=P)
    group = LocalGroup(P)
    plan = scatter_plan(mask, make_config(P, Hq, Hkv, flatten, tiles, keep), group, kv_block)
    # remote work exists: both exchanges and the reduces run
    assert int(plan.comm.qo_split.sum()) > 0 and int(plan.comm.kv_split.sum()) > 0
    q, k, v, d_out, d_lse = make_inputs(S, Hq, Hkv, seed=P)
    ref = reference(mask, q, k, v, d_out, d_lse)
    leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
    group.reset_traffic()
    res = branches(sparse_dist_attn(*leaves, local_selection(mask, group), plan, group, keep_forward_buffers=keep))
    outs = [unshard(o, group) for o, _ in res]
    lses = [unshard(lse, group) for _, lse in res]
    loss(outs, lses, d_out, d_lse).backward()
    check_branches(ref, outs, lses, [unshard(x.grad, group) for x in leaves])
    m = plan.metrics
    for name, phases, send, recv in (("fwd", PHASES_FWD, m.fwd_send, m.fwd_recv),
                                     ("bwd", PHASES_BWD, m.bwd_send, m.bwd_recv)):
        sent, got = traffic_sums(group, phases)
        assert_close(f"{name} sent bytes", send, sent)
        assert_close(f"{name} received bytes", recv, got)
        for ph in phases:  # the schedule's bytes, pair by pair (what the simulator prices)
            assert torch.equal(group.pair_traffic(ph), plan.pair_bytes(ph)), ph


@pytest.mark.parametrize("kind", ["dsa", "nsa"])
def test_triton_kernels_in_the_layer(kind):
    """The Triton kernels (interpreter) on real stage tables: windows into receive buffers, padding rows."""
    P, c, Hq, Hkv = 2, 8, 4, 2
    S = P * c
    mask = make_mask(kind, S, Hkv, seed=1)
    group = LocalGroup(P)
    plan = scatter_plan(mask, make_config(P, Hq, Hkv), group)
    q, k, v, d_out, d_lse = make_inputs(S, Hq, Hkv, seed=1)
    ref = reference(mask, q, k, v, d_out, d_lse)
    leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
    out, lse = sparse_dist_attn(*leaves, local_selection(mask, group), plan, group, backend="triton")
    outs, lses = [unshard(out, group)], [unshard(lse, group)]
    loss(outs, lses, d_out, d_lse).backward()
    check_branches(ref, outs, lses, [unshard(x.grad, group) for x in leaves])


def _gloo_rank(rank, P, kind, c, Hq, Hkv, flatten):
    torch.manual_seed(0)
    S = P * c
    whole = make_mask(kind, S, Hkv, seed=P)
    group = TorchGroup()
    mine = whole.rows(rank * c, (rank + 1) * c)  # this rank holds only its own rows
    plan = solve_sparse_sharded(mine, make_config(P, Hq, Hkv, flatten), group)
    q, k, v, d_out, d_lse = make_inputs(S, Hq, Hkv, seed=P)
    leaves = [shard(x, group).clone().requires_grad_() for x in (q, k, v)]
    res = branches(sparse_dist_attn(*leaves, local_selection(mine, group), plan, group))
    outs, lses = [o for o, _ in res], [lse for _, lse in res]
    loss(outs, lses, shard(d_out, group), shard(d_lse, group)).backward()
    return ([o.detach() for o in outs], [x.detach() for x in lses], [x.grad for x in leaves],
            plan.assignment, group.traffic("fwd.qo"))


@pytest.mark.parametrize("kind,P,flatten", [("dsa", 2, True), ("nsa", 4, False), ("nsa-layer", 4, True)])
def test_gloo_ranks_equal_dense(kind, P, flatten):
    c, Hq, Hkv = 8, 4, 2
    results = run_ranks(_gloo_rank, P, kind, c, Hq, Hkv, flatten, timeout=120.0)
    S = P * c
    mask = make_mask(kind, S, Hkv, seed=P)
    ref = reference(mask, *make_inputs(S, Hq, Hkv, seed=P))
    nb = len(results[0][0])
    outs = [torch.cat([r[0][b] for r in results]) for b in range(nb)]
    lses = [torch.cat([r[1][b] for r in results]) for b in range(nb)]
    grads = [torch.cat([r[2][i] for r in results]) for i in range(3)]
    check_branches(ref, outs, lses, grads)
    for r in results[1:]:  # every rank solved the same gathered problem
        assert torch.equal(r[3], results[0][3])


@pytest.mark.usefixtures("few_solve_rounds")
def test_layer_on_meta_end_to_end():
    """Indexers, area rows, all-gather (a stack), solve, metas, casts, attention, reduces: no host read.
    The DSA layer goes through DynamicCPAttention (a device solve on meta costs seconds here); the NSA
    layer mask through the same flow with a fixed assignment."""
    P, c, Hq, Hkv, dm = 2, 16, 4, 2, 16
    S = P * c
    group = LocalGroup(P)
    x = torch.randn(P, c, dm, device="meta")
    q = torch.randn(P, c, Hq, D, device="meta", requires_grad=True)
    k = torch.randn(P, c, Hkv, D, device="meta", requires_grad=True)
    v = torch.randn(P, c, Hkv, D, device="meta", requires_grad=True)
    cfg = make_config(P, Hq, Hkv)
    dsa = LightningIndexer.init(dm, 2, 8, topk=8, device="meta")
    keys = dsa.keys(unshard(x, group))  # the index keys all-gathered
    topk = torch.cat([dsa(x[r], keys, r * c) for r in range(P)])  # each rank scores its own rows
    layer = DynamicCPAttention(group, cfg, plan_cache=PlanCache(), validate=False)
    out = layer(q, k, v, TokenTopKMask(topk, S))
    out.sum().backward()
    assert out.shape == (P, c, Hq, D) and out.device.type == "meta" and k.grad.shape == k.shape
    plan = layer.plan_cache._entries["default"].plan
    assert isinstance(plan, SparsePlan) and plan.status.device.type == "meta"

    nsa = CompressedKeyIndexer(8, 3, 1)
    k_cmp = nsa.compress(unshard(k.detach(), group))
    blocks = torch.cat([nsa(q[r].detach(), k_cmp, r * c) for r in range(P)])
    for mask, kv_block in ((NSALayerMask(BlockSparseMask(blocks, 8, S), 8), None),
                           (BlockSparseMask(blocks, 8, S), 8)):
        plan = scatter_plan(mask, cfg, group, kv_block)
        res = branches(sparse_dist_attn(q, k, v, local_selection(mask, group), plan, group, validate=False))
        sum(o.sum() for o, _ in res).backward()
        assert res[0][0].device.type == "meta" and plan.status.device.type == "meta"


def test_module_caches_and_matches_dense():
    P, c, Hq, Hkv = 4, 8, 4, 2
    S = P * c
    group = LocalGroup(P)
    mask = make_mask("nsa", S, Hkv, seed=3)
    cache = PlanCache()
    layer = DynamicCPAttention(group, make_config(P, Hq, Hkv), plan_cache=cache)
    q, k, v, d_out, d_lse = make_inputs(S, Hq, Hkv, seed=3)
    ref = reference(mask, q, k, v, d_out, d_lse)
    out, lse = layer(shard(q, group), shard(k, group), shard(v, group), mask, return_lse=True)
    layer(shard(q, group), shard(k, group), shard(v, group), mask)
    assert cache.solves == 1
    assert_close("out", ref[0][0], unshard(out, group), atol=ATOL, rtol=RTOL)
    assert_close("lse", ref[1][0], unshard(lse, group), atol=ATOL, rtol=RTOL)


def test_errors_name_the_argument():
    P, c, Hq, Hkv = 2, 8, 2, 2
    S = P * c
    group = LocalGroup(P)
    mask = make_mask("dsa", S, Hkv)
    plan = solve_sparse_sharded(mask, make_config(P, Hq, Hkv), group)
    q, k, v, *_ = make_inputs(S, Hq, Hkv)
    qs, ks, vs = (shard(x, group) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"sel must be int32/int64 \[2, 8, 12\]"):
        sparse_dist_attn(qs, ks, vs, local_selection(mask, group)[..., :5], plan, group)
    with pytest.raises(ValueError, match="q holds 4 tokens per rank"):
        sparse_dist_attn(qs[:, :4], ks, vs, local_selection(mask, group), plan, group)
    with pytest.raises(ValueError, match="the mask holds every rank's rows"):
        solve_sparse_sharded(mask.rows(0, c), make_config(P, Hq, Hkv), group)
    bad = TokenTopKMask(mask.topk_indices.clone(), S)
    bad.topk_indices[9, 3] = S
    with pytest.raises(ValueError, match=r"topk_indices\[9, 3\] = 16 is outside \[-1, total_seqlen_k=16\)"):
        solve_sparse_sharded(bad, make_config(P, Hq, Hkv), group)
    plan = solve_sparse_sharded(bad, make_config(P, Hq, Hkv), group, validate=False)
    with pytest.raises(ValueError, match="INVALID_MASK"):
        plan.validate()


def test_compiled_layer_equals_eager():
    """torch.compile(fullgraph=True) of the sparse layer: indexer areas, the solve (one op), metas,
    casts, both NSA branches and their backward in one graph; out and grads equal eager."""
    P, c, Hq, Hkv = 2, 16, 4, 2  # P = 2: tracing unrolls the LocalGroup's loop over ranks
    S = P * c
    group = LocalGroup(P)
    mask = make_mask("nsa-layer", S, Hkv, seed=3)
    q, k, v, d_out, _ = make_inputs(S, Hq, Hkv, seed=3)
    results = []
    for compiled in (False, True):
        layer = DynamicCPAttention(group, make_config(P, Hq, Hkv), plan_cache=PlanCache())  # empty: solve traced
        leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]

        def step(q_, k_, v_):
            o_sel, o_win = layer(q_, k_, v_, mask)
            return o_sel + 0.5 * o_win

        fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        out = fn(*leaves)
        (out * shard(d_out, group)).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert_close(name, a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kv_block,stages", [(4, 1), (None, 2)], ids=["blocks4-S1", "hulls-S2"])
def test_what_a_sparse_layer_holds_is_what_autograd_saves(kv_block, stages):
    """As the dense layer's: every storage the forward leaves alive for the backward is saved through
    autograd (hooks see it); the send lists, key blocks' included, are built again in the backward."""
    from dataclasses import replace

    from benchmarks.layer_memory import LiveBytes

    P, c, Hq, Hkv = 8, 16, 4, 2
    mask = make_mask("dsa", P * c, Hkv, seed=P)
    group = LocalGroup(P)
    config = replace(make_config(P, Hq, Hkv, True, 1, True), num_stages=stages)
    plan = scatter_plan(mask, config, group, kv_block)
    assert plan.comm.num_stages == stages and (plan.kv_blocks is None) == (kv_block is None)
    q, k, v, d_out, d_lse = make_inputs(P * c, Hq, Hkv, seed=P)
    leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
    sel = local_selection(mask, group)
    given = {id(x.untyped_storage()) for x in (*leaves, sel)}
    saved = {}

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage()
        return t
    live = LiveBytes(track=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live:
        res = branches(sparse_dist_attn(*leaves, sel, plan, group))
    for o, lse in res:
        pack(o), pack(lse)
    unsaved = [what for key, what in live._what.items()
               if key not in saved and key not in given and "_count" not in what[-1]]
    assert not unsaved, unsaved
    ref = reference(mask, q, k, v, d_out, d_lse)
    outs = [unshard(o, group) for o, _ in res]
    lses = [unshard(lse, group) for _, lse in res]
    loss(outs, lses, d_out, d_lse).backward()
    check_branches(ref, outs, lses, [unshard(x.grad, group) for x in leaves])
