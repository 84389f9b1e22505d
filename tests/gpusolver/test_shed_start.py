"""The "shed" start: overloaded ranks ship a few head groups' best units whole; what it buys on
packed full documents at P = 8 with 4 tiles; the same plans on every path and on meta."""
import dataclasses

import pytest
import torch

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.limits import balanced_load_cap
from gpusolver.masks import packed_documents, varlen_full_mask
from gpusolver.metrics import evaluate
from gpusolver.solver import core, device, strategies as strat
from gpusolver.solver.device import Strategy, solve_device
from gpusolver.solver.reference import assign
from gpusolver.solver.rounds import solve_rounds_persistent
from gpusolver.solver.start import ref as start_ref
from gpusolver.solver.start.shed import shed_start
from tests._testing import assert_close
from tests._threads import one_torch_thread  # noqa: F401 - autouse, module scope


def _problem(mask, P, G, tiles, heads_per_group=8):
    config = SolverConfig(cp_size=P, num_heads_q=heads_per_group * G, num_heads_kv=G, chunk_tiles=tiles,
                          auto_tiles=False)
    areas = block_areas(mask, P, G, impl="torch", tiles=tiles)
    tasks = core.Tasks(areas, config)
    cap = balanced_load_cap(tasks.area.sum(), config.imbalance_tol, P, core._MU_SCALE)
    return config, areas, tasks, cap


def _unit_ranks(tasks, start):
    """[G, U] start rank of each QO unit (-1 without tasks), checking its tasks share it."""
    rows = torch.where(tasks.valid, start, -1).view(tasks.G * tasks.U, tasks.U)
    ranks = rows.amax(1)
    assert torch.equal(torch.where(rows >= 0, rows, ranks[:, None]), ranks[:, None].expand_as(rows)), \
        "a unit's tasks start on different ranks"
    return ranks.view(tasks.G, tasks.U)


def _loads(tasks, start):
    return torch.zeros(tasks.P, dtype=torch.int64).scatter_add_(0, torch.where(tasks.valid, start, 0), tasks.area)


@pytest.fixture(scope="module")
def full_p8_t4():
    """Packed full documents, P = 8, 8K tokens per rank, GQA 64:8, 4 tiles, seed 2 (the quality
    benchmark's mask): ranks 1 and 6 hold long documents, 1.9x and 2.1x the cap of work."""
    return _problem(packed_documents(8 * 8192, seed=2, causal=False), 8, 8, 4)  # the benchmark's mask


def test_overloaded_ranks_ship_a_few_groups_best_units(full_p8_t4):
    config, areas, tasks, cap = full_p8_t4
    start = shed_start(tasks, cap)
    units = _unit_ranks(tasks, start)
    host = torch.arange(tasks.U) // tasks.tiles
    owner = _loads(tasks, tasks.q_host)
    over = owner > cap
    assert over.tolist() == [False, True, False, False, False, False, True, False]
    moved = (units >= 0) & (units != host)
    assert bool((over[host] | ~moved).all()), "only units of overloaded ranks move"
    assert not bool(over[units[moved]].any()), "pieces go to ranks below the cap"
    # every overloaded rank ends at or below the cap (its pieces cover its excess)
    assert bool((_loads(tasks, start)[over] <= cap).all())
    # rank 6 (a 7,392-token document in its chunk): tiles 1-3 of four head groups, the whole chunk
    # of a fifth; tile 0 also holds short documents, so it ships once
    six = moved[:, 24:28]
    assert six.sum(1).tolist() == [3, 3, 3, 3, 4, 0, 0, 0]
    assert bool(six[:4, 1:].all())
    # each piece (one group of one source) goes to one helper
    for g in range(tasks.G):
        for s in (1, 6):
            dest = units[g, 4 * s:4 * s + 4][moved[g, 4 * s:4 * s + 4]]
            assert dest.unique().numel() <= 1


def test_nothing_overloaded_starts_at_home():
    _, _, tasks, cap = _problem(varlen_full_mask([256] * 8), 4, 2, 2)
    assert torch.equal(shed_start(tasks, cap), tasks.q_host)


def test_runs_on_meta():
    _, areas, _, _ = _problem(varlen_full_mask([1000, 24, 512, 512]), 4, 2, 2)
    config = SolverConfig(cp_size=4, num_heads_q=16, num_heads_kv=2, chunk_tiles=2, auto_tiles=False)
    tasks = core.Tasks(areas.to("meta"), config)
    start = shed_start(tasks, torch.zeros((), dtype=torch.int64, device="meta"))
    assert start.device.type == "meta" and start.shape == (tasks.T,) and start.dtype == torch.int64


def test_start_index_matches_strategies():
    assert strat.STARTS.index("shed") == start_ref.SHED
    assert strat.default_strategies(8)[-1].start == "shed"
    assert all(st.start != "shed" for st in strat.default_strategies(strat.LARGE_P))


def test_full_documents_p8_with_4_tiles_reach_0_8_of_the_reference(full_p8_t4):
    """The quality mask that kept the 4-tile median of full documents at P = 8 above 0.8x the
    reference: 190.2 MB per step without the shed strategy, 173.6 with it (the reference 224.7)."""
    config, areas, _, _ = full_p8_t4
    res = solve_device(areas, config, impl="torch")
    step = int(evaluate(areas, res.assignment, config.cost()).step_bottleneck)
    whole = areas.coarsen(1)
    ref_config = dataclasses.replace(config, chunk_tiles=1)
    ref = int(evaluate(whole, assign(whole, ref_config).assignment, config.cost()).step_bottleneck)
    assert bool(res.balanced)
    assert step <= 0.8 * ref, (step, ref)
    assert int(res.variant) == len(strat.default_strategies(8)) - 1, "the shed variant should win here"


_WITH_SHED = (Strategy((float("inf"),), units_per_rank=2, bundle_dests=4),
              Strategy((float("inf"),), units_per_rank=2, bundle_dests=2, task_order="small", start="shed"))


def test_shed_variant_equal_on_every_path():
    """A rank with a long document beside owner-computes, 2 tiles, a given start (as the tiled
    refine gives: the shed variant starts at its own level): the torch loop, the per-round
    Triton path and the persistent kernel agree on every variant."""
    # P = 2 (the smallest where one rank is over the cap at owner-computes and the shed start
    # differs from the given one; P = 4 took twice as long under the interpreter)
    config, areas, tasks, cap = _problem(varlen_full_mask([30, 150, 12, 48]), 2, 2, 2, heads_per_group=2)
    assert bool((_loads(tasks, tasks.q_host) > cap).any())
    given = torch.zeros(tasks.T, dtype=torch.int64)  # a given start unlike any of the solver's: all on rank 0
    search = dict(sideways=True, restart_every=2, singles=True)
    ref_A, ref_key = device.run_variants(tasks, cap, _WITH_SHED, 3, start=given, **search)
    variants, K, D = strat.variants(_WITH_SHED, tasks.G, tasks.P, tasks.tiles)
    starts = start_ref.variant_starts(tasks, variants, given, cap=cap)
    assert starts.shape == (2, tasks.T) and torch.equal(starts[0], given) and not torch.equal(starts[1], given)
    tri_A, tri_key = device._run_triton(tasks, cap, _WITH_SHED, 3, given, **search)
    per_A, per_key = solve_rounds_persistent(tasks, cap, strat.variant_tables(variants, "cpu"),
                                             strat.variant_scales(variants, "cpu"), K, D, 3, 1, True, 2,
                                             start=starts, singles=True)
    for name, (A, key) in {"triton": (tri_A, tri_key), "persistent": (per_A, per_key)}.items():
        assert_close(f"{name} best_key", ref_key, key)
        assert_close(f"{name} best_A", ref_A[:, :tasks.T], A[:, :tasks.T])
