"""The Triton offers step equals its torch twin exactly (interpreter on CPU)."""
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpusolver.config import SolverConfig
from gpusolver.problem import BlockAreas
from gpusolver.solver import core
from gpusolver.solver.offers import kernel as offers_kernel, ref as offers_ref
from gpusolver.solver.offers.kernel import offers_triton
from gpusolver.solver.state import ref as state_ref
from tests._testing import assert_close


def _tasks(gen, P, G, max_area=3, tiles=1):
    """_Tasks over small areas in [0, max_area]: many units of equal area on a rank (U = tiles * P units)."""
    U = tiles * P
    area = torch.randint(0, max_area + 1, (G, U, U), generator=gen)
    area[:, 0, 0] = 1  # at least one task
    busy = (area > 0)[..., None]
    need = torch.where(busy, torch.tensor([0, 4]), 0)  # [G, U, U, 2]
    areas = BlockAreas(area=area, q_need=need, k_need=need.clone(), chunk=4, tiles=tiles).validate()
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, head_dim=8, dtype=torch.float16,
                          chunk_tiles=tiles)
    return core.Tasks(areas, config)


def _state(gen, tasks, B, tied_loads):
    """_State of random assignments A [B, T+1]; with ``tied_loads`` the loads are few distinct values."""
    P, T = tasks.P, tasks.T
    rand = torch.randint(0, P, (B, T), generator=gen)
    owner = torch.rand((B, T), generator=gen) < torch.linspace(0.0, 0.9, B)[:, None]
    A = torch.where(tasks.valid, torch.where(owner, tasks.q_host, rand), P)
    A = torch.cat((A, torch.full((B, 1), P, dtype=torch.int64)), 1)
    state = state_ref.state(tasks, A)  # rank and load are strided views, as the round loop passes them
    if tied_loads:
        state = replace(state, load=torch.randint(0, 4, (B, P), generator=gen))
    return state


def _check(ref, tri):
    for name, r, t in zip(("unit", "headroom", "dests"), ref, tri):
        assert r.dtype == t.dtype == torch.int64, f"{name}: {r.dtype} vs {t.dtype}"
        assert_close(name, r, t)


@settings(max_examples=20, deadline=None)
@given(P=st.integers(3, 8), G=st.integers(1, 2), B=st.integers(1, 3), K=st.integers(1, 16),
       D=st.integers(1, 8), cap_kind=st.sampled_from(["scalar", "per-variant"]), widths=st.booleans(),
       tied_loads=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_offers_match_torch(P, G, B, K, D, cap_kind, widths, tied_loads, seed):
    gen = torch.Generator().manual_seed(seed)
    tasks = _tasks(gen, P, G)
    state = _state(gen, tasks, B, tied_loads)
    K, D = min(K, G * P), min(D, P)  # the widths the round loop passes
    cap = state.load.sum(1).amax() * torch.randint(90, 130, (), generator=gen) // (100 * P)  # 0-dim
    if cap_kind == "per-variant":  # [B, 1], some variants stuck (cap just below their max load)
        cap = torch.where(torch.rand((B, 1), generator=gen) < 0.5, state.load.amax(1, keepdim=True) - 1, cap)
    dests_b = torch.randint(1, D + 1, (B,), generator=gen) if widths else None
    ref = offers_ref.offers(tasks, state, cap, K, D, dests_b)
    _check(ref, offers_triton(tasks, state, cap, K, D, dests_b))


@pytest.mark.parametrize("P,G,tiles,K,D,seed", [(2, 1, 2, 3, 2, 0), (3, 2, 2, 16, 3, 1), (2, 2, 3, 5, 2, 2),
                                                 (3, 1, 4, 12, 3, 3)])
def test_offers_match_torch_tiled(P, G, tiles, K, D, seed):
    """G * U offered units of U tasks each (K up to all of them), windows over the P ranks."""
    gen = torch.Generator().manual_seed(seed)
    tasks = _tasks(gen, P, G, tiles=tiles)
    B = 3
    state = _state(gen, tasks, B, tied_loads=seed % 2 == 1)
    K, D = min(K, G * tiles * P), min(D, P)
    cap = torch.where(torch.rand((B, 1), generator=gen) < 0.5, state.load.amax(1, keepdim=True) - 1,
                      state.load.sum(1, keepdim=True) // P)
    dests_b = torch.randint(1, D + 1, (B,), generator=gen)
    ref = offers_ref.offers(tasks, state, cap, K, D, dests_b)
    assert ref[0].shape == (B, P, K)
    _check(ref, offers_triton(tasks, state, cap, K, D, dests_b))


def test_offers_ties_everywhere():
    """All units of equal area and all loads equal: every order is decided by the index."""
    P, G, B = 5, 2, 2
    gen = torch.Generator().manual_seed(0)
    tasks = _tasks(gen, P, G, max_area=1)
    tasks.area = torch.ones_like(tasks.area)
    state = _state(gen, tasks, B, tied_loads=False)
    state = replace(state, load=torch.full((B, P), 7))
    for cap in (torch.tensor(7), torch.tensor([[9], [3]])):  # no rank light (n_light clamps to 1); all light
        ref = offers_ref.offers(tasks, state, cap, 6, P, torch.tensor([2, P]))
        _check(ref, offers_triton(tasks, state, cap, 6, P, torch.tensor([2, P])))


def test_offers_over_several_unit_tiles(monkeypatch):
    """G * P = 24 units compared in tiles of 4 units, and requested widths above G*P and P."""
    monkeypatch.setattr(offers_kernel, "_TILE", 128)  # BLOCK_U = 128 // 32 = 4: six tiles
    P, G, B = 6, 4, 2
    gen = torch.Generator().manual_seed(3)
    tasks = _tasks(gen, P, G)
    state = _state(gen, tasks, B, tied_loads=True)
    cap = torch.tensor(5)
    ref = offers_ref.offers(tasks, state, cap, 40, 9)
    tri = offers_triton(tasks, state, cap, 40, 9)
    assert ref[0].shape == (B, P, G * P) and ref[2].shape == (B, P, P)
    _check(ref, tri)


def test_offers_on_meta():
    """No host reads: the launcher runs on meta tensors and gives the twin's shapes."""
    P, G, B = 4, 2, 3
    tasks = _tasks(torch.Generator().manual_seed(0), P, G)
    meta = core.Tasks.__new__(core.Tasks)
    meta.G, meta.P, meta.U, meta.T, meta.area = G, P, P, tasks.T, tasks.area.to("meta")
    state = core.State(*(torch.empty(0, device="meta") for _ in range(21)))
    state = replace(state, rank=torch.zeros((B, tasks.T), dtype=torch.int64, device="meta"),
                    load=torch.zeros((B, P), dtype=torch.int64, device="meta"))
    cap = torch.zeros((B, 1), dtype=torch.int64, device="meta")
    unit, headroom, dests = offers_triton(meta, state, cap, 3, 2, torch.ones(B, dtype=torch.int64, device="meta"))
    assert unit.device.type == headroom.device.type == dests.device.type == "meta"
    assert (unit.shape, headroom.shape, dests.shape) == ((B, P, 3), (B, P), (B, P, 2))


def test_offers_check_arguments():
    P, G, B = 3, 1, 2
    gen = torch.Generator().manual_seed(0)
    tasks = _tasks(gen, P, G)
    state = _state(gen, tasks, B, tied_loads=False)
    with pytest.raises(ValueError, match="cap"):
        offers_triton(tasks, state, torch.zeros(B + 1, dtype=torch.int64), 2, 2)
    with pytest.raises(ValueError, match="dests_per_variant"):
        offers_triton(tasks, state, torch.tensor(4), 2, 2, torch.ones(B + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="units_per_rank"):
        offers_triton(tasks, state, torch.tensor(4), 0, 2)


def test_offered_units_are_the_same_by_topk_and_by_sort():
    """Units of equal area on a source (ties by index): the top-k over unique keys picks what the
    stable sort that huge chunks fall back to picks (``tasks.chunk`` only bounds the keys)."""
    gen = torch.Generator().manual_seed(5)
    tasks = _tasks(gen, 4, 2)
    state = _state(gen, tasks, 3, tied_loads=False)
    by_topk = offers_ref.offers(tasks, state, state.load.sum(1).amax() // 4, 5, 3)
    tasks.chunk = 1 << 29  # U * chunk^2 * G * U >= 2^62: the sort path
    by_sort = offers_ref.offers(tasks, state, state.load.sum(1).amax() // 4, 5, 3)
    for name, a, b in zip(("unit", "headroom", "dests"), by_topk, by_sort):
        assert_close(name, a, b)
    ua = torch.zeros((3, 2 * 4, 4), dtype=torch.int64).index_put_(
        (torch.arange(3)[:, None].expand(3, tasks.T), tasks.qo_unit.expand(3, -1), state.rank.clamp(max=3)),
        torch.where(state.rank < 4, tasks.area, 0).expand(3, -1), accumulate=True)
    assert bool((ua.transpose(1, 2).gather(2, by_topk[0]).diff(dim=2) <= 0).all()), "not heaviest first"
