"""dist_attn on forked gloo ranks (TorchGroup) against dense attention on the whole sequence.

Each rank rebuilds the same seeded mask and inputs, solves the mask itself,
runs its shard and returns it; the parent compares after the ranks are done
(it forks before any heavy torch work of its own).
"""
import re
import time
from datetime import timedelta

import pytest
import torch

from gpusolver.masks import full_mask
from gpusolver.runtime import dist_attn, shard
from groupcomm import CollectiveError, TorchGroup
from tests._dist import run_ranks
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import (ATOL, PHASES_BWD, PHASES_FWD, RTOL, make_config, make_inputs, make_mask,
                                            reference, tight_plan, traffic_sums)

KEYS = ("out", "lse", "dq", "dk", "dv")


def _rank_case(rank, P, name, c, Hq, Hkv, flatten, tiles, keep, solver, seed):
    S = P * c
    mask = make_mask(name, S, seed)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, flatten, tiles, keep_forward_buffers=keep), solver)
    group = TorchGroup()
    q, k, v, d_out, d_lse = make_inputs(S, Hq, Hkv, seed)
    qs, ks, vs = (shard(x, group).clone().requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group, keep_forward_buffers=keep)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    m = plan.metrics
    return {
        "got": dict(zip(KEYS, (out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad))),
        "bytes": tuple(traffic_sums(group, phases, plan.num_stages) for phases in (PHASES_FWD, PHASES_BWD)),
        "metrics": ((int(m.fwd_send[rank]), int(m.fwd_recv[rank])), (int(m.bwd_send[rank]), int(m.bwd_recv[rank]))),
        "assignment": plan.assignment,
        "moved": (int(plan.comm.qo_split.sum()), int(plan.comm.kv_split.sum())),
    }


# (mask, P, c, Hq, Hkv, flatten, tiles, keep_forward_buffers, solver, seed); seeds where the plan moves Q rows
CASES = [
    ("random", 2, 32, 4, 2, True, 2, True, "reference", 2),
    ("docs-causal", 4, 16, 2, 2, False, 1, False, "reference", 0),
    ("window", 4, 16, 4, 2, True, 2, True, "device", 0),
    ("docs-full", 8, 16, 4, 1, True, 1, True, "reference", 8),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-P{P}-c{c}-Hq{hq}-Hkv{hkv}-{'flat' if f else 'G1'}-n{n}-"
                                             f"{'keep' if keep else 'recast'}-{s}"
                                             for m, P, c, hq, hkv, f, n, keep, s, _ in CASES])
def test_ranks_equal_reference(case):
    name, P, c, Hq, Hkv, seed = *case[:5], case[-1]
    results = run_ranks(_rank_case, P, name, *case[2:], timeout=120)
    S = P * c
    ref = reference(make_mask(name, S, seed), *make_inputs(S, Hq, Hkv, seed))
    assert results[0]["moved"][0] > 0 and results[0]["moved"][1] > 0  # Q rows and K/V rows travel
    for rank, res in enumerate(results):
        assert torch.equal(res["assignment"], results[0]["assignment"]), f"rank {rank} solved another plan"
        rows = slice(rank * c, (rank + 1) * c)
        for key in KEYS:
            assert_close(f"rank {rank} {key}", ref[key][rows], res["got"][key], atol=ATOL, rtol=RTOL)
        assert res["bytes"] == res["metrics"], f"rank {rank}: counted {res['bytes']}, plan {res['metrics']}"


def _rank_fails(rank, P):
    S, c, Hq, Hkv = 3 * 16, 16, 2, 2
    plan, _ = tight_plan(full_mask(S), make_config(P, Hq, Hkv))  # every rank needs every rank's K and V
    if rank == P - 1:
        raise RuntimeError("injected failure before dist_attn")
    group = TorchGroup(timeout=timedelta(seconds=2))
    q, k, v, _, _ = (shard(x, group).clone() for x in make_inputs(S, Hq, Hkv))
    t0 = time.monotonic()
    try:
        dist_attn(q, k, v, plan, group)
    except CollectiveError as e:
        return "CollectiveError", str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def test_failed_rank_raises_collective_error():
    t0 = time.monotonic()
    got = run_ranks(_rank_fails, 3, timeout=40, pg_timeout=timedelta(seconds=5), return_exceptions=True)
    assert time.monotonic() - t0 < 30
    assert isinstance(got[2], RuntimeError) and "injected" in str(got[2])
    for rank in (0, 1):
        kind, msg, elapsed = got[rank]
        assert kind == "CollectiveError", got[rank]
        # the phase, of a sub-stage's collective (fwd.kv.1) with the default S = 4, and the transport
        assert f"rank {rank}" in msg and re.search(r"fwd\.(qo|kv|o)\.\d point-to-point exchange", msg), msg
        assert elapsed < 10, elapsed
