"""``TorchGroup(transport="p2p")``: a call's ``wait()`` waits for this rank's receives only.

Rank 0 moves rows to rank 1 and receives none; rank 1 reaches the call only after a pause.
Rank 0's ``wait()`` must return before rank 1 has posted its receive (its send is kept in
flight), ``wait_sends()`` then waits for it, and rank 1 must get the rows rank 0 had when it
called, even after rank 0 overwrote its own tensors. ``a2a`` (one exchange) keeps nothing.
"""
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch

from groupcomm import LocalGroup, TorchGroup, group_cast, group_reduce
from tests._dist import run_ranks

N, PAUSE = 4, 1.0


def _routing(src: int, dst: int, P: int = 2):
    """``src`` sends its N rows to ``dst``, nobody else moves a row."""
    split = torch.zeros(P, P, dtype=torch.int64)
    split[src, dst] = N
    index = [torch.arange(N) if r == src else torch.full((N,), -1, dtype=torch.int64) for r in range(P)]
    return split, index


def _values(seed: int) -> torch.Tensor:
    return torch.randn(N, 3, generator=torch.Generator().manual_seed(seed))


def _rank(rank, P, transport):
    group = TorchGroup(timeout=timedelta(seconds=20), transport=transport)
    x = _values(0)
    out = {}
    # the cast: rank 0 -> rank 1
    split, index = _routing(0, 1)
    if rank == 1:
        time.sleep(PAUSE)
    w = group_cast([x.clone() if rank else x], index[rank], split, N, group, phase="c", async_op=True)
    t0 = time.monotonic()
    got = w.wait()[0]
    out["cast_wait_s"] = time.monotonic() - t0
    out["kept_after_cast"] = group.sends_in_flight()
    out["cast"] = got
    # the reduce: rank 1 cast its rows to rank 0 earlier, rank 0 returns partials (one tensor: packed as a view)
    split, index = _routing(1, 0)
    partials = _values(1) if rank == 0 else torch.zeros(N, 3)
    acc = torch.zeros(N, 3)
    if rank == 1:
        time.sleep(PAUSE)
    w = group_reduce([partials], index[rank], split, [acc], group, op="sum", phase="r", async_op=True)
    t0 = time.monotonic()
    res = w.wait()[0]
    out["reduce_wait_s"] = time.monotonic() - t0
    if rank == 0:
        partials.fill_(float("nan"))   # the caller may reuse its tensors once wait() returns
        x.fill_(float("nan"))
    out["kept_after_reduce"] = group.sends_in_flight()
    group.wait_sends()
    out["kept_at_end"] = group.sends_in_flight()
    out["reduce"] = res
    out["traffic"] = (group.traffic("c"), group.traffic("r"))
    return out


@pytest.mark.parametrize("transport", ["p2p", "a2a"])
def test_p2p_wait_is_receive_only(transport):
    r0, r1 = run_ranks(_rank, 2, transport, timeout=60)
    assert torch.equal(r1["cast"][:N], _values(0))            # the rows rank 0 had when it called
    assert torch.equal(r1["reduce"], _values(1))              # rank 0's partials, summed into zeros
    assert torch.equal(r0["reduce"], torch.zeros(N, 3))       # rank 0 receives nothing back
    row = 3 * 4
    assert r0["traffic"] == ((N * row, 0), (N * row, 0)) and r1["traffic"] == ((0, N * row), (0, N * row))
    if transport == "p2p":
        # rank 0 has nothing to receive: its wait ends long before rank 1 posts the receive
        assert r0["cast_wait_s"] < PAUSE / 2 and r0["reduce_wait_s"] < PAUSE / 2, r0
        assert r0["kept_after_cast"] == 1 and r0["kept_after_reduce"] >= 1
    else:  # one exchange: its wait is the whole group's
        assert r0["cast_wait_s"] > PAUSE / 2 and r0["kept_after_reduce"] == 0
    assert r0["kept_at_end"] == 0 and r1["kept_at_end"] == 0


def test_local_group_has_no_sends_to_wait_for():
    g = LocalGroup(2)
    g.wait_sends()  # callable on every backend, a no-op where wait() moves every row
    split, index = _routing(0, 1)
    x = torch.stack([_values(0), _values(2)])
    got = group_cast([x], torch.stack(index), split, N, g)[0]
    g.wait_sends()
    assert torch.equal(got[1], _values(0))


def _rank_drops_group(rank, P):
    """Rank 0 casts to rank 1 and lets its group go without ``wait_sends()``; rank 1 posts late."""
    import gc

    split, index = _routing(0, 1)
    x = _values(0)
    group = TorchGroup(timeout=timedelta(seconds=20), transport="p2p")
    if rank == 1:
        time.sleep(PAUSE)
    got = group_cast([x.clone() if rank else x], index[rank], split, N, group, phase="c")[0]
    kept = group.sends_in_flight()
    del group
    gc.collect()
    return {"cast": got, "kept": kept}


def test_dropped_group_still_delivers_its_sends():
    """gloo hands a send to the wire only once the peer posts its receive, and drops it with its
    handle: a group let go with sends in flight must finish them, or the peer waits forever."""
    r0, r1 = run_ranks(_rank_drops_group, 2, timeout=60, pg_timeout=timedelta(seconds=20))
    assert r0["kept"] == 1  # the case under test: rank 0's send was still in flight when it let go
    assert torch.equal(r1["cast"][:N], _values(0))



class _Landed:
    """A send handle of the fake process group that reports itself done (NCCL's does once its kernel
    has run; gloo's only once waited, so a gloo group keeps its sends until ``wait_sends()``)."""

    def __init__(self, work):
        self._work = work

    def is_completed(self):
        return True

    def wait(self, *args):
        return self._work.wait(*args)


@contextmanager
def _fake_rank0(monkeypatch, on_batch):
    """This process as rank 0 of a fake group of 2 (no byte moves), gloo's worker-thread guard off
    (no threads here), and every ``batch_isend_irecv`` passed through ``on_batch(ops, batch)``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import groupcomm._a2av as a2av

    monkeypatch.setattr(a2av, "retain", lambda *t: None)
    batch = dist.batch_isend_irecv
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: on_batch(ops, batch))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield TorchGroup(transport="p2p")
    finally:
        dist.destroy_process_group()


def test_landed_sends_are_dropped_before_their_wait(monkeypatch):
    """A p2p call's sends are the group's from the moment it is made: a later call drops the send
    buffer once its sends have landed, whether or not the call's own ``wait()`` has come (a layer
    issues every sub-stage's cast up front and waits for cast s at sub-stage s; a landed cast's copy
    of the rows it sent is not held until then). One process as rank 0 of a fake group of 2."""
    import gc
    import weakref

    import torch.distributed as dist

    buffers = []

    def landed(ops, batch):
        # the tensor that owns the send buffer's memory (each op's tensor is a view of it)
        buffers.extend(weakref.ref(op.tensor if op.tensor._base is None else op.tensor._base)
                       for op in ops if op.op is dist.isend)
        return [_Landed(w) for w in batch(ops)]

    with _fake_rank0(monkeypatch, landed) as group:
        split, index = _routing(0, 1)
        first = group_cast([_values(0)], index[0], split, N, group, phase="c", async_op=True)
        assert group.sends_in_flight() == 1 and len(buffers) == 1   # registered when made
        second = group_cast([_values(1)], index[0], split, N, group, phase="c", async_op=True)
        gc.collect()
        assert buffers[0]() is None                # the first send's buffer is gone, its wait() not yet come
        assert group.sends_in_flight() == 1        # the second's, until a later call or wait_sends()
        first.wait(), second.wait()
        group.wait_sends()
        assert group.sends_in_flight() == 0


def test_drop_landed_sends_frees_them_without_a_call(monkeypatch):
    """``drop_landed_sends()`` lets go of landed sends' buffers with no collective after them (a layer
    calls it before gathering a reduce's partials, so the last reduce's send buffer is not live
    beside them), keeps those in flight, and never waits; the other backends keep none."""
    import gc
    import weakref

    import torch.distributed as dist

    buffers, land = [], [True]

    def maybe_landed(ops, batch):
        buffers.extend(weakref.ref(op.tensor if op.tensor._base is None else op.tensor._base)
                       for op in ops if op.op is dist.isend)
        works = batch(ops)
        return [_Landed(w) for w in works] if land[0] else works

    with _fake_rank0(monkeypatch, maybe_landed) as group:
        split, index = _routing(0, 1)
        land[0] = False  # the fake group's own handles never complete: in flight
        flying = group_cast([_values(0)], index[0], split, N, group, phase="c", async_op=True)
        land[0] = True
        landed = group_cast([_values(1)], index[0], split, N, group, phase="c", async_op=True)
        assert group.sends_in_flight() == 2
        group.drop_landed_sends()
        gc.collect()
        assert group.sends_in_flight() == 1 and buffers[1]() is None and buffers[0]() is not None
        flying.wait(), landed.wait()
        group.wait_sends()
    LocalGroup(2).drop_landed_sends()


@pytest.mark.parametrize("consume", [False, True], ids=["kept", "handed-over"])
def test_handed_over_partials_are_sent_without_a_copy(monkeypatch, consume):
    """p2p sends outlive ``wait()``: partials the caller keeps are sent from a copy (it may write
    them once ``wait()`` returns), partials handed over (``consume=True``, the layer's reduces) are
    sent as they are. One process as rank 0 of a fake group of 2; rank 0 returns rank 1's rows."""
    import torch.distributed as dist

    sent = []

    def record(ops, batch):
        sent.extend(op.tensor for op in ops if op.op is dist.isend)
        return batch(ops)

    with _fake_rank0(monkeypatch, record) as group:
        split, index = _routing(1, 0)   # rank 1 cast its rows to rank 0: rank 0 returns them
        partials, acc = _values(1), torch.zeros(N, 3)
        storage = partials.untyped_storage().data_ptr()
        given = [partials] if consume else (partials,)
        w = group_reduce(given, index[0], split, [acc] if consume else (acc,), group, op="sum", phase="r",
                         async_op=True, consume=consume)
        w.wait()
        (t,) = sent
        assert (t.untyped_storage().data_ptr() == storage) == consume
        assert torch.equal(t.view(torch.float32).view(N, 3), _values(1))
        group.wait_sends()


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed_rows"])
def test_packed_partials_are_sent_as_their_buffer(monkeypatch, packed):
    """Several handed-over partials (out and lse, dK and dV) are packed into one send buffer, a copy
    of their rows; made by ``packed_rows`` they already are one, and are sent as it is. Either way
    the rows that arrive are the same bytes."""
    import torch.distributed as dist

    from groupcomm import packed_rows

    sent = []

    def record(ops, batch):
        sent.extend(op.tensor for op in ops if op.op is dist.isend)
        return batch(ops)

    values = [_values(1), _values(2)[:, :2]]
    with _fake_rank0(monkeypatch, record) as group:
        split, index = _routing(1, 0)
        if packed:
            partials = packed_rows(N, [(3,), (2,)], [torch.float32] * 2, torch.device("cpu"))
            for p, v in zip(partials, values):
                p.copy_(v)
        else:
            partials = [v.clone() for v in values]
        storage = partials[0].untyped_storage().data_ptr()
        w = group_reduce(list(partials), index[0], split, [torch.zeros(N, 3), torch.zeros(N, 2)], group,
                         op="sum", phase="r", async_op=True, consume=True)
        w.wait()
        (t,) = sent
        assert (t.untyped_storage().data_ptr() == storage) == packed
        assert torch.equal(t.view(torch.float32).view(N, 5), torch.cat(values, dim=1))
        group.wait_sends()
