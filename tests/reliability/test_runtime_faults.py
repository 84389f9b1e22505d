"""Faults in the runtime: a stalled rank, ranks holding different masks or configs, a rank with no work."""
import re
import time
from datetime import timedelta

import pytest
import torch

from gpusolver import SolverConfig, block_areas, errors
from gpusolver.masks import causal_mask, full_mask
from gpusolver.metrics import owner_computes_assignment
from gpusolver.plan import IMBALANCED, build_plan
from gpusolver.runtime import dist_attn, shard, unshard
from gpusolver.runtime.dist_attn import check_plan_digest, config_digest, plan_digest
from groupcomm import CollectiveError, LocalGroup, TorchGroup
from tests._dist import run_ranks
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import make_config, make_inputs, reference, tight_plan
from tests.reliability._cases import clean_flags, quiet, slices

PG_TIMEOUT = timedelta(seconds=6)


def _stall(rank, P, where):
    """The last rank stalls (alive, but late) before the forward or before the backward."""
    S, Hq, Hkv = P * 16, 2, 2
    # every rank needs every rank's K and V. One remote stage: the first remote wait is on the stalled
    # rank, so the error comes at the group's timeout. With sub-stages (the default) a rank first
    # computes the sub-stages its other peers feed, and which collective then times out (and when)
    # depends on the stage layout; test_dist_gloo's failed rank covers the default's error
    plan, _ = tight_plan(full_mask(S), make_config(P, Hq, Hkv, num_stages=1))
    group = TorchGroup(timeout=timedelta(seconds=2))
    q, k, v, d_out, _ = (shard(x, group).clone() for x in make_inputs(S, Hq, Hkv))
    q.requires_grad_()
    stalls = rank == P - 1
    if stalls and where == "forward":
        time.sleep(4)
        return "stalled"
    t0 = time.monotonic()
    try:
        out, _ = dist_attn(q, k, v, plan, group)
        if stalls:
            time.sleep(4)
            return "stalled"
        t0 = time.monotonic()
        out.backward(d_out)
    except CollectiveError as e:
        return "CollectiveError", str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


# point to point (the default transport) a wait fails at the first collective in which the stalled rank
# sends to this one: in the backward that may be a reduce (dQ, dK, dV) rather than the dO cast
@pytest.mark.parametrize("where,phase", [("forward", r"fwd\.(qo|kv)"), ("backward", r"bwd\.(qo|kv|dq|dkv)")])
def test_stalled_rank_times_out_naming_the_phase(where, phase):
    t0 = time.monotonic()
    got = run_ranks(_stall, 3, where, timeout=40, pg_timeout=PG_TIMEOUT, return_exceptions=True)
    assert time.monotonic() - t0 < 30
    assert got[2] == "stalled"
    for rank in (0, 1):
        kind, msg, elapsed = got[rank]
        assert kind == "CollectiveError", got[rank]
        assert f"rank {rank}" in msg and re.search(phase + " point-to-point exchange", msg), msg  # the default
        assert elapsed < 6, elapsed              # the group's 2 s timeout: the peer never joins


def _mismatch(rank, P, what, validate):
    """Rank 1 passes another mask (or another config); every rank runs the digest check."""
    S, Hq, Hkv = P * 16, 2, 2
    config = make_config(P, Hq, Hkv)
    mask = causal_mask(S)
    if rank == 1 and what == "mask":
        mask = full_mask(S)
    if rank == 1 and what == "config":
        config = make_config(P, Hq, Hkv, imbalance_tol=1.5)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv))
    group = TorchGroup(timeout=timedelta(seconds=5))
    key = config_digest(config)
    with clean_flags():
        try:
            if validate:
                q, k, v, _, _ = (shard(x, group).clone() for x in make_inputs(S, Hq, Hkv))
                dist_attn(q, k, v, plan, group, debug_digest=True, config_key=key)
                return "no error", int(plan_digest(plan))
            check_plan_digest(plan, group, key, validate=False)     # sync-free: a flag, no raise
        except ValueError as e:
            return "ValueError", str(e)
        try:
            errors.check_errors()
        except ValueError as e:
            return "flag", str(e)
    return "no flag", int(plan_digest(plan))


@pytest.mark.parametrize("what", ["mask", "config", "same"])
@pytest.mark.parametrize("validate", [True, False], ids=["validate", "sync-free"])
def test_ranks_with_different_masks_or_configs(what, validate):
    got = run_ranks(_mismatch, 2, what, validate, timeout=60, pg_timeout=PG_TIMEOUT)
    if what == "same":
        assert got[0][0] == got[1][0] == ("no error" if validate else "no flag")
        assert got[0][1] == got[1][1]             # the digest is the same in two processes
        return
    kind = "ValueError" if validate else "flag"
    word = "plan" if what == "mask" else "configuration"
    for rank, (k, msg) in enumerate(got):
        assert k == kind, got[rank]
        assert f"rank {1 - rank}'s {word} digest differs from rank {rank}'s" in msg, msg


def test_digest_is_a_no_op_on_a_local_group():
    P = 2
    config = make_config(P, 2, 2)
    plan, _ = tight_plan(causal_mask(32), config)
    with clean_flags():
        check_plan_digest(plan, LocalGroup(P), config_digest(config), validate=False)
        assert errors.pending() == []


def test_rank_with_no_work():
    """Rank 3 computes nothing and no query attends its keys: out 0, lse -inf, zero grads, no NaN."""
    P, c, Hq, Hkv = 4, 16, 4, 2
    S = P * c
    mask = slices([(0, 3 * c, 0, 3 * c, 1), (0, 0, 0, 0, 0)], S)
    config = make_config(P, Hq, Hkv)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    with quiet():
        plan = build_plan(mask, areas, owner_computes_assignment(areas), config).validate(ignore=IMBALANCED)
    assert int(plan.metrics.load[3]) == 0
    group = LocalGroup(P)
    inputs = make_inputs(S, Hq, Hkv)
    q, k, v = (shard(x, group).requires_grad_() for x in inputs[:3])
    out, lse = dist_attn(q, k, v, plan, group)
    torch.autograd.backward((out, lse), (shard(inputs[3], group), shard(inputs[4], group)))
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert not torch.isnan(t).any(), name
        assert torch.equal(t[3], torch.zeros_like(t[3])), f"{name} of the idle rank"
    assert torch.isneginf(lse[3]).all()
    ref = reference(mask, *inputs)
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad)):
        assert_close(name, ref[name], unshard(got.detach(), group), atol=1e-5, rtol=1e-5)
