"""sparse_dist_attn with the remote work in S sub-stages (NSA blocks, DSA top-k), against single-process
dense attention built from the same indices.

LocalGroup P = 8 and gloo P = 4 (a2a and p2p), forward and backward, kept and re-cast buffers, K and V
as hulls and as key blocks; each sub-stage's byte counters equal the plan's per-stage pair bytes, and
their sums the plan's metrics; the stage tables read only rows of casts 1..s; the layer on meta. The
default tier keeps two LocalGroup cases and one gloo case; S = 1, 2, 4, 8 on P = 8 and 16 and gloo p2p
are in the slow tier.

NSA layer masks (selection plus sliding-window branch, two (out, lse) per row) likewise: both branches
and the gradients against dense attention at fp32 1e-5, counters per sub-stage, on meta, priced by the
simulator (two cases in the default tier; S = 1, 2, 4, 8 on P = 4 and 8, the Triton kernels and
torch.compile in the slow tier).
"""
import math
from dataclasses import replace

import pytest
import torch

from gpusolver.runtime import shard, unshard
from gpusolver.runtime.pipelined import stage_phase
from gpusolver.runtime.sparse_attn import gather_sparse_areas, local_selection, sparse_dist_attn
from groupcomm import LocalGroup, TorchGroup
from tests._dist import run_ranks
from tests._operand_rows import record_cast_rows, record_operand_rows
from tests._testing import assert_close
from tests.gpusolver.sparse._cases import (D, PHASES_BWD, PHASES_FWD, loss, make_config, make_inputs, make_mask,
                                           reference, scatter_plan)

torch.set_num_threads(1)  # a loaded 2-core machine: many small ops run faster on one thread

ATOL, RTOL = 1e-5, 1e-5
GRAD_ATOL = 2e-5  # gradients summed over more partials than the reference's one pass


def _config(P, Hq, Hkv, S, keep=True, tiles=1):
    return replace(make_config(P, Hq, Hkv, True, tiles, keep), num_stages=S)


def _counted(group, phase, S):
    """The counter labels of one collective phase over its sub-stages (the plain phase at S = 1)."""
    return [stage_phase(phase, s) for s in range(1, S + 1)] if S > 1 else [phase]


def _check_bytes(plan, group, S):
    """Each sub-stage's counters equal the plan's per-stage pair bytes; their sums its metrics."""
    for ph in PHASES_FWD + PHASES_BWD:
        for s, label in enumerate(_counted(group, ph, S), start=1):
            assert torch.equal(group.pair_traffic(label), plan.pair_bytes(ph, stage=s)), label
    m = plan.metrics
    for phases, send, recv in ((PHASES_FWD, m.fwd_send, m.fwd_recv), (PHASES_BWD, m.bwd_send, m.bwd_recv)):
        labels = [lab for ph in phases for lab in _counted(group, ph, S)]
        assert torch.equal(sum(group.traffic(lab)[0] for lab in labels), send)
        assert torch.equal(sum(group.traffic(lab)[1] for lab in labels), recv)


def _check_local(kind, P, S, keep, kv_block, tiles=1, c=16, Hq=4, Hkv=2, grad_atol=GRAD_ATOL):
    T = P * c
    mask = make_mask(kind, T, Hkv, seed=P)
    group = LocalGroup(P)
    plan = scatter_plan(mask, _config(P, Hq, Hkv, S, keep, tiles), group, kv_block)
    assert plan.num_stages == S and (kv_block is None) == (plan.kv_blocks is None)
    if S > 1:  # the remote work really is spread over the sub-stages
        assert int((plan.task_stage > 1).sum()) > 0
    q, k, v, d_out, d_lse = make_inputs(T, Hq, Hkv, seed=P)
    ref = reference(mask, q, k, v, d_out, d_lse)
    leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
    group.reset_traffic()
    res = _pairs(sparse_dist_attn(*leaves, local_selection(mask, group), plan, group, keep_forward_buffers=keep))
    assert len(res) == len(ref[0])  # one (out, lse) per branch: two for an NSA layer mask
    outs, lses = [unshard(o, group) for o, _ in res], [unshard(lse, group) for _, lse in res]
    loss(outs, lses, d_out, d_lse).backward()
    for b, (out, lse) in enumerate(zip(outs, lses)):
        assert_close(f"S={S} out{b}", ref[0][b], out, atol=ATOL, rtol=RTOL)
        assert_close(f"S={S} lse{b}", ref[1][b], lse, atol=ATOL, rtol=RTOL)
    for name, a, x in zip(("dq", "dk", "dv"), ref[2:], leaves):
        assert_close(f"S={S} {name}", a, unshard(x.grad, group), atol=grad_atol, rtol=RTOL)
    _check_bytes(plan, group, S)
    return plan


def _pairs(res):
    """(out, lse) per output branch of a ``sparse_dist_attn`` result."""
    return list(res) if isinstance(res[0], tuple) else [res]


# (mask kind, P, S, keep, kv_block: None = hulls, tiles)
CASES = [("dsa", 8, 2, True, None, 1), ("nsa", 8, 4, False, 8, 1)]


@pytest.mark.parametrize("kind,P,S,keep,kv_block,tiles", CASES,
                         ids=[f"{k}-P{P}-S{S}-{'keep' if kp else 'recast'}-{'hulls' if kb is None else 'blocks'}-n{n}"
                              for k, P, S, kp, kb, n in CASES])
def test_sub_stages_equal_dense(kind, P, S, keep, kv_block, tiles):
    _check_local(kind, P, S, keep, kv_block, tiles)


SLOW_CASES = [(kind, P, S, keep, kv_block, tiles) for P in (8, 16) for S in (1, 2, 4, 8)
              for kind, keep, kv_block, tiles in (("dsa", True, None, 1), ("dsa", False, 4, 2),
                                                  ("nsa", True, 8, 1), ("nsa", False, None, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("kind,P,S,keep,kv_block,tiles", SLOW_CASES,
                         ids=[f"{k}-P{P}-S{S}-{'keep' if kp else 'recast'}-{'hulls' if kb is None else 'blocks'}-n{n}"
                              for k, P, S, kp, kb, n in SLOW_CASES])
def test_sub_stages_equal_dense_matrix(kind, P, S, keep, kv_block, tiles):
    _check_local(kind, P, S, keep, kv_block, tiles)


# NSA layer masks (selection and sliding-window branches; K, V as hulls): (P, S, keep, tiles). The contract
# is fp32 <= 1e-5 for out, lse and the gradients alike
LAYER_CASES = [(4, 2, True, 1), (8, 4, False, 1)]
LAYER_SLOW = [(P, S, keep, tiles) for P in (4, 8) for S in (1, 2, 4, 8) for keep, tiles in ((True, 1), (False, 2))]


def _layer_id(P, S, keep, tiles):
    return f"nsa-layer-P{P}-S{S}-{'keep' if keep else 'recast'}-n{tiles}"


def _check_layer(P, S, keep, tiles):
    plan = _check_local("nsa-layer", P, S, keep, None, tiles, grad_atol=ATOL)
    # the window branch's slices sit in the sub-stages too: stage 0 and sub-stages 1..S
    assert plan.window_calc.q_ranges.shape[:2] == (P, S + 1)
    if S > 1:  # some sub-stage past the first runs window slices (rows a query's window reads there)
        wc = plan.window_calc
        assert bool((wc.q_ranges[:, 2:, :, 1] > wc.q_ranges[:, 2:, :, 0]).any())


@pytest.mark.parametrize("P,S,keep,tiles", LAYER_CASES, ids=[_layer_id(*c) for c in LAYER_CASES])
def test_nsa_layer_sub_stages_equal_dense(P, S, keep, tiles):
    """Both branches' out and lse, and the gradients, equal dense attention; counters equal the plan's
    per-stage pair bytes (the two branches' ``fwd.o`` reduces count under one phase per sub-stage)."""
    _check_layer(P, S, keep, tiles)


@pytest.mark.slow
@pytest.mark.parametrize("P,S,keep,tiles", LAYER_SLOW, ids=[_layer_id(*c) for c in LAYER_SLOW])
def test_nsa_layer_sub_stages_equal_dense_matrix(P, S, keep, tiles):
    _check_layer(P, S, keep, tiles)


def test_nsa_layer_sub_stages_on_meta_and_simulated():
    """An S = 4 NSA layer runs on device="meta" (no host read), and the simulator prices the same
    schedule: finite times, and the bytes it moves are the plan's, pair by pair."""
    from gpusolver.runtime.sparse_attn import mask_on_device
    from gpusolver.sim import simulate
    from gpusolver.topology import h200_hgx

    P, c, Hq, Hkv, S = 4, 16, 4, 2, 4
    T = P * c
    mask = make_mask("nsa-layer", T, Hkv, seed=5)
    plan = scatter_plan(mask, _config(P, Hq, Hkv, S), LocalGroup(P))
    assert plan.num_stages == S and int((plan.task_stage > 1).sum()) > 0
    t = simulate(plan, h200_hgx)
    for pas in (t.fwd, t.bwd):
        assert all(math.isfinite(x) and x > 0 for x in (pas.ms, pas.ideal_ms, pas.compute_ms, pas.comm_ms))
        assert pas.ms >= pas.ideal_ms * (1 - 1e-9)
    assert torch.equal(torch.tensor(t.fwd.pair_bytes), plan.pair_bytes("fwd"))
    assert torch.equal(torch.tensor(t.bwd.pair_bytes), plan.pair_bytes("bwd"))
    # the forward's reduces: both branches in every sub-stage
    from gpusolver.plan.schedule import REDUCE, plan_ops

    fwd = plan_ops(plan, "fwd", True)
    assert sorted((op.stages[0], op.branch) for op in fwd if op.kind == REDUCE) == [
        (s, b) for s in range(1, S + 1) for b in (0, 1)]

    group = LocalGroup(P)  # its byte counters live on meta
    meta = mask_on_device(mask, torch.device("meta"))
    plan = scatter_plan(meta, _config(P, Hq, Hkv, S), group)
    assert plan.status.device.type == "meta" and plan.num_stages == S
    qm = torch.empty(P, c, Hq, D, device="meta", requires_grad=True)
    km = torch.empty(P, c, Hkv, D, device="meta", requires_grad=True)
    vm = torch.empty(P, c, Hkv, D, device="meta", requires_grad=True)
    (o_sel, l_sel), (o_win, l_win) = sparse_dist_attn(qm, km, vm, local_selection(meta, group), plan, group,
                                                      validate=False)
    (o_sel.sum() + l_sel.sum() + o_win.sum() + l_win.sum()).backward()
    assert o_sel.device.type == "meta" and o_win.shape == (P, c, Hq, D) and l_win.shape == (P, c, Hq)
    for x in (qm, km, vm):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "meta"


@pytest.mark.parametrize("kv_block", [None, 8], ids=["hulls", "blocks"])
def test_stage_tables_read_only_landed_rows(kv_block):
    """Sub-stage s's windows read only key rows of casts 1..s, its tasks' query rows lie in casts 1..s,
    and over the sub-stages the windows are those of the one-stage plan's remote stage (with key
    blocks: less only the blocks a query unit does not read, which a sub-stage leaves out while
    they may be in flight)."""
    P, c, Hq, Hkv, S = 8, 16, 4, 2, 4
    T = P * c
    mask = make_mask("nsa", T, Hkv, seed=2)
    group = LocalGroup(P)
    plan = scatter_plan(mask, _config(P, Hq, Hkv, S), group, kv_block)
    one = scatter_plan(mask, _config(P, Hq, Hkv, 1), group, kv_block)
    _, _, used = gather_sparse_areas(mask, _config(P, Hq, Hkv, S), group, kv_block)  # [G, U, NB]
    comm = plan.comm
    kv_comm = comm if kv_block is None else plan.kv_blocks.staged
    G = comm.head_groups
    n = G * c
    for r in range(P):
        total = 0
        for s in range(1, S + 1):
            st = plan.stage(r, s)
            lo, hi, off = st.kv_windows.long().unbind(-1)
            live = hi > lo
            landed_kv = kv_comm.stage_base("kv")[s - 1, r] + kv_comm.stage_split("kv")[s - 1, :, r].sum()
            remote = live & (lo + off >= n)
            assert bool((hi + off <= n + landed_kv)[remote].all()), (r, s)
            landed_q = comm.stage_base("qo")[s - 1, r] + comm.stage_split("qo")[s - 1, :, r].sum()
            cls = st.q_class.long()
            row_live = live.any(-1)[cls] & (st.q_pos >= 0)
            rows = torch.arange(st.q_pos.numel())
            assert bool((rows[row_live] < n + landed_q).all()), (r, s)
            total = total + (hi - lo).clamp(min=0)
        lo1, hi1, _ = one.stage(r, 1).kv_windows.long().unbind(-1)
        whole = (hi1 - lo1).clamp(min=0)
        if kv_block is None:
            assert torch.equal(total, whole), r
        else:  # a window dropped is one of a block its query unit never reads
            reads = used.reshape(total.shape).bool()
            assert bool((total <= whole).all()) and torch.equal(total[reads], whole[reads]), r
        # the query rows: the same global positions as one stage, in the shared buffer's own order
        pos_s, pos_1 = plan.stage(r, 1).q_pos, one.stage(r, 1).q_pos
        assert torch.equal(torch.sort(pos_s).values, torch.sort(pos_1).values), r


def test_sub_stages_deterministic_and_layer_on_meta():
    """Two runs are bit-identical; the S = 2 layer (stage tables, casts, reduces, backward) runs on
    device="meta", where no host read can happen."""
    P, c, Hq, Hkv, S = 4, 16, 4, 2, 2
    T = P * c
    group = LocalGroup(P)
    mask = make_mask("dsa", T, Hkv, seed=4)
    plan = scatter_plan(mask, _config(P, Hq, Hkv, S), group)
    q, k, v, d_out, _ = make_inputs(T, Hq, Hkv, seed=4)
    runs = []
    for _ in range(2):
        leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
        out, _ = sparse_dist_attn(*leaves, local_selection(mask, group), plan, group)
        out.backward(shard(d_out, group))
        runs.append([out.detach()] + [x.grad for x in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)

    group = LocalGroup(P)  # its byte counters live on meta
    meta = make_mask("nsa", T, Hkv, seed=4)
    meta = replace(meta, block_indices=meta.block_indices.to("meta"))
    plan = scatter_plan(meta, _config(P, Hq, Hkv, S), group, 8)
    assert plan.status.device.type == "meta" and plan.num_stages == S
    qm = torch.empty(P, c, Hq, D, device="meta", requires_grad=True)
    km = torch.empty(P, c, Hkv, D, device="meta", requires_grad=True)
    vm = torch.empty(P, c, Hkv, D, device="meta", requires_grad=True)
    out, lse = sparse_dist_attn(qm, km, vm, local_selection(meta, group), plan, group, validate=False)
    (out.sum() + lse.sum()).backward()
    assert out.device.type == "meta" and out.shape == (P, c, Hq, D)
    for x in (qm, km, vm):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "meta"


def _gloo_rank(rank, P, kind, S, kv_block, transport):
    c, Hq, Hkv = 8, 4, 2
    T = P * c
    whole = make_mask(kind, T, Hkv, seed=P)
    mine = whole.rows(rank * c, (rank + 1) * c)  # this rank holds only its own rows
    group = TorchGroup(transport=transport)
    plan = scatter_plan(mine, _config(P, Hq, Hkv, S), group, kv_block)  # area rows all-gathered over gloo
    # the receive rows of every operand and sum the layer allocates, and with one remote stage of every
    # cast's buffer (on TorchGroup: this rank's fill)
    seen, casts = record_operand_rows(), record_cast_rows()
    kv_rows = plan.comm.kv_recv_rows if plan.kv_blocks is None else plan.kv_blocks.kv_recv_rows
    fills = {int(plan.comm.qo_recv_rows[rank]), int(kv_rows[rank])}
    caps = (plan.comm.qo_recv_capacity, plan.comm.kv_recv_capacity)
    q, k, v, d_out, d_lse = make_inputs(T, Hq, Hkv, seed=P)
    leaves = [shard(x, group).clone().requires_grad_() for x in (q, k, v)]
    res = _pairs(sparse_dist_attn(*leaves, local_selection(mine, group), plan, group))
    outs, lses = [o for o, _ in res], [lse for _, lse in res]
    loss(outs, lses, shard(d_out, group), shard(d_lse, group)).backward()
    counted = {lab: [int(x) for x in group.traffic(lab)]
               for ph in PHASES_FWD + PHASES_BWD for lab in _counted(group, ph, S)}
    planned = {}
    for ph in PHASES_FWD + PHASES_BWD:
        for s, lab in enumerate(_counted(group, ph, S), start=1):
            pb = plan.pair_bytes(ph, stage=s)
            planned[lab] = [int(pb[rank].sum()), int(pb[:, rank].sum())]
    return ([o.detach() for o in outs], [x.detach() for x in lses], [x.grad for x in leaves], counted, planned,
            int((plan.task_stage > 1).sum()), (set(seen + casts), fills, caps))


def _check_gloo(P, kind, S, kv_block, transport):
    c, Hq, Hkv = 8, 4, 2
    results = run_ranks(_gloo_rank, P, kind, S, kv_block, transport, timeout=120.0)
    T = P * c
    ref = reference(make_mask(kind, T, Hkv, seed=P), *make_inputs(T, Hq, Hkv, seed=P))
    for b in range(len(ref[0])):  # each output branch (two for an NSA layer mask)
        assert_close(f"out{b}", ref[0][b], torch.cat([r[0][b] for r in results]), atol=ATOL, rtol=RTOL)
        assert_close(f"lse{b}", ref[1][b], torch.cat([r[1][b] for r in results]), atol=ATOL, rtol=RTOL)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_close(name, ref[2 + i], torch.cat([r[2][i] for r in results]), atol=GRAD_ATOL, rtol=RTOL)
    for rank, r in enumerate(results):
        assert r[3] == r[4], f"rank {rank}"
        seen, fills, caps = r[6]
        assert seen == fills, f"rank {rank}: operand receive rows {sorted(seen)}, the rank's fills {sorted(fills)}"
    assert S == 1 or results[0][5] > 0  # some task in a later sub-stage
    assert any(max(r[6][0]) < min(r[6][2]) for r in results), "no rank below the capacity: the case checks nothing"


@pytest.mark.parametrize("transport", ["a2a"])
def test_sub_stages_gloo(transport):
    _check_gloo(4, "nsa", 2, 8, transport)


@pytest.mark.parametrize("kind,kv_block", [("nsa", 8), ("dsa", None)])
def test_one_stage_gloo_buffers_hold_the_rank_fill(kind, kv_block):
    """With one remote stage (the sparse default) on TorchGroup every cast's receive buffer, forward
    and backward, holds this rank's fill (by key block with ``kv_block``), not the capacity; values,
    gradients and byte counters as at the capacity."""
    _check_gloo(4, kind, 1, kv_block, "a2a")


@pytest.mark.slow
@pytest.mark.parametrize("kind,kv_block", [("nsa", 8), ("dsa", None)])
def test_one_stage_gloo_p2p(kind, kv_block):
    """One remote stage (the sparse default across nodes) over point-to-point transport: values,
    gradients, byte counters and the buffers at each rank's fill, as over all-to-all-v."""
    _check_gloo(4, kind, 1, kv_block, "p2p")


@pytest.mark.slow
@pytest.mark.parametrize("kind,kv_block,transport", [("nsa", 8, "p2p"), ("dsa", None, "p2p"), ("dsa", None, "a2a"),
                                                     ("nsa-layer", None, "a2a"), ("nsa-layer", None, "p2p")])
def test_sub_stages_gloo_matrix(kind, kv_block, transport):
    _check_gloo(4, kind, 2, kv_block, transport)


@pytest.mark.slow
def test_sub_stages_compiled_equals_eager():
    """torch.compile(fullgraph=True) of an S = 2 NSA layer, solve included (LocalGroup P = 2): out and
    grads equal eager. About a minute of tracing here; the fast tier runs the same layer eagerly."""
    from gpusolver.runtime import DynamicCPAttention, PlanCache

    P, c, Hq, Hkv = 2, 16, 4, 2
    T = P * c
    group = LocalGroup(P)
    mask = make_mask("nsa", T, Hkv, seed=3)
    q, k, v, d_out, _ = make_inputs(T, Hq, Hkv, seed=3)
    results = []
    for compiled in (False, True):
        layer = DynamicCPAttention(group, _config(P, Hq, Hkv, 2), plan_cache=PlanCache())  # empty: solve traced
        leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]

        def step(q_, k_, v_):
            return layer(q_, k_, v_, mask)

        fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        out = fn(*leaves)
        (out * shard(d_out, group)).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert_close(name, a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_nsa_layer_sub_stages_triton_kernels():
    """The sparse kernel's Triton path (the interpreter here) on an S = 2 NSA layer's stage tables:
    windows into the shared receive buffer, rows cast for the later sub-stage left unread."""
    P, c, Hq, Hkv, S = 4, 8, 4, 2, 2
    T = P * c
    mask = make_mask("nsa-layer", T, Hkv, seed=1)
    group = LocalGroup(P)
    plan = scatter_plan(mask, _config(P, Hq, Hkv, S), group)
    assert plan.num_stages == S and int((plan.task_stage > 1).sum()) > 0
    q, k, v, d_out, d_lse = make_inputs(T, Hq, Hkv, seed=1)
    ref = reference(mask, q, k, v, d_out, d_lse)
    leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
    res = sparse_dist_attn(*leaves, local_selection(mask, group), plan, group, backend="triton")
    outs, lses = [unshard(o, group) for o, _ in res], [unshard(lse, group) for _, lse in res]
    loss(outs, lses, d_out, d_lse).backward()
    for b in range(2):
        assert_close(f"out{b}", ref[0][b], outs[b], atol=ATOL, rtol=RTOL)
        assert_close(f"lse{b}", ref[1][b], lses[b], atol=ATOL, rtol=RTOL)
    for name, a, x in zip(("dq", "dk", "dv"), ref[2:], leaves):
        assert_close(name, a, unshard(x.grad, group), atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_nsa_layer_sub_stages_compiled_equals_eager():
    """torch.compile(fullgraph=True) of an S = 2 NSA layer mask's layer, solve included (LocalGroup
    P = 2): both branches' outputs and the gradients equal eager. About 70 s of tracing here; the
    fast tier runs the same layer eagerly and on meta (no host read)."""
    from gpusolver.runtime import DynamicCPAttention, PlanCache

    P, c, Hq, Hkv = 2, 16, 4, 2
    T = P * c
    group = LocalGroup(P)
    mask = make_mask("nsa-layer", T, Hkv, seed=3)
    q, k, v, d_out, _ = make_inputs(T, Hq, Hkv, seed=3)
    results = []
    for compiled in (False, True):
        layer = DynamicCPAttention(group, _config(P, Hq, Hkv, 2), plan_cache=PlanCache())  # empty: solve traced
        leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]

        def step(q_, k_, v_):
            o_sel, o_win = layer(q_, k_, v_, mask)
            return o_sel + 0.5 * o_win

        fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        out = fn(*leaves)
        (out * shard(d_out, group)).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
        if not compiled:  # the layer really ran sub-stages (its cached plan)
            assert layer.plan_for(mask, q.device, "default").num_stages == 2
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert_close(name, a, b, atol=ATOL, rtol=RTOL)
