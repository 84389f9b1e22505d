"""LocalGroup against the plain-python oracle: cast, reduce (sum, lse), meta device, counters, errors."""
import pytest
import torch

from groupcomm import LocalGroup, Work, group_cast, group_reduce, neutral_rows
from groupcomm._merge import fused_reduce
from tests._testing import assert_close
from tests.groupcomm._cases import oracle_cast, oracle_lse, oracle_sum, random_routing

CASES = [(3, 5, 0), (4, 7, 1), (5, 6, 2), (5, 1, 3)]  # (P, N, seed)
IDS = [f"P{p}-N{n}-seed{s}" for p, n, s in CASES]


def _rows(P, N, g):
    """Three tensors with different dtypes and trailing shapes."""
    return [torch.randn(P, N, 3, generator=g),
            torch.randn(P, N, 2, 3, generator=g).to(torch.bfloat16),
            torch.randint(-100, 100, (P, N), generator=g)]


@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_cast_matches_oracle(P, N, seed):
    r = random_routing(P, N, seed)
    x = _rows(P, N, torch.Generator().manual_seed(seed))
    tri = group_cast(x, r.send_index, r.split, r.recv_capacity, LocalGroup(P))
    assert len(tri) == len(x)
    for i, (t, got) in enumerate(zip(x, tri)):
        ref = oracle_cast(t, r)
        assert got.dtype == t.dtype
        assert torch.equal(ref, got), f"tensor {i}"


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_reduce_sum_matches_oracle(P, N, seed, deterministic):
    r = random_routing(P, N, seed)
    g = torch.Generator().manual_seed(seed + 10)
    # every receive row is filled, even past the fill: those rows must be ignored
    partials = [torch.randn(P, r.recv_capacity, 4, generator=g),
                torch.randn(P, r.recv_capacity, 2, 2, generator=g).to(torch.bfloat16)]
    acc = [torch.randn(P, N, 4, generator=g), torch.randn(P, N, 2, 2, generator=g).to(torch.bfloat16)]
    before = [a.clone() for a in acc]
    tri = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op="sum",
                       deterministic=deterministic)
    for a, b in zip(acc, before):
        assert torch.equal(a, b), "acc must not be modified"
    assert tri[0].dtype == torch.float32 and tri[1].dtype == torch.bfloat16
    assert_close("sum fp32", oracle_sum(partials[0], acc[0], r).float(), tri[0])
    assert_close("sum bf16", oracle_sum(partials[1], acc[1], r).to(torch.bfloat16).float(), tri[1].float(),
                 atol=2e-2, rtol=2e-2)


def _lse_case(P, N, seed, h=2, D=3):
    """Partials and acc where some host rows have every lse -inf, some partials -inf, some lse huge."""
    r = random_routing(P, N, seed)
    g = torch.Generator().manual_seed(seed + 20)
    group = LocalGroup(P)
    host_row = torch.arange(N).expand(P, N).contiguous()
    src_row, = group_cast([host_row], r.send_index, r.split, r.recv_capacity, group)
    out_p = torch.randn(P, r.recv_capacity, h, D, generator=g)
    lse_p = torch.randn(P, r.recv_capacity, h, generator=g) * 60      # exp would overflow fp32 unshifted
    lse_p[torch.rand(lse_p.shape, generator=g) < 0.2] = float("-inf")
    out_acc = torch.randn(P, N, h, D, generator=g)
    lse_acc = torch.randn(P, N, h, generator=g) * 60
    empty = 0                                                         # host row 0 of every rank: no key anywhere
    lse_acc[:, empty] = float("-inf")
    out_acc[:, empty] = 0.0
    lse_p[src_row == empty] = float("-inf")
    out_p[src_row == empty] = 0.0
    return r, [out_p, lse_p], [out_acc, lse_acc]


@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_reduce_lse_matches_oracle(P, N, seed):
    r, partials, acc = _lse_case(P, N, seed)
    out_ref, lse_ref = oracle_lse(*partials, *acc, r)
    for det in (True, False):
        out, lse = group_reduce(partials, r.send_index, r.split, acc, LocalGroup(P), op="lse", deterministic=det)
        assert not out.isnan().any() and not lse.isnan().any()
        assert_close("lse", lse_ref.float(), lse, atol=1e-4)
        assert_close("out", out_ref.float(), out, atol=1e-5)
        assert (lse[:, 0] == float("-inf")).all() and (out[:, 0] == 0).all()


@pytest.mark.parametrize("P,N,seed", CASES[:2], ids=IDS[:2])
def test_reduce_lse_bf16_out(P, N, seed):
    r, (out_p, lse_p), (out_acc, lse_acc) = _lse_case(P, N, seed)
    out_ref, lse_ref = oracle_lse(out_p.bfloat16(), lse_p, out_acc.bfloat16(), lse_acc, r)
    out, lse = group_reduce([out_p.bfloat16(), lse_p], r.send_index, r.split, [out_acc.bfloat16(), lse_acc],
                            LocalGroup(P), op="lse")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close("out", out_ref.float(), out.float(), atol=2e-2, rtol=2e-2)
    assert_close("lse", lse_ref.float(), lse, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("op", ["sum", "lse"])
def test_neutral_accumulator_is_the_identity_without_its_memory(op, fused):
    """``neutral_rows`` (a broadcast view of one element) reduces bit for bit as the materialized
    identity (zeros; -inf for an lse) does, on the torch and the fused path, in fp32 and bf16."""
    P, N = 4, 7
    if op == "lse":
        r, partials, _ = _lse_case(P, N, 5)
        partials[0] = partials[0].bfloat16()
        like = [torch.empty(P, N, *partials[0].shape[2:], dtype=torch.bfloat16), torch.empty(P, N, partials[1].shape[2])]
        values = (0.0, float("-inf"))
    else:
        r = random_routing(P, N, 5)
        g = torch.Generator().manual_seed(5)
        partials = [torch.randn(P, r.recv_capacity, 4, generator=g),
                    torch.randn(P, r.recv_capacity, 2, 2, generator=g).bfloat16()]
        like = [torch.empty(P, N, 4), torch.empty(P, N, 2, 2, dtype=torch.bfloat16)]
        values = (0.0, 0.0)
    neutral = [neutral_rows(t, v) for t, v in zip(like, values)]
    assert all(n.untyped_storage().nbytes() == n.element_size() for n in neutral)  # one element each
    whole = [torch.full_like(t, v) for t, v in zip(like, values)]
    with fused_reduce(fused):
        got = group_reduce(partials, r.send_index, r.split, neutral, LocalGroup(P), op=op)
        want = group_reduce(partials, r.send_index, r.split, whole, LocalGroup(P), op=op)
    for g_, w in zip(got, want):
        assert g_.dtype == w.dtype and g_.shape == w.shape
        assert torch.equal(g_, w)
    assert not torch.equal(got[0], whole[0])  # the partials arrived: not a check of zeros against zeros


@pytest.mark.parametrize("op", ["sum", "lse"])
def test_deterministic_agrees_with_nondeterministic(op):
    P, N = 5, 9
    if op == "lse":
        r, partials, acc = _lse_case(P, N, 7)
    else:
        r = random_routing(P, N, 7)
        partials = [torch.randn(P, r.recv_capacity, 8)]
        acc = [torch.randn(P, N, 8)]
    group = LocalGroup(P)
    det1 = group_reduce(partials, r.send_index, r.split, acc, group, op=op, deterministic=True)
    det2 = group_reduce(partials, r.send_index, r.split, acc, group, op=op, deterministic=True)
    nondet = group_reduce(partials, r.send_index, r.split, acc, group, op=op, deterministic=False)
    for a, b, c in zip(det1, det2, nondet):
        assert torch.equal(a, b)
        assert_close(op, a, c)


def test_meta_device_runs_without_host_reads():
    P, N, h, D, cap, send_cap = 4, 6, 2, 8, 11, 9
    meta = torch.device("meta")
    split = torch.empty(P, P, dtype=torch.int64, device=meta)
    send_index = torch.empty(P, send_cap, dtype=torch.int64, device=meta)
    q = torch.empty(P, N, h, D, dtype=torch.bfloat16, device=meta)
    lse = torch.empty(P, N, h, device=meta)
    for impl_group in (LocalGroup(P),):
        got = group_cast([q, lse], send_index, split, cap, impl_group)
        assert [tuple(t.shape) for t in got] == [(P, cap, h, D), (P, cap, h)]
        assert all(t.device == meta for t in got)
        for det in (True, False):
            dq, = group_reduce([got[0]], send_index, split, [q.float()], impl_group, op="sum", deterministic=det)
            assert dq.shape == (P, N, h, D) and dq.dtype == torch.float32 and dq.device == meta
            out, l2 = group_reduce([got[0], got[1]], send_index, split, [q, lse], impl_group, op="lse",
                                   deterministic=det)
            assert out.shape == q.shape and l2.shape == lse.shape and out.device == meta
        sent, recv = impl_group.traffic("cast")
        assert sent.shape == (P,) and sent.device == meta and recv.device == meta


def test_byte_counters_hand_computed():
    split = torch.tensor([[0, 2, 1], [3, 0, 0], [1, 1, 0]])
    send_index = torch.tensor([[0, 1, 1, -1], [0, 1, 2, -1], [2, 2, -1, -1]])
    P, N, cap = 3, 4, 5
    group = LocalGroup(P)
    x = [torch.zeros(P, N, 4), torch.zeros(P, N, 2, 3, dtype=torch.bfloat16)]  # 16 + 12 = 28 bytes a row
    got = group_cast(x, send_index, split, cap, group, phase="fwd")
    sent, recv = group.traffic("fwd")
    assert sent.tolist() == [3 * 28, 3 * 28, 2 * 28]
    assert recv.tolist() == [4 * 28, 3 * 28, 1 * 28]
    group_cast(x, send_index, split, cap, group, phase="fwd")
    assert group.traffic("fwd")[0].tolist() == [6 * 28, 6 * 28, 4 * 28]
    # the reduce sends fp32 partials of 16 bytes back: helpers send what they received
    group_reduce([got[0]], send_index, split, [x[0]], group, op="sum", phase="bwd")
    sent, recv = group.traffic("bwd")
    assert sent.tolist() == [4 * 16, 3 * 16, 1 * 16]
    assert recv.tolist() == [3 * 16, 3 * 16, 2 * 16]
    assert [t.tolist() for t in group.traffic("other")] == [[0, 0, 0], [0, 0, 0]]
    group.reset_traffic()
    assert group.traffic("fwd")[0].tolist() == [0, 0, 0]


def test_cast_layout_by_hand():
    split = torch.tensor([[0, 2, 1], [3, 0, 0], [1, 1, 0]])
    send_index = torch.tensor([[0, 1, 1, -1], [0, 1, 2, -1], [2, 2, -1, -1]])
    x = (torch.arange(3)[:, None] * 10 + torch.arange(4)[None]).contiguous()    # value = 10 * rank + row
    got, = group_cast([x], send_index, torch.as_tensor(split), 5, LocalGroup(3))
    assert got.tolist() == [[10, 11, 12, 22, 0], [0, 1, 22, 0, 0], [1, 0, 0, 0, 0]]


def test_rows_past_capacity_are_dropped():
    split = torch.tensor([[0, 3], [0, 0]])
    send_index = torch.tensor([[2, 0, 1], [-1, -1, -1]])
    x = torch.tensor([[5, 6, 7], [0, 0, 0]])
    got, = group_cast([x], send_index, split, 2, LocalGroup(2))
    assert got.tolist() == [[0, 0], [7, 5]]


def test_async_op_returns_work():
    r = random_routing(3, 4, 0)
    x = [torch.randn(3, 4, 2)]
    work = group_cast(x, r.send_index, r.split, r.recv_capacity, LocalGroup(3), async_op=True)
    assert isinstance(work, Work)
    assert torch.equal(work.wait()[0], oracle_cast(x[0], r))


def test_bad_arguments_raise_value_error():
    P = 3
    r = random_routing(P, 4, 0)
    g = LocalGroup(P)
    x = torch.randn(P, 4, 2)
    cap = r.recv_capacity
    cases = [
        (lambda: group_cast([x, torch.randn(P, 5)], r.send_index, r.split, cap, g), "row count"),
        (lambda: group_cast([x], r.send_index, r.split[:2], cap, g), "split must be"),
        (lambda: group_cast([x], r.send_index, r.split.float(), cap, g), "split must be"),
        (lambda: group_cast([x], r.send_index[0], r.split, cap, g), "send_index"),
        (lambda: group_cast([x], r.send_index, r.split, -1, g), "recv_capacity"),
        (lambda: group_cast([x], r.send_index, r.split, 2.0, g), "recv_capacity"),
        (lambda: group_cast([torch.randn(2, 4, 2)], r.send_index, r.split, cap, g), "leading dim"),
        (lambda: group_cast([], r.send_index, r.split, cap, g), "non-empty"),
        (lambda: group_cast(x, r.send_index, r.split, cap, g), "non-empty list"),
        (lambda: group_reduce([torch.randn(P, cap, 2)], r.send_index, r.split, [x], g, op="max"), "op"),
        (lambda: group_reduce([torch.randn(P, cap, 3)], r.send_index, r.split, [x], g, op="sum"), "trailing"),
        (lambda: group_reduce([torch.randn(P, cap, 2)], r.send_index, r.split, [x, x], g, op="sum"), "pair"),
        (lambda: group_reduce([torch.randn(P, cap, 2, 2)], r.send_index, r.split, [torch.randn(P, 4, 2, 2)], g,
                              op="lse"), "(out, lse)"),
        (lambda: LocalGroup(0), "P must be"),
        (lambda: LocalGroup(2, impl="cuda"), "impl"),
    ]
    for fn, text in cases:
        with pytest.raises(ValueError, match=None) as info:
            fn()
        assert text in str(info.value), f"{text!r} not in {info.value}"


def test_fake_tensor_mode_without_shape_env():
    from torch._subclasses.fake_tensor import FakeTensorMode
    P, N, cap, send_cap = 3, 5, 7, 6
    with FakeTensorMode():
        split = torch.zeros(P, P, dtype=torch.int64)
        send_index = torch.zeros(P, send_cap, dtype=torch.int64)
        x = torch.zeros(P, N, 2, 4)
        lse = torch.zeros(P, N, 2)
        got = group_cast([x, lse], send_index, split, cap, LocalGroup(P))
        out, l2 = group_reduce(got, send_index, split, [x, lse], LocalGroup(P), op="lse")
    assert got[0].shape == (P, cap, 2, 4) and out.shape == x.shape and l2.shape == lse.shape


def test_package_imports_only_torch_triton_and_stdlib():
    import ast
    import pathlib
    import sys

    import groupcomm
    allowed = {"torch", "triton", "groupcomm"} | set(sys.stdlib_module_names)
    for path in pathlib.Path(groupcomm.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


@pytest.mark.parametrize("first_row", [0, 1, 4, 9, 100])
@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_tail_cast_is_the_full_cast_past_first_row(P, N, seed, first_row):
    from groupcomm import tail_routing

    r = random_routing(P, N, seed)
    x = _rows(P, N, torch.Generator().manual_seed(seed))
    full = group_cast(x, r.send_index, r.split, r.recv_capacity, LocalGroup(P))
    split_t, index_t = tail_routing(r.split, r.send_index, torch.arange(P), first_row)
    cap = max(r.recv_capacity - first_row, 0)
    tail = group_cast(x, index_t, split_t, cap, LocalGroup(P))
    assert int(split_t.sum()) == int((r.split.sum(0) - first_row).clamp(min=0).sum())
    for f, t in zip(full, tail):
        assert torch.equal(f[:, first_row:], t)


@pytest.mark.parametrize("P,N,seed", CASES, ids=IDS)
def test_tail_cast_per_destination_first_row(P, N, seed):
    """``first_row`` per destination: rank d's tail is the full cast's rows from ``first_row[d]`` on,
    landing there with ``recv_offset`` (each rank past its own kept rows)."""
    from groupcomm import tail_routing

    r = random_routing(P, N, seed)
    g = torch.Generator().manual_seed(seed + 7)
    x = _rows(P, N, g)
    full = group_cast(x, r.send_index, r.split, r.recv_capacity, LocalGroup(P))
    first = torch.randint(0, r.recv_capacity + 1, (P,), generator=g)
    split_t, index_t = tail_routing(r.split, r.send_index, torch.arange(P), first)
    assert torch.equal(split_t.sum(0), (r.split.sum(0) - first).clamp(min=0))
    tail = group_cast(x, index_t, split_t, r.recv_capacity, LocalGroup(P), recv_offset=first)
    for f, t in zip(full, tail):
        for d in range(P):
            a = int(first[d])
            assert torch.equal(f[d, a:], t[d, a:]) and not t[d, :a].any(), d
