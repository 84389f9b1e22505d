"""The persistent round-loop kernel equals the torch round loop exactly (interpreter on CPU)."""
import pytest
import torch

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import causal_mask, packed_documents
from gpusolver.solver import device, kernels
from gpusolver.solver.device import Strategy, solve_device
from gpusolver.solver.kernels_rounds import solve_rounds_persistent
from tests._testing import assert_close

_STRATEGIES = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),
               Strategy((1.5,), units_per_rank=1, bundle_dests=2, task_order="rows"))


def _problem(P, G, kind, seed=0):
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G)
    mask = packed_documents(512 * P, seed=seed) if kind == "packed" else causal_mask(64 * P)
    areas = block_areas(mask, P, G, impl="torch")
    tasks = device._Tasks(areas, config)
    cap = (int(round(config.imbalance_tol * device._MU_SCALE)) * tasks.area.sum()) // (P * device._MU_SCALE)
    return config, areas, tasks, cap


@pytest.mark.parametrize("P,G,kind,seed,rounds,sideways,restart_every", [
    (4, 2, "packed", 0, 3, False, 0), (3, 1, "causal", 0, 2, True, 0),
    (6, 2, "packed", 2, 6, True, 3),  # the restart at round 3 changes this instance's result
])
def test_every_variant_equals_the_torch_loop(P, G, kind, seed, rounds, sideways, restart_every, monkeypatch):
    """Best assignment and key of every variant, not only the winner's (destinations in tiles of 2)."""
    monkeypatch.setattr(kernels, "_DEST_TILE", 2)
    _, _, tasks, cap = _problem(P, G, kind, seed)
    ref_A, ref_key = device._run_variants(tasks, cap, _STRATEGIES, rounds, sideways=sideways,
                                          restart_every=restart_every)
    if restart_every:
        plain_A, _ = device._run_variants(tasks, cap, _STRATEGIES, rounds, sideways=sideways)
        assert not torch.equal(plain_A[:, :tasks.T], ref_A[:, :tasks.T]), "the restart changed nothing here"
    variants, K, D = device._variants(_STRATEGIES, tasks.G, P)
    A, key = solve_rounds_persistent(tasks, cap, device._variant_tables(variants, "cpu"),
                                     device._variant_scales(variants, "cpu"), K, D, rounds, 1, sideways,
                                     restart_every)
    assert_close("best_key", ref_key, key)
    assert_close("best_A", ref_A[:, :tasks.T], A[:, :tasks.T])
    assert bool((ref_A[:, :tasks.T] != torch.where(tasks.valid, tasks.i, P)).any()), "no variant moved a task"


def test_solve_persistent_equals_torch():
    config, areas, _, _ = _problem(4, 2, "packed")
    ref = solve_device(areas, config, rounds=3, strategies=_STRATEGIES, impl="torch")
    per = solve_device(areas, config, rounds=3, strategies=_STRATEGIES, impl="persistent")
    for name in ("assignment", "balanced", "fwd_bottleneck", "variant"):
        assert_close(name, getattr(ref, name), getattr(per, name))


def test_persistent_runs_on_meta():
    config, areas, _, _ = _problem(4, 2, "packed")
    res = solve_device(areas.to("meta"), config, rounds=3, strategies=_STRATEGIES, impl="persistent")
    assert res.assignment.device.type == "meta" and res.assignment.shape == (2, 4, 4)
    assert res.assignment.dtype == torch.int32


def test_workers_are_checked():
    config, areas, _, _ = _problem(3, 1, "causal")
    with pytest.raises(ValueError, match="workers=2"):
        solve_device(areas, config, rounds=1, strategies=_STRATEGIES, impl="persistent", workers=2)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        solve_device(areas, config, rounds=1, strategies=_STRATEGIES, impl="persistent", workers=0)


def test_solve_plans_are_identical_on_both_paths(monkeypatch):
    """The whole layer solve (default rounds; a one-strategy portfolio to keep the interpreter quick)."""
    from gpusolver import solve
    from gpusolver.masks import varlen_causal_mask

    monkeypatch.setattr(device, "default_strategies", lambda P: _STRATEGIES[:1])
    config = SolverConfig(cp_size=3, num_heads_q=8, num_heads_kv=2)
    mask = varlen_causal_mask([5, 13, 9, 3, 6])  # S = 36, chunk 12
    a = solve(mask, config, impl="torch")
    b = solve(mask, config, impl="persistent")
    assert_close("assignment", a.assignment, b.assignment)
    assert_close("status", a.status, b.status)
    for name in ("q_ranges", "k_ranges", "attn_type"):
        assert_close(name, getattr(a.calc, name), getattr(b.calc, name))
    for rank in range(3):
        for kind in ("qo", "kv"):
            assert_close(f"{kind} send_index rank {rank}", a.comm.send_index(kind, rank), b.comm.send_index(kind, rank))
