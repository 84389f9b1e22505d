"""The four buffer capacities, per-kind kept buffers and the memory budget (host-side rules)."""
from dataclasses import replace

import pytest

from gpusolver.capacity import (CLUSTER_CHUNKS, DEFAULT_CHUNKS, buffer_rows, keep_for_budget, kept_bytes,
                                plain_kept_bytes)
from gpusolver.config import AUTO_STAGES, SolverConfig
from gpusolver.problem import CommCost
from gpusolver.topology import Topology, h200_hgx


def test_buffer_rows_precedence():
    c, G = 100, 8
    assert buffer_rows(SolverConfig(cp_size=64), c).as_tuple() == (2 * G * c, 13 * G * c, 3 * G * c, 16 * G * c)
    assert buffer_rows(SolverConfig(cp_size=8), c).as_tuple() == (2 * G * c, 7 * G * c, 3 * G * c, 7 * G * c)
    cfg = SolverConfig(cp_size=64, max_recv_rows=500, max_qo_send_rows=7)
    assert buffer_rows(cfg, c).as_tuple() == (500, 500, 7, 500)


def _chunks(config, c):
    """A config's buffers in G * c (floats)."""
    return tuple(v / (config.head_groups * c) for v in buffer_rows(config, c).as_tuple())


def test_cluster_defaults_per_P():
    """Across nodes (slice masks, direct transport) the smaller buffers measured there
    (benchmarks/results/capacity_sweep.md); elsewhere the defaults of before, so the plans of one node
    (P <= 8, pinned digests), of no topology, of relays and of sparse selections do not change."""
    c = 8192
    small, mid, old = (1.5, 8, 2, 8), (1.5, 10, 2, 12), (2, 13, 3, 16)
    for P, want in ((16, small), (24, small), (32, small), (40, mid), (48, mid), (64, mid), (72, old)):
        assert _chunks(SolverConfig(cp_size=P, topology=h200_hgx), c) == want, P
    assert [(lo, hi) for lo, hi, _ in CLUSTER_CHUNKS] == [(16, 32), (33, 64)]
    assert _chunks(SolverConfig(cp_size=8, topology=h200_hgx), c) == (2, 7, 3, 7)  # one node: capped at P - 1
    assert _chunks(SolverConfig(cp_size=16), c) == (2, 13, 3, 15)  # no topology
    assert _chunks(SolverConfig(cp_size=64), c) == old
    assert _chunks(SolverConfig(cp_size=16, topology=h200_hgx, num_stages=1), c) == (2, 13, 3, 15)  # relays
    assert _chunks(SolverConfig(cp_size=16, topology=h200_hgx, ib_relay=True), c) == (2, 13, 3, 15)
    # direct at S = 1 too: the solve does not read S, so its buffers are those of S = 4
    assert _chunks(SolverConfig(cp_size=16, topology=h200_hgx, num_stages=1, ib_relay=False), c) == small
    from gpusolver.plan.sparse import SparseSolverConfig
    assert _chunks(SparseSolverConfig(cp_size=16, topology=h200_hgx), c) == (2, 13, 3, 15)
    assert DEFAULT_CHUNKS == dict(zip(("qo_recv", "kv_recv", "qo_send", "kv_send"), old))
    # explicit settings still win over the per-P defaults
    cfg = SolverConfig(cp_size=16, topology=h200_hgx, max_kv_recv_rows=5, max_qo_send_rows=0)
    assert buffer_rows(cfg, c).as_tuple() == (int(1.5 * 8 * c), 5, 0, 8 * 8 * c)
    assert buffer_rows(SolverConfig(cp_size=32, topology=h200_hgx, max_recv_rows=77), c).as_tuple() == (77,) * 4
    # 1.5 chunks of an odd G * c round up to a whole row: QO recv holds at least 1.5 G * c
    odd = SolverConfig(cp_size=16, topology=h200_hgx, num_heads_q=8, num_heads_kv=1)  # G = 1
    assert buffer_rows(odd, 63).qo_recv == 95


def test_cluster_defaults_reach_the_plan():
    """A slice-mask plan solved across nodes is built with the smaller buffers its solve kept it
    within (the runtime allocates ``plan.comm.buffers``); a sparse selection's keeps the old ones."""
    import torch

    from gpusolver.masks import dsa_topk_indices, packed_documents
    from gpusolver.masks.sparse import TokenTopKMask
    from gpusolver.plan.meta import BUFFER_OVERFLOW
    from gpusolver.solve import solve

    P, c = 16, 32
    kw = dict(cp_size=P, topology=h200_hgx, num_heads_q=8, num_heads_kv=2, head_dim=16, dtype=torch.float32)
    config = SolverConfig(**kw)
    plan = solve(packed_documents(P * c, seed=0, causal=True), config, impl="torch")
    assert plan.comm.buffers == buffer_rows(config, c) and _chunks(config, c) == (1.5, 8, 2, 8)
    assert not int(plan.status) & BUFFER_OVERFLOW
    sparse = solve(TokenTopKMask(dsa_topk_indices(P * c, 12, seed=0), P * c), config, impl="torch")
    assert tuple(sparse.comm.buffers.as_tuple()) == tuple(
        min(P - 1, k) * config.head_groups * c for k in (2, 13, 3, 16))


@pytest.mark.parametrize("field", ["max_recv_rows", "max_qo_recv_rows", "max_kv_recv_rows", "max_qo_send_rows",
                                   "max_kv_send_rows"])
def test_bad_rows_name_the_field(field):
    with pytest.raises(ValueError, match=field):
        SolverConfig(cp_size=4, **{field: -1})


def test_keep_values_and_budget_are_checked():
    with pytest.raises(ValueError, match="keep_forward_buffers"):
        SolverConfig(cp_size=4, keep_forward_buffers="q")
    with pytest.raises(ValueError, match="memory_budget"):
        SolverConfig(cp_size=4, memory_budget=0.5)


def test_per_kind_keep_prices_what_is_sent_again():
    both, none, q_only, kv_only = (CommCost(8, 2, 16, 2, 2, keep) for keep in (True, False, "qo", "kv"))
    assert q_only.q_bwd == both.q_bwd and q_only.kv_bwd == none.kv_bwd == none.kv_fwd
    assert kv_only.kv_bwd == both.kv_bwd == 0 and kv_only.q_bwd == none.q_bwd == both.q_bwd + both.q_fwd


def test_budget_keeps_the_most_that_fits():
    c = 8192
    base = SolverConfig(cp_size=8)  # 64:8, D = 128, bf16: a Q row is 4 K+V rows
    plain = plain_kept_bytes(base, c)
    assert plain == c * ((2 * 64 + 2 * 8) * 128 * 2 + 4 * 64)
    q, kv = kept_bytes(base, c, "qo"), kept_bytes(base, c, "kv")
    assert (q, kv) == (2 * 8 * c * 8 * 128 * 2, 7 * 8 * c * 2 * 128 * 2)  # QO 2 G*c rows, KV 7 G*c rows at P = 8
    eps = 1e-9  # a budget a hair above a boundary, past its float rounding
    q_row, kv_row = 8 * 128 * 2, 2 * 128 * 2  # Q and K+V bytes of one group-major row
    q_recv = 2 * 8 * c  # QO receive rows
    kv_recv = 7 * 8 * c  # KV receive rows
    # the whole kinds that fit first (the QO buffer is the larger at P = 8), then the first rows of
    # Q that fit, then of K and V (row granularity); once anything is kept a kind that does not fit
    # is kept in part, with no rows at all when no room is left. Both kinds kept, one in part: the
    # rows size one room each rank splits by its own fills (kept_per_rank), a whole kind at its
    # buffer's rows
    for budget, keep, q_rows, kv_rows, per_rank in (
            (1.0, False, None, None, False),
            (1 + 1000 * q_row / plain + eps, True, 1000, 0, True),
            (1 + (kv - 1) / plain, True, (kv - 1) // q_row, (kv - 1) % q_row // kv_row, True),
            (1 + kv / plain + eps, True, 0, kv_recv, True),               # K, V whole; no room for a Q row
            (1 + (q - 1) / plain, True, (q - 1 - kv) // q_row, kv_recv, True),  # K, V whole, the first Q rows
            (1 + q / plain + eps, True, q_recv, 0, True),                 # Q whole
            (1 + (q + 10 * kv_row) / plain + eps, True, q_recv, 10, True),
            (1 + (q + kv) / plain + eps, True, None, None, False)):
        resolved = keep_for_budget(SolverConfig(cp_size=8, memory_budget=budget), c)
        assert resolved.keep_forward_buffers == keep and resolved.memory_budget is None, budget
        assert (resolved.kept_q_rows, resolved.kept_kv_rows) == (q_rows, kv_rows), budget
        assert resolved.kept_per_rank == per_rank, budget
        assert kept_bytes(resolved, c, keep, kv_rows, q_rows) <= (budget - 1) * plain
    # the budget chooses only among what keep_forward_buffers allows
    assert keep_for_budget(SolverConfig(cp_size=8, keep_forward_buffers="qo", memory_budget=100.0), c) \
        .keep_forward_buffers == "qo"
    only_kv = keep_for_budget(SolverConfig(cp_size=8, keep_forward_buffers="kv"), c)
    assert only_kv.keep_forward_buffers == "kv" and only_kv.kept_q_rows is None and 0 < only_kv.kept_kv_rows
    unbounded = SolverConfig(cp_size=8, memory_budget=None)
    assert keep_for_budget(unbounded, c) is unbounded
    # the default budget, 1.5: the first Q rows that fit (the whole buffer is past it), K and V cast again
    assert base.memory_budget == 1.5
    default = keep_for_budget(base, c)
    assert default.keep_forward_buffers is True and 0 < default.kept_q_rows < q_recv and default.kept_kv_rows == 0
    assert 0.5 * plain - q_row < kept_bytes(default, c, True, 0, default.kept_q_rows) <= 0.5 * plain
    # rows the caller chose are theirs, and the budget is dropped
    for field in ("kept_kv_rows", "kept_q_rows"):
        chosen = keep_for_budget(SolverConfig(cp_size=8, **{field: 7}), c)
        assert getattr(chosen, field) == 7 and chosen.memory_budget is None, field


def test_budget_keeps_rows_at_any_stage_count():
    """A budget short of the whole buffers keeps their first rows with S sub-stages too: the same rows
    as at S = 1 (the casts share the buffers), and the stage count the config asked for ("auto": 4)."""
    c = 8192
    one = SolverConfig(cp_size=8, num_stages=1)
    plain, q_row = plain_kept_bytes(one, c), 8 * 128 * 2
    budget = 1 + 1000 * q_row / plain + 1e-9
    want = keep_for_budget(replace(one, memory_budget=budget), c)
    assert (want.keep_forward_buffers, want.kept_q_rows, want.kept_kv_rows, want.num_stages) == (True, 1000, 0, 1)
    for stages, S in ((2, 2), (4, 4), ("auto", AUTO_STAGES)):
        resolved = keep_for_budget(SolverConfig(cp_size=8, num_stages=stages, memory_budget=budget), c)
        assert (resolved.keep_forward_buffers, resolved.kept_q_rows, resolved.kept_kv_rows) == (True, 1000, 0), stages
        assert resolved.num_stages == S and resolved.auto_stages == (stages == "auto"), stages
        assert kept_bytes(resolved, c, True, 0, 1000) == kept_bytes(want, c, True, 0, 1000)


def test_relay_keeps_whole_kinds_only():
    """Relay transport has no tail casts: its budget keeps whole kinds, nothing in part."""
    c = 8192
    base = SolverConfig(cp_size=8)
    plain, q_row = plain_kept_bytes(base, c), 8 * 128 * 2
    topo = Topology(ranks_per_node=4, nvlink_gbps=1.0, ib_gbps=0.5, attn_tflops=1.0)
    relay = SolverConfig(cp_size=8, topology=topo, ib_relay=True, memory_budget=1 + 1000 * q_row / plain)
    resolved = keep_for_budget(relay, c)
    assert resolved.keep_forward_buffers is False
    assert (resolved.kept_q_rows, resolved.kept_kv_rows) == (None, None)


def test_sub_stages_share_the_kept_buffers():
    """The S remote sub-stages cast into one receive buffer per kind: the kept bytes of one stage."""
    c = 256
    one, three = SolverConfig(cp_size=8, num_stages=1), SolverConfig(cp_size=8, num_stages=3)
    for keep in (True, "qo", "kv", False):
        assert kept_bytes(three, c, keep) == kept_bytes(one, c, keep), keep
    assert kept_bytes(three, c, "qo") > 0
    assert kept_bytes(three, c, "qo") > 0


def test_kept_kv_rows_prices_and_checks():
    part = CommCost(8, 2, 16, 2, 2, True, kept_kv_rows=5)
    assert part.kv_bwd == 0 and part.q_bwd == CommCost(8, 2, 16, 2, 2, True).q_bwd
    part_q = CommCost(8, 2, 16, 2, 2, True, kept_q_rows=5)  # priced as kept: the tail is the plan's count
    assert part_q.q_bwd == CommCost(8, 2, 16, 2, 2, True).q_bwd and part_q.kv_bwd == 0
    assert SolverConfig(cp_size=4, kept_q_rows=3).cost().kept_q_rows == 3
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="kept_q_rows"):
            SolverConfig(cp_size=4, kept_q_rows=bad)
        with pytest.raises(ValueError, match="kept_q_rows"):
            CommCost(8, 2, 16, 2, 2, True, kept_q_rows=bad)
    assert SolverConfig(cp_size=4, kept_kv_rows=7).cost().kept_kv_rows == 7
    with pytest.raises(ValueError, match="kept_kv_rows"):
        SolverConfig(cp_size=4, kept_kv_rows=-1)
    # the sub-stages share the one KV buffer whose first rows are kept: any S takes them
    assert SolverConfig(cp_size=4, kept_kv_rows=8, num_stages=2).num_stages == 2
    with pytest.raises(ValueError, match="kept_kv_rows"):
        CommCost(8, 2, 16, 2, 2, True, kept_kv_rows=1.5)
