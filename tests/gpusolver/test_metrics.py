"""evaluate against a brute-force recompute; owner-computes; check_assignment."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusolver.metrics import PlanMetrics, check_assignment, evaluate, owner_computes_assignment
from gpusolver.problem import BlockAreas, CommCost
from gpusolver.transfers import transfer_ranges
from tests._testing import assert_close


def areas_from_dense(dense: torch.Tensor, cp_size: int) -> BlockAreas:
    """BlockAreas of a dense [G, S, S] bool mask (plain loops, for tests)."""
    G, S, _ = dense.shape
    c = S // cp_size
    area = torch.zeros(G, cp_size, cp_size, dtype=torch.int64)
    q_need = torch.zeros(G, cp_size, cp_size, 2, dtype=torch.int64)
    k_need = torch.zeros(G, cp_size, cp_size, 2, dtype=torch.int64)
    for g in range(G):
        for i in range(cp_size):
            for j in range(cp_size):
                blk = dense[g, i * c:(i + 1) * c, j * c:(j + 1) * c]
                area[g, i, j] = int(blk.sum())
                if area[g, i, j]:
                    rows = blk.any(dim=1).nonzero().flatten()
                    cols = blk.any(dim=0).nonzero().flatten()
                    q_need[g, i, j] = torch.tensor([int(rows[0]), int(rows[-1]) + 1])
                    k_need[g, i, j] = torch.tensor([int(cols[0]), int(cols[-1]) + 1])
    return BlockAreas(area, q_need, k_need, c).validate()


def random_instance(seed: int, G: int, P: int, c: int, density: float = 0.6, tiles: int = 1):
    """Random areas / needs (area > 0 iff non-empty needs) and a random valid assignment.

    With ``tiles`` n: U = n * P units of c tokens each (unit u on rank u // n)."""
    rng = np.random.default_rng(seed)
    U = P * tiles
    area = torch.zeros(G, U, U, dtype=torch.int64)
    q_need = torch.zeros(G, U, U, 2, dtype=torch.int64)
    k_need = torch.zeros(G, U, U, 2, dtype=torch.int64)
    asg = torch.full((G, U, U), -1, dtype=torch.int32)
    for g in range(G):
        for i in range(U):
            for j in range(U):
                if rng.random() >= density:
                    continue
                qlo, qhi = sorted(rng.choice(c + 1, size=2, replace=False).tolist())
                klo, khi = sorted(rng.choice(c + 1, size=2, replace=False).tolist())
                q_need[g, i, j] = torch.tensor([qlo, qhi])
                k_need[g, i, j] = torch.tensor([klo, khi])
                area[g, i, j] = int(rng.integers(max(qhi - qlo, khi - klo), (qhi - qlo) * (khi - klo) + 1))
                asg[g, i, j] = int(rng.integers(0, P))
    return BlockAreas(area, q_need, k_need, c, tiles).validate(), asg


def brute_force(areas: BlockAreas, asg: torch.Tensor, cost: CommCost) -> dict:
    """The metrics recomputed with Python loops over tasks (unit u lives on rank u // tiles)."""
    G, P, c, n = areas.head_groups, areas.cp_size, areas.chunk, areas.tiles
    U = P * n
    load = [0] * P
    local = 0
    hull = {}  # (kind, g, unit, dest) -> [lo, hi]
    for g in range(G):
        for i in range(U):
            for j in range(U):
                a = int(areas.area[g, i, j])
                if a == 0:
                    continue
                r = int(asg[g, i, j])
                load[r] += a
                if r == i // n == j // n:
                    local += a
                for kind, unit, need in (("qo", i, areas.q_need[g, i, j]), ("kv", j, areas.k_need[g, i, j])):
                    if r == unit // n:
                        continue
                    lo, hi = int(need[0]), int(need[1])
                    old = hull.get((kind, g, unit, r))
                    hull[(kind, g, unit, r)] = [lo, hi] if old is None else [min(old[0], lo), max(old[1], hi)]

    def volumes(whole_chunk: bool):
        fs, fr, bs, br = [0] * P, [0] * P, [0] * P, [0] * P
        for (kind, g, unit, dest), (lo, hi) in hull.items():
            host = unit // n
            rows = hi - lo
            if rows <= 0:
                continue
            if whole_chunk:
                rows = c
            if kind == "qo":
                fs[host] += rows * cost.q_fwd; fr[dest] += rows * cost.q_fwd
                fs[dest] += rows * cost.o_fwd; fr[host] += rows * cost.o_fwd
                bs[host] += rows * cost.q_bwd; br[dest] += rows * cost.q_bwd
                bs[dest] += rows * cost.dq_bwd; br[host] += rows * cost.dq_bwd
            else:
                fs[host] += rows * cost.kv_fwd; fr[dest] += rows * cost.kv_fwd
                bs[host] += rows * cost.kv_bwd; br[dest] += rows * cost.kv_bwd
                bs[dest] += rows * cost.dkv_bwd; br[host] += rows * cost.dkv_bwd
        return fs, fr, bs, br

    fs, fr, bs, br = volumes(False)
    cfs, cfr, cbs, cbr = volumes(True)
    total = sum(load)
    return dict(
        load=load, fwd_send=fs, fwd_recv=fr, bwd_send=bs, bwd_recv=br,
        fwd_bottleneck=max(max(a, b) for a, b in zip(fs, fr)),
        bwd_bottleneck=max(max(a, b) for a, b in zip(bs, br)),
        imbalance=max(load) / (total / P) if total else 1.0,
        local_fraction=local / total if total else 1.0,
        fwd_bottleneck_chunk=max(max(a, b) for a, b in zip(cfs, cfr)),
        bwd_bottleneck_chunk=max(max(a, b) for a, b in zip(cbs, cbr)),
    )


def assert_matches(ref: dict, m: PlanMetrics):
    for key in ("load", "fwd_send", "fwd_recv", "bwd_send", "bwd_recv"):
        assert_close(key, torch.tensor(ref[key], dtype=torch.int64), getattr(m, key))
    for key in ("fwd_bottleneck", "bwd_bottleneck", "fwd_bottleneck_chunk", "bwd_bottleneck_chunk"):
        assert getattr(m, key).dtype == torch.int64 and getattr(m, key).dim() == 0
        assert int(getattr(m, key)) == ref[key], key
    for key in ("imbalance", "local_fraction"):
        assert getattr(m, key).dtype == torch.float64 and getattr(m, key).dim() == 0
        assert_close(key, torch.tensor(ref[key], dtype=torch.float64), getattr(m, key), atol=1e-12, rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), G=st.integers(1, 3), P=st.integers(1, 5), c=st.integers(1, 9),
       density=st.sampled_from([0.0, 0.3, 0.8, 1.0]), tiles=st.sampled_from([1, 1, 2, 3]), keep=st.booleans())
def test_evaluate_matches_brute_force(seed, G, P, c, density, tiles, keep):
    areas, asg = random_instance(seed, G, P, c, density, tiles)
    cost = CommCost(num_heads_q=4 * G, num_heads_kv=2 * G, head_dim=3, dtype_bytes=2, head_groups=G,
                    keep_forward_buffers=keep)
    check_assignment(areas, asg)
    assert_matches(brute_force(areas, asg, cost), evaluate(areas, asg, cost))


def test_evaluate_hand_case():
    # P=2, G=1, c=4: one task (0, 0, 1) on rank 1 needing rows [1, 3), cols [0, 4)
    area = torch.zeros(1, 2, 2, dtype=torch.int64)
    q_need = torch.zeros(1, 2, 2, 2, dtype=torch.int64)
    k_need = torch.zeros(1, 2, 2, 2, dtype=torch.int64)
    area[0, 0, 1] = 5
    q_need[0, 0, 1] = torch.tensor([1, 3])
    k_need[0, 0, 1] = torch.tensor([0, 4])
    areas = BlockAreas(area, q_need, k_need, 4)
    cost = CommCost(num_heads_q=2, num_heads_kv=1, head_dim=2, dtype_bytes=2, head_groups=1)
    # q_fwd = 8, o_fwd = 2 * (4 + 4) = 16, q_bwd = 2 * (4 + 8) = 24 (dO, lse, delta), dq_bwd = 8
    assert (cost.q_fwd, cost.o_fwd, cost.q_bwd, cost.dq_bwd, cost.kv_fwd) == (8, 16, 24, 8, 8)
    asg = torch.tensor([[[-1, 1], [-1, -1]]], dtype=torch.int32)
    m = evaluate(areas, asg, cost)
    # 2 Q rows 0 -> 1: rank 0 sends 16 (Q), receives 32 (O); KV stays on rank 1
    assert m.to_dict()["fwd_send"] == [16, 32] and m.to_dict()["fwd_recv"] == [32, 16]
    assert m.to_dict()["bwd_send"] == [48, 16] and m.to_dict()["bwd_recv"] == [16, 48]
    assert int(m.fwd_bottleneck) == 32 and int(m.bwd_bottleneck) == 48
    # whole chunk: 4 rows instead of 2
    assert int(m.fwd_bottleneck_chunk) == 64 and int(m.bwd_bottleneck_chunk) == 96
    assert m.to_dict()["load"] == [0, 5] and float(m.imbalance) == 2.0 and float(m.local_fraction) == 0.0


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recast"])
def test_evaluate_backward_protocols(keep):
    # P=2, G=1, c=4, hq=2, hkv=1, D=2, b=2. Rank 1 computes two tasks of rank 0's units:
    # (0, 0, 1) needs Q rows [1, 3) of chunk 0 (2 QO tokens 0 -> 1; its KV is local) and
    # (0, 1, 0) needs K columns [1, 4) of chunk 0 (3 KV tokens 0 -> 1; its QO is local)
    area = torch.zeros(1, 2, 2, dtype=torch.int64)
    q_need = torch.zeros(1, 2, 2, 2, dtype=torch.int64)
    k_need = torch.zeros(1, 2, 2, 2, dtype=torch.int64)
    area[0, 0, 1], q_need[0, 0, 1], k_need[0, 0, 1] = 5, torch.tensor([1, 3]), torch.tensor([0, 4])
    area[0, 1, 0], q_need[0, 1, 0], k_need[0, 1, 0] = 6, torch.tensor([0, 4]), torch.tensor([1, 4])
    areas = BlockAreas(area, q_need, k_need, 4)
    cost = CommCost(2, 1, 2, 2, 1, keep_forward_buffers=keep)
    asg = torch.tensor([[[-1, 1], [1, -1]]], dtype=torch.int32)
    d = evaluate(areas, asg, cost).to_dict()
    # forward: rank 0 sends 2 * 8 (Q) + 3 * 8 (K, V) = 40 and receives 2 * 16 (O, lse) = 32
    assert d["fwd_send"] == [40, 32] and d["fwd_recv"] == [32, 40]
    if keep:
        # rank 0 sends 2 * 2 * (4 + 8) = 48 (dO, lse, delta) and no K, V; it receives
        # 2 * 8 (dQ) + 3 * 8 (dK, dV) = 40
        assert (cost.q_bwd, cost.dq_bwd, cost.kv_bwd, cost.dkv_bwd) == (24, 8, 0, 8)
        assert d["bwd_send"] == [48, 40] and d["bwd_recv"] == [40, 48]
        assert d["bwd_bottleneck"] == 48 and d["bwd_bottleneck_chunk"] == 4 * 24
    else:
        # Q (2 * 8) and K, V (3 * 8) go out again: 48 + 16 + 24 = 88
        assert (cost.q_bwd, cost.dq_bwd, cost.kv_bwd, cost.dkv_bwd) == (32, 8, 8, 8)
        assert d["bwd_send"] == [88, 40] and d["bwd_recv"] == [40, 88]
        assert d["bwd_bottleneck"] == 88 and d["bwd_bottleneck_chunk"] == 4 * 32 + 4 * 8


def test_evaluate_on_meta():
    G, P, c = 2, 8, 16
    areas = BlockAreas(torch.empty(G, P, P, dtype=torch.int64, device="meta"),
                       torch.empty(G, P, P, 2, dtype=torch.int64, device="meta"),
                       torch.empty(G, P, P, 2, dtype=torch.int64, device="meta"), c)
    cost = CommCost(16, 8, 128, 2, G)
    asg = owner_computes_assignment(areas)
    assert asg.device.type == "meta" and asg.dtype == torch.int32 and asg.shape == (G, P, P)
    m = evaluate(areas, asg, cost)
    for key in ("load", "fwd_send", "fwd_recv", "bwd_send", "bwd_recv"):
        t = getattr(m, key)
        assert t.device.type == "meta" and t.shape == (P,) and t.dtype == torch.int64, key
    for key in ("fwd_bottleneck", "bwd_bottleneck", "fwd_bottleneck_chunk", "bwd_bottleneck_chunk"):
        t = getattr(m, key)
        assert t.device.type == "meta" and t.shape == () and t.dtype == torch.int64, key
    for key in ("imbalance", "local_fraction"):
        t = getattr(m, key)
        assert t.device.type == "meta" and t.shape == () and t.dtype == torch.float64, key


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recast"])
@pytest.mark.parametrize("G,P,S", [(1, 4, 32), (2, 3, 21)])
def test_owner_computes_no_qo_traffic(G, P, S, keep):
    dense = torch.ones(S, S, dtype=torch.bool).tril()[None].repeat(G, 1, 1)
    dense[-1, :, : S // 3] = False  # groups differ
    areas = areas_from_dense(dense, P)
    asg = owner_computes_assignment(areas)
    check_assignment(areas, asg)
    ref = torch.arange(P, dtype=torch.int32).view(1, P, 1).expand(G, P, P)
    assert_close("owner asg", torch.where(areas.area > 0, ref, -1).int(), asg)
    qo_range, kv_range = transfer_ranges(areas, asg)
    assert int(qo_range.abs().sum()) == 0
    cost = CommCost(4 * G, 2 * G, 4, 2, G, keep_forward_buffers=keep)
    m = evaluate(areas, asg, cost)
    kv_tokens = int((kv_range[..., 1] - kv_range[..., 0]).sum())
    assert kv_tokens > 0
    assert int(m.fwd_send.sum()) == int(m.fwd_recv.sum()) == kv_tokens * cost.kv_fwd
    if keep:  # only dK, dV, the forward's K, V reversed
        assert_close("bwd_send", m.fwd_recv, m.bwd_send)
        assert_close("bwd_recv", m.fwd_send, m.bwd_recv)
    else:
        assert int(m.bwd_send.sum()) == int(m.bwd_recv.sum()) == 2 * kv_tokens * cost.kv_fwd
    assert_close("owner load", areas.area.sum(dim=(0, 2)), m.load)
    assert_matches(brute_force(areas, asg, cost), m)


def test_single_rank_is_local():
    areas = areas_from_dense(torch.ones(2, 6, 6, dtype=torch.bool).tril(), 1)
    m = evaluate(areas, owner_computes_assignment(areas), CommCost(4, 2, 2, 2, 2))
    assert float(m.local_fraction) == 1.0 and float(m.imbalance) == 1.0
    assert int(m.fwd_bottleneck) == 0 and int(m.bwd_bottleneck_chunk) == 0


def test_no_work():
    areas = areas_from_dense(torch.zeros(1, 8, 8, dtype=torch.bool), 2)
    m = evaluate(areas, owner_computes_assignment(areas), CommCost(2, 1, 2, 2, 1))
    d = m.to_dict()
    assert d["imbalance"] == 1.0 and d["local_fraction"] == 1.0 and d["load"] == [0, 0]
    assert isinstance(d["fwd_bottleneck"], int) and isinstance(d["imbalance"], float)


def test_summary_and_chunk_bound():
    areas, asg = random_instance(3, 2, 4, 8)
    m = evaluate(areas, asg, CommCost(8, 2, 4, 2, 2))
    text = m.summary()
    assert "imbalance" in text and len(text.splitlines()) == 3 + 4
    assert int(m.fwd_bottleneck_chunk) >= int(m.fwd_bottleneck) > 0
    assert int(m.bwd_bottleneck_chunk) >= int(m.bwd_bottleneck) > 0


def test_check_assignment_errors():
    areas, asg = random_instance(1, 1, 3, 4, density=1.0)
    with pytest.raises(ValueError, match=r"assignment must be \[G, P, P\]"):
        check_assignment(areas, asg[0])
    with pytest.raises(ValueError, match="integer"):
        check_assignment(areas, asg.float())
    bad = asg.clone()
    bad[0, 2, 1] = 3
    with pytest.raises(ValueError, match=r"assignment\[0, 2, 1\] = 3 .* \[0, 3\)"):
        check_assignment(areas, bad)
    bad[0, 2, 1] = -1
    with pytest.raises(ValueError, match=r"assignment\[0, 2, 1\] = -1"):
        check_assignment(areas, bad)
    area = areas.area.clone()
    area[0, 1, 1] = 0
    empty = BlockAreas(area, areas.q_need, areas.k_need, areas.chunk)
    with pytest.raises(ValueError, match=r"assignment\[0, 1, 1\] = \d+ .* empty .* must be -1"):
        check_assignment(empty, asg)
    with pytest.raises(ValueError, match="head_groups"):
        evaluate(areas, asg, CommCost(4, 2, 2, 2, 2))


def test_evaluate_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    areas, asg = random_instance(5, 2, 4, 8)
    cost = CommCost(8, 2, 4, 2, 2)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = BlockAreas(mode.from_tensor(areas.area), mode.from_tensor(areas.q_need),
                          mode.from_tensor(areas.k_need), areas.chunk)
        m = evaluate(fake, owner_computes_assignment(fake), cost)
        assert m.fwd_send.shape == (4,) and m.imbalance.dtype == torch.float64
