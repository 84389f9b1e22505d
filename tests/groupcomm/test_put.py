"""The put kernel (interpreter) against its torch twin, and the symmetric-memory argument preparation."""
import pytest
import torch

from groupcomm import LocalGroup, group_cast, group_reduce
from groupcomm._base import first_true
from groupcomm._put_kernel import put_rows
from groupcomm._put_ref import put_rows_inplace, put_rows_ref
from groupcomm._routing import put_targets
from groupcomm._symm_mem import SymmMemGroup, peer_table, put_arguments
from tests.groupcomm._cases import random_routing

CASES = [(3, 5, 0), (4, 7, 1), (5, 3, 2)]
IDS = [f"P{p}-N{n}-seed{s}" for p, n, s in CASES]


@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_local_triton_equals_torch(P, N, seed):
    r = random_routing(P, N, seed)
    g = torch.Generator().manual_seed(seed)
    # 12 + 6 + 1 = 19 bytes a row: odd widths move as single bytes
    x = [torch.randn(P, N, 3, generator=g), torch.randn(P, N, 3, generator=g).half(),
         torch.randint(0, 2, (P, N), generator=g).bool()]
    ref = group_cast(x, r.send_index, r.split, r.recv_capacity, LocalGroup(P, impl="torch"))
    tri = group_cast(x, r.send_index, r.split, r.recv_capacity, LocalGroup(P, impl="triton"))
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)
    partials = [torch.randn(P, r.recv_capacity, 2, 4, generator=g), torch.randn(P, r.recv_capacity, 2, generator=g)]
    acc = [torch.randn(P, N, 2, 4, generator=g), torch.randn(P, N, 2, generator=g)]
    for op in ("sum", "lse"):
        ref = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P, impl="torch"), op=op)
        tri = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P, impl="triton"), op=op)
        for a, b in zip(ref, tri):
            assert torch.equal(a, b), op


@pytest.mark.parametrize("width,dtype", [(5, torch.uint8), (6, torch.int16), (12, torch.int32), (40, torch.int64)],
                         ids=["w5-u8", "w6-i16", "w12-i32", "w40-i64"])
def test_put_kernel_stacked_equals_twin(width, dtype):
    """Word widths, a row wider than one BLOCK_W pass, padding and out-of-range targets."""
    P, N, C, R = 3, 6, 7, 5
    g = torch.Generator().manual_seed(width)
    src = torch.randint(-100, 100, (P, N, width), generator=g).to(dtype)
    index = torch.randint(-1, N, (P, C), generator=g)
    # distinct targets: position p of rank b goes to rank (b + 1) % P, row p (rows >= R are skipped)
    peer = ((torch.arange(P)[:, None] + 1) % P).expand(P, C).clone()
    peer[0, 1] = -1
    peer[1, 2] = P                                # out of range: skipped
    row = torch.arange(C).expand(P, C).clone()
    ref = put_rows_ref(src, index, peer, row, torch.zeros(P, R, width, dtype=dtype))
    out = torch.zeros(P, R, width, dtype=dtype)
    put_rows(src, index, peer, row, out, block_rows=4)
    assert torch.equal(ref, out)
    wide = torch.zeros(P, R, width, dtype=dtype)
    put_rows(src, index, peer, row, wide, block_rows=512)   # BLOCK_W shrinks to 16: several passes a row
    assert torch.equal(ref, wide)


@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_put_kernel_peer_table_equals_stacked(P, N, seed):
    """The GPU addressing (one pointer per peer buffer) under the interpreter, one launch per sending rank."""
    r = random_routing(P, N, seed)
    W = 3
    src = torch.randint(0, 1000, (P, N, W), generator=torch.Generator().manual_seed(seed))
    peer, row = put_targets(r.split, r.send_index, torch.arange(P), r.recv_capacity)
    stacked = put_rows_ref(src, r.send_index, peer, row, torch.zeros(P, r.recv_capacity, W, dtype=src.dtype))
    buffers = [torch.zeros(r.recv_capacity, W, dtype=src.dtype) for _ in range(P)]
    for rank in range(P):
        table = peer_table([b.data_ptr() for b in buffers], buffers[rank].data_ptr(), rank, "cpu")
        p, q = put_arguments(r.split, r.send_index[rank], rank, r.recv_capacity)
        put_rows(src[rank][None], r.send_index[rank][None], p[None], q[None], peer_ptrs=table,
                 capacity=r.recv_capacity)
    assert torch.equal(stacked, torch.stack(buffers))


def test_put_arguments_match_oracle():
    split = torch.tensor([[0, 2, 1], [3, 0, 0], [1, 1, 0]])
    send_index = [torch.tensor([0, 1, 1, -1]), torch.tensor([0, 1, 2, -1]), torch.tensor([2, 2, -1, -1])]
    # rank 0 -> rank 1 rows 0, 1 (first source); -> rank 2 row 0
    # rank 1 -> rank 0 rows 0..2; rank 2 -> rank 0 row 3, rank 1 row 2
    want = {0: ([1, 1, 2, -1], [0, 1, 0, 0]), 1: ([0, 0, 0, -1], [0, 1, 2, 0]), 2: ([0, 1, -1, -1], [3, 2, 0, 0])}
    for rank, (peers, rows) in want.items():
        peer, row = put_arguments(split, send_index[rank], rank, 5)
        assert peer.tolist() == peers and row.tolist() == rows, rank
    # a capacity of 3 drops rank 2's row for rank 0 (row 3)
    peer, row = put_arguments(split, send_index[2], 2, 3)
    assert peer.tolist() == [-1, 1, -1, -1] and row.tolist() == [0, 2, 0, 0]


def test_put_arguments_meta():
    meta = torch.device("meta")
    peer, row = put_arguments(torch.empty(4, 4, dtype=torch.int64, device=meta),
                              torch.empty(9, dtype=torch.int64, device=meta), 2, 7)
    assert peer.shape == (9,) and row.device == meta


def test_peer_table_offsets():
    table = peer_table([1000, 5000, 9000], 5064, 1, "cpu")
    assert table.tolist() == [1064, 5064, 9064]


def test_symm_mem_module_imports_on_cpu():
    from groupcomm import _symm_mem
    usable, why = _symm_mem.symm_mem_usable()
    assert not usable and why
    assert SymmMemGroup.batched is False


def test_put_kernel_compiles_for_sm90():
    """Both addressing modes pass the real front end and ptxas (the interpreter checks less)."""
    from tests._sm90 import capture_launches, compile_sm90
    r = random_routing(3, 4, 0)
    src = torch.zeros(1, 4, 2, dtype=torch.int64)
    peer, row = put_targets(r.split, r.send_index[:1], torch.zeros(1, dtype=torch.int64), r.recv_capacity)
    with capture_launches() as records:
        put_rows(src, r.send_index[:1], peer, row, torch.zeros(3, r.recv_capacity, 2, dtype=torch.int64))
        buffers = [torch.zeros(r.recv_capacity, 2, dtype=torch.int64) for _ in range(3)]
        table = peer_table([b.data_ptr() for b in buffers], buffers[0].data_ptr(), 0, "cpu")
        put_rows(src, r.send_index[:1], peer, row, peer_ptrs=table, capacity=r.recv_capacity)
    assert len(records) == 2
    try:
        results = compile_sm90(records, timeout=120)
    except RuntimeError as e:
        if "ptxas" in str(e):
            pytest.skip("no ptxas in this Triton install")
        raise
    for res in results:
        assert res["error"] is None, res["error"]


def test_put_in_place_equals_twin_in_a_strided_view():
    """``put_rows_inplace`` writes the twin's rows into a view of a larger tensor (the receive rows of
    stage 1's operands) and leaves every other element alone: padding, out-of-range targets, and a
    sender with no valid position at all (its writes must not touch out[0, 0])."""
    P, N, C, R, W = 3, 6, 7, 5, 4
    g = torch.Generator().manual_seed(3)
    src = torch.randint(-100, 100, (P, N, W), generator=g)
    index = torch.randint(-1, N, (P, C), generator=g)
    index[2] = -1                                 # rank 2 sends nothing
    index[0, 0] = -1                              # rank 0's first position is padding
    peer = ((torch.arange(P)[:, None] + 1) % P).expand(P, C).clone()
    peer[1, 2] = P                                # out of range: skipped
    row = torch.arange(C).expand(P, C).clone()    # rows >= R are skipped
    base = torch.randint(-100, 100, (P, 2 + R + 1, W), generator=g)
    out = base.clone()
    view = out[:, 2:2 + R]                        # strided: not contiguous across ranks
    ref = put_rows_ref(src, index, peer, row, base[:, 2:2 + R].clone())
    put_rows_inplace(src, index, peer, row, view)
    assert torch.equal(view, ref)
    assert torch.equal(out[:, :2], base[:, :2]) and torch.equal(out[:, 2 + R:], base[:, 2 + R:])


def test_an_empty_send_list_puts_nothing():
    """A send list of no positions (a hop whose capacity is 0: relay transport on nodes of one rank)
    leaves the buffers as they were, on the torch twin, in place, and the kernel alike."""
    P, N, R, W = 2, 4, 3, 5
    src = torch.arange(P * N * W, dtype=torch.int32).view(P, N, W)
    index = peer = row = torch.empty(P, 0, dtype=torch.int64)
    base = torch.full((P, R, W), -7, dtype=torch.int32)
    assert torch.equal(put_rows_ref(src, index, peer, row, base.clone()), base)
    out = base.clone()
    put_rows_inplace(src, index, peer, row, out)
    assert torch.equal(out, base)
    out = base.clone()
    put_rows(src, index, peer, row, out)
    assert torch.equal(out, base)


@pytest.mark.parametrize("B,N", [(3, 1), (4, 16), (5, 37)], ids=["B3-N1", "B4-N16", "B5-N37"])
def test_first_true_equals_argmax(B, N):
    """The first True of each row, 0 for a row with none: eager ``argmax`` of the int8 mask, exactly.
    (Compiled, the int8 argmax could return garbage for a row with none; that failure depended on
    stack bytes, so the inductor check is end to end: test_compile_masks.py::test_slices_inductor.)"""
    g = torch.Generator().manual_seed(N)
    mask = torch.rand(B, N, generator=g) < 0.2
    mask[0] = False                               # a row with no True
    mask[-1, -1] = True                           # a row whose only True may be the last
    mask[-1, :-1] = False
    assert torch.equal(first_true(mask), mask.to(torch.int8).argmax(1, keepdim=True))
    assert first_true(torch.zeros(B, 0, dtype=torch.bool)).tolist() == [[0]] * B


def test_consumed_partials_are_freed_before_the_sums(monkeypatch):
    """``group_reduce(consume=True)`` empties the lists it is given, and LocalGroup drops the partials
    once their rows have moved: when the sums start, nothing holds the partials' storage."""
    import weakref

    import groupcomm._sim as sim

    P, N = 4, 5
    r = random_routing(P, N, 0)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(P, r.recv_capacity + 2, 2, 4, generator=g)
    expect = group_reduce([full[:, 2:].clone()], r.send_index, r.split, [torch.randn(P, N, 2, 4, generator=g)],
                          LocalGroup(P), op="sum")
    g = torch.Generator().manual_seed(0)
    full = torch.randn(P, r.recv_capacity + 2, 2, 4, generator=g)
    partials, acc = [full[:, 2:]], [torch.randn(P, N, 2, 4, generator=g)]
    alive = weakref.ref(full.untyped_storage())
    seen = []
    reduce_rows = sim.reduce_rows

    def check(*args):
        seen.append(alive() is None)
        return reduce_rows(*args)
    monkeypatch.setattr(sim, "reduce_rows", check)
    del full
    out = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op="sum", consume=True)
    assert partials == [] and acc == [] and seen == [True]
    assert torch.equal(out[0], expect[0])
    with pytest.raises(ValueError, match="consume"):
        group_reduce((torch.zeros(P, r.recv_capacity, 1),), r.send_index, r.split, [torch.zeros(P, N, 1)],
                     LocalGroup(P), op="sum", consume=True)
