"""The Triton acceptance step equals its torch twins exactly (interpreter on CPU)."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import causal_mask, packed_documents
from gpusolver.metrics import owner_computes_assignment
from gpusolver.solver import core
from gpusolver.solver.accept import kernel as accept_kernel, ref as accept_ref
from gpusolver.solver.accept.kernel import accept_apply_triton, accept_triton
from gpusolver.solver.accept.ref import accept_apply
from gpusolver.solver.core import Proposals
from gpusolver.solver.device import Strategy, solve_device
from gpusolver.solver.track import kernel as track_kernel
from gpusolver.solver.track.kernel import track_triton
from gpusolver.solver.track.ref import track
from tests._testing import assert_close
from tests.gpusolver.test_solver_kernels import _NoLaunch, meta_triton_solve


def _random_round(seed, B, P, K, M=None, T=None):
    """A random proposal set with many score ties and shared destinations, the state fields
    _accept reads, and the round's limits: (prop, st, dest_cap, limit, excess, balance)."""
    gen = torch.Generator().manual_seed(seed)
    N = P * K
    ri = lambda lo, hi, shape: torch.randint(lo, hi, shape, generator=gen)  # noqa: E731
    score = ri(0, 4, (B, N)).double() / 2  # few distinct values: ties everywhere
    score = torch.where(torch.rand((B, N), generator=gen) < 0.15, float("inf"), score)
    M = M or P
    T = T or N * M + 3
    tasks = torch.randperm(T, generator=gen)[:N * M].view(1, N, M).expand(B, -1, -1).clone()
    tasks = torch.where(torch.rand((B, N, M), generator=gen) < 0.4, T, tasks)
    prop = Proposals(ok=torch.rand((B, N), generator=gen) < 0.7, score=score, dest=ri(0, P, (B, N)),
                      source=torch.arange(P).repeat_interleave(K).expand(B, -1),  # strided, as the kernels give it
                     area=ri(0, 12, (B, N)), dest_send=ri(0, 40, (B, N)), dest_recv=ri(0, 40, (B, N)), tasks=tasks,
                     dest_bsend=ri(-5, 40, (B, N)), dest_brecv=ri(0, 40, (B, N)), dest_qin=ri(0, 6, (B, N)),
                     dest_kin=ri(0, 6, (B, N)))
    load = ri(0, 40, (B, P))
    rows = {name: ri(0, 30, (B, P)) for name in ("q_out", "q_in", "k_out", "k_in")}
    send, recv, bsend, brecv = (ri(0, 80, (B, P)) for _ in range(4))
    vol, bvol = torch.maximum(send, recv), torch.maximum(bsend, brecv)
    state = SimpleNamespace(load=load, send=send, recv=recv, vol=vol, bsend=bsend, brecv=brecv, bvol=bvol,
                            bottleneck=vol.amax(1) + ri(0, 40, (B,)), bwd_bottleneck=bvol.amax(1) + ri(0, 40, (B,)),
                            **rows)
    cap = ri(20, 50, ())
    dest_cap = torch.where(torch.rand((B, 1), generator=gen) < 0.5, cap, load.amax(1, keepdim=True) - 1)
    limit = torch.where(torch.rand(B, generator=gen) < 0.2, float(core._BIG), ri(40, 140, (B,)).double())
    balance = torch.rand(B, generator=gen) < 0.6
    A = torch.cat((ri(0, P, (B, T)), torch.full((B, 1), P)), 1)
    return A, (prop, state, dest_cap, limit, load - cap, balance)


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 3), P=st.integers(1, 6), K=st.integers(1, 5), training=st.booleans(),
       recv_caps=st.sampled_from([None, (20, 20), (35, 12), (9, 30)]), seed=st.integers(0, 2**31 - 1))
def test_accept_matches_torch(B, P, K, training, recv_caps, seed):
    """Both objectives' limits; QO and KV receive buffers of any size or of a few rows, apart."""
    _, args = _random_round(seed, B, P, K)
    if recv_caps is not None:  # per variant: the buffers, or none for a variant whose start is past them
        free = torch.arange(B) == 1
        recv_caps = torch.stack([torch.where(free, 1 << 60, c) for c in recv_caps])
    ref = accept_ref.accept(*args, training, recv_caps)
    tri = accept_triton(*args, training, recv_caps)
    assert_close("keep", ref, tri)


def test_accept_over_several_chunks_and_shared_cap():
    """N = 150 proposals: three chunks of 64 plus a ragged one; dest_cap a 0-dim tensor."""
    _, (prop, state, _, limit, excess, balance) = _random_round(3, 2, 10, 15)
    dest_cap = torch.tensor(35)
    ref = accept_ref.accept(prop, state, dest_cap, limit, excess, balance)
    assert bool(ref.any()) and not bool(ref.all())
    assert_close("keep", ref, accept_triton(prop, state, dest_cap, limit, excess, balance))


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 3), P=st.integers(2, 5), K=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_accept_apply_matches_torch(B, P, K, seed):
    A, args = _random_round(seed, B, P, K)
    T = A.shape[1] - 1
    ref_A, ref_stuck = accept_apply(A, *args)
    tri_A, tri_stuck = accept_apply_triton(A.clone(), *args)  # in place
    assert_close("A", ref_A[:, :T], tri_A[:, :T])
    assert_close("dummy column", A[:, T], tri_A[:, T])
    assert_close("stuck", ref_stuck, tri_stuck)


@pytest.mark.parametrize("seed,tiles", [(1, 2), (8, 3)])
def test_accept_apply_matches_torch_with_tiled_task_slots(seed, tiles):
    """Proposals of a tiled solve carry U = tiles * P task slots (M != P)."""
    B, P, K = 2, 3, 2
    A, args = _random_round(seed, B, P, K, M=tiles * P)
    assert args[0].tasks.shape == (B, P * K, tiles * P)
    T = A.shape[1] - 1
    ref_A, ref_stuck = accept_apply(A, *args)
    tri_A, tri_stuck = accept_apply_triton(A.clone(), *args)
    assert bool((ref_A[:, :T] != A[:, :T]).any()), "no task moved"
    assert_close("A", ref_A[:, :T], tri_A[:, :T])
    assert_close("stuck", ref_stuck, tri_stuck)


def test_accept_apply_moves_tasks():
    """A round where some proposals are kept and some variant is stuck: both outputs carry information."""
    A, args = _random_round(11, 3, 4, 2)
    prop, balance = args[0], args[5]
    T = A.shape[1] - 1
    keep = accept_ref.accept(*args)
    tri_A, tri_stuck = accept_apply_triton(A.clone(), *args)
    moved = (keep[..., None] & (prop.tasks < T)).any(-1)
    assert bool(moved.any()), "no task moved"
    assert bool((tri_A[:, :T] != A[:, :T]).any())
    assert_close("stuck", balance & ~keep.any(1), tri_stuck)


def _random_track(seed, B, P, T):
    """Arguments of track: loads around the cap, keys on both sides of the best so far."""
    gen = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi, shape: torch.randint(lo, hi, shape, generator=gen)  # noqa: E731
    A, best_A = ri(0, P + 1, (B, T + 1)), ri(0, P + 1, (B, T + 1))
    load = ri(0, 30, (B, P))
    cap = ri(15, 30, ())
    fields = ("send", "recv", "vol", "bsend", "brecv", "bvol", "q_out", "q_in", "k_out", "k_in")
    state = SimpleNamespace(load=load, bottleneck=ri(0, 100, (B,)), bwd_bottleneck=ri(0, 100, (B,)),
                            **{name: ri(0, 12, (B, P)) for name in fields})
    best_key = torch.where(torch.rand(B, generator=gen) < 0.5, ri(0, 100, (B,)), core._BIG // 2 + ri(0, 30, (B,)))
    best_key = torch.where(torch.rand(B, generator=gen) < 0.2, core._BIG, best_key)
    stuck = torch.rand(B, generator=gen) < 0.5
    threshold = torch.where(torch.rand(B, generator=gen) < 0.3, float(core._BIG), torch.rand(B, generator=gen) * 200)
    return A, state, cap, stuck, threshold.double(), best_A, best_key


def _in_place_copies(args):
    """track's arguments with fresh best_A and best_key, which the Triton launcher updates in place."""
    return args[:5] + (args[5].clone(), args[6].clone())


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 6), P=st.integers(1, 6), T=st.integers(1, 40), training=st.booleans(),
       caps=st.sampled_from([None, (10, 10, 11, 11), (6, 14, 12, 8)]), seed=st.integers(0, 2**31 - 1))
def test_track_matches_torch(B, P, T, training, caps, seed):
    """Both objectives' keys; rows within or past the buffers (QO / KV received, QO / KV sent)."""
    args = _random_track(seed, B, P, T)
    kw = dict(training=training, **(dict(caps=caps) if caps else {}))
    ref, tri = track(*args, **kw), track_triton(*_in_place_copies(args), **kw)
    for name, r, t in zip(("best_A", "best_key", "excess", "balance", "dest_cap", "limit"), ref, tri):
        if name == "limit":  # bit-equal float64
            assert r.dtype == t.dtype == torch.float64 and torch.equal(r, t), name
        else:
            assert_close(name, r, t)


def test_track_over_several_chunks_keeps_and_replaces():
    """T + 1 = 2501 columns (three copy steps); some variants improve and some do not."""
    args = _random_track(5, 6, 4, 2500)
    copies = _in_place_copies(args)
    ref, tri = track(*args), track_triton(*copies)
    assert tri[0] is copies[5] and tri[1] is copies[6], "best_A and best_key are updated in place"
    better = ref[1] != args[6]
    assert bool(better.any()) and not bool(better.all())
    for name, r, t in zip(("best_A", "best_key", "excess", "balance", "dest_cap", "limit"), ref, tri):
        assert torch.equal(r, t), name


@pytest.mark.parametrize("P,kind,rounds", [pytest.param(4, "packed", 5, id="4-packed"),
                                            pytest.param(4, "causal", 5, id="4-causal"),
                                            pytest.param(3, "causal", 2, id="3-causal-r2")])
def test_solve_triton_equals_torch(P, kind, rounds):
    """The per-step Triton path's whole solve (state, offers, bundles, accept, track each round);
    the fast tier's case is the smallest that still moves a task, the P = 4 ones are in the slow tier."""
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2)
    mask = packed_documents(512 * P, seed=0) if kind == "packed" else causal_mask(64 * P)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    strategies = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),
                  Strategy((float("inf"),), units_per_rank=1, bundle_dests=2, task_order="rows"))
    ref = solve_device(areas, config, rounds=rounds, strategies=strategies, impl="torch")
    tri = solve_device(areas, config, rounds=rounds, strategies=strategies, impl="triton")
    assert_close("assignment", ref.assignment, tri.assignment)
    assert_close("balanced", ref.balanced, tri.balanced)
    assert_close("fwd_bottleneck", ref.fwd_bottleneck, tri.fwd_bottleneck)
    assert_close("variant", ref.variant, tri.variant)
    assert bool((tri.assignment != owner_computes_assignment(areas)).any()), "no move was made"
    # "auto" takes the torch path off CUDA
    auto = solve_device(areas, config, rounds=rounds, strategies=strategies)
    assert_close("auto assignment", ref.assignment, auto.assignment)


def test_triton_accept_runs_on_meta(monkeypatch):
    """The launchers are free of host reads (they run on meta, where the kernel is skipped);
    the solve calls the fused launcher once per round."""
    calls = []

    def counted(A, *args, **kw):
        calls.append(A.shape)
        return accept_apply_triton(A, *args, **kw)

    monkeypatch.setattr(accept_kernel, "accept_apply_triton", counted)
    tracked = []

    def counted_track(A, *args, **kw):
        tracked.append(A.shape)
        return track_triton(A, *args, **kw)

    monkeypatch.setattr(track_kernel, "track_triton", counted_track)
    P, G, rounds = 4, 2, 3
    meta_triton_solve(P, G, rounds)
    # the training objective runs the portfolio under each rule: two passes of the rounds
    assert calls == [(2, G * P * P + 1)] * (2 * rounds) and tracked == [(2, G * P * P + 1)] * (2 * (rounds + 1))
    # the plain launcher too
    _, args = _random_round(0, 2, 3, 2)
    to_meta = lambda t: t.to("meta")  # noqa: E731
    prop, state, dest_cap, limit, excess, balance = args
    prop = Proposals(**{k: to_meta(v) for k, v in vars(prop).items()})
    state = SimpleNamespace(**{k: to_meta(v) for k, v in vars(state).items()})
    keep = accept_triton(prop, state, to_meta(dest_cap), to_meta(limit), to_meta(excess), to_meta(balance))
    assert keep.device.type == "meta" and keep.shape == (2, 6) and keep.dtype == torch.bool


def test_accept_kernel_launches_once_per_call(monkeypatch):
    stub, track_stub = _NoLaunch(), _NoLaunch()
    monkeypatch.setattr(accept_kernel, "_accept_kernel", stub)
    monkeypatch.setattr(track_kernel, "_track_kernel", track_stub)
    A, args = _random_round(1, 3, 4, 2)
    accept_triton(*args)
    accept_apply_triton(A, *args)
    track_triton(*_random_track(0, 3, 4, 10))
    assert stub.grids == [(3,), (3,)] and track_stub.grids == [(3,)]
