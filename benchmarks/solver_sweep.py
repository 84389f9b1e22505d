"""Where the device solver stands against the reference on small CP groups, over many masks.

A wider grid than ``solver_quality.py``: for each P, packed causal and full
documents at several tokens per rank and GQA shapes, ``--seeds`` seeds each;
every mask solved by the CPU reference and by ``solve_device`` (torch path,
default settings). Per P it prints how many masks each solver balances, how
many times the device solver's bytes are above the reference's (all masks,
and the masks the reference balances), the largest such ratio, and the
median device / reference ratio; then every mask above. The bytes are what
the device solver minimises: a training step's fwd + bwd bottleneck
(``--objective training``, the default) or the forward's alone
(``--objective forward``, the forward-only solver, as the earlier records).

    python benchmarks/solver_sweep.py                     # P = 2, 4, 6, 8; 2K/4K/8K; 32:4 and 64:8; 4 seeds
    python benchmarks/solver_sweep.py --P 4 --seeds 2
    python benchmarks/solver_sweep.py --objective forward
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, solver_quality as a script or by path

from _common import RESULTS_DIR, environment, markdown_table, median, parse_list, write_results  # noqa: E402
from solver_quality import provenance, run_instance  # noqa: E402

DEFAULT_P = (2, 4, 6, 8)
DEFAULT_TOKENS = (2048, 4096, 8192)
DEFAULT_HEADS = ((32, 4), (64, 8))

SUMMARY_COLUMNS = [
    ("P", "P", "d"), ("masks", "masks", "d"), ("ref balanced", "ref_balanced", "d"),
    ("dev balanced", "dev_balanced", "d"), ("dev above ref", "above", "d"),
    ("above, ref balanced", "above_ref_balanced", "d"), ("max dev/ref (ref balanced)", "max_ratio_ref_balanced", ".3f"),
    ("median dev/ref", "median_ratio", ".3f"),
]
ABOVE_COLUMNS = [
    ("P", "P", "d"), ("kind", "kind", ""), ("tokens/rank", "tokens_per_rank", "d"), ("Hq:Hkv", "heads", ""),
    ("seed", "seed", "d"), ("dev/ref", "ratio", ".3f"), ("ref MB", "ref_mb", ".1f"), ("dev MB", "dev_mb", ".1f"),
    ("ref balanced", "ref_balanced", ""),
    ("dev balanced", "dev_balanced", ""),
]


# objective -> (the device solver of ``run_instance``, the bytes compared)
OBJECTIVES = {"training": ("device", "step"), "forward": ("device-fwd", "fwd")}


def sweep_rows(cp_sizes, kinds, tokens, heads, seeds, objective: str = "training") -> list[dict]:
    """One row per mask: the reference's and the device solver's bytes (``ref_bytes``,
    ``dev_bytes``: the step or the forward bottleneck, per ``objective``; both kept) and balance."""
    solver, measure = OBJECTIVES[objective]
    rows = []
    for P in cp_sizes:
        for kind in kinds:
            for tpr in tokens:
                for hq, hkv in heads:
                    for seed in range(seeds):
                        ref, dev = run_instance(kind, P, seed, ("reference", solver), tpr, "cpu", heads=(hq, hkv))
                        rb, db = ref[f"{measure}_bytes"], dev[f"{measure}_bytes"]
                        rows.append({"P": P, "kind": kind, "tokens_per_rank": tpr, "heads": f"{hq}:{hkv}",
                                     "seed": seed, "measure": measure, "ref_bytes": rb, "dev_bytes": db,
                                     "ref_mb": rb / 1e6, "dev_mb": db / 1e6,
                                     "ref_fwd_bytes": ref["fwd_bytes"], "dev_fwd_bytes": dev["fwd_bytes"],
                                     "ref_step_bytes": ref["step_bytes"], "dev_step_bytes": dev["step_bytes"],
                                     "ratio": dev[f"dev_over_ref_{measure}"], "ref_balanced": ref["balanced"],
                                     "dev_balanced": dev["balanced"]})
            print(f"# done P={P} {kind}", file=sys.stderr, flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for P in dict.fromkeys(r["P"] for r in rows):
        rs = [r for r in rows if r["P"] == P]
        above = [r for r in rs if r["dev_bytes"] > r["ref_bytes"]]
        above_bal = [r for r in above if r["ref_balanced"]]
        out.append({"P": P, "masks": len(rs), "ref_balanced": sum(r["ref_balanced"] for r in rs),
                    "dev_balanced": sum(r["dev_balanced"] for r in rs), "above": len(above),
                    "above_ref_balanced": len(above_bal),
                    "max_ratio_ref_balanced": max((r["ratio"] for r in above_bal), default=None),
                    "median_ratio": median([r["ratio"] for r in rs])})
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--P", default=",".join(map(str, DEFAULT_P)), help="CP sizes, comma-separated")
    p.add_argument("--kinds", default="causal,full", help="packed-document kinds: causal, full")
    p.add_argument("--tokens-per-rank", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated")
    p.add_argument("--heads", default=",".join(f"{q}:{k}" for q, k in DEFAULT_HEADS),
                   help="Hq:Hkv pairs, comma-separated (default 32:4,64:8)")
    p.add_argument("--seeds", type=int, default=4, help="seeds per mask shape, 0..n-1 (default 4)")
    p.add_argument("--objective", default="training", choices=tuple(OBJECTIVES),
                   help="training: the default solver, compared on fwd + bwd per step; forward: the "
                        "forward-only solver, compared on the forward bottleneck")
    p.add_argument("--json", default=str(RESULTS_DIR / "solver_sweep.json"), help="JSON output path")
    p.add_argument("--md", default=None, help="also write the printed tables to this markdown file")
    args = p.parse_args(argv)
    try:
        args.P = parse_list(args.P, int, name="--P")
        args.kinds = parse_list(args.kinds, str, allowed=("causal", "full"), name="--kinds")
        args.tokens_per_rank = parse_list(args.tokens_per_rank, int, name="--tokens-per-rank")
        args.heads = [_heads(h) for h in parse_list(args.heads, str, name="--heads")]
    except ValueError as e:
        p.error(str(e))
    if args.seeds <= 0:
        p.error(f"--seeds must be positive, got {args.seeds}")
    return args


def _heads(text: str) -> tuple[int, int]:
    """``"64:8"`` -> ``(64, 8)``; raises ValueError naming ``--heads`` and the bad item."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--heads: {text!r} is not Hq:Hkv with positive integers")
    return int(parts[0]), int(parts[1])


def main(argv=None) -> dict:
    """Run the sweep; prints the tables and returns the JSON payload (``rows``, ``summary``)."""
    torch.set_num_threads(1)
    args = parse_args(argv)
    rows = sweep_rows(args.P, args.kinds, args.tokens_per_rank, args.heads, args.seeds, args.objective)
    summary = summarize(rows)
    above = [r for r in rows if r["dev_bytes"] > r["ref_bytes"]]
    what = "training step bytes, fwd + bwd" if args.objective == "training" else \
        "forward bottleneck bytes, forward-only solver"
    run = provenance(argv)
    run["command"] = run["command"].replace("solver_quality.py", "solver_sweep.py", 1)
    text = "\n\n".join([
        f"## Device solver vs reference: packed {' and '.join(args.kinds)} documents, "
        f"{'/'.join(map(str, args.tokens_per_rank))} tokens per rank, Hq:Hkv "
        f"{', '.join(f'{q}:{k}' for q, k in args.heads)}, {args.seeds} seeds; D = 128, bf16, mu = 1.10",
        f"Commit {run['commit']}, `{run['command']}`, {run['machine']}.",
        f"### Per P ({what})", markdown_table(summary, SUMMARY_COLUMNS),
        "### Masks where the device solver moves more than the reference", markdown_table(above, ABOVE_COLUMNS),
    ]) + "\n"
    print(text)
    payload = {"benchmark": "solver_sweep",
               "config": {"P": args.P, "kinds": args.kinds, "tokens_per_rank": args.tokens_per_rank,
                          "heads": [list(h) for h in args.heads], "seeds": args.seeds, "objective": args.objective},
               "environment": environment(), "provenance": run, "summary": summary, "rows": rows}
    write_results(args.json, payload, args.md, text)
    return payload


if __name__ == "__main__":
    main()
