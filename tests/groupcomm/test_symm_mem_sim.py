"""SymmMemGroup's whole call path on CPU: P threads, plain buffers as the 'symmetric' memory.

Only the allocation is replaced: each rank's buffer is a CPU tensor, the
handle's device barrier is a ``threading.Barrier`` and the put kernel runs
under the interpreter (one launch at a time: the interpreter is not
thread-safe). Everything else (argument preparation, peer table, barriers,
zeroing past the fill, the way back, counters) is the real code.
"""
import threading

import pytest
import torch

import groupcomm._put_kernel as put_kernel
from groupcomm import LocalGroup, SymmMemGroup, group_cast, group_reduce
from groupcomm._pack import word_dtype
from groupcomm._symm_mem import peer_table
from tests.groupcomm._cases import random_routing


class _Handle:
    def __init__(self, barrier):
        self._barrier = barrier

    def barrier(self, channel=0, timeout_ms=0):
        self._barrier.wait(timeout=30)


def _sim_groups(P):
    groups = [SymmMemGroup.__new__(SymmMemGroup) for _ in range(P)]
    shared, lock = {}, threading.Lock()
    barrier = threading.Barrier(P)

    def make_buffer(rank):
        def buffer(rows, row_bytes, device):
            with lock:
                if (rows, row_bytes) not in shared:
                    word = word_dtype(row_bytes)
                    width = row_bytes // torch.empty((), dtype=word).element_size()
                    bufs = [torch.full((max(rows, 1), width), 7, dtype=word) for _ in range(P)]  # stale data
                    shared[(rows, row_bytes)] = bufs
            bufs = shared[(rows, row_bytes)]
            table = peer_table([b.data_ptr() for b in bufs], bufs[rank].data_ptr(), rank, device)
            return bufs[rank], _Handle(barrier), table
        return buffer

    for rank, g in enumerate(groups):
        g._setup(None, rank, P, None)
        g._buffer = make_buffer(rank)
    return groups


def _threads(P, fn):
    results, errors = [None] * P, []

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:
            errors.append((rank, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    if errors:
        raise errors[0][1]
    return results


@pytest.mark.parametrize("P,seed", [(3, 0), (4, 5)], ids=["P3", "P4"])
def test_symm_mem_group_equals_local_group(P, seed, monkeypatch):
    lock = threading.Lock()
    launch = put_kernel.put_rows

    def locked(*args, **kwargs):
        with lock:
            return launch(*args, **kwargs)

    monkeypatch.setattr(put_kernel, "put_rows", locked)
    r = random_routing(P, 5, seed)
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(P, r.N, 3, generator=g), torch.randn(P, r.N, 2, generator=g).half()]
    parts = [torch.randn(P, r.recv_capacity, 2, 4, generator=g), torch.randn(P, r.recv_capacity, 2, generator=g)]
    acc = [torch.randn(P, r.N, 2, 4, generator=g), torch.randn(P, r.N, 2, generator=g)]
    groups = _sim_groups(P)

    def rank_fn(rank):
        grp = groups[rank]
        idx = r.send_index[rank]
        out = {"cast": group_cast([t[rank] for t in x], idx, r.split, r.recv_capacity, grp, phase="fwd")}
        out["cast2"] = group_cast([t[rank] for t in x], idx, r.split, r.recv_capacity, grp, phase="fwd")
        out["lse"] = group_reduce([t[rank] for t in parts], idx, r.split, [t[rank] for t in acc], grp, op="lse")
        mine = [t[rank].clone() for t in acc]  # in place: merged into these when the call is made
        out["lse_in"] = group_reduce([t[rank] for t in parts], idx, r.split, mine, grp, op="lse", phase="in",
                                     inplace=True)
        out["same"] = all(a is b for a, b in zip(out["lse_in"], mine))
        out["traffic"] = (grp.traffic("fwd"), grp.traffic("reduce"))
        return out

    got = _threads(P, rank_fn)
    local = LocalGroup(P)
    ref_cast = group_cast(x, r.send_index, r.split, r.recv_capacity, local, phase="fwd")
    group_cast(x, r.send_index, r.split, r.recv_capacity, local, phase="fwd")
    ref_lse = group_reduce(parts, r.send_index, r.split, acc, local, op="lse")
    for rank, res in enumerate(got):
        for key in ("cast", "cast2"):
            for a, b in zip(ref_cast, res[key]):
                assert torch.equal(a[rank], b), (rank, key)
        for a, b, c in zip(ref_lse, res["lse"], res["lse_in"]):
            assert torch.equal(a[rank], b), (rank, "lse")
            assert torch.equal(a[rank], c), (rank, "lse in place")
        assert res["same"], (rank, "in place: the result is acc's tensors")
        fwd, red = res["traffic"]
        assert fwd == tuple(int(t[rank]) for t in local.traffic("fwd"))
        assert red == tuple(int(t[rank]) for t in local.traffic("reduce"))


def test_symm_mem_group_rejects_cpu_tensors():
    grp = SymmMemGroup.__new__(SymmMemGroup)
    grp._setup(None, 0, 2, None)
    split = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match="CUDA"):
        group_cast([torch.zeros(2, 2)], torch.tensor([0]), split, 2, grp)
