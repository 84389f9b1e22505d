"""dist_attn with the remote work in S sub-stages, against dense attention on the whole sequence.

LocalGroup (P simulated ranks) and forked gloo ranks (TorchGroup), forward and
backward, kept and re-cast buffers; the byte counters of every sub-stage's
cast and reduce against the plan's per-stage splits. The default tier keeps a
small representative set; the whole matrix (P = 8, 16 and 2, 4 on gloo; S = 1,
2, 4, 8; tiles 1 and 2) is in the slow tier.
"""
from dataclasses import replace

import pytest
import torch
from torch import nn

from gpusolver import block_areas
from gpusolver.masks import varlen_causal_mask
from gpusolver.config import LOCAL_TAIL, sub_stages
from gpusolver.plan import IMBALANCED
from gpusolver.plan.build import build_plan
from gpusolver.problem import kept_kinds
from gpusolver.runtime import DynamicCPAttention, PlanCache, dist_attn, shard
from gpusolver.runtime.pipelined import counter_phases, stage_phase
from groupcomm import LocalGroup, TorchGroup
from tests._dist import run_ranks
from tests._operand_rows import record_cast_rows, record_operand_rows
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import (ATOL, D, RTOL, doc_lengths, make_config, make_inputs, make_mask,
                                            reference, tight_plan)
from tests.gpusolver.runtime.test_dist_attn import KEYS, _assert_all_close, _run
from tests.gpusolver.runtime._cases import few_solve_rounds  # noqa: F401 - fixture


def _case_id(case):
    name, P, c, Hq, Hkv, flatten, tiles, S, keep = case
    return (f"{name}-P{P}-c{c}-Hq{Hq}-Hkv{Hkv}-{'flat' if flatten else 'G1'}-n{tiles}-S{S}-"
            f"{'keep' if keep else 'recast'}")


def _check_local(case):
    name, P, c, Hq, Hkv, flatten, tiles, S, keep = case
    T = P * c
    mask = make_mask(name, T, seed=P)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, flatten, tiles, num_stages=S, keep_forward_buffers=keep))
    NS = sub_stages(S, LOCAL_TAIL)  # with S > 1 the local tail is sub-stage S + 1
    assert plan.num_stages == NS and plan.calc.q_ranges.shape[1] == NS + 1
    if S > 1:  # the remote work really is spread over more than one sub-stage
        assert int(((plan.task_stage > 1) & (plan.task_stage <= S)).sum()) > 0
    if S > 1 and (Hkv if flatten else 1) * tiles ** 2 > 1:  # and the tail runs local work (whole tasks: it
        assert int((plan.task_stage == NS).sum()) > 0       # needs more than one local task per rank)
    inputs = make_inputs(T, Hq, Hkv, seed=P)
    _assert_all_close(reference(mask, *inputs), _run(plan, P, *inputs, keep_forward_buffers=keep), f"S={S} ")


# (mask, P, c, Hq, Hkv, flatten, tiles, S, keep)
CASES = [
    ("random", 8, 16, 4, 2, True, 1, 2, True),
    ("docs-causal", 8, 32, 4, 2, False, 2, 4, False),
    ("docs-full", 4, 16, 2, 2, True, 1, 8, True),
]


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_stages_equal_reference(case):
    _check_local(case)


SLOW_CASES = [(name, P, 16, 4, 2, flatten, tiles, S, keep)
              for P in (8, 16) for S in (1, 2, 4, 8) for tiles in (1, 2)
              for name, flatten, keep in (("docs-causal", True, True), ("random", False, False))]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[_case_id(c) for c in SLOW_CASES])
def test_stages_equal_reference_matrix(case):
    _check_local(case)


PHASES = {"fwd": ("fwd.qo", "fwd.kv", "fwd.o"), "bwd": ("bwd.qo", "bwd.kv", "bwd.dq", "bwd.dkv")}


def _stage_bytes(plan, cost, keep):
    """{phase of sub-stage s: (sent [P], recv [P])} from the plan's per-stage split matrices."""
    comm = plan.comm
    row = {"fwd.qo": ("qo", "cast", cost.q_fwd), "fwd.kv": ("kv", "cast", cost.kv_fwd),
           "fwd.o": ("qo", "return", cost.o_fwd), "bwd.qo": ("qo", "cast", cost.q_bwd),
           "bwd.dq": ("qo", "return", cost.dq_bwd), "bwd.dkv": ("kv", "return", cost.dkv_bwd)}
    if "kv" not in kept_kinds(keep):  # K, V cast again; Q again rides in bwd.qo (cost.q_bwd)
        row["bwd.kv"] = ("kv", "cast", cost.kv_bwd)
    out = {}
    for base, (kind, which, b) in row.items():
        for s, split in enumerate(comm.stage_split(kind, which).unbind(0), start=1):
            sent, recv = split.sum(1) * b, split.sum(0) * b
            if which == "return":  # partials flow from the helper (dst of the cast) back to the host
                sent, recv = recv, sent
            out[stage_phase(base, s) if comm.num_stages > 1 else base] = (sent, recv)  # S = 1: the plain phases
    return out


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "recast"])
def test_stage_bytes_equal_plan(keep):
    """Each sub-stage's counters equal that sub-stage's split; their sums equal the plan's volumes."""
    P, c, Hq, Hkv, S = 8, 16, 4, 2, 4
    T = P * c
    config = make_config(P, Hq, Hkv, num_stages=S, keep_forward_buffers=keep)
    plan, _ = tight_plan(make_mask("docs-causal", T, seed=1), config)
    group = LocalGroup(P)
    _run(plan, P, *make_inputs(T, Hq, Hkv), group=group, keep_forward_buffers=keep)
    want = _stage_bytes(plan, config.cost(), keep)
    for phase, (sent, recv) in want.items():
        got = group.traffic(phase)
        assert torch.equal(got[0], sent) and torch.equal(got[1], recv), (phase, got, sent, recv)
    assert sum(int(s.sum()) > 0 for s, _ in want.values()) > len(want) // 2  # most stages move bytes
    m = plan.metrics
    for step, send, recv in (("fwd", m.fwd_send, m.fwd_recv), ("bwd", m.bwd_send, m.bwd_recv)):
        phases = counter_phases(PHASES[step], S)  # what the demo sums to check a layer's bytes
        assert len(phases) == S * len(PHASES[step]) and counter_phases(PHASES[step], 1) == tuple(PHASES[step])
        tot_s = sum(group.traffic(ph)[0] for ph in phases)
        tot_r = sum(group.traffic(ph)[1] for ph in phases)
        assert torch.equal(tot_s, send) and torch.equal(tot_r, recv), step
    assert all(int(group.traffic(b)[0].sum()) == 0 for b in PHASES["fwd"])  # no unstaged phase ran


def _per_kind_plan(mask, config):
    """``tight_plan`` rebuilt with QO and KV receive buffers of different rows (each its own fill plus
    a margin), so a row indexed with the other kind's capacity would land in the wrong place."""
    plan, tight = tight_plan(mask, config)
    fill = {k: int(getattr(plan.comm, f"{k}_recv_rows").max()) for k in ("qo", "kv")}  # all casts, one buffer
    per_kind = replace(tight, max_qo_recv_rows=fill["qo"] + 1, max_kv_recv_rows=fill["kv"] + 5)
    areas = block_areas(mask, config.cp_size, config.head_groups, impl="torch", tiles=config.chunk_tiles)
    return build_plan(mask, areas, plan.assignment, per_kind).validate(ignore=IMBALANCED), per_kind


@pytest.mark.parametrize("keep", ["qo", "kv"])
def test_stages_per_kind_keep_and_capacities(keep):
    """S = 3 with one kind kept and the other cast again, QO and KV buffers of different rows:
    values and gradients equal dense attention, and every sub-stage's counters equal its split."""
    P, c, Hq, Hkv, S = 4, 16, 4, 2, 3
    T = P * c
    mask = make_mask("docs-causal", T, seed=3)
    plan, config = _per_kind_plan(mask, make_config(P, Hq, Hkv, num_stages=S, keep_forward_buffers=keep,
                                                    memory_budget=None))
    comm = plan.comm
    assert comm.num_stages == S + 1 and comm.qo_recv_capacity != comm.kv_recv_capacity  # and the local tail
    inputs = make_inputs(T, Hq, Hkv, seed=3)
    group = LocalGroup(P)
    _assert_all_close(reference(mask, *inputs), _run(plan, P, *inputs, group=group, keep_forward_buffers=keep),
                      f"keep={keep} ")
    want = _stage_bytes(plan, config.cost(), keep)
    assert (stage_phase("bwd.kv", 1) in want) == (keep == "qo")
    for phase, (sent, recv) in want.items():
        got = group.traffic(phase)
        assert torch.equal(got[0], sent) and torch.equal(got[1], recv), (phase, got, sent, recv)
    for base in PHASES["bwd"]:  # the schedule the simulator prices moves what ran, pair by pair
        ran = sum(group.pair_traffic(stage_phase(base, s)) for s in range(1, comm.num_stages + 1))
        assert torch.equal(ran, plan.pair_bytes(base)), base
    # the sub-stages share one buffer of the kept kind, as one stage does
    m, rows = plan.memory(config), comm.buffers
    G = comm.head_groups
    q_row, kv_row = Hq // G * D * 4, 2 * Hkv // G * D * 4  # fp32
    assert m.kept == (rows.qo_recv * q_row if keep == "qo" else rows.kv_recv * kv_row)


def test_stages_deterministic_bit_identical():
    P, c, Hq, Hkv, S = 4, 16, 4, 2, 4
    T = P * c
    mask = make_mask("random", T, seed=5)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, num_stages=S))
    inputs = make_inputs(T, Hq, Hkv, seed=5)
    first, second = (_run(plan, P, *inputs) for _ in range(2))
    for key in KEYS:
        assert torch.equal(first[key], second[key]), key
    _assert_all_close(first, _run(plan, P, *inputs, deterministic=False), "deterministic=False ")


def test_stages_backward_sums_in_place(monkeypatch):
    """The slice kernel's backward adds each stage's share straight into the fp32 sums, and gives
    what each stage's gradients added afterwards (the path a custom stage kernel takes) give."""
    from gpusolver.runtime import pipelined
    from gpusolver.runtime.per_rank import per_rank

    P, c, Hq, Hkv, S = 4, 16, 4, 2, 4
    T = P * c
    mask = make_mask("random", T, seed=5)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, num_stages=S))
    inputs = make_inputs(T, Hq, Hkv, seed=5)
    real, stages = pipelined._flex_backward_into, []

    def counting(plan_, scale, ranks, batched, s, into, *t):
        stages.append(s)
        real(plan_, scale, ranks, batched, s, into, *t)

    def apart(plan_, scale, ranks, batched, s, into, *t):
        parts = per_rank(ranks, batched, lambda r, *x: pipelined._flex_backward(plan_, scale)(r, s, *x), *t)
        for acc, part in zip(into, parts):
            acc.add_(part)

    monkeypatch.setattr(pipelined, "_flex_backward_into", counting)
    fused = _run(plan, P, *inputs)
    assert set(stages) == set(range(S + 2))  # the local stage, S sub-stages, the local tail
    monkeypatch.setattr(pipelined, "_flex_backward_into", apart)
    _assert_all_close(fused, _run(plan, P, *inputs), "per-stage gradients ")


@pytest.mark.parametrize("keep", [False, True], ids=["cast-again", "kept"])
def test_stages_operands_freed_before_the_gradients(monkeypatch, keep):
    """The backward frees its operands (dO, lse, delta and the Q, K, V it received) before it makes
    the gradients out of the fp32 sums: a waited cast's handle, which holds its receive rows, is let
    go, so the gradients never sit beside the operands (the pass's peak is never its end)."""
    import weakref

    import gpusolver.runtime.pipelined as pipelined

    P, c, Hq, Hkv, S = 4, 16, 4, 2, 4
    T = P * c
    mask = make_mask("docs-causal", T, seed=3)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, num_stages=S))
    inputs = make_inputs(T, Hq, Hkv, seed=3)
    real_into, real_copy = pipelined._flex_backward_into, pipelined.natural_copy
    read, live_at_copy = [], []

    def recording(plan_, scale, ranks, batched, s, into, *t):
        if s > 0:  # a remote sub-stage reads the operands, received rows included
            do, q, k, v = t[:4]
            # kept Q, K, V are the forward's saved tensors, which autograd holds through the backward
            read.extend(weakref.ref(x) for x in ((do,) if keep else (do, q, k, v)))
        real_into(plan_, scale, ranks, batched, s, into, *t)

    def checking(*a, **kw):
        if read:  # the backward's gradients: no operand may be left
            live_at_copy.append(sum(r() is not None for r in read))
        return real_copy(*a, **kw)

    monkeypatch.setattr(pipelined, "_flex_backward_into", recording)
    monkeypatch.setattr(pipelined, "natural_copy", checking)
    _assert_all_close(_run(plan, P, *inputs, keep_forward_buffers=keep),
                      _run(plan, P, *inputs, keep_forward_buffers=keep, deterministic=False))
    assert read and live_at_copy, "no remote sub-stage ran"
    assert max(live_at_copy) == 0, live_at_copy


def test_stages_merge_windows_same_bits(monkeypatch):
    """The reduces gather their partials a window of rows at a time (``pipelined.MERGE_PIECES``; a
    custom stage kernel's merges too): elementwise, so any number of windows gives the same bits."""
    import gpusolver.runtime.pipelined as pipelined

    monkeypatch.setattr(pipelined, "WINDOW_MIN_ELEMENTS", 1)  # these rows are small: window them anyway

    P, c, Hq, Hkv, S = 4, 16, 4, 2, 4
    T = P * c
    mask = make_mask("docs-causal", T, seed=3)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, num_stages=S))
    inputs = make_inputs(T, Hq, Hkv, seed=3)
    got = {}
    for pieces in (1, 3, 8):
        monkeypatch.setattr(pipelined, "MERGE_PIECES", pieces)
        got[pieces] = _run(plan, P, *inputs)
    for pieces in (3, 8):
        for key in KEYS:
            assert torch.equal(got[1][key], got[pieces][key]), (pieces, key)


@pytest.mark.usefixtures("few_solve_rounds")
def test_stages_layer_on_meta():
    """Solve, stage pass, per-stage metas, casts, reduces and backward with no host read."""
    P, c, Hq, Hkv = 4, 16, 4, 2
    T = P * c
    mask = varlen_causal_mask(doc_lengths(T, 0), device="meta")
    layer = DynamicCPAttention(LocalGroup(P), make_config(P, Hq, Hkv, num_stages=3), plan_cache=PlanCache())
    q = torch.empty(P, c, Hq, D, device="meta", requires_grad=True)
    k = torch.empty(P, c, Hkv, D, device="meta", requires_grad=True)
    v = torch.empty(P, c, Hkv, D, device="meta", requires_grad=True)
    out, lse = layer(q, k, v, mask, return_lse=True)
    assert out.shape == (P, c, Hq, D) and lse.shape == (P, c, Hq) and out.device.type == "meta"
    (out.sum() + lse.sum()).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "meta"


class _Attn(nn.Module):
    def __init__(self, group, config):
        super().__init__()
        self.attn = DynamicCPAttention(group, config, plan_cache=PlanCache())

    def forward(self, q, k, v, mask):
        return self.attn(q, k, v, mask)


def test_stages_compile_fullgraph():
    """The whole S = 2 layer, solve included, under torch.compile(fullgraph=True) with a LocalGroup."""
    P, c, Hq, Hkv = 2, 16, 4, 2
    T = P * c
    mask = varlen_causal_mask(doc_lengths(T, 2))
    config = make_config(P, Hq, Hkv, num_stages=2)
    group = LocalGroup(P)
    q, k, v, d_out, _ = (shard(x, group) for x in make_inputs(T, Hq, Hkv, seed=3))
    eager_in = [x.clone().requires_grad_() for x in (q, k, v)]
    comp_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _Attn(group, config)(*eager_in, mask)
    got = torch.compile(_Attn(group, config), fullgraph=True, backend="aot_eager")(*comp_in, mask)
    assert_close("out", ref, got, atol=ATOL, rtol=RTOL)
    ref.backward(d_out)
    got.backward(d_out)
    for name, a, b in zip("qkv", eager_in, comp_in):
        assert_close(f"d{name}", a.grad, b.grad, atol=ATOL, rtol=RTOL)


def _rank_stages(rank, P, name, c, Hq, Hkv, tiles, S, keep, seed, transport="a2a", kept_share=None,
                 kept_q_share=None, per_rank=False):
    """kept_share: keep this share of the KV buffer's largest fill (``kept_kv_rows``), or all (None);
    kept_q_share: likewise of the QO buffer (``kept_q_rows``); per_rank: the two as one room each rank
    splits by its own fills (``kept_per_rank``)."""
    T = P * c
    mask = make_mask(name, T, seed)
    config = make_config(P, Hq, Hkv, True, tiles, num_stages=S, keep_forward_buffers=keep)
    plan, _ = tight_plan(mask, config)
    kept_rows = None if kept_share is None else int(int(plan.comm.kv_recv_rows.max()) * kept_share)
    q_rows = None if kept_q_share is None else int(int(plan.comm.qo_recv_rows.max()) * kept_q_share)
    group = TorchGroup(transport=transport)
    q, k, v, d_out, d_lse = make_inputs(T, Hq, Hkv, seed)
    qs, ks, vs = (shard(x, group).clone().requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group, keep_forward_buffers=keep, kept_kv_rows=kept_rows,
                         kept_q_rows=q_rows, kept_per_rank=per_rank)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    want = _stage_bytes(plan, config.cost(), keep)
    cost = replace(config, kept_kv_rows=kept_rows, kept_q_rows=q_rows, kept_per_rank=per_rank).cost()
    for base, rows in (("bwd.kv", kept_rows), ("bwd.qo", q_rows)):
        if rows is None:
            continue
        for s in range(1, S + 1):  # each sub-stage's cast again: its rows past the kept ones
            pb = plan.pair_bytes(base, cost, stage=s)
            want[stage_phase(base, s) if S > 1 else base] = (pb.sum(1), pb.sum(0))
    counted = {ph: group.traffic(ph) for ph in want}
    planned = {ph: (int(s_[rank]), int(r_[rank])) for ph, (s_, r_) in want.items()}
    return {"got": dict(zip(KEYS, (out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad))),
            "counted": counted, "planned": planned}


def _check_gloo(P, name, c, Hq, Hkv, tiles, S, keep, seed, transport="a2a", kept_share=None, kept_q_share=None,
                per_rank=False):
    results = run_ranks(_rank_stages, P, name, c, Hq, Hkv, tiles, S, keep, seed, transport, kept_share,
                        kept_q_share, per_rank, timeout=120)
    T = P * c
    ref = reference(make_mask(name, T, seed), *make_inputs(T, Hq, Hkv, seed))
    for rank, res in enumerate(results):
        rows = slice(rank * c, (rank + 1) * c)
        for key in KEYS:
            assert_close(f"rank {rank} {key}", ref[key][rows], res["got"][key], atol=ATOL, rtol=RTOL)
        assert res["counted"] == res["planned"], f"rank {rank}"


# (P, mask, c, Hq, Hkv, tiles, S, keep, seed, transport)
GLOO = [(2, "random", 32, 4, 2, 2, 2, True, 2, "a2a"), (4, "docs-causal", 16, 2, 2, 1, 4, False, 0, "a2a"),
        (4, "docs-full", 16, 4, 2, 2, 2, True, 1, "p2p")]


@pytest.mark.parametrize("case", GLOO, ids=[f"P{c[0]}-{c[1]}-n{c[5]}-S{c[6]}-{c[9]}" for c in GLOO])
def test_stages_gloo(case):
    _check_gloo(*case)


GLOO_SLOW = [(P, "docs-causal", 16, 4, 2, tiles, S, True, 0, transport) for P in (2, 4) for S in (1, 2, 4, 8)
             for tiles in (1, 2) for transport in ("a2a", "p2p")]


@pytest.mark.slow
@pytest.mark.parametrize("case", GLOO_SLOW, ids=[f"P{c[0]}-n{c[5]}-S{c[6]}-{c[9]}" for c in GLOO_SLOW])
def test_stages_gloo_matrix(case):
    _check_gloo(*case)


@pytest.mark.parametrize("transport", ["a2a", "p2p"])
def test_stages_gloo_kept_rows(transport):
    """S = 2 on gloo ranks keeping a quarter of the KV buffer's fill (``kept_kv_rows``): cast 1 straddles
    the kept rows, cast 2 lands past them, at its own row of the rest. Each sub-stage's tail travels with
    host splits and host start rows; values, gradients and the ``bwd.kv.s`` counters as on LocalGroup."""
    _check_gloo(2, "docs-causal", 32, 4, 2, 1, 2, True, 0, transport, 0.25)


@pytest.mark.parametrize("S,transport", [(1, "a2a"), (2, "p2p")])
def test_stages_gloo_kept_q_rows(S, transport):
    """Half the QO buffer's largest fill kept (``kept_q_rows``) on gloo ranks: Q of the rows past them
    travels again beside dO, each sub-stage's tail with host splits and host start rows; values,
    gradients and the ``bwd.qo.s`` counters as on LocalGroup."""
    _check_gloo(2, "docs-causal", 32, 4, 2, 1, S, True, 0, transport, None, 0.5)


@pytest.mark.parametrize("P,S,transport", [(2, 1, "a2a"), (4, 2, "p2p")])
def test_stages_gloo_kept_per_rank(P, S, transport):
    """``kept_per_rank`` on gloo ranks: a room of half the largest QO fill and a quarter of the largest
    KV fill, which each rank splits by its own fills from the host splits; each tail lands at the rank's
    own first row past its kept ones. Values, gradients and the ``bwd.qo.s`` / ``bwd.kv.s`` counters as
    on LocalGroup."""
    _check_gloo(P, "docs-causal", 32 if P == 2 else 16, 4, 2, 1, S, True, 0, transport, 0.25, 0.5, True)


def _rank_reduce_rows(rank, P, name, c, Hq, Hkv, S, seed):
    """On a gloo rank: the rows of every reduce buffer the layer gathers, next to the receive capacity."""
    import gpusolver.runtime.pipelined as pipelined

    mask = make_mask(name, P * c, seed)
    config = make_config(P, Hq, Hkv, True, 1, num_stages=S)
    plan, _ = tight_plan(mask, config)
    seen = []
    gather = pipelined._gather_remote

    def recorded(x, idx, n, lead, dtype, out=None):
        seen.append((idx.shape[0], x.shape[0] - n))
        assert out is None or out.shape[0] == idx.shape[0]  # a packed buffer's rows: the same
        return gather(x, idx, n, lead, dtype, out=out)

    pipelined._gather_remote = recorded
    lengths, index = [], pipelined.RouteTables.index

    def measured(self, kind, which):
        lists = index(self, kind, which)
        lengths.append((self.host is not None, kind, which, lists[0].shape[0]))
        return lists

    pipelined.RouteTables.index = measured
    group = TorchGroup(transport="p2p")
    q, k, v, d_out, d_lse = make_inputs(P * c, Hq, Hkv, seed)
    qs, ks, vs = (shard(x, group).clone().requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    group.wait_sends()
    return seen, sorted(set(lengths))


def test_stages_gloo_reduce_buffers_hold_the_returned_rows():
    """On TorchGroup each sub-stage's reduce buffer holds the rows the rank returns in it (the stage's
    fill, from the host copy of the splits), not the receive capacity: forward O and lse per sub-stage,
    backward dQ and dK, dV; and the send lists hold the most rows a sub-stage sends, not the send
    capacity. (The layer's values on gloo: ``test_stages_gloo``.)"""
    P, name, c, Hq, Hkv, S, seed = 4, "docs-causal", 16, 4, 2, 4, 0
    got = run_ranks(_rank_reduce_rows, P, name, c, Hq, Hkv, S, seed, timeout=120)
    plan, _ = tight_plan(make_mask(name, P * c, seed), make_config(P, Hq, Hkv, True, 1, num_stages=S))
    comm = plan.comm
    for rank, (seen, lengths) in enumerate(got):
        # every send list holds the most rows a sub-stage sends (each pass builds its lists once the
        # host copy of the splits has landed), not the send capacity
        for cut, kind, which, length in lengths:
            sends = comm.stage_split(kind, which)[:, rank].sum(-1)  # [S] rows this rank sends
            assert cut and length == int(sends.max()), (rank, kind, which, length)
        assert {(kind, which) for _, kind, which, _ in lengths} == {
            ("qo", "cast"), ("kv", "cast"), ("qo", "return"), ("kv", "return")}
        returned = {kind: [int(x) for x in comm.stage_split(kind, "return")[:, :, rank].sum(1)] for kind in ("qo", "kv")}
        # the operands gathered from hold this rank's fill (``pipelined.receive_rows``), not the capacity
        fill = {"qo": int(comm.qo_recv_rows[rank]), "kv": int(comm.kv_recv_rows[rank])}
        want = sorted([(n, fill["qo"]) for n in returned["qo"] for _ in range(2)]       # fwd: out, lse
                      + [(n, fill["qo"]) for n in returned["qo"]]                       # bwd: dq
                      + [(n, fill["kv"]) for n in returned["kv"] for _ in range(2)])    # bwd: dk, dv
        assert sorted(seen) == want, f"rank {rank}"
        assert sum(returned["qo"]) <= fill["qo"] and sum(returned["kv"]) <= fill["kv"], f"rank {rank}"


def _rank_operand_rows(rank, P, name, c, Hq, Hkv, S, seed, keep, kept_share):
    """On a gloo rank: the rows of every operand and sum the pipelined layer allocates (``Operands``),
    with its values and gradients."""
    mask = make_mask(name, P * c, seed)
    config = make_config(P, Hq, Hkv, True, 1, num_stages=S, keep_forward_buffers=keep)
    plan, _ = tight_plan(mask, config)
    kept_rows = None if kept_share is None else int(int(plan.comm.kv_recv_rows.max()) * kept_share)
    seen, casts = record_operand_rows(), record_cast_rows()
    group = TorchGroup(transport="p2p")
    q, k, v, d_out, d_lse = make_inputs(P * c, Hq, Hkv, seed)
    qs, ks, vs = (shard(x, group).clone().requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group, keep_forward_buffers=keep, kept_kv_rows=kept_rows)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    group.wait_sends()
    return {"rows": seen + casts, "got": dict(zip(KEYS, (out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad)))}


@pytest.mark.parametrize("S", [1, 4])
@pytest.mark.parametrize("keep,kept_share", [(True, None), (False, None), (True, 0.5)],
                         ids=["kept", "cast-again", "kept-rows"])
def test_stages_gloo_operands_hold_the_rank_fill(keep, kept_share, S):
    """On TorchGroup every operand and sum over received rows (forward Q, K, V and the running out;
    backward dO, the sums, what is cast again) and, with one remote stage, every cast's receive
    buffer holds the rows this rank receives, not the receive capacity; values and gradients equal
    dense attention. With half the largest KV fill kept (``kept_kv_rows``) a rank whose own fill is
    below the kept rows keeps its whole buffer and its tails move nothing."""
    P, name, c, Hq, Hkv, seed = 4, "docs-causal", 16, 4, 2, 0
    got = run_ranks(_rank_operand_rows, P, name, c, Hq, Hkv, S, seed, keep, kept_share, timeout=120)
    plan, _ = tight_plan(make_mask(name, P * c, seed), make_config(P, Hq, Hkv, True, 1, num_stages=S))
    comm = plan.comm
    ref = reference(make_mask(name, P * c, seed), *make_inputs(P * c, Hq, Hkv, seed))
    fills = [(int(comm.qo_recv_rows[r]), int(comm.kv_recv_rows[r])) for r in range(P)]
    assert any(f < cap for f, cap in zip(fills[0], (comm.qo_recv_capacity, comm.kv_recv_capacity))), \
        "the case must have a buffer below its capacity"
    if kept_share is not None:  # kept rows between the ranks' KV fills: some keep all, some cast a tail again
        kept = int(max(f for _, f in fills) * kept_share)
        assert min(f for _, f in fills) < kept < max(f for _, f in fills)
    for rank, res in enumerate(got):
        assert set(res["rows"]) <= set(fills[rank]) and set(fills[rank]) <= set(res["rows"]), \
            f"rank {rank}: operand rows {sorted(set(res['rows']))}, fills {fills[rank]}"
        rows = slice(rank * c, (rank + 1) * c)
        for key in KEYS:
            assert_close(f"rank {rank} {key}", ref[key][rows], res["got"][key], atol=ATOL, rtol=RTOL)
