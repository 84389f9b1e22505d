"""The device solver's Triton steps equal their torch twins exactly (interpreter on CPU)."""
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import packed_documents
from gpusolver.problem import BlockAreas
from gpusolver.solver import core
from gpusolver.solver.bundle import kernel as bundle_kernel, ref as bundle_ref
from gpusolver.solver.bundle.kernel import bundle_proposals_triton
from gpusolver.solver.device import Strategy, solve_device
from gpusolver.solver.state import kernel as state_kernel, ref as state_ref
from gpusolver.solver.state.kernel import state_triton
from gpusolver.solver.strategies import TASK_ORDERS
from tests._testing import assert_close

_STATE_FIELDS = ("rank", "q_lo", "q_hi", "k_lo", "k_hi", "qlen", "klen", "kcount",
                 "send", "recv", "vol", "bottleneck", "load", "bsend", "brecv", "bvol", "bwd_bottleneck",
                 "q_out", "q_in", "k_out", "k_in")
_PROPOSAL_FIELDS = ("ok", "score", "dest", "source", "area", "dest_send", "dest_recv", "tasks",
                    "dest_bsend", "dest_brecv", "dest_qin", "dest_kin")


def _config(P, G, tiles=1, **kw):
    return SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, head_dim=8, dtype=torch.float16,
                        chunk_tiles=tiles, **kw)


def _random_areas(gen, P, G, chunk=16, density=0.6, tiles=1):
    """Areas with consistent needs: a non-empty block needs non-empty intervals inside the unit
    (U = tiles * P units per group, unit-local needs)."""
    U = tiles * P
    busy = torch.rand((G, U, U), generator=gen) < density
    busy[:, 0, 0] = True  # at least one task
    lo = torch.randint(0, chunk, (G, U, U, 2, 1), generator=gen)
    ln = torch.randint(1, chunk + 1, (G, U, U, 2, 1), generator=gen)
    hi = torch.minimum(lo + ln, torch.full_like(lo, chunk))
    need = torch.where(busy[..., None, None], torch.cat((lo, hi), -1), 0)  # [G, U, U, 2(q/k), 2]
    qn, kn = need[..., 0, :], need[..., 1, :]
    area = torch.where(busy, (qn[..., 1] - qn[..., 0]) * (kn[..., 1] - kn[..., 0])
                       - torch.randint(0, 3, (G, U, U), generator=gen), 0).clamp(min=0)
    area = torch.where(busy, area.clamp(min=1), 0)
    return BlockAreas(area=area, q_need=qn.contiguous(), k_need=kn.contiguous(), chunk=chunk,
                      tiles=tiles).validate()


def _random_assignments(gen, tasks, B):
    """A [B, T+1]: valid tasks on their query host or a random rank (a different mix per variant), P elsewhere."""
    P, T = tasks.P, tasks.T
    rand = torch.randint(0, P, (B, T), generator=gen)
    owner = torch.rand((B, T), generator=gen) < torch.linspace(0.0, 0.9, B)[:, None]
    A = torch.where(tasks.valid, torch.where(owner, tasks.q_host, rand), P)
    return torch.cat((A, torch.full((B, 1), P, dtype=torch.int64)), 1)


def _check_state(ref, tri):
    for name in _STATE_FIELDS:
        assert_close(name, getattr(ref, name), getattr(tri, name))
    assert (ref.nodes is None) == (tri.nodes is None)
    if ref.nodes is not None:  # the relay transport's node tables
        assert_close("nodes", ref.nodes, tri.nodes)


def _check_proposals(ref, tri):
    for name in _PROPOSAL_FIELDS:
        r, t = getattr(ref, name), getattr(tri, name)
        if name == "score":  # bit-equal float64, inf included
            assert r.dtype == t.dtype == torch.float64
            assert torch.equal(r, t), f"score: max diff {(r - t).nan_to_num(0.0).abs().max().item():.3e}"
        else:
            assert_close(name, r, t)


@settings(max_examples=8, deadline=None)
@given(P=st.integers(3, 6), G=st.integers(1, 2), B=st.integers(2, 3), seed=st.integers(0, 2**31 - 1))
def test_state_matches_torch(P, G, B, seed):
    gen = torch.Generator().manual_seed(seed)
    areas = _random_areas(gen, P, G)
    tasks = core.Tasks(areas, _config(P, G))
    A = _random_assignments(gen, tasks, B)
    _check_state(state_ref.state(tasks, A), state_triton(tasks, A))


@settings(max_examples=6, deadline=None)
@given(P=st.integers(2, 4), G=st.integers(1, 2), tiles=st.sampled_from([2, 3, 4]), B=st.integers(2, 3),
       seed=st.integers(0, 2**31 - 1))
def test_state_matches_torch_tiled(P, G, tiles, B, seed):
    """U = tiles * P units per group: hulls per (unit, rank), each rank's bytes summed over its units."""
    gen = torch.Generator().manual_seed(seed)
    areas = _random_areas(gen, P, G, chunk=8, tiles=tiles)
    tasks = core.Tasks(areas, _config(P, G, tiles))
    A = _random_assignments(gen, tasks, B)
    ref, tri = state_ref.state(tasks, A), state_triton(tasks, A)
    assert tri.q_lo.shape == (B, G * tiles * P, P)
    _check_state(ref, tri)


def test_state_matches_torch_over_several_task_tiles():
    P, G, B = 24, 2, 2  # T = 1152 tasks: two tiles of 1024
    gen = torch.Generator().manual_seed(1)
    areas = _random_areas(gen, P, G, chunk=40)
    tasks = core.Tasks(areas, _config(P, G))
    A = _random_assignments(gen, tasks, B)
    _check_state(state_ref.state(tasks, A), state_triton(tasks, A))


def _bundle_case(P, G, B, K, D, sideways, tile, seed, tiles=1, states=("torch", "triton"), singles=False,
                 objective="training", rows=None, topology=None, ib_relay=None):
    """A random round's proposals from both twins, on the torch state and/or the Triton state
    (``rows``: the QO receive buffer's rows, the KV receive and the two send lists a few rows
    apart; None for the worst case; ``topology``: the cluster whose links price the bytes)."""
    gen = torch.Generator().manual_seed(seed)
    areas = _random_areas(gen, P, G, **({} if tiles == 1 else {"chunk": 8, "tiles": tiles}))
    worst = G * areas.rank_tokens * (P - 1)
    bufs = dict(max_recv_rows=worst) if rows is None else \
        dict(max_qo_recv_rows=rows, max_kv_recv_rows=rows + 3, max_qo_send_rows=rows + 1, max_kv_send_rows=rows + 2)
    tasks = core.Tasks(areas, _config(P, G, tiles, objective=objective, topology=topology, ib_relay=ib_relay, **bufs))
    assert tasks.caps == (rows is not None)
    A = _random_assignments(gen, tasks, B)
    ref_st = state_ref.state(tasks, A)
    tri_st = state_triton(tasks, A)  # contiguous tensors where the twin's are strided views
    total = tasks.area.sum()
    cap = (total * torch.randint(100, 130, (), generator=gen)) // (100 * P)
    excess = ref_st.load - cap
    balance = torch.rand(B, generator=gen) < 0.5
    scale = torch.rand(B, generator=gen).double() * 3
    threshold = torch.where(torch.rand(B, generator=gen) < 0.3, float(core._BIG),
                            scale * ref_st.bottleneck.double() + 1.0)
    dests_b = torch.randint(1, D + 1, (B,), generator=gen)  # per-variant window widths and task orders
    order_b = torch.randint(0, len(TASK_ORDERS), (B,), generator=gen)
    cap = torch.where(torch.rand(B, 1, generator=gen) < 0.3, ref_st.load.amax(1, keepdim=True) - 1, cap)
    args = (cap, excess, balance, threshold, K, D, dests_b, order_b, sideways, singles)
    caps = None
    if rows is not None:  # each variant's buffers: the plan's, or none (a start past them)
        free = torch.rand(B, generator=gen) < 0.3
        caps = torch.stack([torch.where(free, core._BIG, c) for c in tasks.buffer_rows])
    ref = bundle_ref.bundle_proposals(tasks, ref_st, *args, caps=caps)
    with mock.patch.object(bundle_kernel, "_DEST_TILE", tile):
        for state in states:
            _check_proposals(ref, bundle_proposals_triton(tasks, ref_st if state == "torch" else tri_st, *args,
                                                          caps=caps))
    return ref


@settings(max_examples=4, deadline=None)
@given(P=st.integers(3, 6), G=st.integers(1, 2), B=st.integers(2, 3), K=st.integers(1, 3),
       D=st.integers(1, 8), sideways=st.booleans(), singles=st.booleans(), tile=st.sampled_from([2, 4, 16]),
       objective=st.sampled_from(["training", "forward"]), rows=st.sampled_from([None, 6, 20]),
       seed=st.integers(0, 2**31 - 1))
def test_bundle_proposals_match_torch(P, G, B, K, D, sideways, singles, tile, objective, rows, seed):
    """Destinations priced in tiles of ``tile`` (16 by default; smaller ones exercise the running best);
    both objectives; buffers of the worst case or a few rows (the capacity checks bind)."""
    _bundle_case(P, G, B, K, D, sideways, tile, seed, singles=singles, objective=objective, rows=rows)


@pytest.mark.parametrize("objective,rows,states", [("training", 6, ("torch", "triton")), ("forward", None, ("triton",))],
                         ids=["training-6", "forward-None"])
def test_bundle_proposals_match_torch_one_case(objective, rows, states):
    """One fixed instance per objective of the random sweep above (which runs in the slow tier):
    P = 3 with D = 3 destinations in tiles of 2 (the running best), sideways and single-task
    bundles on; with ``rows`` the buffers bind. The torch twin's strided state is read by the
    training case (its fields are a superset of the forward objective's)."""
    ref = _bundle_case(3, 2, 2, 2, 3, True, 2, 7, states=states, singles=True, objective=objective, rows=rows)
    assert bool(ref.ok.any()), "the instance proposes nothing: the twins would agree trivially"


@settings(max_examples=4, deadline=None)
@given(P=st.integers(2, 3), G=st.integers(1, 2), tiles=st.sampled_from([2, 3]), K=st.integers(1, 3),
       D=st.integers(1, 3), sideways=st.booleans(), singles=st.booleans(), tile=st.sampled_from([4, 16]),
       objective=st.sampled_from(["training", "forward"]), rows=st.sampled_from([None, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_bundle_proposals_match_torch_tiled(P, G, tiles, K, D, sideways, singles, tile, objective, rows, seed):
    """U = tiles * P task slots per unit (3 tiles: padded key-host slots), query host u // tiles;
    with ``tile`` 4 the destinations come in several tiles (tile // tiles rounded to a power of 2)."""
    ref = _bundle_case(P, G, 2, K, D, sideways, tile, seed, tiles=tiles, states=("triton",), singles=singles,
                       objective=objective, rows=rows)
    assert ref.tasks.shape == (2, P * min(K, G * tiles * P), tiles * P)


def test_bundle_proposals_match_torch_tiled_one_case():
    """One fixed instance of the tiled sweep above (slow tier): 3 tiles (padded key-host slots), the
    destinations in several tiles, the buffers binding."""
    P, G, tiles, K = 3, 2, 3, 2
    ref = _bundle_case(P, G, 2, K, 3, True, 4, 11, tiles=tiles, states=("triton",), singles=True, rows=4)
    assert ref.tasks.shape == (2, P * min(K, G * tiles * P), tiles * P)
    assert bool(ref.ok.any()), "the instance proposes nothing: the twins would agree trivially"


def test_tiled_bundles_sum_key_host_deltas():
    """Instances where a bundle moves several tasks of one key host and the busiest other key host
    decides a score: the per-task maximum of the untiled kernel would differ there."""
    P, G, B, tiles = 3, 1, 2, 2

    def per_task(send, delta, inc, elsewhere):  # the untiled rule: each task's change on its own
        host = torch.arange(delta.shape[-1]) // tiles  # key unit j's host
        lead = (send.shape[0],) + (1,) * (inc.dim() - 2)
        alone = inc & elsewhere.index_select(-1, host)
        return torch.where(alone, send[:, host].view(*lead, -1) + delta, 0).amax(-1)

    found = 0
    for seed in range(120):
        gen = torch.Generator().manual_seed(seed)
        tasks = core.Tasks(_random_areas(gen, P, G, chunk=8, density=0.9, tiles=tiles),
                           _config(P, G, tiles, objective="forward"))
        A = _random_assignments(gen, tasks, B)
        st_ = state_ref.state(tasks, A)
        cap = tasks.area.sum() * 11 // (10 * P)
        balance = torch.tensor([True, False])
        threshold = torch.where(balance, st_.bottleneck.double() * 1.02 + 1.0, float(core._BIG))
        args = (cap, st_.load - cap, balance, threshold, 2, 2)
        ref = bundle_ref.bundle_proposals(tasks, st_, *args)
        with mock.patch.object(bundle_ref, "_busiest_key_host", per_task):
            untiled = bundle_ref.bundle_proposals(tasks, st_, *args)
        if torch.equal(ref.score, untiled.score):
            continue
        found += 1
        _check_proposals(ref, bundle_proposals_triton(tasks, st_, *args))
        if found == 2:
            break
    assert found == 2, f"only {found} of 120 instances sum deltas per key host"


def test_bundle_proposals_find_moves_in_both_phases():
    """A fixed unbalanced instance where both phases have valid moves, so ok/score/tasks are exercised."""
    P, G, B = 4, 2, 2
    gen = torch.Generator().manual_seed(8)
    areas = _random_areas(gen, P, G, density=0.9)
    tasks = core.Tasks(areas, _config(P, G))
    A = torch.cat((torch.where(tasks.valid, tasks.i, P).expand(B, -1),
                   torch.full((B, 1), P, dtype=torch.int64)), 1)
    st_ = state_ref.state(tasks, A)
    cap = tasks.area.sum() * 11 // (10 * P)
    excess = st_.load - cap
    balance = torch.tensor([True, False])
    threshold = torch.full((B,), float(core._BIG), dtype=torch.float64)
    ref = bundle_ref.bundle_proposals(tasks, st_, cap, excess, balance, threshold, 4, 4)
    tri = bundle_proposals_triton(tasks, st_, cap, excess, balance, threshold, 4, 4)
    assert bool(ref.ok[0].any()) and bool(ref.ok[1].any())
    assert bool((ref.tasks < tasks.T).any())
    _check_proposals(ref, tri)


@pytest.mark.parametrize("tiles,P,G,K", [(1, 3, 2, 2), (2, 3, 1, 2), (1, 4, 2, 4), (2, 4, 2, 4)],
                         ids=["1", "2", "1-P4", "2-P4"])
def test_singles_offer_one_task_bundles_while_balancing(tiles, P, G, K):
    """With ``singles`` a balancing variant may propose a unit's first task alone: on some of these
    instances a valid proposal changes to a one-task bundle; the bottleneck-phase variant's
    proposals never change. Both twins agree wherever one changed (``K`` units offered per source,
    as many window destinations; the P = 4 cases are in the slow tier)."""
    B = 2
    found = 0
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        areas = _random_areas(gen, P, G, density=0.9, **({} if tiles == 1 else {"chunk": 8, "tiles": tiles}))
        tasks = core.Tasks(areas, _config(P, G, tiles))
        A = torch.cat((torch.where(tasks.valid, tasks.q_host, P).expand(B, -1),
                       torch.full((B, 1), P, dtype=torch.int64)), 1)
        st_ = state_ref.state(tasks, A)
        cap = tasks.area.sum() * 11 // (10 * P)
        balance = torch.tensor([True, False])
        threshold = torch.full((B,), float(core._BIG), dtype=torch.float64)
        args = (cap, st_.load - cap, balance, threshold, K, K, None, None, False)
        plain = bundle_ref.bundle_proposals(tasks, st_, *args, False)
        single = bundle_ref.bundle_proposals(tasks, st_, *args, True)
        for name in ("ok", "score", "tasks"):
            assert_close(name, getattr(plain, name)[1], getattr(single, name)[1])
        moved = lambda prop: (prop.tasks[0] < tasks.T).sum(-1)  # noqa: E731  tasks per proposal, variant 0
        changed = (single.ok[0] != plain.ok[0]) | (moved(single) != moved(plain))
        if not bool((changed & single.ok[0] & (moved(single) == 1)).any()):
            continue
        found += 1
        _check_proposals(single, bundle_proposals_triton(tasks, st_, *args, True))
        if found == 2:
            break
    assert found == 2, f"only {found} of 40 instances take a one-task bundle while balancing"


def test_impl_is_checked():
    P = 2
    config = SolverConfig(cp_size=P, num_heads_q=2, num_heads_kv=1)
    areas = block_areas(packed_documents(64 * P, seed=0), P, 1, impl="torch")
    with pytest.raises(ValueError, match="impl"):
        solve_device(areas, config, rounds=1, impl="cuda")


class _NoLaunch:
    """Stands in for a Triton kernel: records each launch's grid and runs the kernel when given one."""

    def __init__(self, kernel=None):
        self.grids, self.kernel = [], kernel

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid] if self.kernel is not None else (lambda *args, **kwargs: None)


def meta_triton_solve(P: int, G: int, rounds: int, tiles: int = 1):
    """A Triton-path solve on meta areas (two variants, two units per source); checks its shape."""
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=G, chunk_tiles=tiles)
    areas = block_areas(packed_documents(256 * P, seed=0), P, G, impl="torch", tiles=tiles)
    strategies = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),)
    res = solve_device(areas.to("meta"), config, rounds=rounds, strategies=strategies, impl="triton")
    U = tiles * P
    assert res.assignment.device.type == "meta" and res.assignment.shape == (G, U, U)
    return res


def _spy_kernels(monkeypatch, launch: bool):
    """Spies on the state and bundle kernels: (state, bytes, bundle) grids; ``launch`` runs them."""
    spies = []
    for module, name in ((state_kernel, "_state_kernel"), (state_kernel, "_state_bytes_kernel"),
                         (bundle_kernel, "_bundle_kernel")):
        spies.append(_NoLaunch(getattr(module, name) if launch else None))
        monkeypatch.setattr(module, name, spies[-1])
    return spies


@pytest.mark.parametrize("tiles", [1, 2])
def test_triton_path_runs_on_meta(monkeypatch, tiles):
    """Every launcher of the Triton path is free of host reads: on meta each allocates its
    outputs and launches nothing (a tiled solve: the chunks' solve, then the tiles')."""
    spies = _spy_kernels(monkeypatch, launch=False)
    meta_triton_solve(4, 2, 2, tiles)
    assert all(not spy.grids for spy in spies)


def test_triton_path_launches_each_kernel_once_per_round(monkeypatch):
    state_k, bytes_k, bundle_k = _spy_kernels(monkeypatch, launch=True)
    P, G, rounds = 3, 1, 2
    # forward-only: the training objective runs the portfolio once per rule, twice the launches
    config = SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=G, objective="forward")
    areas = block_areas(packed_documents(64 * P, seed=0), P, G, impl="torch")
    solve_device(areas, config, rounds=rounds, impl="triton",
                 strategies=(Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),))
    # the state once per round and once more for the winner's bottlenecks
    assert len(state_k.grids) == len(bytes_k.grids) == rounds + 2 and len(bundle_k.grids) == rounds
    # grids: (task tiles, B), (B, P), (B, P, K)
    assert state_k.grids[0] == (1, 2) and bytes_k.grids[0] == (2, P) and bundle_k.grids[0] == (2, P, 2)


@pytest.mark.parametrize("need,P,K,D", [(1, 3, 2, 3), (3, 5, 3, 5)], ids=["1", "3"])
def test_sideways_proposals_match_torch(need, P, K, D):
    """Bottleneck-phase instances with sideways moves (score in [1, 2)), the one rule only they exercise
    (``need`` such instances: one at P = 3 with D = 3, two destination tiles; three at P = 5 in the
    slow tier)."""
    G, B = 2, 2
    found = 0
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        tasks = core.Tasks(_random_areas(gen, P, G, density=0.8), _config(P, G))
        A = _random_assignments(gen, tasks, B)
        st_ = state_ref.state(tasks, A)
        cap = st_.load.amax(1, keepdim=True)  # every rank may take work up to today's maximum
        args = (cap, st_.load - cap, torch.zeros(B, dtype=torch.bool), torch.full((B,), float(core._BIG),
                dtype=torch.float64), K, D, None, None, True)
        ref = bundle_ref.bundle_proposals(tasks, st_, *args)
        side = ref.ok & (ref.score >= 1.0) & (ref.score < 2.0)
        if bool(side.any()):
            found += 1
            with mock.patch.object(bundle_kernel, "_DEST_TILE", 2):  # several tiles: the best crosses tiles
                _check_proposals(ref, bundle_proposals_triton(tasks, st_, *args))
            without = bundle_ref.bundle_proposals(tasks, st_, *args[:-1], False)
            assert not bool((without.ok & (without.score >= 1.0)).any()), "sideways moves without the flag"
            if found == need:
                break
    assert found == need, f"only {found} of 40 instances had a sideways move"
