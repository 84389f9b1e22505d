"""``plan.memory()`` equals what ``dist_attn`` allocates for its collective buffers and keeps.

On CPU with a ``LocalGroup``: saved-tensor hooks count what the layer keeps for its backward
(unique storages), and wrappers around the group record every receive buffer the casts write
into (the receive rows of stage 1's operands, written in place) and every return buffer the
reduces allocate (one per returned tensor), forward and backward apart. Per-rank figures are
the batched totals over P.
"""
from dataclasses import replace

import pytest
import torch

from gpusolver import solve
from gpusolver.config import AUTO_STAGES
from gpusolver.masks import varlen_causal_mask
from groupcomm import LocalGroup
from tests._testing import assert_close
from gpusolver.runtime import dist_attn, shard, unshard
from tests.gpusolver.runtime._cases import (D, doc_lengths, make_config, make_inputs, make_mask, reference,
                                            tight_plan)
from tests.gpusolver.runtime.test_dist_attn import KEYS, _assert_all_close


class _Recorder:
    """Bytes of every buffer ``LocalGroup._move`` returns (a reduce's return buffers), appended to
    ``self.current``."""

    def __init__(self, group):
        self.current = []
        move = group._move

        def recorded(*args, **kwargs):
            out = move(*args, **kwargs)
            self.current.append(out.numel() * out.element_size())
            return out
        group._move = recorded


def _saved(fn):
    """fn() under saved-tensor hooks: (its result, bytes of each saved tensor in save order, bytes of
    their unique storages)."""
    sizes, storages = [], {}

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        s = t.untyped_storage()
        storages[id(s)] = (s, s.nbytes())  # the storage itself too, so its id is not reused
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes, sum(n for _, n in storages.values())


@pytest.mark.parametrize("keep,stages", [(True, "auto"), (False, "auto"), ("qo", "auto"), ("kv", "auto"), (True, 1)])
def test_plan_memory_equals_the_runtime(keep, stages):
    """At the default S = 4 sub-stages and with one remote stage: the buffers the layer receives
    into, returns into and keeps are ``plan.memory()``'s."""
    P, c, Hq, Hkv = 4, 16, 4, 2
    S = P * c
    config = make_config(P, Hq, Hkv, keep_forward_buffers=keep, max_qo_recv_rows=40, max_kv_recv_rows=64,
                         max_qo_send_rows=56, max_kv_send_rows=88, num_stages=stages, memory_budget=None)
    plan = solve(varlen_causal_mask(doc_lengths(S, 0)), config)
    NS = plan.num_stages
    assert NS == (1 if stages == 1 else AUTO_STAGES + 1)  # S = 4 and the local tail
    m = plan.memory(config)
    # distinct per-kind capacities: a formula with one kind's rows in place of another's fails
    assert plan.comm.buffers.as_tuple() == (40, 64, 56, 88)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(P, c, Hq, D, generator=g, requires_grad=True)
    k = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    group = LocalGroup(P)
    rec, into = _Recorder(group), _IntoRecorder(group)
    (out, lse), sizes, held = _saved(lambda: dist_attn(q, k, v, plan, group, keep_forward_buffers=keep))
    fwd, fwd_recv = rec.current, list(into.current.values())
    rec.current, into.current = [], {}
    (out.sum() + lse.sum()).backward()
    bwd, bwd_recv = rec.current, list(into.current.values())
    # the layer's own activations (group-major copies of q, k, v, and out, lse, fp32 here) and the
    # kept receive buffers: a kept kind is saved as one tensor, its local rows followed by its buffer
    # (with sub-stages each sub-stage saves its views of that one tensor: the storages count it once)
    own = P * c * (2 * Hq * D + 2 * Hkv * D + Hq) * 4
    if NS == 1:  # the kept buffers are inside the five saved tensors
        assert len(sizes) == 5 and sum(sizes) == own + P * m.kept
    else:  # the five are the activations, the sub-stages' views of the kept buffers follow
        assert sum(sizes[:5]) == own
    # their storages hold no more than a scratch row each (the reduce's and LocalGroup's put's)
    assert 0 <= held - own - P * m.kept <= 2 * Hq // 2 * D * 4 * P
    q_kept = 40 * (Hq // 2) * D * 4 if keep in (True, "qo") else 0
    kv_kept = 64 * 2 * (Hkv // 2) * D * 4 if keep in (True, "kv") else 0
    assert m.kept == q_kept + kv_kept
    # Q, K, V received into the remote stages' operands (one buffer per tensor, shared by the S casts);
    # O and lse come back, one return buffer each per sub-stage, finished before the next
    assert len(fwd_recv) == 3 and len(fwd) == 2 * NS and fwd == fwd[:2] * NS
    assert sum(fwd_recv) + sum(fwd[:2]) == P * m.fwd_peak
    # dO, lse, delta (and Q unless kept), K, V unless kept, then dQ, and dK, dV back
    assert len(bwd_recv) == 3 + (not q_kept) + 2 * (not kv_kept) and len(bwd) == 3 * NS and bwd == bwd[:3] * NS
    assert sum(bwd_recv) + sum(bwd[:3]) + P * m.kept == P * m.bwd_peak


@pytest.mark.parametrize("flatten", [True, False], ids=["G2", "G1"])
def test_sub_stages_save_the_output_itself(flatten):
    """With sub-stages the O and lse the backward reads are the layer's outputs themselves, saved as
    returned: a layer leaves no second copy of O (group-major) alive beside its output until its backward,
    with head groups (G > 1, where the layouts differ) and without; values and gradients still equal
    dense attention's (the row delta is computed from the natural O and dO)."""
    P, c, Hq, Hkv = 4, 16, 4, 2
    mask = make_mask("docs-causal", P * c, seed=1)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, flatten, num_stages=2))
    assert plan.num_stages == 3 and (plan.comm.head_groups > 1) == flatten  # S = 2 and the local tail
    inputs = make_inputs(P * c, Hq, Hkv, seed=2)
    group = LocalGroup(P)
    qs, ks, vs = (shard(x, group).requires_grad_() for x in inputs[:3])
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage()  # held: no pointer is reused
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = dist_attn(qs, ks, vs, plan, group)
    assert out.untyped_storage().data_ptr() in storages and lse.untyped_storage().data_ptr() in storages
    torch.autograd.backward((out, lse), (shard(inputs[3], group), shard(inputs[4], group)))
    got = {key: unshard(t.detach(), group) for key, t in zip(KEYS, (out, lse, qs.grad, ks.grad, vs.grad))}
    _assert_all_close(reference(mask, *inputs), got)


class _IntoRecorder:
    """The distinct receive buffers ``LocalGroup._cast_into`` writes (by storage and offset), in bytes."""

    def __init__(self, group):
        self.current = {}
        into = group._cast_into

        def recorded(tensors, send_index, split, out, *args):
            for o in out:
                key = (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape))
                self.current[key] = o.numel() * o.element_size()
            return into(tensors, send_index, split, out, *args)
        group._cast_into = recorded


@pytest.mark.parametrize("keep", [True, pytest.param(False, marks=pytest.mark.slow),
                                  pytest.param("kv", marks=pytest.mark.slow)])
def test_sub_stages_share_the_receive_memory(keep):
    """S = 3: the three casts of a kind write into one buffer of the plan's capacity, so the layer
    keeps and receives what ``plan.memory()`` says, the same as the one-stage plan; each reduce's
    return buffer is the one-stage one, and LocalGroup finishes each before the next."""
    P, c, Hq, Hkv, S = 4, 16, 4, 2, 3
    caps = dict(max_qo_recv_rows=40, max_kv_recv_rows=64, max_qo_send_rows=56, max_kv_send_rows=88)
    mask = varlen_causal_mask(doc_lengths(P * c, 0))
    config = make_config(P, Hq, Hkv, keep_forward_buffers=keep, num_stages=S, memory_budget=None, **caps)
    plan = solve(mask, config)
    assert plan.num_stages == config.plan_stages and int((plan.task_stage > 1).sum()) > 0
    m = plan.memory(config)
    one = solve(mask, make_config(P, Hq, Hkv, keep_forward_buffers=keep, memory_budget=None, **caps)).memory(config)
    assert m.kept == one.kept
    g = torch.Generator().manual_seed(0)
    q = torch.randn(P, c, Hq, D, generator=g, requires_grad=True)
    k = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    group = LocalGroup(P)
    ret, into = _Recorder(group), _IntoRecorder(group)
    (out, lse), sizes, held = _saved(lambda: dist_attn(q, k, v, plan, group, keep_forward_buffers=keep))
    fwd_ret, fwd_recv = ret.current, sum(into.current.values())
    ret.current, into.current = [], {}
    (out.sum() + lse.sum()).backward()
    bwd_ret, bwd_recv = ret.current, sum(into.current.values())
    own = P * c * (2 * Hq * D + 2 * Hkv * D + Hq) * 4
    assert sum(sizes[:5]) == own
    # what is held past the layer's own activations is the kept receive rows (the kept operands'
    # local rows are the saved q, k, v themselves), within the scratch rows of the puts and reduces
    assert 0 <= held - own - P * m.kept <= 2 * Hq // 2 * D * 4 * P
    assert (m.fwd_peak, m.bwd_peak) == (one.fwd_peak, one.bwd_peak)
    # Q, K+V buffers and one O and lse return buffer at a time (each returned tensor its own buffer)
    NS = plan.num_stages  # S and the local tail, whose reduces return nothing into a buffer of the same rows
    assert len(fwd_ret) == 2 * NS and fwd_ret == fwd_ret[:2] * NS and fwd_recv + sum(fwd_ret[:2]) == P * m.fwd_peak
    # dO, lse, delta (Q, K, V unless kept) buffers, the kept ones, and one dQ and one dK, dV return buffer
    assert len(bwd_ret) == 3 * plan.num_stages and bwd_recv + sum(bwd_ret[:3]) + P * m.kept == P * m.bwd_peak


def _kept_part_runs(field: str, rows: int, **more):
    """The one-stage layer at P = 4 keeping all of each receive buffer and, with ``field``
    (``kept_kv_rows`` or ``kept_q_rows``) = ``rows`` (and ``more`` of the config's kept fields), part
    of them: (plan, config, its plan.memory, the group of the part-kept run, its saved bytes, its
    backward's receive buffers and return buffers). The two runs' gradients are asserted equal bit
    for bit (the same kernels over the same rows)."""
    P, c, Hq, Hkv = 4, 16, 4, 2
    # one remote stage: the saved tensors and buffers are its layout (sub-stages: test_kept_stages.py)
    config = make_config(P, Hq, Hkv, max_qo_recv_rows=40, max_kv_recv_rows=64, max_qo_send_rows=56,
                         max_kv_send_rows=88, num_stages=1, **{field: rows}, **more)
    plan = solve(varlen_causal_mask(doc_lengths(P * c, 0)), config)
    fill = plan.comm.kv_recv_rows if field == "kept_kv_rows" else plan.comm.qo_recv_rows
    assert int(fill.max()) > rows  # some rows past the kept ones travel again
    g = torch.Generator().manual_seed(0)
    q = torch.randn(P, c, Hq, D, generator=g, requires_grad=True)
    k = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    grads, seen = {}, None
    for kept in (None, rows):
        group = LocalGroup(P)
        rec, into = _Recorder(group), _IntoRecorder(group)
        kw = {field: kept, **more} if kept is not None else {"keep_forward_buffers": True}
        (out, lse), sizes, _ = _saved(lambda: dist_attn(q, k, v, plan, group, **kw))
        rec.current, into.current = [], {}
        q.grad = k.grad = v.grad = None
        (out.sum() + lse.sum()).backward()
        grads[kept] = (q.grad, k.grad, v.grad)
        seen = (group, sizes, list(into.current.values()), list(rec.current))
    for a, b in zip(grads[None], grads[rows]):
        assert torch.equal(a, b)
    return (plan, config, plan.memory(config)) + seen


def _own_bytes(P=4, c=16, Hq=4, Hkv=2) -> int:
    """q, k, v, out (fp32) and lse of the layer's shards: what plain attention keeps."""
    return P * c * (2 * Hq * D + 2 * Hkv * D + Hq) * 4


def test_part_of_the_kv_buffer_kept():
    """``kept_kv_rows``: the first rows of the KV buffer are kept, the rest cast again (the tail of
    the forward's cast); the gradients are those of keeping everything, bit for bit, the bytes kept
    and moved are ``plan.memory``'s and ``pair_bytes``'s."""
    P, Hq, Hkv, rows = 4, 4, 2, 20
    plan, config, m, group, sizes, recv, ret = _kept_part_runs("kept_kv_rows", rows)
    assert m.kept == 40 * (Hq // 2) * D * 4 + rows * 2 * (Hkv // 2) * D * 4
    assert sum(sizes) == _own_bytes() + P * m.kept
    # dO, lse, delta; the KV rows past the kept ones, written after them (K, V); dQ, dK, dV back.
    # The backward's KV operand is whole again (its kept rows copied back), beside the kept copy:
    # plan.memory's backward peak counts both
    assert len(recv) == 5 and len(ret) == 3
    assert sum(recv) + sum(ret) + P * m.kept == P * m.bwd_peak
    sent, got = group.traffic("bwd.kv")
    tail = plan.pair_bytes("bwd.kv", config.cost())
    assert torch.equal(got, tail.sum(0)) and int(tail.sum()) > 0


def test_part_of_the_q_buffer_kept():
    """``kept_q_rows``: the first rows of the QO buffer are kept, Q of the rest travels again beside dO
    (the tail of the forward's cast); the gradients are those of keeping everything, bit for bit, the
    bytes kept and moved are ``plan.memory``'s and ``pair_bytes``'s."""
    P, Hq, Hkv, rows = 4, 4, 2, 10
    plan, config, m, group, sizes, recv, ret = _kept_part_runs("kept_q_rows", rows)
    assert m.kept == rows * (Hq // 2) * D * 4 + 64 * 2 * (Hkv // 2) * D * 4
    assert sum(sizes) == _own_bytes() + P * m.kept
    # dO, lse, delta; Q of the rows past the kept ones, written after them; dQ, dK, dV back. The
    # backward's Q operand is whole again (its kept rows copied back), beside the kept copy
    assert len(recv) == 4 and len(ret) == 3
    assert sum(recv) + sum(ret) + P * m.kept == P * m.bwd_peak
    sent, got = group.traffic("bwd.qo")
    planned = plan.pair_bytes("bwd.qo", config.cost())
    assert torch.equal(got, planned.sum(0)) and torch.equal(sent, planned.sum(1))
    # Q again is the tail past the kept rows, rank by rank
    again = planned - plan.pair_bytes("bwd.qo", replace(config, kept_q_rows=None).cost())
    assert torch.equal(again.sum(0) // ((Hq // 2) * D * 4), (plan.comm.qo_recv_rows - rows).clamp(min=0))
    assert int(again.sum()) > 0


def test_one_room_split_per_rank():
    """``kept_per_rank``: one room of 10 Q rows' and 20 K, V rows' bytes that each rank splits by its
    own fills, Q first: the layer saves its activations and the room, the backward builds whole
    operands beside it, each rank receives again exactly its rows past what it kept, and the
    gradients are those of keeping everything, bit for bit."""
    from gpusolver.problem import split_kept_room

    P, Hq, Hkv = 4, 4, 2
    plan, config, m, group, sizes, recv, ret = _kept_part_runs("kept_q_rows", 10, kept_kv_rows=20,
                                                               kept_per_rank=True)
    q_row, kv_row = (Hq // 2) * D * 4, 2 * (Hkv // 2) * D * 4
    assert m.kept == 10 * q_row + 20 * kv_row
    assert sum(sizes) == _own_bytes() + P * m.kept  # the local rows and the room, nothing else
    # dO, lse, delta; Q, K, V past each rank's kept rows into whole buffers; dQ, dK, dV back
    assert len(recv) == 6 and len(ret) == 3
    assert sum(recv) + sum(ret) + P * m.kept == P * m.bwd_peak
    cost = config.cost()
    fill_q, fill_kv = plan.comm.qo_recv_rows.long(), plan.comm.kv_recv_rows.long()
    kq, kk = split_kept_room(fill_q, fill_kv, m.kept, q_row, kv_row)
    assert int((kq < 10).sum()) > 0 or int((kk > 20).sum()) > 0  # some rank's split is not the prefixes'
    planned_q, planned_kv = plan.pair_bytes("bwd.qo", cost), plan.pair_bytes("bwd.kv", cost)
    for phase, planned in (("bwd.qo", planned_q), ("bwd.kv", planned_kv)):
        sent, got = group.traffic(phase)
        assert torch.equal(got, planned.sum(0)) and torch.equal(sent, planned.sum(1)), phase
    again_q = planned_q - plan.pair_bytes("bwd.qo", replace(config, kept_q_rows=None, kept_kv_rows=None,
                                                            kept_per_rank=False).cost())
    assert torch.equal(again_q.sum(0) // q_row, fill_q - kq)
    assert torch.equal(planned_kv.sum(0) // kv_row, fill_kv - kk)
    assert int(again_q.sum() + planned_kv.sum()) > 0


def test_kept_kv_rows_must_be_a_row_count():
    P, c = 4, 16
    config = make_config(P, 4, 2)
    plan = solve(varlen_causal_mask(doc_lengths(P * c, 0)), config)
    q = torch.randn(P, c, 4, D)
    k = v = torch.randn(P, c, 2, D)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="kept_kv_rows"):
            dist_attn(q, k, v, plan, LocalGroup(P), kept_kv_rows=bad)
        with pytest.raises(ValueError, match="kept_q_rows"):
            dist_attn(q, k, v, plan, LocalGroup(P), kept_q_rows=bad)
        with pytest.raises(ValueError, match="kept_q_rows"):
            dist_attn(q, k, v, plan, LocalGroup(P), kept_q_rows=bad, kept_kv_rows=4, kept_per_rank=True)
    # one room split per rank needs both kinds kept and both row counts, and a bool
    for kw in ({"kept_q_rows": 4, "keep_forward_buffers": True},
               {"kept_q_rows": 4, "kept_kv_rows": 4, "keep_forward_buffers": "qo"}):
        with pytest.raises(ValueError, match="kept_per_rank=True"):
            dist_attn(q, k, v, plan, LocalGroup(P), kept_per_rank=True, **kw)
        with pytest.raises(ValueError, match="kept_per_rank=True"):
            make_config(P, 4, 2, kept_per_rank=True, **kw)
    with pytest.raises(ValueError, match="kept_per_rank must be a bool"):
        make_config(P, 4, 2, kept_q_rows=4, kept_kv_rows=4, kept_per_rank="yes")


@pytest.mark.parametrize("stages", [1, "auto"])
def test_fused_reduce_keeps_the_accounting_and_the_results(monkeypatch, stages):
    """The reduces through groupcomm's fused merge (the GPU default; its kernels under the interpreter
    here): the same buffers and kept bytes as ``plan.memory()`` says, the torch path's results, with
    one remote stage and at the default sub-stages (each sub-stage's reduce its own return buffers)."""
    import groupcomm._reduce
    from groupcomm._merge import fused_reduce

    calls = []
    merge = groupcomm._reduce.fused_reduce_rows
    monkeypatch.setattr(groupcomm._reduce, "fused_reduce_rows", lambda *a: calls.append(a[4]) or merge(*a))

    P, c, Hq, Hkv = 4, 16, 4, 2
    config = make_config(P, Hq, Hkv, max_qo_recv_rows=40, max_kv_recv_rows=64, max_qo_send_rows=56,
                         max_kv_send_rows=88, num_stages=stages)
    plan = solve(varlen_causal_mask(doc_lengths(P * c, 0)), config)
    NS = plan.num_stages
    assert NS == (1 if stages == 1 else AUTO_STAGES + 1)  # S = 4 and the local tail
    m = plan.memory(config)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(P, c, Hq, D, generator=g, requires_grad=True)
    k = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    results = {}
    for fused in (False, True):
        group = LocalGroup(P)
        rec, into = _Recorder(group), _IntoRecorder(group)
        q.grad = k.grad = v.grad = None
        with fused_reduce(fused):
            (out, lse), sizes, held = _saved(lambda: dist_attn(q, k, v, plan, group))
            fwd_ret, fwd_recv = rec.current, sum(into.current.values())
            rec.current, into.current = [], {}
            (out.sum() + lse.sum()).backward()
        bwd_ret, bwd_recv = rec.current, sum(into.current.values())
        own = P * c * (2 * Hq * D + 2 * Hkv * D + Hq) * 4
        if NS == 1:
            assert sum(sizes) == own + P * m.kept
        else:  # each sub-stage saves views of the one kept buffer per kind: its storage counts once
            assert sum(sizes[:5]) == own and 0 <= held - own - P * m.kept <= 2 * Hq // 2 * D * 4 * P
        # one O and lse return buffer, one dQ and one dK, dV at a time: each sub-stage's the same
        assert len(fwd_ret) == 2 * NS and fwd_ret == fwd_ret[:2] * NS
        assert len(bwd_ret) == 3 * NS and bwd_ret == bwd_ret[:3] * NS
        assert fwd_recv + sum(fwd_ret[:2]) == P * m.fwd_peak
        assert bwd_recv + sum(bwd_ret[:3]) + P * m.kept == P * m.bwd_peak
        results[fused] = (out, lse, q.grad, k.grad, v.grad)
        # per sub-stage: O and lse in the forward; dQ, then dK and dV in the backward
        assert calls == (["lse"] * NS + ["sum", "sum"] * NS if fused else [])
        calls.clear()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[False], results[True]):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)


def test_part_of_the_kv_buffer_kept_with_sub_stages():
    """S = 3 with ``kept_kv_rows``: the forward keeps the first rows of the one KV buffer the casts
    share, the backward casts each sub-stage's rows past them again into the rows past them: the layer
    keeps and receives what ``plan.memory()`` says, and its gradients are those of keeping everything."""
    P, c, Hq, Hkv, S, kept_rows = 4, 16, 4, 2, 3, 20
    caps = dict(max_qo_recv_rows=40, max_kv_recv_rows=64, max_qo_send_rows=56, max_kv_send_rows=88)
    config = make_config(P, Hq, Hkv, num_stages=S, kept_kv_rows=kept_rows, **caps)
    plan = solve(varlen_causal_mask(doc_lengths(P * c, 0)), config)
    assert plan.num_stages == config.plan_stages and int(plan.comm.kv_recv_rows.max()) > kept_rows
    m = plan.memory(config)
    assert m.kept == 40 * (Hq // 2) * D * 4 + kept_rows * 2 * (Hkv // 2) * D * 4
    g = torch.Generator().manual_seed(0)
    q = torch.randn(P, c, Hq, D, generator=g, requires_grad=True)
    k = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    own = P * c * (2 * Hq * D + 2 * Hkv * D + Hq) * 4
    grads = {}
    for kept in (None, kept_rows):
        group = LocalGroup(P)
        ret, into = _Recorder(group), _IntoRecorder(group)
        (out, lse), sizes, held = _saved(lambda: dist_attn(q, k, v, plan, group, kept_kv_rows=kept))
        ret.current, into.current = [], {}
        q.grad = k.grad = v.grad = None
        (out.sum() + lse.sum()).backward()
        grads[kept] = (q.grad, k.grad, v.grad)
        if kept is None:
            continue
        # the layer's activations (the kept operands' local rows are the saved q, k, v), then the kept
        # rows: the whole Q buffer and the first kept_rows of the KV one
        assert sum(sizes[:5]) == own and sum(sizes) - sum(sizes[:5]) == P * (m.kept + c * (Hq + 2 * Hkv) * D * 4)
        assert 0 <= held - own - P * m.kept <= 2 * Hq // 2 * D * 4 * P
        # dO, lse, delta; K, V past the kept rows (every sub-stage's tail lands in those rows of the whole
        # operands, the kept rows copied in: its buffer counts once, kept rows plus tail); one dQ and one
        # dK, dV return buffer at a time
        recv = list(into.current.values())
        assert len(recv) == 5 and len(ret.current) == 3 * plan.num_stages
        assert sum(recv) + sum(ret.current[:3]) + P * m.kept == P * m.bwd_peak
        for s in range(1, S + 1):
            assert torch.equal(group.traffic(f"bwd.kv.{s}")[1],
                               plan.pair_bytes("bwd.kv", config.cost(), stage=s).sum(0))
        assert int(sum(group.traffic(f"bwd.kv.{s}")[1].sum() for s in range(1, S + 1))) > 0
    for a, b in zip(grads[None], grads[kept_rows]):
        assert torch.equal(a, b)


# relay-S4 is slow (20 s: the relay sub-stages' backward on CPU); its values with the rebuilt routing
# stay fast in test_relay_stages.py::test_relay_stages_equal_reference
@pytest.mark.parametrize("stages,relay", [(4, False), (1, False), pytest.param(4, True, marks=pytest.mark.slow),
                                          (1, True)], ids=["S4", "S1", "relay-S4", "relay-S1"])
def test_what_a_layer_holds_is_what_autograd_saves(stages, relay):
    """Every storage the forward makes and leaves alive until the backward is one autograd saves (or
    an output): what saved-tensor hooks count is what a layer holds, and activation offloading or
    checkpointing through them reaches all of it. The routing's tables (send lists and gathers, S
    times the capacities of int64: 62-83 MB per layer at real shapes, a relay plan's hops 432 MB at
    P = 16 with S = 4) are built again in the backward, not kept on the autograd context."""
    from benchmarks.layer_memory import LiveBytes
    from tests.gpusolver.runtime.test_relay import _plans

    P, c, Hq, Hkv = 4, 16, 4, 2
    if relay:  # two nodes of 4
        P = 8
        _, plan, mask, _ = _plans("docs-causal", P, 4, num_stages=stages, seed=1)
        assert plan.relay is not None
    else:
        mask = make_mask("docs-causal", P * c, seed=1)
        plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, num_stages=stages))
    assert plan.num_stages == (stages if relay or stages == 1 else stages + 1)  # direct: and the local tail
    inputs = make_inputs(P * c, Hq, Hkv, seed=2)
    group = LocalGroup(P)
    qs, ks, vs = (shard(x, group).requires_grad_() for x in inputs[:3])
    given = {id(x.untyped_storage()) for x in (qs, ks, vs)}
    saved = {}

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage()  # held: no id is reused
        return t
    live = LiveBytes(track=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live:
        out, lse = dist_attn(qs, ks, vs, plan, group)
    for t in (out, lse):
        pack(t)
    # the group's own byte counters (a few [2, P] and [P, P] per phase, whatever the layer) aside
    unsaved = [what for key, what in live._what.items()
               if key not in saved and key not in given and "_count" not in what[-1]]
    assert not unsaved, unsaved
    torch.autograd.backward((out, lse), (shard(inputs[3], group), shard(inputs[4], group)))
    got = {key: unshard(t.detach(), group) for key, t in zip(KEYS, (out, lse, qs.grad, ks.grad, vs.grad))}
    _assert_all_close(reference(mask, *inputs), got)
