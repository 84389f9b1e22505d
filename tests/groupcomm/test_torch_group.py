"""TorchGroup on forked gloo ranks equals LocalGroup on the same global inputs; faults raise CollectiveError."""
import time
from datetime import timedelta

import pytest
import torch

from groupcomm import (CollectiveError, HostSplits, LocalGroup, TorchGroup, group_cast, group_reduce, host_splits,
                       neutral_rows)
from tests._dist import run_ranks
from tests._testing import assert_close
from tests.groupcomm._cases import random_routing

PHASES = ("fwd", "fwd_async", "sum", "sum_nd", "lse", "lse_neutral")


def _inputs(P, seed):
    """Global inputs with a leading rank dim: rows, sum partials/acc, lse partials/acc."""
    r = random_routing(P, 5, seed)
    g = torch.Generator().manual_seed(seed)
    cap, N = r.recv_capacity, r.N
    rows = [torch.randn(P, N, 2, 3, generator=g).bfloat16(), torch.randn(P, N, 2, generator=g)]
    sums = ([torch.randn(P, cap, 3, generator=g).bfloat16()], [torch.randn(P, N, 3, generator=g)])
    lse_p = torch.randn(P, cap, 2, generator=g) * 30
    lse_p[:, ::3] = float("-inf")
    lse_a = torch.randn(P, N, 2, generator=g) * 30
    lse_a[:, 0] = float("-inf")
    lses = ([torch.randn(P, cap, 2, 4, generator=g), lse_p], [torch.randn(P, N, 2, 4, generator=g), lse_a])
    return r, rows, sums, lses


def _run(group, rank, r, rows, sums, lses):
    """The same sequence of calls on a real rank (rank given) or on LocalGroup (rank None)."""
    pick = (lambda t: t) if rank is None else (lambda t: t[rank])
    idx = pick(r.send_index)
    hs = None if rank is None else host_splits(r.split)   # one copy for every call below
    kw = dict(host_split=hs)
    out = {"fwd": group_cast([pick(t) for t in rows], idx, r.split, r.recv_capacity, group, phase="fwd", **kw)}
    work = group_cast([pick(rows[1])], idx, r.split, r.recv_capacity, group, phase="fwd_async", async_op=True,
                      **kw)
    out["fwd_async"] = work.wait()
    parts, acc = ([pick(t) for t in x] for x in sums)
    out["sum"] = group_reduce(parts, idx, r.split, acc, group, op="sum", phase="sum", **kw)
    out["sum_nd"] = group_reduce(parts, idx, r.split, acc, group, op="sum", phase="sum_nd", deterministic=False,
                                 async_op=True, **kw).wait()
    parts, acc = ([pick(t) for t in x] for x in lses)
    out["lse"] = group_reduce(parts, idx, r.split, acc, group, op="lse", phase="lse", **kw)
    # the identity accumulator as a broadcast view: held by the reduce in flight, made whole on wait()
    neutral = [neutral_rows(acc[0]), neutral_rows(acc[1], float("-inf"))]
    out["lse_neutral"] = group_reduce(parts, idx, r.split, neutral, group, op="lse", phase="lse_neutral",
                                      async_op=True, **kw).wait()
    out["traffic"] = {ph: group.traffic(ph) for ph in PHASES}
    return out


def _rank_fn(rank, P, seed):
    return _run(TorchGroup(), rank, *_inputs(P, seed))


@pytest.mark.parametrize("P,seed", [(2, 0), (4, 1)], ids=["P2", "P4"])
def test_torch_group_equals_local_group(P, seed):
    got = run_ranks(_rank_fn, P, seed, timeout=60)
    ref = _run(LocalGroup(P), None, *_inputs(P, seed))
    r, _, _, (parts, acc) = _inputs(P, seed)
    ident = [torch.zeros_like(acc[0]), torch.full_like(acc[1], float("-inf"))]
    want = group_reduce(parts, r.send_index, r.split, ident, LocalGroup(P), op="lse")
    assert all(torch.equal(a, b) for a, b in zip(want, ref["lse_neutral"]))
    for rank, res in enumerate(got):
        for key in ("fwd", "fwd_async", "sum", "lse", "lse_neutral"):
            for i, (a, b) in enumerate(zip(ref[key], res[key])):
                assert a.dtype == b.dtype, (rank, key, i)
                assert torch.equal(a[rank], b), f"rank {rank} {key}[{i}]"
        assert_close(f"rank {rank} sum_nd", ref["sum_nd"][0][rank].float(), res["sum_nd"][0].float(),
                     atol=1e-2, rtol=1e-2)
        for ph in PHASES:
            sent, recv = ref["traffic"][ph]
            assert res["traffic"][ph] == (int(sent[rank]), int(recv[rank])), (rank, ph)


def _faulty(rank, P, mode):
    group = TorchGroup(timeout=timedelta(seconds=2))
    x = torch.zeros(4, 2)
    split = torch.ones(P, P, dtype=torch.int64) - torch.eye(P, dtype=torch.int64)
    send_index = torch.arange(P - 1)
    if rank == P - 1:
        if mode == "raise":
            raise RuntimeError("injected failure before the collective")
        time.sleep(3)                     # alive but never joins: the others must time out
        return "stalled"
    t0 = time.monotonic()
    try:
        group_cast([x], send_index, split, P, group, phase="fault_phase")
    except CollectiveError as e:
        return ("CollectiveError", str(e), time.monotonic() - t0)
    return ("no error", "", time.monotonic() - t0)


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_failed_peer_raises_collective_error(mode):
    t0 = time.monotonic()
    got = run_ranks(_faulty, 3, mode, timeout=30, return_exceptions=True)
    assert time.monotonic() - t0 < 20
    for rank in (0, 1):
        kind, msg, elapsed = got[rank]
        assert kind == "CollectiveError", got[rank]
        assert "fault_phase" in msg and f"rank {rank}" in msg, msg
        assert elapsed < 3.0, elapsed                    # the 2 s timeout, not the peer waking up
    if mode == "raise":
        assert isinstance(got[2], RuntimeError) and "injected" in str(got[2])
    else:
        assert got[2] == "stalled"


def _child_error(rank, P):
    if rank == 1:
        raise ValueError("bad input on rank 1")
    return rank


def test_run_ranks_reraises_child_error_with_rank():
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_ranks(_child_error, 2, timeout=30)


def test_host_splits_on_cpu():
    split = torch.tensor([[0, 2], [1, 0]])
    hs = host_splits(split)
    assert isinstance(hs, HostSplits) and hs.get() == [[0, 2], [1, 0]]
    split[0, 1] = 7                                  # the copy was taken at creation
    assert hs.get() == [[0, 2], [1, 0]]
    with pytest.raises(ValueError, match="split must be"):
        host_splits(torch.zeros(2, 3, dtype=torch.int64))


def test_torch_group_needs_initialized_distributed():
    with pytest.raises(ValueError, match="not initialized"):
        TorchGroup()


def _pick_default(rank, P):
    import logging

    from groupcomm import default_group
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("groupcomm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    group = default_group()
    return type(group).__name__, [r.getMessage() for r in records]


def test_default_group_on_cpu_is_torch_group():
    for name, messages in run_ranks(_pick_default, 2, timeout=30):
        assert name == "TorchGroup"
        assert len(messages) == 1 and "TorchGroup" in messages[0], messages


def _rank_return_rows(rank, P, seed):
    r, _, sums, _ = _inputs(P, seed)
    group = TorchGroup()
    sizes = []
    exchange = group._exchange

    def spy(out, inp, out_sizes, in_sizes, phase):
        sizes.append(out.shape[0])
        return exchange(out, inp, out_sizes, in_sizes, phase)
    group._exchange = spy
    parts, acc = ([t[rank] for t in x] for x in sums)
    got = group_reduce(parts, r.send_index[rank], r.split, acc, group, op="sum", async_op=True).wait()
    return sizes, got


def test_reduce_returns_into_the_rows_it_returns():
    """The way back lands in a buffer of the rows this rank really sent (host-known), not of the send
    list's capacity, so reduces in flight together hold one send list at most; results unchanged."""
    P, seed = 3, 2
    got = run_ranks(_rank_return_rows, P, seed, timeout=60)
    r, _, sums, _ = _inputs(P, seed)
    ref = group_reduce(sums[0], r.send_index, r.split, sums[1], LocalGroup(P), op="sum")
    for rank, (sizes, res) in enumerate(got):
        assert sizes == [int(r.split[rank].sum())] and sizes[0] < r.send_index.shape[1], (rank, sizes)
        assert torch.equal(ref[0][rank], res[0]), rank
