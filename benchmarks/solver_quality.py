"""Solver quality on the benchmark masks: balance and bytes moved, next to USP and owner-computes.

Masks: packed causal documents and packed full documents drawn from the
shipped document-length histogram, 8K tokens per rank, GQA Hq:Hkv = 64:8,
D = 128, bf16, head groups G = 8, mu = 1.10 (``SolverConfig`` defaults).
For every (mask kind, P, seed) and solver (``reference``: the CPU greedy,
``device``: ``solve_device`` with the training-step objective, the default;
``device-fwd``: ``SolverConfig(objective="forward")``, the forward-only plans
of the earlier figures) it records

    imbalance            max load / mean load (balanced when <= mu)
    fwd / bwd MB         bottleneck bytes, max_r max(send_r, recv_r), 10^6 B (backward under
                         the runtime's protocol, ``CommCost``)
    step MB              fwd + bwd: what a training step waits for (the device objective)
    fwd / bwd / step vs USP  change vs USP in % (-55 = 55 % fewer bytes)
    fwd / bwd ÷ owner    bottleneck ratio to owner-computes (unbalanced, no Q/O traffic)
    dev/ref fwd, step    device bytes / reference bytes
    fwd ÷ fwd-only       device forward / the forward-only solve's (with ``device-fwd``)
    solve ms             one solve, wall time (see solver_latency.py for latency)

then a summary of medians per (kind, P, solver) next to MagiAttention's
published changes vs USP. ``torch.set_num_threads(1)`` is set first: the
solver's tensors are small, and on CPU threading overhead dominates.

    python benchmarks/solver_quality.py                       # P = 8,16,32,64, 3 seeds
    python benchmarks/solver_quality.py --P 8 --kinds causal --solvers device
    python benchmarks/solver_quality.py --quick               # P = 8,16, 1 seed
    python benchmarks/solver_quality.py --P 8,16 --tiles 1,2,4  # device rows per chunk_tiles
    python benchmarks/solver_quality.py --P 8,32 --tokens-per-rank 131072 \
        --json benchmarks/results/solver_quality_128k.json --md benchmarks/results/solver_quality_128k.md

With ``--tiles`` the device solver also runs with sub-chunk tiles
(``SolverConfig.chunk_tiles`` n > 1: rows ``device t<n>``), its bytes and
loads measured on the tiled units; the reference always places whole chunks.
Every run records its commit, command line and machine (``provenance``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, run as a script or loaded by path

from _common import (  # noqa: E402
    KINDS, PACKED_KINDS, RESULTS_DIR, TOKENS_PER_RANK, environment, make_mask, markdown_table, median, parse_list, ratio,
    write_results,
)
from gpusolver.areas import block_areas  # noqa: E402
from gpusolver.baselines import baseline_table  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.metrics import evaluate, owner_computes_assignment  # noqa: E402
from gpusolver.solver.device import solve_device  # noqa: E402
from gpusolver.solver.reference import assign  # noqa: E402

SOLVERS = ("reference", "device", "device-fwd")
# the indexer masks of ``python -m gpusolver quality --mask nsa|dsa`` (block areas only: a plan
# needs slices, the solve does not); uniform work per query, so owner-computes is often balanced
SPARSE_KINDS = {"nsa": "NSA block selections (64-token blocks, top-16)", "dsa": "DSA token top-k (k = 2048)"}
ALL_KINDS = {**{k: v[1] for k, v in KINDS.items()}, **SPARSE_KINDS}
DEFAULT_SOLVERS = ("reference", "device")
FULL_P, QUICK_P = (8, 16, 32, 64), (8, 16)
FULL_SEEDS, QUICK_SEEDS = 3, 1
MB = 1e6
_MU = SolverConfig(cp_size=1).imbalance_tol
# MagiAttention's published dynamic-solver change vs USP (GQA 64:8, 8-64 GPUs), % of bytes
ANCHORS = {"causal": {"fwd": "−62…−70 %", "bwd": "−33…−64 %"},
           "full": {"fwd": "−48…−55 %", "bwd": "−6…−42 %"}}
ANCHOR_LINE = ("Anchor (MagiAttention published, dynamic solver vs USP, GQA 64:8, 8–64 GPUs): "
               "full documents forward −48 to −55 %, backward −6 to −42 %; "
               "causal documents forward −62 to −70 %, backward −33 to −64 %.")

RUN_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("seed", "seed", "d"), ("solver", "solver", ""),
    ("imbalance", "imbalance", ".3f"), ("fwd MB", "fwd_mb", ".1f"), ("bwd MB", "bwd_mb", ".1f"),
    ("step MB", "step_mb", ".1f"),
    ("fwd vs USP %", "fwd_vs_usp_pct", "+.1f"), ("bwd vs USP %", "bwd_vs_usp_pct", "+.1f"),
    ("step vs USP %", "step_vs_usp_pct", "+.1f"),
    ("fwd ÷ owner", "fwd_vs_owner", ".2f"), ("bwd ÷ owner", "bwd_vs_owner", ".2f"),
    ("step ÷ owner", "step_vs_owner", ".2f"),
    ("dev/ref fwd", "dev_over_ref_fwd", ".2f"), ("dev/ref step", "dev_over_ref_step", ".2f"),
    ("fwd ÷ fwd-only", "fwd_vs_fwd_only", ".3f"), ("solve ms", "solve_ms", ".1f"),
]
SUMMARY_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("solver", "solver", ""), ("runs", "runs", "d"),
    ("imbalance", "imbalance", ".3f"), ("balanced %", "balanced_pct", ".0f"),
    ("fwd MB", "fwd_mb", ".1f"), ("bwd MB", "bwd_mb", ".1f"), ("step MB", "step_mb", ".1f"),
    ("fwd vs USP %", "fwd_vs_usp_pct", "+.1f"), ("bwd vs USP %", "bwd_vs_usp_pct", "+.1f"),
    ("step vs USP %", "step_vs_usp_pct", "+.1f"),
    ("fwd ÷ owner", "fwd_vs_owner", ".2f"), ("step ÷ owner", "step_vs_owner", ".2f"),
    ("dev/ref fwd", "dev_over_ref_fwd", ".2f"),
    ("dev/ref step", "dev_over_ref_step", ".2f"), ("fwd ÷ fwd-only", "fwd_vs_fwd_only", ".3f"),
    ("solve ms", "solve_ms", ".1f"), ("anchor fwd", "anchor_fwd", ""), ("anchor bwd", "anchor_bwd", ""),
]


def _pct(v, base) -> float | None:
    r = ratio(v, base)
    return None if r is None else 100.0 * (r - 1.0)


def _solve(name: str, areas, config: SolverConfig) -> tuple[torch.Tensor, float]:
    """(assignment [G, U, U] int32, wall seconds of the solve)."""
    sync = torch.cuda.synchronize if areas.area.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if name == "reference":
        asg = assign(areas, config).assignment
    else:
        cfg = dataclasses.replace(config, objective="forward") if name.startswith("device-fwd") else config
        asg = solve_device(areas, cfg).assignment
    sync()
    return asg, time.perf_counter() - t0


def _plan_row(areas, asg, config, usp, owner) -> dict:
    m = evaluate(areas, asg, config.cost())
    fwd, bwd, imb = int(m.fwd_bottleneck), int(m.bwd_bottleneck), float(m.imbalance)
    return {
        "imbalance": imb, "balanced": imb <= config.imbalance_tol + 1e-9,
        "fwd_bytes": fwd, "bwd_bytes": bwd, "step_bytes": fwd + bwd, "fwd_mb": fwd / MB, "bwd_mb": bwd / MB,
        "step_mb": (fwd + bwd) / MB,
        "fwd_vs_usp_pct": _pct(fwd, usp["fwd_bottleneck"]), "bwd_vs_usp_pct": _pct(bwd, usp["bwd_bottleneck"]),
        "step_vs_usp_pct": _pct(fwd + bwd, usp["step_bottleneck"]),
        "fwd_vs_owner": ratio(fwd, owner["fwd_bottleneck"]), "bwd_vs_owner": ratio(bwd, owner["bwd_bottleneck"]),
        "step_vs_owner": ratio(fwd + bwd, owner["fwd_bottleneck"] + owner["bwd_bottleneck"]),
        "local_fraction": float(m.local_fraction),
    }


def run_instance(kind: str, cp_size: int, seed: int, solvers, tokens_per_rank: int, device,
                 tiles=(1,), heads: tuple[int, int] | None = None) -> list[dict]:
    """Rows for one mask: one per solver (the device solver once per tile count), plus the
    baselines' bytes in each row. ``heads`` (Hq, Hkv) overrides the config's 64:8."""
    config = SolverConfig(cp_size=cp_size) if heads is None else \
        SolverConfig(cp_size=cp_size, num_heads_q=heads[0], num_heads_kv=heads[1])
    t0 = time.perf_counter()
    if kind in SPARSE_KINDS:
        from gpusolver.cli.quality import _sparse_areas  # the quality command's indexer masks

        mask = None
        areas_at = lambda n: _sparse_areas(kind, cp_size * tokens_per_rank,  # noqa: E731
                                           dataclasses.replace(config, chunk_tiles=n, auto_tiles=False), seed)
    else:
        mask = make_mask(kind, cp_size, seed, tokens_per_rank, device=device)
        areas_at = lambda n: block_areas(mask, cp_size, config.head_groups, impl="auto", tiles=n)  # noqa: E731
    areas = areas_at(1)
    areas_s = time.perf_counter() - t0
    base = baseline_table(areas, config)
    usp, owner = base["usp"], base["owner_computes"]
    owner_imb = float(evaluate(areas, owner_computes_assignment(areas), config.cost()).imbalance)
    common = {"kind": kind, "P": cp_size, "seed": seed, "num_slices": None if mask is None else mask.num_slices,
              "areas_ms": 1e3 * areas_s,
              "usp_fwd_bytes": usp["fwd_bottleneck"], "usp_bwd_bytes": usp["bwd_bottleneck"],
              "owner_fwd_bytes": owner["fwd_bottleneck"], "owner_bwd_bytes": owner["bwd_bottleneck"],
              "owner_imbalance": owner_imb}
    rows = []
    for name in solvers:
        for n in (tiles if name.startswith("device") else (1,)):
            # an exact tile count (chunk_tiles="auto", the default, would pick the fewest that balance)
            cfg = dataclasses.replace(config, chunk_tiles=n, auto_tiles=False)
            units = areas if n == 1 else areas_at(n)
            asg, secs = _solve(name, units, cfg)
            label = name if n == 1 else f"{name} t{n}"
            rows.append({**common, "solver": label, "tiles": n, **_plan_row(units, asg, cfg, usp, owner),
                         "solve_ms": 1e3 * secs})
    ref = next((r for r in rows if r["solver"] == "reference"), None)
    for r in rows:
        dev = ref and r["solver"] != "reference"
        r["dev_over_ref_fwd"] = ratio(r["fwd_bytes"], ref["fwd_bytes"]) if dev else None
        r["dev_over_ref_step"] = ratio(r["step_bytes"], ref["step_bytes"]) if dev else None
        fwd_only = next((x for x in rows if x["solver"] == r["solver"].replace("device", "device-fwd", 1)), None)
        r["fwd_vs_fwd_only"] = (ratio(r["fwd_bytes"], fwd_only["fwd_bytes"])
                                if fwd_only and r["solver"].split(" ")[0] == "device" else None)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Medians per (kind, P, solver), plus the USP and owner-computes baselines per (kind, P)."""
    out = []
    keys = sorted({(r["kind"], r["P"]) for r in rows}, key=lambda k: (list(ALL_KINDS).index(k[0]), k[1]))
    for kind, P in keys:
        group = [r for r in rows if r["kind"] == kind and r["P"] == P]
        for solver in dict.fromkeys(r["solver"] for r in group):
            rs = [r for r in group if r["solver"] == solver]
            out.append({
                "kind": kind, "P": P, "solver": solver, "runs": len(rs),
                "imbalance": median([r["imbalance"] for r in rs]),
                "balanced_pct": 100.0 * sum(r["balanced"] for r in rs) / len(rs),
                **{k: median([r[k] for r in rs]) for k in (
                    "fwd_mb", "bwd_mb", "step_mb", "fwd_vs_usp_pct", "bwd_vs_usp_pct", "step_vs_usp_pct",
                    "fwd_vs_owner", "bwd_vs_owner", "step_vs_owner", "dev_over_ref_fwd", "dev_over_ref_step", "fwd_vs_fwd_only",
                    "solve_ms")},
                # the worst cell, for the "at or below USP in every cell" target
                "max_bwd_vs_usp_pct": max((r["bwd_vs_usp_pct"] for r in rs), default=None),
                "anchor_fwd": ANCHORS.get(kind, {}).get("fwd", ""), "anchor_bwd": ANCHORS.get(kind, {}).get("bwd", ""),
            })
        firsts = {(r["seed"]): r for r in group}.values()  # one row per seed carries the baselines
        owner_imb = median([r["owner_imbalance"] for r in firsts])
        for name, key in (("owner-computes", "owner"), ("usp", "usp")):
            fwd = median([r[f"{key}_fwd_bytes"] for r in firsts])
            bwd = median([r[f"{key}_bwd_bytes"] for r in firsts])
            out.append({
                "kind": kind, "P": P, "solver": name, "runs": len(firsts),
                "imbalance": owner_imb if key == "owner" else None,
                "balanced_pct": (100.0 * sum(r["owner_imbalance"] <= _MU + 1e-9 for r in firsts) / len(firsts)
                                 if key == "owner" else None),
                "fwd_mb": fwd / MB, "bwd_mb": bwd / MB, "step_mb": (fwd + bwd) / MB,
                "fwd_vs_usp_pct": median([_pct(r[f"{key}_fwd_bytes"], r["usp_fwd_bytes"]) for r in firsts]),
                "bwd_vs_usp_pct": median([_pct(r[f"{key}_bwd_bytes"], r["usp_bwd_bytes"]) for r in firsts]),
                "step_vs_usp_pct": median([_pct(r[f"{key}_fwd_bytes"] + r[f"{key}_bwd_bytes"],
                                                r["usp_fwd_bytes"] + r["usp_bwd_bytes"]) for r in firsts]),
                "dev_over_ref_step": None, "fwd_vs_fwd_only": None, "max_bwd_vs_usp_pct": None,
                "fwd_vs_owner": median([ratio(r[f"{key}_fwd_bytes"], r["owner_fwd_bytes"]) for r in firsts]),
                "bwd_vs_owner": median([ratio(r[f"{key}_bwd_bytes"], r["owner_bwd_bytes"]) for r in firsts]),
                "step_vs_owner": median([ratio(r[f"{key}_fwd_bytes"] + r[f"{key}_bwd_bytes"],
                                               r["owner_fwd_bytes"] + r["owner_bwd_bytes"]) for r in firsts]),
                "dev_over_ref_fwd": None, "solve_ms": None, "anchor_fwd": "", "anchor_bwd": "",
            })
    return out


def _config_dict() -> dict:
    c = SolverConfig(cp_size=1)
    return {"num_heads_q": c.num_heads_q, "num_heads_kv": c.num_heads_kv, "head_dim": c.head_dim,
            "dtype": str(c.dtype).removeprefix("torch."), "imbalance_tol": c.imbalance_tol,
            "head_groups": c.head_groups}


# the sources a quality figure depends on: a run from a tree that changed them is marked "-dirty"
_SOURCES = ("gpusolver/solver", "gpusolver/areas", "gpusolver/masks", "gpusolver/data", "gpusolver/metrics.py",
            "gpusolver/baselines.py", "gpusolver/config.py", "gpusolver/problem.py", "gpusolver/limits.py",
            "gpusolver/transfers.py", "gpusolver/bounds.py", "gpusolver/cli/quality.py",
            "benchmarks/solver_quality.py", "benchmarks/optimality_gap.py", "benchmarks/_common.py")


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(argv) -> dict:
    """Commit (``-dirty`` when the solver's sources differ from it), command line and machine of a run."""
    commit = _git("rev-parse", "--short=12", "HEAD") or None
    if commit and _git("status", "--porcelain", "--untracked-files=no", "--", *_SOURCES):
        commit += "-dirty"
    args = sys.argv[1:] if argv is None else list(argv)
    return {"commit": commit, "command": shlex.join(["python", "benchmarks/solver_quality.py", *args]),
            "machine": f"{_cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--P", default=None, help=f"CP sizes, comma-separated (default {','.join(map(str, FULL_P))})")
    p.add_argument("--seeds", type=int, default=None, help=f"seeds per (kind, P), 0..n-1 (default {FULL_SEEDS})")
    p.add_argument("--kinds", default=",".join(PACKED_KINDS),
                   help="mask kinds: causal, full (packed documents; default), causal-seq, full-seq (one sequence), "
                        "nsa, dsa (indexer selections)")
    p.add_argument("--solvers", default=",".join(DEFAULT_SOLVERS),
                   help="solvers: reference, device (training step), device-fwd (objective='forward')")
    p.add_argument("--tiles", default="1", help="device solver chunk_tiles values, comma-separated (default 1)")
    p.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK)
    p.add_argument("--device", default="cpu", help="device of the masks, areas and device solve")
    p.add_argument("--json", default=str(RESULTS_DIR / "solver_quality.json"), help="JSON output path")
    p.add_argument("--md", default=None, help="also write the printed tables to this markdown file")
    p.add_argument("--quick", action="store_true", help=f"P = {','.join(map(str, QUICK_P))}, {QUICK_SEEDS} seed")
    args = p.parse_args(argv)
    try:
        args.P = parse_list(args.P, int, name="--P") if args.P else list(QUICK_P if args.quick else FULL_P)
        args.kinds = parse_list(args.kinds, str, allowed=tuple(ALL_KINDS), name="--kinds")
        args.solvers = parse_list(args.solvers, str, allowed=SOLVERS, name="--solvers")
        args.tiles = parse_list(args.tiles, int, name="--tiles")
    except ValueError as e:
        p.error(str(e))
    if args.seeds is None:
        args.seeds = QUICK_SEEDS if args.quick else FULL_SEEDS
    if args.seeds <= 0:
        p.error(f"--seeds must be positive, got {args.seeds}")
    return args


def main(argv=None) -> dict:
    """Run the benchmark; prints the tables and returns the JSON payload (``rows``, ``summary``, ...)."""
    torch.set_num_threads(1)
    args = parse_args(argv)
    rows = []
    for kind in args.kinds:
        for P in args.P:
            for seed in range(args.seeds):
                rows += run_instance(kind, P, seed, args.solvers, args.tokens_per_rank, args.device, args.tiles)
                print(f"# done {kind} P={P} seed={seed}", file=sys.stderr, flush=True)
    summary = summarize(rows)
    run = provenance(argv)
    text = "\n\n".join([
        f"## Solver quality: {', '.join(ALL_KINDS[k] for k in args.kinds)}, {args.tokens_per_rank} tokens per rank, "
        f"Hq:Hkv = 64:8, D = 128, "
        f"bf16, G = 8, mu = 1.10",
        f"Commit {run['commit']}, `{run['command']}`, {run['machine']}, {torch.get_num_threads()} torch thread(s).",
        "### Summary (medians over seeds)", markdown_table(summary, SUMMARY_COLUMNS), ANCHOR_LINE,
        "### Runs", markdown_table(rows, RUN_COLUMNS),
    ]) + "\n"
    print(text)
    payload = {
        "benchmark": "solver_quality",
        "config": {"P": args.P, "seeds": args.seeds, "kinds": args.kinds, "solvers": args.solvers, "tiles": args.tiles,
                   "tokens_per_rank": args.tokens_per_rank, "device": args.device, **_config_dict()},
        "environment": environment(), "provenance": run, "anchors_vs_usp": ANCHORS,
        "summary": summary, "rows": rows,
    }
    write_results(args.json, payload, args.md, text)
    return payload


if __name__ == "__main__":
    main()
