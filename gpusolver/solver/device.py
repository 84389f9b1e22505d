"""The device solver: parallel scored moves from owner-computes.

Every operation is a whole-tensor op over static shapes and the loop runs a
fixed number of rounds, so the solve runs on any device without host reads
(it runs on ``device="meta"``) and can be captured in a CUDA graph.

The algorithm (docs/design/solver.md, "The device algorithm"):

* Start from owner-computes: every task on its query host (no Q/O traffic,
  usually unbalanced). With sub-chunk tiles (``chunk_tiles`` n > 1, units of
  c / n tokens, unit u on rank u // n) start instead from the plan solved for
  whole chunks: tile moves then refine it (coarse to fine). Some variants
  start elsewhere: transposed, Ulysses, or (below P = 32) shed, where each
  overloaded rank first ships a few head groups' best units whole.
* Every round, each source rank offers its heaviest QO units; a *bundle
  move* ships a prefix of one unit's tasks (in one of three task orders:
  largest first, fewest needed query rows first, or smallest first) to one
  destination: as much as fits the destination's headroom, so the unit's rows
  travel once for as much work as possible. Its exact marginal cost, in bytes
  at each rank it touches (query host, source, destination, key hosts), is
  what it adds to the destination's hulls of the unit's rows and of each
  task's key columns, and what it frees at the source.
* **Balance phase** (some rank above ``mu x mean``): moves off overloaded
  ranks, scored by added bytes per unit of area, every touched rank under the
  variant's threshold. A variant stuck with no move may, for one round, fill
  destinations to just below its maximum load (chains instead of swaps).
* **Bottleneck phase** (balanced): moves that lower the bottleneck rank's
  volume without pushing any touched rank to the bottleneck.
* Selection by segmented arg-mins and prefix sums: each offered unit picks its
  best (destination, size); each destination accepts proposals in score order
  while its load and volume fit; each source stops once its excess is covered.
* Local search below P = 32: sideways bottleneck-phase moves (the bottleneck
  stays, every touched rank stays below it, the total bytes fall), and at
  rounds 8 and 16 a restart from the best state with the bottleneck rank's
  moves undone. Below P = 8 the balance phase may also ship a unit's first
  task alone.
* A portfolio of strategies (search width, task order, threshold) runs as
  variants side by side; each keeps its best state over the rounds (balanced
  first, then the lowest forward bottleneck) and the best variant wins.

All volumes are forward bytes in int64; ties break by index, so the result
is bit-identical on every rank. With ``SolverConfig(topology=...)`` across
nodes every byte is priced by its link (an InfiniBand byte weighs the
NVLink / NIC bandwidth ratio, an NVLink byte 1: integers, so every path
agrees), and each bundle is also priced against the rank of the source's
node with most headroom; the persistent path refuses such a configuration.

This module is the round driver; the package is laid out as it works:

    core.py        tasks, the state of an assignment, proposals, constants
    strategies.py  the portfolio (Strategy, default_strategies) and its variant tables
    state/         hulls, loads and bytes of an assignment   ref.py (torch) | kernel.py (Triton)
    offers/        each source's offered units and destination window
    bundle/        each offered unit's best bundle move, priced exactly
    accept/        which proposals to apply, and the moves
    track/         each variant's best state and the round's limits
    start/         the transposed and shed starts and the restart (shed.py: torch on every path)
    rounds.py      the whole round loop as one persistent Triton kernel
    reference.py   the CPU yardstick (numpy)

Each ``ref.py`` is the torch twin its ``kernel.py`` equals bit for bit; the
kernels import only ``core`` (and the kernels of earlier steps), never this
driver.
"""
from __future__ import annotations

from dataclasses import fields, replace

import torch

from gpusolver.config import SolverConfig
from gpusolver.limits import MAX_CHUNK_TILES, balanced_load_cap
from gpusolver.problem import BlockAreas
from gpusolver.solver.accept.ref import accept_apply
from gpusolver.solver.balance import candidate_tols, choose
from gpusolver.solver.bundle.ref import bundle_proposals
from gpusolver.solver.core import _BIG, _MU_SCALE, DeviceSolveResult, Tasks, objective, over_buffers, step_vol
from gpusolver.solver.start.ref import restart, variant_starts
from gpusolver.solver.state.ref import state
from gpusolver.solver.strategies import (
    _INF, DEFAULT_ROUNDS, DEFAULT_STRATEGIES, LARGE_P, LARGE_P_STRATEGIES, NODE_LEVEL_STRATEGIES, RESTART_EVERY,
    SINGLES_P, STARTS,
    TASK_ORDERS, Strategy, default_local_search, default_strategies, variant_scales, variant_tables, variants)
from gpusolver.solver.track.ref import track
from gpusolver.step_model import time_weights

__all__ = ["DEFAULT_ROUNDS", "DEFAULT_STRATEGIES", "DeviceSolveResult", "IMPLS", "LARGE_P", "LARGE_P_STRATEGIES",
           "RESTART_EVERY", "SINGLES_P", "STARTS", "TASK_ORDERS", "Strategy", "coarser_tiles", "default_local_search",
           "default_strategies", "run_variants", "solve_device"]

IMPLS = ("torch", "triton", "persistent", "auto")
# The torch path runs the whole portfolio as one batch below this many ranks: measured side by
# side, one batch is faster there and slower above (CHANGELOG.md, "Design notes").
TORCH_BATCH_RANKS = 16


def coarser_tiles(tiles: int) -> int:
    """The tiles per chunk a tiled solve starts from: half of an even count, else 1."""
    return tiles // 2 if tiles % 2 == 0 else 1


def run_variants(tasks: Tasks, cap: torch.Tensor, strategies: tuple[Strategy, ...], rounds: int,
                 state_fn=None, propose_fn=None, accept_apply_fn=None, track_fn=None,
                 sideways: bool = False, restart_every: int = 0, start: torch.Tensor | None = None,
                 start_fn=None, singles: bool = False):
    """Run the variants of ``strategies`` side by side: best (A [B, T+1], key [B]).

    ``start`` ([T] int64, the rank of each non-empty task) is the assignment every
    variant starts from and round 0's state; by default each variant starts as its
    strategy says (``variant_starts``; ``start_fn`` computes the "transpose" and "ulysses" starts).
    ``sideways`` allows sideways bottleneck-phase moves, ``singles`` one-task bundles
    while balancing (``_bundle_proposals``).
    With ``restart_every = R > 0``, at rounds R, 2R, ... (before the last) each
    variant restarts from its best state with its bottleneck rank's moves
    undone (``restart``): an iterated local search, since the moves settle
    within a few rounds.

    The four steps of a round default to the torch twins (``state``,
    ``bundle_proposals``, ``accept_apply``, ``track``); the Triton path
    passes its kernels' launchers, which are bit-equal twins.

    The strategies' search widths become per-variant limits inside one batch
    (units beyond a variant's count are not proposed; its destination window
    is narrowed to its own width). A variant's result does not depend on the
    batch it runs in: proposals keep their relative order, and a narrowed
    window only repeats a destination already priced first.
    """
    state_fn, propose_fn = state_fn or state, propose_fn or bundle_proposals
    accept_apply_fn, track_fn = accept_apply_fn or accept_apply, track_fn or track
    P, T, dev = tasks.P, tasks.T, tasks.area.device
    rows, K, D = variants(strategies, tasks.G, P, tasks.tiles)
    B = len(rows)
    order_b, dests_b, units_b = variant_tables(rows, dev).unbind(0)
    offered = (torch.arange(P * K, device=dev) % K)[None, :] < units_b[:, None]  # [B, P*K]
    # the objective and the buffers (host values: the best-state key ranks plans past a buffer last)
    track_kw = dict(training=tasks.training)
    if tasks.caps:
        track_kw.update(caps=tasks.buffer_rows)
    caps = None  # [4, B] each variant's buffers for its moves, set at round 0
    # the start (owner-computes unless given or transposed); column T is a dummy that absorbs
    # writes of unused slots
    nodes_fn = lambda: node_start(tasks, rounds, state_fn=state_fn, propose_fn=propose_fn,  # noqa: E731
                                  accept_apply_fn=accept_apply_fn, track_fn=track_fn)
    starts = variant_starts(tasks, rows, start, start_fn, cap=cap, nodes_fn=nodes_fn)
    A = torch.where(tasks.valid, tasks.q_host if starts is None else starts, P).expand(B, T)
    A = torch.cat((A, torch.full((B, 1), P, dtype=torch.int64, device=dev)), dim=1)
    best_A = A.clone()
    best_key = torch.full((B,), _BIG, dtype=torch.int64, device=dev)
    threshold = None
    stuck = torch.zeros((B,), dtype=torch.bool, device=dev)
    for rnd in range(rounds + 1):
        st = state_fn(tasks, A)
        if threshold is None:  # round 0, each variant's start, is the base of its threshold
            scale = variant_scales(rows, dev)
            threshold = torch.where(scale == _INF, float(_BIG), objective(st, tasks.training).double() * scale + 1.0)
            if tasks.caps:
                caps = start_caps(tasks, st)
        best_A, best_key, excess, balance, dest_cap, limit = track_fn(A, st, cap, stuck, threshold, best_A, best_key,
                                                                      **track_kw)
        if rnd == rounds:
            break
        if restart_every > 0 and rnd > 0 and rnd % restart_every == 0:
            # only balanced variants restart: undoing the bottleneck rank's moves of a variant
            # still balancing throws its balancing away (a long causal pack ended unbalanced with
            # every variant restarting, balanced with this rule)
            again = (best_key < _BIG // 2)[:, None]
            A = torch.where(again, restart(tasks, best_A, step_vol(state_fn(tasks, best_A), tasks.training)), A)
            stuck = stuck & ~again[:, 0]
            st = state_fn(tasks, A)
            best_A, best_key, excess, balance, dest_cap, limit = track_fn(A, st, cap, stuck, threshold,
                                                                          best_A, best_key, **track_kw)
        prop = propose_fn(tasks, st, dest_cap, excess, balance, threshold, K, D, dests_b, order_b, sideways,
                          singles, caps=caps)
        prop = replace(prop, ok=prop.ok & offered)
        A, stuck = accept_apply_fn(A, prop, st, dest_cap, limit, excess, balance, training=tasks.training,
                                   recv_caps=None if caps is None else caps[:2])
    return best_A, best_key


def node_start(tasks: Tasks, rounds: int, **steps) -> torch.Tensor:
    """The "nodes" start, [T] int64: a two-level assignment over a topology's nodes.

    First a solve over the nodes: each node is one rank whose R ranks' chunks are its R tiles
    (unit u on node u // R, the tiled problem's layout), so the node-level plan balances the
    nodes' loads within mu and minimises the bytes between nodes. Then each task goes to a rank
    of its node: its query host when that is there, else its key host, else the rank at its
    query host's local index; the rounds of the topology-aware solve balance the ranks inside
    each node from there. ``steps`` are the round's step functions (``run_variants``), so every
    path computes the same start. Owner-computes without a topology across nodes, with tiles,
    or past MAX_CHUNK_TILES ranks per node. Made once per solve (kept on ``tasks``).
    """
    made = tasks.__dict__.get("_node_start")
    if made is not None:
        return made
    areas, config = tasks.problem
    if tasks.links is None or areas.tiles != 1 or tasks.links[0] > MAX_CHUNK_TILES:
        return tasks.q_host
    R, N = tasks.links[0], tasks.P // tasks.links[0]
    node_areas = BlockAreas(areas.area, areas.q_need, areas.k_need, areas.chunk, R)
    node_config = replace(config, cp_size=N, chunk_tiles=R, auto_tiles=False, topology=None, max_recv_rows=None,
                          max_stage_slices=None)
    node_tasks = Tasks(node_areas, node_config)
    node_cap = balanced_load_cap(node_tasks.area.sum(), config.imbalance_tol, N, _MU_SCALE)
    sideways, restart_every, singles = default_local_search(N)
    best_A, best_key = run_variants(node_tasks, node_cap, NODE_LEVEL_STRATEGIES, rounds, sideways=sideways,
                                    restart_every=restart_every, singles=singles, **steps)
    node = best_A.index_select(0, best_key.argmin().view(1))[0, :tasks.T]
    q, k = tasks.q_host, tasks.k_host
    rank = torch.where(q // R == node, q, torch.where(k // R == node, k, node * R + q % R))
    made = torch.where(tasks.valid, rank, tasks.P)
    tasks._node_start = made
    return made


def start_caps(tasks: Tasks, st) -> torch.Tensor:
    """[4, B] int64, the rows each variant's moves keep to, (QO recv, KV recv, QO send, KV send)
    in ``Tasks.buffer_rows`` order, buffer by buffer: the plan's buffer when the variant's start
    fits it, else none (``_BIG``): a start already past a buffer cannot be brought within it by
    moves that never grow a rank past it, so that variant searches as without that buffer (the
    others still bind), and its plans rank after every plan that fits (``core.state_key``)."""
    rows = (st.q_in, st.k_in, st.q_out, st.k_out)  # [B, P] each, in buffer_rows order
    return torch.stack([torch.where((r > cap).any(1), _BIG, cap) for r, cap in zip(rows, tasks.buffer_rows)])


def solve_device(areas: BlockAreas, config: SolverConfig, *, rounds: int = DEFAULT_ROUNDS,
                 strategies: tuple[Strategy, ...] | None = None, impl: str = "auto",
                 workers: int | None = None, sideways: bool | None = None,
                 restart_every: int | None = None, singles: bool | None = None) -> DeviceSolveResult:
    """Assign every task to a rank, on the device of ``areas``, without host reads.

    areas:      BlockAreas (area [G, U, U] int64, q_need/k_need [G, U, U, 2] int64; U = P,
                or n * P with ``config.chunk_tiles = n`` sub-chunk tiles: then the areas at
                ``coarser_tiles(n)`` tiles are solved first and that plan is refined).
    config:     SolverConfig (P, heads, D, dtype, imbalance_tol, chunk_tiles).
    rounds:     rounds of moves per variant (static).
    strategies: batches of variants (default: ``default_strategies(P, config.relays)``); the best state wins.
    impl:       "torch"; "triton" (a few kernels per round, each step's kernel.py); "persistent"
                (one kernel for all rounds, rounds.py); or "auto" (triton on CUDA).
    workers:    programs per variant of the persistent kernel (None: 1 off CUDA, on CUDA
                ``rounds.default_workers``).
    sideways, restart_every, singles: the local search's extras (None:
                ``default_local_search(P)``); see ``run_variants``.
    With ``config.imbalance_auto`` the whole solve runs at each of ``balance.candidate_tols(mu)``
    and the plan of the lowest modelled step wins (``balance.choose``; its ``imbalance_tol`` field
    says which bound): one solve's work per candidate.
    With ``objective="training"`` the portfolio runs twice, its moves priced by the training rule
    and by the forward rule, and the plan with the smaller fwd + bwd wins (so a training plan never
    moves more per step than the forward-only one): twice the rounds of a forward-only solve.
    Returns a DeviceSolveResult; ``assignment`` is [G, U, U] int32 and
    ``variant`` indexes the variants of all strategies in order (of the winning rule's run).
    """
    strategies = _check(areas, config, rounds, strategies, impl)
    if config.imbalance_auto:
        # a time-aware mu: one solve per candidate bound, the lowest modelled step kept on the device
        tols = candidate_tols(config.imbalance_tol)
        results = [solve_device(areas, replace(config, imbalance_tol=mu, imbalance_auto=False), rounds=rounds,
                                strategies=strategies, impl=impl, workers=workers, sideways=sideways,
                                restart_every=restart_every, singles=singles) for mu in tols]
        weights = time_weights(config, areas.chunk * areas.num_units)
        return choose(results, tols, areas.area, weights, config.cp_size)
    default_sideways, default_restart, default_singles = default_local_search(areas.cp_size)
    search = dict(sideways=default_sideways if sideways is None else bool(sideways),
                  restart_every=default_restart if restart_every is None else restart_every,
                  singles=default_singles if singles is None else bool(singles))
    if search["restart_every"] < 0:
        raise ValueError(f"restart_every must be >= 0 (0: never), got {restart_every}")
    start = coarse = None
    if areas.tiles > 1:
        # coarse to fine: solve at half the tiles (whole chunks for an odd count) first, then
        # refine that plan with tile moves; each level keeps its best state, so n tiles never
        # end above n / 2 tiles or whole chunks
        coarse_tiles = coarser_tiles(areas.tiles)
        coarse = solve_device(areas.coarsen(coarse_tiles), replace(config, chunk_tiles=coarse_tiles),
                              rounds=rounds, strategies=strategies, impl=impl, workers=workers, **search)
        start = areas.refine(coarse.assignment).reshape(-1).long()
    tasks = Tasks(areas, config)
    cap = balanced_load_cap(tasks.area.sum(), config.imbalance_tol, tasks.P, _MU_SCALE)  # largest balanced load
    if impl == "torch" or (impl == "auto" and not areas.area.is_cuda):
        state_fn = state
    else:
        from gpusolver.solver.state.kernel import state_triton as state_fn

    def run(rule_tasks: Tasks) -> tuple[torch.Tensor, torch.Tensor]:
        """The first best variant's row ([1, T+1]) and index, moves priced by ``rule_tasks``' rule."""
        if impl == "persistent":
            best_A, best_key = _run_persistent(rule_tasks, cap, strategies, rounds, workers, start, **search)
        elif impl == "triton" or (impl == "auto" and areas.area.is_cuda):
            best_A, best_key = _run_triton(rule_tasks, cap, strategies, rounds, start, **search)
        else:
            best_A, best_key = _run_torch(rule_tasks, cap, strategies, rounds, start, **search)
        winner = best_key.argmin().view(1)  # index_select keeps it on the device
        return best_A.index_select(0, winner), winner[0]

    row, variant = run(tasks)
    tiles = torch.full_like(variant, tasks.tiles)
    result = _report(tasks, row, cap, state_fn, variant, tiles)
    if tasks.training:
        # the portfolio once more under the forward rule (the forward-only plan), and the better
        # step wins: with kept buffers a plan's backward is about its forward, and either rule ends
        # lower on some quality masks (CHANGELOG.md, "Design notes")
        other, other_variant = run(tasks.with_rule(training=False))
        theirs = _report(tasks, other, cap, state_fn, other_variant, tiles)
        usable = lambda r: r.balanced & r.fits  # noqa: E731
        take = usable(theirs) & (~usable(result) | (theirs.objective < result.objective))
        result = DeviceSolveResult(**{f.name: torch.where(take, getattr(theirs, f.name), getattr(result, f.name))
                                      for f in fields(DeviceSolveResult) if getattr(result, f.name) is not None})
        row = torch.where(take, other, row)
    if coarse is not None and config.auto_tiles:
        # chunk_tiles="auto": the fewest tiles that reach mu and fit the buffers, chosen on the device
        # (the coarser level already chose among its own)
        use = coarse.balanced & coarse.fits
        refined = torch.where(tasks.valid, areas.refine(coarse.assignment).reshape(-1).long(), tasks.P)
        row = torch.where(use, torch.cat((refined, row[0, tasks.T:])), row[0])[None]
        tiles, variant = torch.where(use, coarse.tiles, result.tiles), torch.where(use, coarse.variant, result.variant)
        result = _report(tasks, row, cap, state_fn, variant, tiles)
    return result


def _check(areas: BlockAreas, config: SolverConfig, rounds: int, strategies, impl: str) -> tuple[Strategy, ...]:
    """The portfolio to run; raises ValueError on a mismatch of areas and config or a bad argument."""
    G, P = areas.head_groups, areas.cp_size
    if P != config.cp_size:
        raise ValueError(f"areas are for P={P} ranks but config.cp_size={config.cp_size}")
    if G != config.head_groups:
        raise ValueError(f"areas have G={G} head groups but config.head_groups={config.head_groups}")
    if areas.tiles != config.chunk_tiles:
        raise ValueError(f"areas have tiles={areas.tiles} per chunk but config.chunk_tiles={config.chunk_tiles}")
    strategies = default_strategies(P, config.relays) if strategies is None else tuple(strategies)
    if rounds < 0 or not strategies or not all(st.threshold_scales for st in strategies):
        raise ValueError(f"need rounds >= 0 and strategies with threshold scales, got {rounds}, {strategies}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "persistent" and config.link_weights is not None:
        # the one-launch loop has never run on a GPU; it prices plain bytes until one times it
        raise ValueError(f"impl='persistent' does not take a topology across nodes (ranks_per_node="
                         f"{config.topology.ranks_per_node} < cp_size={P}); use impl='triton' or 'torch' "
                         "(docs/support_matrix.md)")
    return strategies


def _run_torch(tasks: Tasks, cap, strategies, rounds, start, **search):
    """The torch twins (CPU). With few ranks each op is small and its dispatch dominates, so the
    portfolio runs as one batch; from TORCH_BATCH_RANKS up, one batch per strategy, so narrow
    strategies do not pay for the widest one (either way each variant's result is the same)."""
    batches = (strategies,) if tasks.P < TORCH_BATCH_RANKS else tuple((st,) for st in strategies)
    runs = [run_variants(tasks, cap, batch, rounds, start=start, **search) for batch in batches]
    return torch.cat([a for a, _ in runs]), torch.cat([k for _, k in runs])


def _run_triton(tasks: Tasks, cap, strategies, rounds, start, **search):
    """The same loop with each step's Triton kernel; one batch for the whole portfolio (fewest launches)."""
    from gpusolver.solver.accept.kernel import accept_apply_triton
    from gpusolver.solver.bundle.kernel import bundle_proposals_triton
    from gpusolver.solver.start.kernel import transpose_start_triton
    from gpusolver.solver.state.kernel import state_triton
    from gpusolver.solver.track.kernel import track_triton

    return run_variants(tasks, cap, strategies, rounds, state_triton, bundle_proposals_triton, accept_apply_triton,
                        track_triton, start=start, start_fn=transpose_start_triton, **search)


def _run_persistent(tasks: Tasks, cap, strategies, rounds, workers, start, sideways, restart_every, singles):
    """Every round of every variant in one launch (rounds.py)."""
    from gpusolver.solver.rounds import default_workers, solve_rounds_persistent
    from gpusolver.solver.start.kernel import transpose_start_triton

    rows, K, D = variants(strategies, tasks.G, tasks.P, tasks.tiles)
    dev = tasks.area.device
    if workers is None:
        workers = default_workers(len(rows), tasks.P * K, dev)
    return solve_rounds_persistent(tasks, cap, variant_tables(rows, dev), variant_scales(rows, dev), K, D, rounds,
                                   workers, sideways, restart_every,
                                   start=variant_starts(tasks, rows, start, transpose_start_triton, cap=cap),
                                   singles=singles)


def _report(tasks: Tasks, row: torch.Tensor, cap, state_fn, variant, tiles) -> DeviceSolveResult:
    """The result of the chosen assignment ``row`` ([1, T+1]): its bottlenecks, balance and buffers
    from ``state_fn`` of that one row."""
    G, U = tasks.G, tasks.U
    assignment = torch.where(tasks.valid, row[0, :tasks.T], -1).view(G, U, U)
    st = state_fn(tasks, row.contiguous())
    ok = st.load[0].amax() <= cap
    none = torch.full_like(st.bottleneck[0], -1)
    fwd, bwd = torch.where(ok, st.bottleneck[0], none), torch.where(ok, st.bwd_bottleneck[0], none)
    goal = torch.where(ok, objective(st, tasks.training)[0], none)
    fits = ~over_buffers(st, tasks.buffer_rows)[0]
    return DeviceSolveResult(assignment=assignment.to(torch.int32), balanced=ok, fwd_bottleneck=fwd,
                             variant=variant, bwd_bottleneck=bwd, objective=goal, fits=fits, tiles=tiles)
