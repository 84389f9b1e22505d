"""``group_cast(out=..., recv_offset=...)``: several casts sharing one receive buffer, each at its own rows.

Two random routings cast one after the other into the same buffers, the second from each rank's
first fill on: every backend must give the oracle's two blocks back to back, leave every other row
(the caller's own rows before the offset, anything after) as it was, and count the same bytes.
"""
import pytest
import torch

from groupcomm import LocalGroup, TorchGroup, group_cast
from groupcomm._routing import put_targets
from tests._dist import run_ranks
from tests.groupcomm._cases import oracle_cast, random_routing


def _two_casts(P, N, seed):
    """Two routings over the same rows, the tensors, and the shared buffers' rows: a 2-row head the casts
    must not touch, then the first cast's fill, then the second's (offset per rank), then 1 spare row."""
    first, second = random_routing(P, N, seed), random_routing(P, N, seed + 7)
    fill1, fill2 = first.split.sum(0), second.split.sum(0)
    head = 2
    R = head + int((fill1 + fill2).max()) + 1
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(P, N, 3, generator=g), torch.randint(-100, 100, (P, N, 2), generator=g).to(torch.int16)]
    return first, second, head, R, x


def _expected(first, second, head, R, x, background):
    """The oracle: the background with cast 1's rows at head.., cast 2's right after each rank's fill 1."""
    P = first.P
    out = [b.clone() for b in background]
    for o, t in zip(out, x):
        a, b = oracle_cast(t, first), oracle_cast(t, second)
        for r in range(P):
            n1, n2 = int(first.split[:, r].sum()), int(second.split[:, r].sum())
            o[r, head:head + n1] = a[r, :n1]
            o[r, head + n1:head + n1 + n2] = b[r, :n2]
    return out


def _background(P, R, x):
    return [torch.full((P, R, *t.shape[2:]), -7, dtype=t.dtype) for t in x]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("P,N,seed", [(3, 5, 0), (4, 6, 1)], ids=["P3", "P4"])
def test_local_group_casts_share_one_buffer(P, N, seed, impl):
    first, second, head, R, x = _two_casts(P, N, seed)
    group = LocalGroup(P, impl=impl)
    buf = _background(P, R, x)
    start1 = torch.full((P,), head, dtype=torch.int64)
    start2 = start1 + first.split.sum(0)
    views = [b[:, :] for b in buf]
    got1 = group_cast(x, first.send_index, first.split, R, group, phase="c1", out=views, recv_offset=start1)
    assert all(g is v for g, v in zip(got1, views))  # written in place, returned as given
    group_cast(x, second.send_index, second.split, R, group, phase="c2", out=buf, recv_offset=start2)
    for i, (want, got) in enumerate(zip(_expected(first, second, head, R, x, _background(P, R, x)), buf)):
        assert torch.equal(want, got), f"tensor {i}"
    # the counters are the routings' own
    row_bytes = 3 * 4 + 2 * 2
    for phase, r in (("c1", first), ("c2", second)):
        off = r.split * (1 - torch.eye(P, dtype=torch.int64))
        sent, recv = group.traffic(phase)
        assert torch.equal(sent, off.sum(1) * row_bytes) and torch.equal(recv, off.sum(0) * row_bytes)


def test_local_group_non_contiguous_out():
    """A view of the rows past a local block (the layer's ``X[:, n:]``) is written through."""
    P, N, seed = 3, 5, 2
    first, second, head, R, x = _two_casts(P, N, seed)
    whole = [torch.zeros(P, 4 + R, *t.shape[2:], dtype=t.dtype) for t in x]
    views = [w[:, 4:] for w in whole]
    assert not views[0].is_contiguous()
    group_cast(x, first.send_index, first.split, R, LocalGroup(P), out=views,
               recv_offset=torch.full((P,), head, dtype=torch.int64))
    for t, w in zip(x, whole):
        want = oracle_cast(t, first)
        for r in range(P):
            n1 = int(first.split[:, r].sum())
            assert torch.equal(w[r, 4 + head:4 + head + n1], want[r, :n1])
            assert not w[r, :4 + head].any() and not w[r, 4 + head + n1:].any()


def test_offset_past_the_buffer_drops_rows():
    """Rows past the buffer's rows are dropped (never written out of bounds), as a fill past capacity is."""
    P, N = 3, 5
    r = random_routing(P, N, 3)
    fill = r.split.sum(0)
    R = int(fill.max())
    offset = torch.ones(P, dtype=torch.int64)
    peer, row = put_targets(r.split, r.send_index, torch.arange(P), R, offset)
    assert bool((row[peer >= 0] < R).all())
    x = [torch.randn(P, N, 2)]
    out = [torch.zeros(P, R, 2)]
    group_cast(x, r.send_index, r.split, R, LocalGroup(P), out=out, recv_offset=offset, flag_errors=False)
    want = oracle_cast(x[0], r)
    for d in range(P):
        n = min(int(fill[d]), R - 1)
        assert torch.equal(out[0][d, 1:1 + n], want[d, :n]) and not out[0][d, 0].any()


def test_out_is_checked():
    P, N = 3, 4
    r = random_routing(P, N, 0)
    x = [torch.randn(P, N, 2)]
    with pytest.raises(ValueError, match=r"out\[0\] must be"):
        group_cast(x, r.send_index, r.split, r.recv_capacity, LocalGroup(P), out=[torch.zeros(P, 1, 2)])
    with pytest.raises(ValueError, match="recv_offset must be"):
        group_cast(x, r.send_index, r.split, r.recv_capacity, LocalGroup(P), recv_offset=torch.zeros(P + 1).long())


def _rank_into(rank, P, N, seed, transport):
    first, second, head, R, x = _two_casts(P, N, seed)
    group = TorchGroup(transport=transport)
    mine = [t[rank] for t in x]
    buf = [b[rank].contiguous() for b in _background(P, R, x)]
    start1 = torch.full((P,), head, dtype=torch.int64)
    start2 = start1 + first.split.sum(0)
    w1 = group_cast(mine, first.send_index[rank], first.split, R, group, phase="c1", out=buf, recv_offset=start1,
                    host_recv_offset=head, async_op=True)
    # the second start row read from the device (no host copy given)
    w2 = group_cast(mine, second.send_index[rank], second.split, R, group, phase="c2", out=buf, recv_offset=start2,
                    async_op=True)
    w1.wait()
    w2.wait()
    group.wait_sends()
    return {"buf": buf, "traffic": {ph: group.traffic(ph) for ph in ("c1", "c2")}}


@pytest.mark.parametrize("transport", ["a2a", "p2p"])
def test_torch_group_casts_share_one_buffer(transport):
    P, N, seed = 3, 5, 4
    got = run_ranks(_rank_into, P, N, seed, transport, timeout=60)
    first, second, head, R, x = _two_casts(P, N, seed)
    want = _expected(first, second, head, R, x, _background(P, R, x))
    row_bytes = 3 * 4 + 2 * 2
    for rank, res in enumerate(got):
        for i, (w, b) in enumerate(zip(want, res["buf"])):
            assert torch.equal(w[rank], b), f"rank {rank} tensor {i}"
        for phase, r in (("c1", first), ("c2", second)):
            off = r.split * (1 - torch.eye(P, dtype=torch.int64))
            assert res["traffic"][phase] == (int(off[rank].sum()) * row_bytes, int(off[:, rank].sum()) * row_bytes)


def test_symm_mem_group_casts_share_one_buffer(monkeypatch):
    """SymmMemGroup's whole path on CPU (threads, plain buffers, the put kernel under the interpreter):
    each cast puts at its own rows of the one symmetric buffer and copies only those rows out."""
    import threading

    import groupcomm._put_kernel as put_kernel
    from tests.groupcomm.test_symm_mem_sim import _sim_groups, _threads

    lock = threading.Lock()
    launch = put_kernel.put_rows

    def locked(*args, **kwargs):
        with lock:
            return launch(*args, **kwargs)

    monkeypatch.setattr(put_kernel, "put_rows", locked)
    P, N, seed = 3, 5, 5
    first, second, head, R, x = _two_casts(P, N, seed)
    groups = _sim_groups(P)
    start1 = torch.full((P,), head, dtype=torch.int64)
    start2 = start1 + first.split.sum(0)

    def rank_fn(rank):
        mine = [t[rank] for t in x]
        buf = [b[rank].clone() for b in _background(P, R, x)]
        group_cast(mine, first.send_index[rank], first.split, R, groups[rank], phase="c1", out=buf,
                   recv_offset=start1)
        group_cast(mine, second.send_index[rank], second.split, R, groups[rank], phase="c2", out=buf,
                   recv_offset=start2)
        return buf

    got = _threads(P, rank_fn)
    want = _expected(first, second, head, R, x, _background(P, R, x))
    for rank, buf in enumerate(got):
        for i, (w, b) in enumerate(zip(want, buf)):
            assert torch.equal(w[rank], b), f"rank {rank} tensor {i}"
