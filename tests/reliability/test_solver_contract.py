"""The device solver against evaluate(): its internal state and move prices, owner-computes, and its
three paths on the default portfolio (new tests beside the solver's own, through ``_solver_api``)."""
import time

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from gpusolver import SolverConfig, block_areas, evaluate
from gpusolver.masks import AttnSlices, full_mask, sliding_window_mask, varlen_causal_mask, varlen_full_mask
from gpusolver.metrics import owner_computes_assignment
from tests.attn_kernels._slices import random_slices
from tests.gpusolver.runtime._cases import doc_lengths
from tests.reliability import _solver_api as api
from tests.reliability._cases import budget, fuzzing


def _assignment(tasks, row: torch.Tensor) -> torch.Tensor:
    """[G, U, U] assignment of one variant's task ranks ([T] or [T+1] with the dummy column)."""
    return torch.where(tasks.valid, row[:tasks.T], -1).view(tasks.G, tasks.U, tasks.U)


def _mask(kind: str, S: int, seed: int) -> AttnSlices:
    if kind == "random":
        return AttnSlices(*random_slices(S, S, seed), S, S)
    lengths = doc_lengths(S, seed)
    return varlen_causal_mask(lengths) if kind == "causal-docs" else varlen_full_mask(lengths)


# ------------------------------------------------------------------ owner-computes: never worse


OWNER_BALANCED = [("full", 2, "training"), ("full", 4, "forward"), ("aligned-causal-docs", 4, "training"),
                  ("aligned-full-docs", 2, "forward"), ("window", 4, "training"), ("wide-window", 8, "training")]


@pytest.mark.parametrize("kind,P,objective", OWNER_BALANCED, ids=[f"{k}-P{P}-{o}" for k, P, o in OWNER_BALANCED])
def test_no_worse_than_owner_computes_where_it_is_balanced(kind, P, objective):
    """On masks where owner-computes is balanced (asserted, not assumed), the device plan is
    balanced and moves no more than it, in what the solver minimises."""
    c = 512
    S = P * c
    mask = {"full": lambda: full_mask(S), "aligned-causal-docs": lambda: varlen_causal_mask([c] * P),
            "aligned-full-docs": lambda: varlen_full_mask([c // 2, c, c // 2] * (P // 2)),
            "window": lambda: sliding_window_mask(S, 64), "wide-window": lambda: sliding_window_mask(S, c)}[kind]()
    config = SolverConfig(cp_size=P, objective=objective)
    areas = block_areas(mask, P, config.head_groups)
    owner = evaluate(areas, owner_computes_assignment(areas), config.cost())
    assert owner.imbalance.item() <= config.imbalance_tol           # the precondition holds on this mask
    res = api.solve_device(areas, config)
    m = evaluate(areas, res.assignment, config.cost())
    assert bool(res.balanced) and m.imbalance.item() <= config.imbalance_tol
    if objective == "forward":
        assert m.fwd_bottleneck.item() <= owner.fwd_bottleneck.item()
    else:
        assert (m.fwd_bottleneck + m.bwd_bottleneck).item() <= (owner.fwd_bottleneck + owner.bwd_bottleneck).item()
    assert int(res.objective) == (int(m.fwd_bottleneck) if objective == "forward"
                                  else int(m.fwd_bottleneck + m.bwd_bottleneck))


# ------------------------------------------------------------------ the state and the prices are evaluate()


def _check_state(tasks, areas, config, A: torch.Tensor, st) -> None:
    for b in range(A.shape[0]):
        m = evaluate(areas, _assignment(tasks, A[b]), config.cost())
        for name, got, want in (("load", st.load[b], m.load), ("fwd send", st.send[b], m.fwd_send),
                                ("fwd recv", st.recv[b], m.fwd_recv), ("bwd send", st.bsend[b], m.bwd_send),
                                ("bwd recv", st.brecv[b], m.bwd_recv)):
            assert torch.equal(got, want), f"variant {b} {name}: state {got.tolist()}, evaluate {want.tolist()}"
        assert int(st.bottleneck[b]) == int(m.fwd_bottleneck) and int(st.bwd_bottleneck[b]) == int(m.bwd_bottleneck)


def _check_prices(tasks, areas, config, st, prop, exact: bool = False) -> int:
    """Each offered move, applied alone, changes its destination's load by exactly its price, and its
    volumes by exactly theirs, or (unless ``exact``) by no more in the two cases the prices bound
    from above (``PRICE_BOUNDS``). Returns the number of moves checked."""
    checked = 0
    A = st.rank
    P = tasks.P
    for b in range(A.shape[0]):
        m0 = evaluate(areas, _assignment(tasks, A[b]), config.cost())
        for n in prop.ok[b].nonzero()[:, 0].tolist():
            ids = prop.tasks[b, n]
            ids = ids[ids < tasks.T]
            moved = A[b, :tasks.T].clone()
            moved[ids] = prop.dest[b, n]
            m1 = evaluate(areas, _assignment(tasks, moved), config.cost())
            d, s = int(prop.dest[b, n]), int(prop.source[b, n])
            got = [int(x[d]) for x in (m1.load - m0.load, m1.fwd_send - m0.fwd_send, m1.fwd_recv - m0.fwd_recv,
                                        m1.bwd_send - m0.bwd_send, m1.bwd_recv - m0.bwd_recv)]
            want = [int(x[b, n]) for x in (prop.area, prop.dest_send, prop.dest_recv, prop.dest_bsend,
                                            prop.dest_brecv)]
            home = d == int(tasks.q_host[ids[0]])
            kv_here = st.kcount[b].reshape(-1)[tasks.kv_unit[ids] * P + s]
            shared = bool(((tasks.k_host[ids] == d) & (kv_here > 1)).any())
            what = f"variant {b} move {n} {s} -> {d} (home {home}, shared K/V unit {shared}): " \
                   f"evaluate {got}, priced {want}"
            assert got[0] == want[0], what
            if (home or shared) and not exact:
                assert all(g <= w for g, w in zip(got[1:], want[1:])), what
            else:
                assert got == want, what
            checked += 1
    return checked


# The destination's volume prices are upper bounds, not exact, when (a) the destination is the
# unit's query host: the price is the destination's own part and leaves out the Q/O rows it stops
# sending as the host; (b) the source keeps other tasks of a moved task's K/V unit and the
# destination is that unit's key host: the K/V rows the source stops receiving are counted only
# when the moved task was the unit's last there (a lower bound of what is freed). Exact (b) needs
# the hull of a K/V unit's other tasks on the source, a second extreme per (K/V unit, rank) kept in
# the state of all three paths (torch, Triton, persistent).
PRICE_BOUNDS = "destination volume prices are upper bounds when it is the query host or shares a K/V unit"


@settings(max_examples=budget(4, 300))
@given(kind=st.sampled_from(["random", "causal-docs", "full-docs"]), P=st.integers(2, 6), c=st.sampled_from([8, 24, 64]),
       G=st.integers(1, 2), tiles=st.sampled_from([1, 2]), objective=st.sampled_from(["training", "forward"]),
       keep=st.booleans(), seed=st.integers(0, 2 ** 16))
# found by make fuzz: whole chunks too, a move home (case (a)) in the first rounds, priced +3072
# receive bytes for +432
@example(kind="random", P=6, c=24, G=2, tiles=1, objective="training", keep=False, seed=216)
def test_state_and_prices_equal_evaluate_per_variant(kind, P, c, G, tiles, objective, keep, seed):
    S = P * c
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, head_dim=64, chunk_tiles=tiles,
                          objective=objective, keep_forward_buffers=keep)
    areas = block_areas(_mask(kind, S, seed), P, G, tiles=tiles)
    tasks = api.Tasks(areas, config)
    seen, priced = [], []

    def spy_state(t, A):
        s = api.state(t, A)
        seen.append((A.clone(), s))
        return s

    def spy_prices(*args, **kw):
        prop = api.bundle_proposals(*args, **kw)
        priced.append((args[1], prop))
        return prop

    sideways, restart_every, singles = api.default_local_search(P)
    api.run_variants(tasks, api.load_cap(tasks, config), api.default_strategies(P), 6, state_fn=spy_state,
                     propose_fn=spy_prices, sideways=sideways, restart_every=restart_every, singles=singles)
    for A, s in seen:
        _check_state(tasks, areas, config, A, s)
    for s, prop in priced:
        _check_prices(tasks, areas, config, s, prop)


@pytest.mark.xfail(strict=True, reason=PRICE_BOUNDS)
@pytest.mark.parametrize("kind,G,keep,seed", [("random", 1, True, 1), ("causal-docs", 2, False, 2)])
def test_tile_move_prices_are_exact(kind, G, keep, seed):
    """P = 2, 24 tokens per rank, 2 tiles (owner-computes puts two tasks of every K/V unit on a rank):
    (random, seed 1) a move 1 -> 0 priced +6336 send bytes adds 5056, case (b): rank 1 keeps another
    task of the moved task's K/V unit, whose hull shrinks by 5 tokens (1280 bytes) rank 0 no longer
    sends; (causal-docs, seed 2) a move home to rank 1 priced -3072 send / 0 receive frees 9216 / 6336,
    case (a): the 12 Q rows (6144 bytes) and O rows it no longer exchanges as the host."""
    P, c, tiles = 2, 24, 2
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, head_dim=64, chunk_tiles=tiles,
                          keep_forward_buffers=keep)
    areas = block_areas(_mask(kind, P * c, seed), P, G, tiles=tiles)
    tasks = api.Tasks(areas, config)
    priced = []

    def spy_prices(*args, **kw):
        prop = api.bundle_proposals(*args, **kw)
        priced.append((args[1], prop))
        return prop

    sideways, restart_every, singles = api.default_local_search(P)
    api.run_variants(tasks, api.load_cap(tasks, config), api.default_strategies(P), 6, propose_fn=spy_prices,
                     sideways=sideways, restart_every=restart_every, singles=singles)
    for s, prop in priced[:3]:
        _check_prices(tasks, areas, config, s, prop, exact=True)


def test_triton_state_equals_evaluate_per_variant():
    P, G = 3, 2
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=G, head_dim=64)
    areas = block_areas(_mask("causal-docs", 96 * P, 5), P, G)
    tasks = api.Tasks(areas, config)
    g = torch.Generator().manual_seed(0)
    A = torch.randint(0, P, (4, tasks.T + 1), generator=g)           # four arbitrary variants
    A[:, tasks.T] = P
    A = torch.where(torch.cat([tasks.valid, tasks.valid.new_zeros(1)])[None], A, P)
    _check_state(tasks, areas, config, A, api.state_triton(tasks, A))


# ------------------------------------------------------------------ three paths, default portfolio, restarts


def _three_paths(rounds: int, restart_every: int):
    P, G = 2, 1
    config = SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=G, head_dim=64)
    areas = block_areas(_mask("causal-docs", 128 * P, 3), P, G)
    tasks = api.Tasks(areas, config)
    cap = api.load_cap(tasks, config)
    strategies = api.default_strategies(P)
    sideways, _, singles = api.default_local_search(P)
    assert len(api.variants(strategies, G, P, 1)[0]) >= 8           # the whole default portfolio
    out, times = {}, {}
    for impl in ("torch", "triton", "persistent"):
        t0 = time.monotonic()
        out[impl] = api.run_path(impl, tasks, cap, strategies, rounds, sideways, restart_every, singles)
        times[impl] = time.monotonic() - t0
    T = tasks.T
    for impl in ("triton", "persistent"):
        # column T is a scratch slot that absorbs writes of unused move slots: not part of the plan
        assert torch.equal(out[impl][0][:, :T], out["torch"][0][:, :T]), impl
        assert torch.equal(out[impl][1], out["torch"][1]), impl
    return out, times


def test_three_paths_default_portfolio_through_a_restart():
    """Rounds 0-3 with a restart at round 2: every variant's best state equal on the three paths."""
    _three_paths(rounds=3, restart_every=2)


@pytest.mark.skipif(not fuzzing(), reason="the default schedule (9 rounds) takes ~80 s in the interpreter: make fuzz")
def test_three_paths_default_portfolio_default_schedule():
    _, restart_every, _ = api.default_local_search(2)
    _three_paths(rounds=restart_every + 1, restart_every=restart_every)
