"""How far the solvers are from optimal, on instances small enough for an exact MILP.

For packed-document masks at P = 4 (G = 8 head groups) and P = 8 (G = 4:
GQA 32:4), 4K tokens per rank, D = 128, bf16, mu = 1.10: the MILP of
``gpusolver.bounds.milp_bottleneck`` gives a proven lower bound on the best
possible forward bottleneck (and its own assignment, an upper bound); next to
it the reference and device solvers' forward bottlenecks and their ratio to
that lower bound (1.00 = provably optimal).

    python benchmarks/optimality_gap.py                 # 3 seeds, 20 s MILP limit each
    python benchmarks/optimality_gap.py --seeds 1 --time-limit 5
    python benchmarks/optimality_gap.py --quality-masks --tiles 4 --time-limit 90
    python benchmarks/optimality_gap.py --quality-masks --kinds full --bound-tiles 2 --time-limit 400

``--quality-masks`` takes the quality benchmark's masks instead (P = 8, GQA
64:8, G = 8, 8K tokens per rank): ``bound / reference`` above 0.8 there
proves that no whole-chunk plan reaches 0.8x the reference. ``--tiles n``
adds the device solver with n sub-chunk tiles per chunk. ``--bound-tiles m``
solves the MILP over m tiles per chunk: its bound then holds for every plan at
m tiles and at every divisor of m (whole chunks included), so with n dividing m
the tiled plan gets its own gap (``tiled / bound``). The bound of every row is
the larger of the MILP's and ``shed_lower_bound``'s (each rank alone, a small
program per rank; both columns are shown). ``--direction step``
bounds a training step's bytes instead, ``max_r fwd_r + max_r bwd_r`` (the
MILP with one bottleneck variable per phase), against the device solver's
training objective (the default; ``fwd`` compares the forward-only solver,
``SolverConfig(objective="forward")``, as the earlier tables did).

    python benchmarks/optimality_gap.py --quality-masks --direction step --time-limit 120
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, run as a script or loaded by path

from _common import RESULTS_DIR, environment, make_mask, markdown_table, ratio, write_json, write_text  # noqa: E402
from gpusolver.areas import block_areas  # noqa: E402
from gpusolver.bounds import milp_bottleneck, shed_lower_bound  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.metrics import evaluate  # noqa: E402
from gpusolver.solver.device import solve_device  # noqa: E402
from gpusolver.solver.reference import assign  # noqa: E402

TOKENS_PER_RANK = 4096
CASES = ((4, 64, 8), (8, 32, 4))  # (P, Hq, Hkv): at most 256 non-empty tasks for the MILP
QUALITY_TOKENS_PER_RANK, QUALITY_CASES = 8192, ((8, 64, 8),)  # solver_quality.py's masks at P = 8
MB = 1e6
COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("G", "G", "d"), ("seed", "seed", "d"), ("MILP status", "status", ""),
    ("MILP bound MB", "milp_lower_mb", ".1f"), ("shed bound MB", "shed_lower_mb", ".1f"),
    ("lower bound MB", "lower_mb", ".1f"), ("MILP plan MB", "milp_mb", ".1f"),
    ("reference MB", "reference_mb", ".1f"), ("device MB", "device_mb", ".1f"),
    ("reference / bound", "reference_gap", ".2f"), ("device / bound", "device_gap", ".2f"),
    ("bound / reference", "bound_over_reference", ".2f"),
    ("imb ref", "imbalance_reference", ".3f"), ("imb dev", "imbalance_device", ".3f"),
]
TILED_COLUMNS = [("device tiled MB", "tiled_mb", ".1f"), ("tiled / reference", "tiled_over_reference", ".2f"),
                 ("tiled / bound", "tiled_gap", ".2f")]


def _bytes(m, direction: str) -> int:
    return int(m.fwd_bottleneck + m.bwd_bottleneck) if direction == "step" else int(m.fwd_bottleneck)


def row(kind: str, P: int, hq: int, hkv: int, seed: int, time_limit: float, tokens_per_rank: int = TOKENS_PER_RANK,
        tiles: int = 1, bound_tiles: int = 1, direction: str = "fwd") -> dict:
    objective = "training" if direction == "step" else "forward"
    config = SolverConfig(cp_size=P, num_heads_q=hq, num_heads_kv=hkv, chunk_tiles=1, objective=objective)
    mask = make_mask(kind, P, seed, tokens_per_rank)
    units = {}  # the areas at each tile count, computed once

    def areas_at(n: int):
        if n not in units:
            units[n] = block_areas(mask, P, config.head_groups, impl="torch", tiles=n)
        return units[n]

    areas = areas_at(1)
    cost = config.cost()
    # a plan at n tiles is also a plan at every multiple of n, measured there with no more
    # bytes (per-tile hulls nest in the chunk's), so the bound at m tiles holds for it
    milp = milp_bottleneck(areas_at(bound_tiles), cost, mu=config.imbalance_tol, direction=direction,
                           time_limit=time_limit, max_tasks=1 << 16)
    ref = _bytes(ref_m := evaluate(areas, assign(areas, config).assignment, cost), direction)
    dev = _bytes(dev_m := evaluate(areas, solve_device(areas, config).assignment, cost), direction)
    # each rank alone (``shed_lower_bound``): small programs, often tighter than the whole one at its
    # time limit; the table's gaps are against the larger of the two
    shed, _ = shed_lower_bound(areas_at(bound_tiles), cost, mu=config.imbalance_tol, direction=direction,
                               time_limit=time_limit)
    lb = shed if milp.lower_bound is None else max(milp.lower_bound, shed)
    mb = lambda v: None if v is None else v / MB  # noqa: E731
    out = {"kind": kind, "P": P, "G": config.head_groups, "seed": seed, "bound_tiles": bound_tiles,
           "direction": direction, "status": milp.status,
           "milp_lower_mb": mb(milp.lower_bound), "shed_lower_mb": mb(shed), "lower_mb": mb(lb),
           "milp_mb": mb(milp.bottleneck),
           "reference_mb": mb(ref), "device_mb": mb(dev),
           "reference_gap": ratio(ref, lb), "device_gap": ratio(dev, lb),
           "bound_over_reference": ratio(lb, ref),
           "imbalance_reference": ref_m.imbalance.item(), "imbalance_device": dev_m.imbalance.item()}
    if tiles > 1:
        t_config = dataclasses.replace(config, chunk_tiles=tiles, auto_tiles=False)
        t_areas = areas_at(tiles)
        tiled = _bytes(evaluate(t_areas, solve_device(t_areas, t_config).assignment, cost), direction)
        out.update(tiled_mb=mb(tiled), tiled_over_reference=ratio(tiled, ref),
                   tiled_gap=ratio(tiled, lb) if bound_tiles % tiles == 0 else None)
    return out


def _provenance(argv) -> dict:
    """The quality benchmark's record of a run (commit, command line, machine), for this script."""
    from solver_quality import provenance

    run = provenance(argv)
    return {**run, "command": run["command"].replace("solver_quality.py", "optimality_gap.py", 1)}


def _seed_list(p: argparse.ArgumentParser, text: str) -> list[int]:
    """The seeds of ``--seed-list``; a parser error names a bad entry."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        p.error(f"--seed-list must be comma-separated ints, got {text!r}")
    if any(s < 0 for s in seeds):
        p.error(f"--seed-list seeds must be >= 0, got {text!r}")
    return seeds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed-list", default=None,
                   help="comma-separated seeds to run instead of range(--seeds), e.g. 2 (a longer MILP on one mask)")
    p.add_argument("--time-limit", type=float, default=20.0, help="seconds for each MILP")
    p.add_argument("--kinds", default="causal,full")
    p.add_argument("--quality-masks", action="store_true",
                   help="the quality benchmark's masks: P = 8, GQA 64:8, 8K tokens per rank")
    p.add_argument("--tiles", type=int, default=1, help="also the device solver with this many tiles per chunk")
    p.add_argument("--bound-tiles", type=int, default=1, help="tiles per chunk of the MILP's units")
    p.add_argument("--direction", default="fwd", choices=("fwd", "step"),
                   help="fwd: the forward bottleneck (forward-only solver); step: forward + backward (training)")
    p.add_argument("--json", default=str(RESULTS_DIR / "optimality_gap.json"))
    p.add_argument("--md", default=str(RESULTS_DIR / "optimality_gap.md"),
                   help="the printed table, without the MILP solver's own log lines")
    args = p.parse_args(argv)
    if args.seeds <= 0 or args.time_limit <= 0 or args.tiles <= 0 or args.bound_tiles <= 0:
        p.error(f"--seeds, --time-limit, --tiles and --bound-tiles must be positive, got {args.seeds}, "
                f"{args.time_limit}, {args.tiles}, {args.bound_tiles}")
    torch.set_num_threads(1)
    tokens, cases = (QUALITY_TOKENS_PER_RANK, QUALITY_CASES) if args.quality_masks else (TOKENS_PER_RANK, CASES)
    seeds = range(args.seeds) if args.seed_list is None else _seed_list(p, args.seed_list)
    rows = [row(kind, P, hq, hkv, seed, args.time_limit, tokens, args.tiles, args.bound_tiles, args.direction)
            for kind in args.kinds.split(",") for P, hq, hkv in cases for seed in seeds]
    columns = COLUMNS + (TILED_COLUMNS if args.tiles > 1 else [])
    tiled = f"; device tiled: {args.tiles} tiles per chunk" if args.tiles > 1 else ""
    tiled += f"; MILP over {args.bound_tiles} tiles per chunk" if args.bound_tiles > 1 else ""
    what = "training step bottleneck (fwd + bwd)" if args.direction == "step" else "forward bottleneck"
    run = _provenance(argv)
    text = (f"## Optimality gap: {what} vs the MILP lower bound (packed documents, "
            f"{tokens} tokens per rank, D = 128, bf16, mu = 1.10{tiled})\n\n"
            f"Commit {run['commit']}, `{run['command']}`, {run['machine']}.\n\n{markdown_table(rows, columns)}\n")
    print(text)
    write_text(args.md, text)
    payload = {"benchmark": "optimality_gap", "environment": environment(), "provenance": run, "rows": rows}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
