"""``kept_kv_rows`` / ``kept_q_rows`` with S > 1 sub-stages: the first R rows of the shared KV (QO)
receive buffer kept, each sub-stage's KV cast (Q beside dO) run again past them
(``gpusolver.runtime.kept_rows``).

LocalGroup, fp32, small shapes: values and gradients against dense attention and bit for bit against
keeping the whole buffer, every sub-stage's ``bwd.kv.s`` counters against ``plan.pair_bytes``, the
simulator's bytes against the plan's, and the layer on ``device="meta"``. R spans the cases: 0 (every
KV row cast again), a row inside the fill (some casts straddle it, some lie below it) and the fill
itself (nothing cast again). The gloo case is ``test_stages.py``'s ``test_stages_gloo_kept_rows``.
"""
from dataclasses import replace

import pytest
import torch

from gpusolver.masks import varlen_causal_mask
from gpusolver.runtime import DynamicCPAttention, PlanCache
from gpusolver.sim import simulate
from gpusolver.topology import Topology
from groupcomm import LocalGroup
from tests.gpusolver.runtime._cases import (D, doc_lengths, make_config, make_inputs, make_mask, meta_layer_step,
                                            reference, tight_plan)
from tests.gpusolver.runtime.test_dist_attn import KEYS, _assert_all_close, _run
from tests.gpusolver.runtime._cases import few_solve_rounds  # noqa: F401 - fixture

PHASES_BWD = ("bwd.qo", "bwd.kv", "bwd.dq", "bwd.dkv")
ROWS = {"zero": lambda fill: 0, "part": lambda fill: fill // 2, "filled": lambda fill: fill}


def _plan(name, P, S, seed):
    mask = make_mask(name, P * 16, seed=seed)
    plan, config = tight_plan(mask, make_config(P, 4, 2, num_stages=S))
    assert plan.num_stages == config.plan_stages == S + 1 and int((plan.task_stage > 1).sum()) > 0  # + the tail
    return mask, plan, config


def _tails(plan, cost):
    """Rows of the ``bwd.kv`` tail of each sub-stage, summed over ranks."""
    return [int(plan.pair_bytes("bwd.kv", cost, stage=s).sum()) // cost.kv_fwd
            for s in range(1, plan.num_stages + 1)]


@pytest.mark.parametrize("which", list(ROWS))
@pytest.mark.parametrize("name,P,S,seed", [("docs-causal", 4, 2, 3), ("random", 4, 4, 1)],
                         ids=["docs-causal-P4-S2", "random-P4-S4"])
def test_kept_rows_with_sub_stages(name, P, S, seed, which):
    mask, plan, config = _plan(name, P, S, seed)
    comm = plan.comm
    fill, cap = int(comm.kv_recv_rows.max()), comm.kv_recv_capacity
    R = ROWS[which](fill)
    assert R < cap  # a row count dist_attn keeps in part (R >= cap keeps the whole buffer)
    cost = replace(config, kept_kv_rows=R).cost()
    tails, full = _tails(plan, cost), _tails(plan, replace(config, keep_forward_buffers=False).cost())
    if which == "zero":
        assert tails == full and sum(full) > 0
    elif which == "filled":
        assert sum(tails) == 0
    else:  # some rows lie below R, some past it
        assert 0 < sum(tails) < sum(full)
    inputs = make_inputs(P * 16, 4, 2, seed=seed)
    group = _check_kept_layer(plan, mask, inputs, cost, range(1, plan.num_stages + 1), f"S={S} R={R} ", kept_kv_rows=R)
    assert all(int(group.traffic(b)[0].sum()) == 0 for b in PHASES_BWD)  # no unstaged phase ran


@pytest.mark.parametrize("which", list(ROWS))
@pytest.mark.parametrize("S,kv_share", [(1, None), (4, None), (2, 0.5)], ids=["S1", "S4", "S2-kv-part"])
def test_kept_q_rows(S, kv_share, which):
    """The first R rows of the QO buffer kept (with S = 2 half of the KV fill kept too): values and
    gradients against dense attention and bit for bit against keeping everything; every sub-stage's
    counters are the plan's, and over the sub-stages each rank receives Q again for exactly its rows
    past R."""
    P, seed = 4, 3
    mask = make_mask("docs-causal", P * 16, seed=seed)
    plan, config = tight_plan(mask, make_config(P, 4, 2, num_stages=S))
    assert plan.num_stages == config.plan_stages and (S == 1 or int((plan.task_stage > 1).sum()) > 0)  # as _plan
    comm = plan.comm
    fill = comm.qo_recv_rows
    R = ROWS[which](int(fill.max()))
    assert R < comm.qo_recv_capacity
    kv = None if kv_share is None else int(int(comm.kv_recv_rows.max()) * kv_share)
    cost = replace(config, kept_q_rows=R, kept_kv_rows=kv).cost()
    whole_q = replace(config, kept_kv_rows=kv).cost()
    stages = range(1, plan.num_stages + 1) if S > 1 else (None,)
    again = sum(plan.pair_bytes("bwd.qo", cost, stage=s) - plan.pair_bytes("bwd.qo", whole_q, stage=s)
                for s in stages)
    assert torch.equal(again.sum(0) // cost.q_fwd, (fill - R).clamp(min=0))
    assert (which == "filled") == (int(again.sum()) == 0)
    inputs = make_inputs(P * 16, 4, 2, seed=seed)
    _check_kept_layer(plan, mask, inputs, cost, stages, f"S={S} R={R} ", kept_q_rows=R, kept_kv_rows=kv)


def _check_kept_layer(plan, mask, inputs, cost, stages, where: str, **kept):
    """The layer keeping ``kept`` (``dist_attn``'s kept arguments) against dense attention and bit for
    bit against keeping everything; every (sub-stage's) backward counter is ``plan.pair_bytes``'s.
    Its group."""
    P = plan.comm.cp_size
    group = LocalGroup(P)
    got = _run(plan, P, *inputs, group=group, keep_forward_buffers=True, **kept)
    _assert_all_close(reference(mask, *inputs), got, where)
    whole = _run(plan, P, *inputs, keep_forward_buffers=True)  # the same kernels over the same rows
    for key in KEYS:
        assert torch.equal(got[key], whole[key]), key
    for base in PHASES_BWD:
        for s in stages:
            phase = base if s is None else f"{base}.{s}"
            assert torch.equal(group.pair_traffic(phase), plan.pair_bytes(base, cost, stage=s)), phase
    return group


def test_straddling_tails_by_hand():
    """A hand check of the per-stage first row: each sub-stage's tail is its rows at buffer rows >= R,
    counted from ``kv_stage_base`` and the stage's receive fill, rank by rank."""
    _, plan, config = _plan("docs-causal", 4, 4, 3)
    comm = plan.comm
    base = comm.stage_base("kv")                                       # [S, P]
    fill = comm.stage_split("kv").sum(1)                               # [S, P] rows each cast brings
    R = int(comm.kv_recv_rows.max()) // 2
    cost = replace(config, kept_kv_rows=R).cost()
    want = (base + fill - torch.maximum(base, torch.full_like(base, R))).clamp(min=0)  # rows past R
    for s in range(1, plan.num_stages + 1):
        got = plan.pair_bytes("bwd.kv", cost, stage=s).sum(0) // cost.kv_fwd
        assert torch.equal(got, want[s - 1]), s
    assert int(((base < R) & (base + fill > R)).sum()) > 0  # some cast straddles the kept rows


def test_simulator_prices_the_stage_tails():
    """The simulated backward moves ``plan.pair_bytes("bwd")``: the kept rows' tails per sub-stage."""
    _, plan, config = _plan("docs-causal", 4, 4, 3)
    topo = Topology(ranks_per_node=4, nvlink_gbps=1.0, ib_gbps=0.5, attn_tflops=1.0)
    bwd = {}
    for field, fill in (("kept_kv_rows", plan.comm.kv_recv_rows), ("kept_q_rows", plan.comm.qo_recv_rows)):
        R = int(fill.max()) // 2
        for rows in (None, R, 0):
            cost = replace(config, **{field: rows}).cost()
            want = plan.pair_bytes("bwd", cost)
            want.fill_diagonal_(0)
            lt = simulate(plan, topo, cost=cost)
            assert torch.equal(torch.tensor(lt.bwd.pair_bytes), want), (field, rows)
            bwd[field, rows] = int(want.sum())
        assert bwd[field, None] < bwd[field, R] < bwd[field, 0], field


@pytest.mark.usefixtures("few_solve_rounds")
def test_kept_rows_sub_stages_on_meta():
    """The S = 3 layer keeping part of its KV buffer (and of its QO buffer, as prefixes or one room
    split per rank) runs on ``device="meta"``: no host read."""
    P, c, Hq, Hkv = 4, 16, 4, 2
    for rows in ({"kept_kv_rows": 9}, {"kept_q_rows": 5, "kept_kv_rows": 9},
                 {"kept_q_rows": 5, "kept_kv_rows": 9, "kept_per_rank": True}):
        layer = DynamicCPAttention(LocalGroup(P), make_config(P, Hq, Hkv, num_stages=3, **rows),
                                   plan_cache=PlanCache())
        meta_layer_step(layer, P, c, Hq, Hkv)


@pytest.mark.usefixtures("few_solve_rounds")
def test_sub_stages_bf16_on_meta():
    """S = 2 in bf16 (the accumulator fp32, each stage's out bf16: the merge takes both), kept rows or
    not, on ``device="meta"``."""
    P, c, Hq, Hkv = 4, 16, 4, 2
    mask = varlen_causal_mask(doc_lengths(P * c, 0), device="meta")
    for rows in (None, 9):
        config = replace(make_config(P, Hq, Hkv, num_stages=2, kept_kv_rows=rows), dtype=torch.bfloat16)
        layer = DynamicCPAttention(LocalGroup(P), config, plan_cache=PlanCache())
        q, k, v = (torch.empty(P, c, h, D, device="meta", dtype=torch.bfloat16, requires_grad=True)
                   for h in (Hq, Hkv, Hkv))
        out, lse = layer(q, k, v, mask, return_lse=True)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        (out.sum() + lse.sum()).backward()
        assert all(x.grad.dtype == torch.bfloat16 for x in (q, k, v))


@pytest.mark.parametrize("lead", [0, 1], ids=["one-rank", "batched"])
def test_keep_prefix_copies_a_part_and_keeps_a_whole_operand_itself(lead):
    """The forward keeps rows ``[0, n + R)`` of K and V: a copy when rows past them go (cast again in
    the backward), the operand itself when R covers all its rows (a ``TorchGroup`` buffer at a fill
    within R), which a copy would hold twice."""
    from gpusolver.runtime.kept_rows import keep_prefix

    g = torch.Generator().manual_seed(0)
    shape = (10, 2, 4) if lead == 0 else (3, 10, 2, 4)
    x = [torch.randn(shape, generator=g), torch.randn(shape, generator=g)]
    n = 4
    part = keep_prefix(x, lead, n, 3)
    for t, p in zip(x, part):
        assert p.shape[lead] == n + 3 and p.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert torch.equal(p, t.narrow(lead, 0, n + 3))
    for kept in (6, 9):  # exactly the buffer's rows, and more than it holds
        whole = keep_prefix(x, lead, n, kept)
        assert all(w is t for w, t in zip(whole, x))


@pytest.mark.parametrize("S,room", [(1, "some"), (2, "some"), (4, "some"), (4, "none"), (2, "all")],
                         ids=["S1", "S2", "S4", "S4-no-room", "S2-all-fit"])
def test_kept_per_rank(S, room):
    """``kept_per_rank``: each rank keeps its Q rows then its K, V rows in one room, the rest cast again
    with per-rank first rows. Values and gradients against dense attention and bit for bit against
    keeping everything; every sub-stage's counters are the plan's; over the sub-stages each rank
    receives exactly its Q and K, V rows past what it kept (``split_kept_room`` of its own fills)."""
    from gpusolver.problem import split_kept_room

    P, seed = 4, 3
    mask = make_mask("docs-causal", P * 16, seed=seed)
    plan, config = tight_plan(mask, make_config(P, 4, 2, num_stages=S))
    comm = plan.comm
    fill_q, fill_kv = comm.qo_recv_rows.long(), comm.kv_recv_rows.long()
    q_fwd, kv_fwd = config.cost().q_fwd, config.cost().kv_fwd
    assert q_fwd % kv_fwd == 0  # so a room of a rank's fills' bytes is whole rows of each kind
    # some: the second-smallest rank's fills' bytes, so some ranks keep everything and some do not
    total = sorted((fill_q * q_fwd + fill_kv * kv_fwd).tolist())
    q_rows = {"some": total[1] // q_fwd, "none": 0, "all": int(fill_q.max())}[room]
    kv_rows = {"some": total[1] % q_fwd // kv_fwd, "none": 0, "all": int(fill_kv.max())}[room]
    cost = replace(config, kept_q_rows=q_rows, kept_kv_rows=kv_rows, kept_per_rank=True).cost()
    whole = replace(config, keep_forward_buffers=True).cost()
    kq, kk = split_kept_room(fill_q, fill_kv, q_rows * q_fwd + kv_rows * kv_fwd, q_fwd, kv_fwd)
    # a row count past its buffer's rows names the whole buffer: priced as the buffer's rows, as
    # plan.memory and the runtime size the room
    over = replace(config, kept_q_rows=comm.qo_recv_capacity + 7, kept_kv_rows=kv_rows, kept_per_rank=True).cost()
    at = replace(config, kept_q_rows=comm.qo_recv_capacity, kept_kv_rows=kv_rows, kept_per_rank=True).cost()
    assert torch.equal(plan.pair_bytes("bwd", over), plan.pair_bytes("bwd", at))
    stages = range(1, plan.num_stages + 1) if S > 1 else (None,)
    again_q = sum(plan.pair_bytes("bwd.qo", cost, stage=s) - plan.pair_bytes("bwd.qo", whole, stage=s)
                  for s in stages)
    again_kv = sum(plan.pair_bytes("bwd.kv", cost, stage=s) for s in stages)
    assert torch.equal(again_q.sum(0) // cost.q_fwd, fill_q - kq)
    assert torch.equal(again_kv.sum(0) // cost.kv_fwd, fill_kv - kk)
    tails = int(again_q.sum() + again_kv.sum())
    assert (tails == 0) == (room == "all")
    if room == "some":  # the split follows the fills: some rank keeps all, some casts a tail
        gone = (fill_q > kq) | (fill_kv > kk)
        assert bool(gone.any()) and not bool(gone.all())
    inputs = make_inputs(P * 16, 4, 2, seed=seed)
    _check_kept_layer(plan, mask, inputs, cost, stages, f"S={S} room={room} ", kept_q_rows=q_rows,
                      kept_kv_rows=kv_rows, kept_per_rank=True)


@pytest.mark.parametrize("lead", [0, 1], ids=["one-rank", "batched"])
def test_room_packs_each_ranks_rows_and_unpacks_them_in_place(lead):
    """``pack_room`` against a loop over ranks: rank r's room is its first ``kq`` Q rows (as ``g`` units
    each), then its first ``kk`` K rows and ``kk`` V rows, zero past them; ``unpack_room`` puts them back
    at their buffer rows, zero elsewhere, beside the local rows."""
    from gpusolver.runtime.kept_rows import KeptRoom, pack_room, unpack_room

    g_, n, cap_q, cap_k, hkv, Dh, units = 2, 3, 5, 9, 2, 4, 14
    P = 3
    gen = torch.Generator().manual_seed(0)
    kept_q = torch.tensor([0, 4, 5])                    # none, part, the whole QO buffer
    kept_kv = torch.tensor([7, 3, 2])                   # (units - kq * g) // 2 at most: 7, 3, 2
    room = KeptRoom(units, g_, kept_q, kept_kv)
    ranks = tuple(range(P)) if lead else (1,)
    B = len(ranks)
    xq = torch.randn(B, n + cap_q, hkv * g_, Dh, generator=gen)
    xk = torch.randn(B, n + cap_k, hkv, Dh, generator=gen)
    xv = torch.randn(B, n + cap_k, hkv, Dh, generator=gen)
    squeeze = (lambda t: t) if lead else (lambda t: t[0])
    pool = pack_room(squeeze(xq), squeeze(xk), squeeze(xv), room, ranks, n, lead)
    pool = pool if lead else pool[None]
    assert pool.shape == (B, units, hkv, Dh)
    for b, r in enumerate(ranks):
        kq, kk = int(kept_q[r]), int(kept_kv[r])
        want = torch.zeros(units, hkv, Dh)
        want[:kq * g_] = xq[b, n:n + kq].reshape(kq * g_, hkv, Dh)
        want[kq * g_:kq * g_ + kk] = xk[b, n:n + kk]
        want[kq * g_ + kk:kq * g_ + 2 * kk] = xv[b, n:n + kk]
        assert torch.equal(pool[b], want), r
    Xq, Xkv = unpack_room(squeeze(pool), squeeze(xq[:, :n]), squeeze(xk[:, :n]), squeeze(xv[:, :n]), room, ranks,
                          cap_q, cap_k, lead)
    for b, r in enumerate(ranks):
        kq, kk = int(kept_q[r]), int(kept_kv[r])
        for x, src, kept in ((Xq.x[0], xq, kq), (Xkv.x[0], xk, kk), (Xkv.x[1], xv, kk)):
            x = x if lead else x[None]
            want = torch.zeros_like(src[b])
            want[:n + kept] = src[b, :n + kept]
            assert torch.equal(x[b], want), r
