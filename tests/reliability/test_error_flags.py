"""Device error flags: recorded without a host read, read once by check_errors(), first error first."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

from attn_kernels import flex_attn
from gpusolver import SolverConfig, block_areas, check_errors, errors
from gpusolver.masks import AttnSlices, causal_mask
from gpusolver.runtime import DynamicCPAttention, shard
from groupcomm import LocalGroup, group_cast
from tests.reliability._cases import D, clean_flags, flagged, qkv, quiet, slices



@pytest.fixture(autouse=True)
def _flags():
    with clean_flags():
        yield


def _bad_ranges():
    return (torch.tensor([[0, 64], [0, 64]], dtype=torch.int32), torch.tensor([[0, 32], [32, 99]], dtype=torch.int32),
            torch.tensor([0, 0], dtype=torch.int32))


def test_recording_reads_nothing_on_the_host(counter):
    q, k, v = qkv(64, 64)
    mask = slices([(0, 8, 0, 8, 1), (8, 20, 8, 16, 5)], 16)
    with counter() as c:
        flex_attn(q, k, v, *_bad_ranges(), validate=False)
        block_areas(mask, 2)
        group_cast([torch.randn(2, 3, 4)], torch.tensor([[0, 1, 2], [0, -1, -1]]), torch.tensor([[0, 3], [1, 0]]),
                   2, LocalGroup(2))
    assert c.host_reads == 0, c.by_op
    msg = flagged("flex_attn: k_ranges")
    assert "also: block_areas:" in msg and "group_cast" in msg    # every error listed, first in time first


@pytest.mark.parametrize("grouped", [False, True])
def test_one_launch_check_equals_the_torch_check(counter, grouped):
    """The Triton slice check (CUDA's path; the interpreter here) flags the same row and values."""
    g = torch.Generator().manual_seed(1)
    R, S = 3000, 100
    q = torch.sort(torch.randint(0, S + 1, (R, 2), generator=g), 1).values.int()
    k = torch.sort(torch.randint(0, S + 1, (R, 2), generator=g), 1).values.int()
    t = torch.randint(0, 4, (R,), generator=g).int()
    k[2500, 1], q[2900] = S + 3, torch.tensor([9, 2])
    mask = AttnSlices(*(x.view(2, R // 2, *x.shape[1:]) for x in (q, k, t)), S, S) if grouped else \
        AttnSlices(q, k, t, S, S)
    got = []
    for impl in ("torch", "triton"):
        errors.reset()
        with counter() as c:
            errors.record_slices("block_areas", mask, impl=impl)
        got.append(errors.pending()[0])
        if impl == "triton":
            assert c.triton_launches == 1 and c.host_reads == 0
    for key in ("row", "values", "hits", "message"):
        assert got[0][key] == got[1][key], key
    where = "[group 1] row 1000" if grouped else "row 2500"
    assert got[1]["message"] == f"block_areas: k_ranges {where}: [{int(k[2500, 0])}, 103) is outside " \
        "[0, total_seqlen_k=100)"


# one bad row: (which column it breaks, how)
_BREAKS = [("q", "negative"), ("q", "reversed"), ("q", "past"), ("k", "negative"), ("k", "reversed"),
           ("k", "past"), ("t", "negative"), ("t", "past")]


def _slice_table(seed: int, n: int, S: int, bad: list[tuple[int, int]], dtype, strided: bool):
    """n valid rows over S tokens with ``bad`` = [(row, index into _BREAKS)] broken."""
    g = torch.Generator().manual_seed(seed)
    q = torch.sort(torch.randint(0, S + 1, (n, 2), generator=g), 1).values
    k = torch.sort(torch.randint(0, S + 1, (n, 2), generator=g), 1).values
    t = torch.randint(0, 4, (n,), generator=g)
    for row, how in bad:
        col, kind = _BREAKS[how]
        if col == "t":
            t[row] = -1 if kind == "negative" else 4 + row % 3
            continue
        r = q if col == "q" else k
        r[row] = torch.tensor({"negative": [-1 - row % 5, 1], "reversed": [S, S - 1 - row % S],
                               "past": [0, S + 1 + row % 7]}[kind])
    if strided:  # non-contiguous views, as a caller's slice of a wider table gives
        q, k, t = (torch.stack([x, x], -1)[..., 0] for x in (q, k, t))
    return q.to(dtype), k.to(dtype), t.to(dtype)


@given(st.data())
def test_one_launch_check_leaves_the_table_the_torch_check_leaves(data):
    """Every word of the flag table after the Triton check (interpreted) equals the torch reference's,
    over two checks in a row (the first hit kept, hits counted, the clock ticking on clean checks too)."""
    S = data.draw(st.integers(1, 50), label="S")
    checks = []
    for _ in range(2):
        n = data.draw(st.sampled_from([1, 2, 7, 1023, 1024, 1025, 2100]), label="rows")
        bad = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, len(_BREAKS) - 1)),
                                 max_size=3), label="bad rows")
        dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="dtype")
        groups = data.draw(st.sampled_from([g for g in (1, 2, 5) if n % g == 0]), label="groups")
        q, k, t = _slice_table(data.draw(st.integers(0, 2**16), label="seed"), n, S, bad, dtype,
                               data.draw(st.booleans(), label="strided"))
        rows = n // groups if groups > 1 else 0
        if groups > 1:
            q, k, t = q.reshape(groups, -1, 2), k.reshape(groups, -1, 2), t.reshape(groups, -1)
        checks.append((q, k, t, rows))
    tables = []
    for impl in ("torch", "triton"):
        errors.reset()
        for q, k, t, rows in checks:
            errors.record_slice_table("block_areas", "mask", errors._slices_message, q, k, t, S, S, rows, impl=impl)
        tables.append(errors._table(torch.device("cpu")).clone())
    assert torch.equal(tables[0], tables[1]), (tables[0] != tables[1]).nonzero().tolist()


def test_first_error_in_time_and_hit_counts():
    q, k, v = qkv(64, 64)
    block_areas(slices([(0, 8, 0, 8, 9)], 8), 1)                  # first: a bad type in a mask
    for _ in range(3):
        flex_attn(q, k, v, *_bad_ranges(), validate=False)       # then three bad kernel calls
    found = errors.pending()
    assert [e["op"] for e in found] == ["block_areas", "flex_attn"]
    assert found[1]["hits"] == 3 and found[1]["row"] == 1 and found[1]["values"][:4] == [1, 32, 99, 64]
    msg = flagged(r"^block_areas: attn_type row 0: code 9")
    assert "also: flex_attn: k_ranges[1] = [32, 99)" in msg


def test_clean_calls_flag_nothing():
    q, k, v = qkv(64, 64)
    qr, kr, t = _bad_ranges()
    kr[1, 1] = 64
    flex_attn(q, k, v, qr, kr, t, validate=False)
    block_areas(causal_mask(64), 4, 2)
    assert errors.pending() == []
    check_errors()


def test_meta_and_fake_tensors_record_nothing():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = (x.to("meta") for x in qkv(64, 64))
    flex_attn(q, k, v, *(x.to("meta") for x in _bad_ranges()), validate=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fq, fk, fv = qkv(64, 64)
        block_areas(AttnSlices(torch.tensor([[0, 8]]), torch.tensor([[0, 99]]), torch.tensor([0]), 8, 8), 1)
    assert errors.pending() == []


def test_flags_under_torch_compile_without_recompiling():
    """flex_attn compiled with fullgraph records its flags in the graph; new bad values do not recompile."""
    torch._dynamo.reset()
    q, k, v = qkv(64, 64)

    def layer(q, k, v, qr, kr, t):
        out, lse = flex_attn(q, k, v, qr, kr, t, validate=False)
        return out * 2, lse

    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=cnt, fullgraph=True)
    qr, kr, t = _bad_ranges()
    compiled(q, k, v, qr, kr, t)
    flagged(r"flex_attn: k_ranges\[1\] = \[32, 99\)")
    t[0] = 5
    kr[1, 1] = 64
    compiled(q, k, v, qr, kr, t)
    flagged(r"flex_attn: attn_type\[0\] = 5")
    assert cnt.frame_count == 1


def test_module_checks_every_n_calls():
    P, Hq, Hkv = 2, 2, 1
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32)
    with pytest.raises(ValueError, match="check_every must be a positive int"):
        DynamicCPAttention(LocalGroup(P), config, check_every=0)
    attn = DynamicCPAttention(LocalGroup(P), config, validate=False, solver="reference", check_every=2)
    bad = slices([(0, 16, 0, 16, 1), (16, 32, 16, 32, 6)], 32)
    q, k, v = (shard(x, attn.group) for x in qkv(32, 32, Hq, Hkv))
    with quiet():
        attn(q, k, v, bad)                               # call 1: flagged, not read yet
        assert errors.pending()
        with pytest.raises(ValueError, match=r"attn_type row 1: code 6"):
            attn(q, k, v, bad)                           # call 2: the check reads and raises
        assert errors.pending() == []
