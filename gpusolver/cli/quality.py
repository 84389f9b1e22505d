"""``python -m gpusolver quality`` and ``solve``: the solver on one mask at real shapes.

``quality`` solves a packed-document mask (default 8K tokens per rank, GQA
64:8, D = 128, bf16, P = 8) with both solvers and prints how each plan
compares with owner-computes and the classic context-parallel schemes (no
attention runs). ``solve`` builds one full plan (areas, assignment, metas),
prints its summary and can save it (``Plan.save``) for ``show``.
"""
from __future__ import annotations

import dataclasses
import time
import warnings

import torch

from gpusolver.areas import block_areas, block_sparse_areas, token_topk_areas
from gpusolver.baselines import baseline_table
from gpusolver.config import SolverConfig
from gpusolver.masks import dsa_topk_indices, nsa_block_indices, packed_documents
from gpusolver.metrics import evaluate
from gpusolver.solve import SOLVERS, solve, solve_assignment

MIB = 1 << 20


def _quality_rows(areas, config: SolverConfig, solvers, tiled=None) -> list[str]:
    """Markdown rows: each solver, the device solver on ``tiled`` (areas, config) if given,
    owner-computes and the classic schemes."""
    base = baseline_table(areas, config)
    usp_f, usp_b = base["usp"]["fwd_bottleneck"], base["usp"]["bwd_bottleneck"]
    rows = ["| plan | imbalance | fwd bottleneck | bwd bottleneck | fwd vs USP | bwd vs USP | solve |",
            "|---|---|---|---|---|---|---|"]

    def row(name, imb, fwd, bwd, seconds):
        t = "" if seconds is None else f"{seconds * 1e3:.0f} ms"
        imb_s = "" if imb is None else f"{imb:.3f}"
        rows.append(f"| {name} | {imb_s} | {fwd / MIB:.1f} MiB | {bwd / MIB:.1f} MiB | "
                    f"{100 * (fwd / usp_f - 1):+.0f} % | {100 * (bwd / usp_b - 1):+.0f} % | {t} |")

    for name in solvers:
        t0 = time.perf_counter()
        assignment = solve_assignment(areas, config, solver=name)
        seconds = time.perf_counter() - t0
        m = evaluate(areas, assignment, config.cost())
        row(f"gpusolver {name}", m.imbalance.item(), m.fwd_bottleneck.item(), m.bwd_bottleneck.item(), seconds)
    if tiled is not None:
        t_areas, t_config = tiled
        t0 = time.perf_counter()
        assignment = solve_assignment(t_areas, t_config, solver="device")
        seconds = time.perf_counter() - t0
        m = evaluate(t_areas, assignment, t_config.cost())
        row(f"gpusolver device, {t_config.chunk_tiles} tiles per chunk", m.imbalance.item(),
            m.fwd_bottleneck.item(), m.bwd_bottleneck.item(), seconds)
    owner = evaluate(areas, torch.where(areas.area > 0, torch.arange(config.cp_size).view(1, -1, 1), -1),
                     config.cost())
    row("owner-computes", owner.imbalance.item(), owner.fwd_bottleneck.item(), owner.bwd_bottleneck.item(), None)
    for name in ("usp", "ring", "all_gather_kv"):
        row(name.replace("_", "-"), None, base[name]["fwd_bottleneck"], base[name]["bwd_bottleneck"], None)
    return rows


def _sparse_areas(kind: str, seqlen: int, config: SolverConfig, seed: int):
    """Block areas of a random NSA block selection or DSA token top-k (what an indexer would produce)."""
    n = config.chunk_tiles
    units = config.cp_size * n  # computed for n * P ranks, read as n tiles per rank
    if kind == "nsa":  # 64-token blocks, top-16 per query and KV head
        sel = nsa_block_indices(seqlen, config.num_heads_kv, block_size=64, top_n=16, seed=seed)
        areas = block_sparse_areas(sel, 64, units, config.head_groups)
    else:
        topk = dsa_topk_indices(seqlen, topk=min(2048, seqlen), seed=seed)  # shared by all heads
        areas = token_topk_areas(topk, units, config.head_groups)
    return areas.as_tiles(n)


def quality(args) -> None:
    torch.set_num_threads(1)  # the solve is many small ops: threads only add overhead on CPU
    hq, hkv = args.heads
    config = SolverConfig(cp_size=args.cp_size, num_heads_q=hq, num_heads_kv=hkv, head_dim=args.head_dim)
    kind = "causal" if args.causal else "full"
    what = {"docs": f"packed {kind}-document mask", "nsa": "NSA block selection (64-token blocks, top-16)",
            "dsa": "DSA token top-k (k = 2048)"}[args.mask]
    print(f"{what}: {args.tokens_per_rank} tokens per rank, P={config.cp_size}, "
          f"GQA {config.num_heads_q}:{config.num_heads_kv}, D={config.head_dim}, bf16, seed {args.seed}, "
          f"mu={config.imbalance_tol}")
    S = args.tokens_per_rank * config.cp_size
    tiled_config = dataclasses.replace(config, chunk_tiles=args.tiles) if args.tiles > 1 else None
    if args.mask != "docs":  # sparse indexer masks: assignment quality only (plans need slices)
        areas = _sparse_areas(args.mask, S, config, args.seed)
        tiled = None if tiled_config is None else (_sparse_areas(args.mask, S, tiled_config, args.seed), tiled_config)
        print("\n".join(_quality_rows(areas, config, SOLVERS, tiled)))
        return
    mask = packed_documents(S, seed=args.seed, causal=args.causal)
    tiled = None if tiled_config is None else (
        block_areas(mask, config.cp_size, config.head_groups, impl="torch", tiles=args.tiles), tiled_config)
    print("\n".join(_quality_rows(block_areas(mask, config.cp_size, config.head_groups, impl="torch"),
                                   config, SOLVERS, tiled)))
    t0 = time.perf_counter()
    plan = solve(mask, config)
    print(f"\nfull solve (areas + device solver + plan metas, torch path on CPU): "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
    print(plan.summary())


def solve_command(args) -> None:
    from gpusolver.cli.args import build_mask

    torch.set_num_threads(1)
    hq, hkv = args.heads
    config = SolverConfig(cp_size=args.cp_size, num_heads_q=hq, num_heads_kv=hkv, head_dim=args.head_dim,
                          dtype=args.dtype, chunk_tiles=args.tiles)
    mask = build_mask(args.mask, args.tokens_per_rank * config.cp_size, args.seed)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the summary's status line names an imbalance
        plan = solve(mask, config, solver=args.solver)
    print(f"solved P={config.cp_size} ({args.solver} solver) in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    print(plan.summary())
    if args.save:
        plan.save(args.save, config=config)
        print(f"plan saved to {args.save} (python -m gpusolver show --plan {args.save})")
