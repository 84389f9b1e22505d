"""The runtime's schedule as data: the op lists, and the bytes they say equal what LocalGroup moves."""
import pytest
import torch

from gpusolver.config import AUTO_STAGES
from gpusolver.plan.schedule import (ATTN, CAST, COMM, COMPUTE, PHASES, REDUCE, WAIT, backward_ops, forward_ops,
                                     stage_area)
from gpusolver.runtime import dist_attn, shard
from gpusolver.runtime.pipelined import counter_phases, stage_phase
from groupcomm import LocalGroup
from tests.gpusolver.runtime._cases import PHASES_BWD, PHASES_FWD, make_config, make_inputs, make_mask, tight_plan


def _check_well_formed(ops):
    names = [op.name for op in ops]
    assert len(set(names)) == len(names)
    for i, op in enumerate(ops):
        assert all(d in names[:i] for d in op.deps), op  # deps name earlier ops only
        assert op.stream == (COMM if op.collective else COMPUTE)
        if op.kind == WAIT:
            (dep,) = op.deps
            assert ops[names.index(dep)].phase == op.phase and ops[names.index(dep)].collective


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_lists_are_well_formed(stages):
    for ops in (forward_ops(stages), forward_ops(stages, 2), backward_ops(stages, True), backward_ops(stages, False)):
        _check_well_formed(ops)
        order = [op.stages for op in ops if op.kind == ATTN]
        if stages > 2 and ops[0].phase.startswith("bwd"):  # sub-stages' backward: the local stage last
            assert order == [(s,) for s in range(1, stages)] + [(0,)]
        else:
            assert order == [(s,) for s in range(stages)]
    fwd = forward_ops(2)
    # both casts are issued before stage 0, which does not wait for them; stage 1 waits for both
    assert [op.name for op in fwd[:3]] == ["fwd.cast.qo", "fwd.cast.kv", "fwd.attn.0"] and fwd[2].deps == ()
    assert set(next(op for op in fwd if op.name == "fwd.attn.1").deps) == {"fwd.wait.qo", "fwd.wait.kv"}
    bwd = backward_ops(2, True)
    # the runtime waits for the dO cast before its stage 0 (what the simulator must price)
    order = [op.name for op in bwd]
    assert order.index("bwd.wait.qo") < order.index("bwd.attn.0")
    assert {op.phase for op in backward_ops(2, False) if op.collective} == set(PHASES_BWD)
    assert {op.phase for op in fwd if op.collective} == set(PHASES_FWD)
    assert {op.phase for op in bwd if op.collective} == set(PHASES_BWD) - {"bwd.kv"}


def test_sub_stage_backward_hides_its_returns_under_the_local_stage():
    """S = 3: every dQ / dK, dV reduce is issued before the local stage runs, and reduce s right
    after sub-stage s; the forward runs the local stage first, before any wait."""
    bwd = [op.name for op in backward_ops(4, True)]
    local = bwd.index("bwd.attn.0")
    for s in (1, 2, 3):
        for ph in ("dq", "dkv"):
            assert bwd.index(f"bwd.attn.{s}") < bwd.index(f"bwd.reduce.{ph}.{s}") < local
    assert all(bwd.index(f"bwd.wait.{ph}.{s}") > local for s in (1, 2, 3) for ph in ("dq", "dkv"))
    fwd = forward_ops(4)
    first_wait = next(i for i, op in enumerate(fwd) if op.kind == WAIT)
    assert [op.name for op in fwd].index("fwd.attn.0") < first_wait


def test_sub_stage_forward_reduces_every_branch():
    """An NSA layer's two output branches with S = 3: each sub-stage reduces both branches right after
    its attention, and the merge waits for all 2 S reduces."""
    fwd = forward_ops(4, 2)
    names = [op.name for op in fwd]
    reduces = [op for op in fwd if op.kind == REDUCE]
    assert sorted((op.stages, op.branch) for op in reduces) == [((s,), b) for s in (1, 2, 3) for b in (0, 1)]
    for op in reduces:
        (s,) = op.stages
        assert op.deps == (f"fwd.attn.{s}",) and names.index(op.name) < names.index(f"fwd.attn.{s + 1}"
                                                                                   if s < 3 else "fwd.merge")
    merge = fwd[-1]
    assert merge.kind == "merge" and len(merge.deps) == 6
    assert {names.index(d) for d in merge.deps} == {names.index(f"fwd.wait.o.{s}.{b}") for s in (1, 2, 3)
                                                    for b in (0, 1)}


def test_bad_stage_count():
    with pytest.raises(ValueError, match="num_stages"):
        forward_ops(0)
    with pytest.raises(ValueError, match="branches"):
        forward_ops(2, 0)


@pytest.mark.parametrize("keep", [True, False])
def test_pair_bytes_equal_local_group_counts(keep):
    P, c, Hq, Hkv = 4, 16, 4, 2
    mask = make_mask("docs-causal", P * c, seed=3)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, keep_forward_buffers=keep))
    group = LocalGroup(P)
    q, k, v, d_out, d_lse = make_inputs(P * c, Hq, Hkv)
    qs, ks, vs = (shard(x, group).requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group, keep_forward_buffers=keep)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    S = plan.num_stages
    assert S == AUTO_STAGES + 1  # the default (and its local tail): the group counts each collective per sub-stage
    moved = 0
    for phase in PHASES:
        want = sum(group.pair_traffic(ph) for ph in counter_phases((phase,), S))
        got = plan.pair_bytes(phase)
        assert got.dtype == torch.int64 and got.shape == (P, P)
        assert torch.equal(got, want), phase
        for s in range(1, S + 1):  # and each sub-stage's collective on its own
            assert torch.equal(plan.pair_bytes(phase, stage=s), group.pair_traffic(stage_phase(phase, s))), (phase, s)
        moved += int(want.sum())
    assert moved > 0
    m = plan.metrics
    for pas, send, recv in (("fwd", m.fwd_send, m.fwd_recv), ("bwd", m.bwd_send, m.bwd_recv)):
        pb = plan.pair_bytes(pas)
        assert torch.equal(pb, sum(group.pair_traffic(ph) for ph in counter_phases(PHASES, S) if ph.startswith(pas)))
        assert torch.equal(pb.sum(1), send) and torch.equal(pb.sum(0), recv)
    with pytest.raises(ValueError, match="phase"):
        plan.pair_bytes("fwd.x")


def test_task_stage_and_stage_area():
    P, c = 4, 16
    mask = make_mask("docs-full", P * c, seed=1)
    plan, _ = tight_plan(mask, make_config(P, 4, 2))
    st = plan.task_stage
    S = plan.num_stages
    assert st.dtype == torch.int32 and st.shape == plan.assignment.shape and S == AUTO_STAGES + 1  # + the tail
    a, area = plan.assignment.long(), plan.area
    host = torch.arange(P)
    for g, i, j in torch.cartesian_prod(*(torch.arange(n) for n in st.shape)).tolist():
        if area[g, i, j] == 0:
            assert st[g, i, j] == -1
        elif a[g, i, j] == host[i] == host[j]:  # a local task: stage 0 or the local tail
            assert st[g, i, j] in (0, S)
        else:  # a remote task: one of the remote sub-stages
            assert 1 <= st[g, i, j] < S
    sa = stage_area(plan)  # [P, 2]: local, and every remote sub-stage together
    full = stage_area(plan, S + 1)
    assert torch.equal(sa.sum(1), plan.metrics.load) and torch.equal(full.sum(1), plan.metrics.load)
    assert torch.equal(sa[:, 0], full[:, 0]) and torch.equal(sa[:, 1], full[:, 1:].sum(1))
    assert torch.equal(sa[:, 0] + full[:, S], torch.stack([area[:, r, r][a[:, r, r] == r].sum() for r in range(P)]))
    assert int(full[:, S].sum()) > 0  # the local tail has work
