"""``group_reduce(inplace=True)``: the result written into acc itself, bit for bit the out-of-place one.

Deterministic mode adds the same terms in the same order either way, so in-place and out-of-place
results are compared by their bits (``_same_bits``: -0.0 and +0.0 differ there), on the torch and
the fused path (kernels under the interpreter), with LocalGroup, on forked gloo ranks
(TorchGroup), on meta and under ``torch.compile``; then the accumulators it refuses.
"""
import pytest
import torch

from groupcomm import LocalGroup, TorchGroup, group_reduce, host_splits, neutral_rows
from groupcomm._merge import fused_reduce
from tests._dist import run_ranks
from tests.groupcomm._cases import random_routing

NEG_INF = float("-inf")
CASES = [(2, 5, 0), (3, 7, 1), (5, 6, 2), (8, 9, 3), (4, 1, 4)]  # (P, N, seed)
IDS = [f"P{p}-N{n}-seed{s}" for p, n, s in CASES]
_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_INTS[a.element_size()]),
                                                                     b.view(_INTS[b.element_size()]))


def _lse_inputs(P, N, seed, cap, out_dtype=torch.bfloat16):
    """Partials (out in ``out_dtype``, lse fp32 with -inf) in the receive layout, and the host's running
    (out, lse) fp32 as rows of a larger buffer (strided views, as the layer's accumulators are)."""
    g = torch.Generator().manual_seed(seed + 30)
    partials = [torch.randn(P, cap, 3, 5, generator=g).to(out_dtype), torch.randn(P, cap, 3, generator=g) * 30]
    partials[1][torch.rand(partials[1].shape, generator=g) < 0.3] = NEG_INF
    big = [torch.randn(P, N + 3, 3, 5, generator=g), torch.randn(P, N + 3, 3, generator=g) * 30]
    big[1][:, 0] = NEG_INF  # a host row with nothing yet: out 0, lse -inf
    big[0][:, 0] = 0.0
    return partials, big


def _sum_inputs(P, N, seed, cap):
    """Partials bf16 and fp32 and fp32 sums as strided rows of a larger buffer; some sums -0.0 (a
    skipped position adds -0.0 to row 0 in place: it must change no bit)."""
    g = torch.Generator().manual_seed(seed + 40)
    partials = [torch.randn(P, cap, 4, generator=g).bfloat16(), torch.randn(P, cap, 2, 3, generator=g)]
    big = [torch.randn(P, N + 2, 4, generator=g), torch.randn(P, N + 2, 2, 3, generator=g)]
    for b in big:
        b[:, 0] = -0.0
    return partials, big


def _host_rows(big, N):
    return [b.narrow(1, 0, N) for b in big]


@pytest.mark.parametrize("det", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("op", ["lse", "sum"])
@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_inplace_equals_out_of_place(P, N, seed, op, fused, det):
    """The same bits as ``inplace=False`` with the same acc (deterministic mode; the fused path is
    deterministic in both modes, and so is the CPU's torch path), written into acc's own rows only,
    and the result is acc's tensors."""
    r = random_routing(P, N, seed)
    partials, big = (_lse_inputs if op == "lse" else _sum_inputs)(P, N, seed, r.recv_capacity)
    with fused_reduce(fused):
        want = group_reduce(partials, r.send_index, r.split, _host_rows(big, N), LocalGroup(P), op=op,
                            deterministic=det)
        into = [b.clone() for b in big]
        acc = _host_rows(into, N)
        got = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op=op, deterministic=det,
                           inplace=True)
    assert len(got) == len(acc) and all(g is a for g, a in zip(got, acc))
    for i, (w, g, b, x) in enumerate(zip(want, got, big, into)):
        assert _same_bits(w, g), f"{op} tensor {i}: in place differs from out of place"
        assert _same_bits(b.narrow(1, N, b.shape[1] - N), x.narrow(1, N, x.shape[1] - N)), "rows past acc written"
    assert not torch.equal(got[0], _host_rows(big, N)[0])  # the partials arrived


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("det", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("op", ["lse", "sum"])
def test_pieces_give_the_same_bits(monkeypatch, op, det, inplace):
    """The torch path adds each window's rows in pieces (``_reduce._PIECES``), fewer where a piece
    would be small (``PIECE_MIN_ELEMENTS``): every real row is in one piece, so the bits do not
    depend on the pieces. These rows are small enough to go in one piece by default."""
    import groupcomm._reduce as reduce

    P, N, seed = 8, 9, 3
    r = random_routing(P, N, seed)
    partials, big = (_lse_inputs if op == "lse" else _sum_inputs)(P, N, seed, r.recv_capacity)
    got = []
    for least in (reduce.PIECE_MIN_ELEMENTS, 1):
        monkeypatch.setattr(reduce, "PIECE_MIN_ELEMENTS", least)
        steps = []
        monkeypatch.setattr(reduce, "_piece_step", lambda W, vals, f=reduce._piece_step: steps.append(
            (W, f(W, vals))) or steps[-1][1])
        into = [b.clone() for b in big]
        with fused_reduce(False):
            got.append(group_reduce(partials, r.send_index, r.split, _host_rows(into, N), LocalGroup(P), op=op,
                                    deterministic=det, inplace=inplace))
        assert steps, "the torch path took no pieces"
        pieces = max(-(-W // step) for W, step in steps)
        assert (pieces == 1) == (least > 1), (least, steps)
    for i, (a, b) in enumerate(zip(*got)):
        assert _same_bits(a, b), f"{op} tensor {i}: pieces changed the bits"


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_inplace_reduces_in_sequence(fused):
    """Reduces one after another into one accumulator (what the layer's sub-stages do) give the
    bits of chaining out-of-place results."""
    P, N = 4, 6
    routes = [random_routing(P, N, s) for s in (11, 12, 13)]
    _, big = _lse_inputs(P, N, 0, 1)
    acc = [b.clone() for b in _host_rows(big, N)]
    chained = _host_rows(big, N)
    with fused_reduce(fused):
        for s, r in enumerate(routes):
            partials, _ = _lse_inputs(P, N, s, r.recv_capacity)
            chained = group_reduce(partials, r.send_index, r.split, chained, LocalGroup(P), op="lse")
            group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op="lse", inplace=True)
    for a, c in zip(acc, chained):
        assert _same_bits(a, c)


def test_inplace_consume_empties_partials_only():
    """consume=True with inplace: the partials are handed over (list emptied), acc's list is left as
    given (its tensors are the result)."""
    P, N = 3, 5
    r = random_routing(P, N, 2)
    partials, big = _sum_inputs(P, N, 2, r.recv_capacity)
    acc = _host_rows([b.clone() for b in big], N)
    given = list(acc)
    got = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op="sum", consume=True, inplace=True)
    assert partials == [] and acc == given and all(g is a for g, a in zip(got, given))
    with pytest.raises(ValueError, match="consume=True"):
        group_reduce(tuple(_sum_inputs(P, N, 2, r.recv_capacity)[0]), r.send_index, r.split, acc, LocalGroup(P),
                     op="sum", consume=True, inplace=True)
    # acc may be a tuple in place: only partials are emptied
    parts, _ = _sum_inputs(P, N, 2, r.recv_capacity)
    group_reduce(parts, r.send_index, r.split, tuple(acc), LocalGroup(P), op="sum", consume=True, inplace=True)
    assert parts == []


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_inplace_on_meta_allocates_no_result(fused):
    """On meta (no host read), the result is acc itself; in place the fused path's fakes return
    nothing (only the slot table is made)."""
    P, N, h, D, cap, send_cap = 4, 6, 2, 8, 11, 9
    meta = torch.device("meta")
    split = torch.empty(P, P, dtype=torch.int64, device=meta)
    send_index = torch.empty(P, send_cap, dtype=torch.int64, device=meta)
    out = torch.empty(P, N + 3, h, D, device=meta).narrow(1, 0, N)
    lse = torch.empty(P, N, h, device=meta)
    partials = [torch.empty(P, cap, h, D, dtype=torch.bfloat16, device=meta), torch.empty(P, cap, h, device=meta)]
    with fused_reduce(fused):
        for det in (True, False):
            got = group_reduce(partials, send_index, split, [out, lse], LocalGroup(P), op="lse", inplace=True,
                               deterministic=det)
            assert got[0] is out and got[1] is lse
            dq, = group_reduce(partials[:1], send_index, split, [out], LocalGroup(P), op="sum", inplace=True,
                               deterministic=det)
            assert dq is out


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_inplace_compiles_fullgraph(fused):
    """group_reduce(inplace=True) into rows of a larger buffer under torch.compile(fullgraph=True):
    one graph, the eager bits, the buffer's other rows untouched."""
    P, N = 4, 7
    r = random_routing(P, N, 5)
    partials, big = _lse_inputs(P, N, 5, r.recv_capacity)
    group = LocalGroup(P)

    def both(partials, big):
        acc = [b.narrow(1, 0, N) for b in big]
        group_reduce(list(partials), r.send_index, r.split, acc, group, op="lse", inplace=True)
        group_reduce([partials[0]], r.send_index, r.split, [big[0].narrow(1, 0, N)], group, op="sum", inplace=True)
        return big[0] * 1, big[1] * 1

    with fused_reduce(fused):
        eager = both(partials, [b.clone() for b in big])
        torch._dynamo.reset()
        into = [b.clone() for b in big]
        compiled = torch.compile(both, fullgraph=True, backend="aot_eager")(partials, into)
    torch._dynamo.reset()
    for a, b, x in zip(eager, compiled, into):
        assert _same_bits(a, b) and _same_bits(a, x)


def _rank_inplace(rank, P, seed, transport):
    """On a gloo rank: out of place, then in place (asynchronous: TorchGroup merges at the first
    wait(), acc untouched before), op lse and sum."""
    r = random_routing(P, 6, seed)
    hs = host_splits(r.split)
    group = TorchGroup(transport=transport)
    res = {}
    for op in ("lse", "sum"):
        partials, big = (_lse_inputs if op == "lse" else _sum_inputs)(P, 6, seed, r.recv_capacity)
        parts = [p[rank] for p in partials]
        acc = [b[rank].narrow(0, 0, 6) for b in big]
        res[op, "out"] = group_reduce(parts, r.send_index[rank], r.split, acc, group, op=op, host_split=hs,
                                      phase=f"{op}.out")
        before = [a.clone() for a in acc]
        work = group_reduce(parts, r.send_index[rank], r.split, acc, group, op=op, host_split=hs, async_op=True,
                            phase=f"{op}.in", inplace=True)
        res[op, "untouched"] = all(torch.equal(a, b) for a, b in zip(acc, before))
        got = work.wait()
        res[op, "same"] = all(g is a for g, a in zip(got, acc))
        res[op, "in"] = [a.clone() for a in acc]
    group.wait_sends()
    return res


@pytest.mark.parametrize("transport", ["p2p", "a2a"])
def test_torch_group_inplace_equals_out_of_place(transport):
    """TorchGroup on forked gloo ranks: in place has the bits of out of place and of LocalGroup in place."""
    P, seed = 3, 4
    got = run_ranks(_rank_inplace, P, seed, transport, timeout=60)
    r = random_routing(P, 6, seed)
    for op in ("lse", "sum"):
        partials, big = (_lse_inputs if op == "lse" else _sum_inputs)(P, 6, seed, r.recv_capacity)
        acc = _host_rows(big, 6)
        local = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op=op, inplace=True)
        for rank, res in enumerate(got):
            assert res[op, "untouched"], f"rank {rank} {op}: acc written before wait()"
            assert res[op, "same"], f"rank {rank} {op}: the result is not acc's tensors"
            for i, (o, x, loc) in enumerate(zip(res[op, "out"], res[op, "in"], local)):
                assert _same_bits(o, x), f"rank {rank} {op}[{i}]: in place differs from out of place"
                assert _same_bits(loc[rank], x), f"rank {rank} {op}[{i}]: differs from LocalGroup"


def _bad_cases():
    P, N = 3, 5
    r = random_routing(P, N, 1)
    cap = r.recv_capacity
    lse_p = [torch.randn(P, cap, 2, 4), torch.randn(P, cap, 2)]
    sum_p = [torch.randn(P, cap, 4)]
    out, lse = torch.zeros(P, N, 2, 4), torch.zeros(P, N, 2)
    x = torch.zeros(P, N, 4)
    overlapping = torch.zeros(P * N * 4).as_strided((P, N, 4), (N * 2, 2, 1))  # rows overlap their neighbours
    return r, [
        ("neutral", sum_p, [neutral_rows(x)], "sum", r"acc\[0\].*share memory.*neutral_rows"),
        ("expanded", sum_p, [torch.zeros(P, 1, 4).expand(P, N, 4)], "sum", r"acc\[0\].*share memory"),
        ("overlapping", sum_p, [overlapping], "sum", r"acc\[0\].*strides \(10, 2, 1\)"),
        ("neutral lse", lse_p, [neutral_rows(out), neutral_rows(lse, NEG_INF)], "lse", r"acc\[0\].*share memory"),
        ("bf16 sum", [sum_p[0].bfloat16()], [x.bfloat16()], "sum", r"acc\[0\].*own sum dtype.*bfloat16"),
        ("fp16 sum", sum_p, [x.half()], "sum", r"acc\[0\].*torch.float16.*accumulate in torch.float32"),
        ("int sum", [sum_p[0].long()], [x.long()], "sum", r"acc\[0\].*floating dtype.*int64"),
        ("fp64 partial", [sum_p[0].double()], [x], "sum", r"acc\[0\].*float32 with partials\[0\] torch.float64"),
        ("bf16 out", lse_p, [out.bfloat16(), lse], "lse", r"acc\[0\] \(out\) must be fp32.*bfloat16"),
        ("fp64 lse", lse_p, [out, lse.double()], "lse", r"acc\[1\] \(lse\) must be fp32.*float64"),
        ("same tensor", [sum_p[0], sum_p[0]], [x, x], "sum", r"acc\[1\] and acc\[0\] may overlap"),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _bad_cases()[1]])
def test_inplace_refuses_bad_accumulators(name):
    """Each refusal names the argument and the value."""
    r, cases = _bad_cases()
    _, partials, acc, op, match = next(c for c in cases if c[0] == name)
    with pytest.raises(ValueError, match=match):
        group_reduce(partials, r.send_index, r.split, acc, LocalGroup(r.P), op=op, inplace=True)


def test_inplace_accepts_disjoint_rows_of_one_storage():
    """Two accumulators in one storage are fine when they share no element (row ranges, interleaved
    rows of one layout); refused when they may."""
    P, N = 3, 5
    r = random_routing(P, N, 1)
    parts = [torch.randn(P, r.recv_capacity, 4), torch.randn(P, r.recv_capacity, 4)]
    for pick in (lambda buf: [buf[:, :N], buf[:, N:]], lambda buf: [buf[:, 0:2 * N:2], buf[:, 1:2 * N:2]]):
        buf = torch.randn(P, 2 * N, 4, generator=torch.Generator().manual_seed(0))
        want = group_reduce(parts, r.send_index, r.split, [t.clone() for t in pick(buf)], LocalGroup(P), op="sum")
        got = group_reduce(parts, r.send_index, r.split, pick(buf), LocalGroup(P), op="sum", inplace=True)
        assert all(_same_bits(w, g) for w, g in zip(want, got))
    buf = torch.zeros(P, 2 * N, 4)
    for bad in ([buf[:, 1:N + 1], buf[:, :N]],                       # one layout, shifted by a row
                [buf[:, :N], buf[:, 0:2 * N:2]]):                   # two layouts whose bytes meet
        with pytest.raises(ValueError, match=r"acc\[1\] and acc\[0\] may overlap"):
            group_reduce(parts, r.send_index, r.split, bad, LocalGroup(P), op="sum", inplace=True)


def _rank_received_rows_only(rank, P, seed, transport):
    """On a gloo rank: the reduce with partials of only the rows this rank received (``recv_capacity``
    the cast's), in place and out of place, next to the whole receive buffer's."""
    r = random_routing(P, 6, seed)
    hs = host_splits(r.split)
    group = TorchGroup(transport=transport)
    n_recv = int(r.split[:, rank].sum())
    res = {}
    for op in ("lse", "sum"):
        partials, big = (_lse_inputs if op == "lse" else _sum_inputs)(P, 6, seed, r.recv_capacity)
        whole = [p[rank] for p in partials]
        filled = [p[rank, :n_recv].clone() for p in partials]
        acc = [b[rank].narrow(0, 0, 6) for b in big]
        res[op, "whole"] = group_reduce(whole, r.send_index[rank], r.split, acc, group, op=op, host_split=hs,
                                        phase=f"{op}.whole")
        res[op, "filled"] = group_reduce(filled, r.send_index[rank], r.split, acc, group, op=op, host_split=hs,
                                         phase=f"{op}.filled", recv_capacity=r.recv_capacity)
        into = [a.clone() for a in acc]
        group_reduce([p.clone() for p in filled], r.send_index[rank], r.split, into, group, op=op, host_split=hs,
                     phase=f"{op}.into", recv_capacity=r.recv_capacity, inplace=True)
        res[op, "into"] = into
        if n_recv:  # one row short of what it received: refused by name
            try:
                group_reduce([p[:n_recv - 1] for p in filled], r.send_index[rank], r.split, acc, group, op=op,
                             host_split=hs, phase=f"{op}.short", recv_capacity=r.recv_capacity)
                res[op, "short"] = None
            except ValueError as e:
                res[op, "short"] = str(e)
        res[op, "bytes"] = (group.traffic(f"{op}.whole"), group.traffic(f"{op}.filled"))
    group.wait_sends()
    return res


@pytest.mark.parametrize("transport", ["p2p", "a2a"])
def test_torch_group_reduces_partials_of_the_received_rows_only(transport):
    """``group_reduce(recv_capacity=)`` on TorchGroup: partials holding only the rows a rank received
    give the bits of the whole receive buffer's, in place too, and move the same bytes; fewer rows
    than it received are refused, naming both counts."""
    P, seed = 3, 4
    got = run_ranks(_rank_received_rows_only, P, seed, transport, timeout=60)
    r = random_routing(P, 6, seed)
    for rank, res in enumerate(got):
        n_recv = int(r.split[:, rank].sum())
        assert 0 < n_recv < r.recv_capacity
        for op in ("lse", "sum"):
            for i, (w, f, x) in enumerate(zip(res[op, "whole"], res[op, "filled"], res[op, "into"])):
                assert _same_bits(w, f), f"rank {rank} {op}[{i}]: received rows only differ from the whole buffer"
                assert _same_bits(w, x), f"rank {rank} {op}[{i}]: in place differs"
            assert res[op, "bytes"][0] == res[op, "bytes"][1]
            assert res[op, "short"] is not None and f"returns the {n_recv} rows it received" in res[op, "short"] \
                and f"partials hold {n_recv - 1}" in res[op, "short"], res[op, "short"]


def test_recv_capacity_refused_where_whole_buffers_move():
    """LocalGroup moves whole receive buffers: partials must hold recv_capacity rows; and recv_capacity
    below the partials' rows, or not an int, is refused by name."""
    P, N = 3, 5
    r = random_routing(P, N, 1)
    cap = r.recv_capacity
    partials, x = [torch.randn(P, cap, 4)], torch.zeros(P, N, 4)
    with pytest.raises(ValueError, match=rf"LocalGroup moves whole receive buffers.*recv_capacity={cap + 1}.*got {cap}"):
        group_reduce(partials, r.send_index, r.split, [x], LocalGroup(P), op="sum", recv_capacity=cap + 1)
    for bad in (cap - 1, 2.0, True):
        with pytest.raises(ValueError, match=rf"recv_capacity must be an int >= the partials' {cap} rows, got {bad!r}"):
            group_reduce(partials, r.send_index, r.split, [x], LocalGroup(P), op="sum", recv_capacity=bad)
    same = group_reduce(partials, r.send_index, r.split, [x], LocalGroup(P), op="sum", recv_capacity=cap)
    plain = group_reduce(partials, r.send_index, r.split, [x], LocalGroup(P), op="sum")
    assert _same_bits(same[0], plain[0])
