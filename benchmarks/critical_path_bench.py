"""Where a layer's SIMULATED time goes: each pass's critical path, per mask and summed over the masks.

Masks: the layer benchmark's (packed causal / full documents, 8K tokens per rank, GQA 64:8,
D = 128, bf16, G = 8), solved on the topology with the default config
(``SolverConfig(topology=...)``; ``--plan-cache`` reuses ``stages_bench --solve-topology``'s
saved assignments) and simulated over one transport (``gpusolver.sim.simulate``, not measured).
Each pass's critical path (``gpusolver.sim.critical``) is the chain of compute, transfers and
latencies that ends at its last rank's finish; its parts add up to the pass. Per (kind, P, seed):

    step / ideal       the simulated step over the plan's ideal bound
    fwd / bwd ms       each pass, simulated
    compute %          the share of the pass the chain spends computing
    top transfers      the chain's three largest (collective, link class) parts, ms
    idle before first  the chain's time before its first compute (waiting for the first casts)

and summed over every mask, the chain's ms per (pass, collective, link class). With
``--ib-scale k`` the same plans are also simulated with k times the InfiniBand bandwidth (a
what-if: how much of the step the bytes at the NICs hold); with ``--imbalance-tol mu`` every mask is
solved at that bound instead of the default (a plan of its own in ``--plan-cache``):

    step (IB x k) / ideal   that step over today's ideal bound (the same plan's, at 1x)
    step (IB x k) / step    that step over today's

    PYTHONPATH=. python benchmarks/critical_path_bench.py --P 16,32,64 --seeds 3 --plan-cache build/sim_plans \\
        --md benchmarks/results/critical_path_bench.md
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    RESULTS_DIR, add_cluster_sweep_args, build_as_solved, cached_assignment, cluster_sweep, environment, make_mask,
    markdown_table, median, plan_cache_path, write_results,
)

from gpusolver import SolverConfig, block_areas  # noqa: E402
from gpusolver.sim import simulate  # noqa: E402
from gpusolver.sim.critical import summary  # noqa: E402
from gpusolver.sim.engine import COMM_MODES  # noqa: E402


def _pass_row(name: str, pt, parts: dict) -> dict:
    """The row's columns of one pass; ``parts``: its path's ``summary``."""
    first = next((s.start for s in pt.critical if s.kind == "compute"), pt.ms * 1e-3)
    top = sorted(parts["transfers"].items(), key=lambda kv: -kv[1])[:3]
    return {f"{name}_ms": pt.ms, f"{name}_compute_pct": 100.0 * parts["compute"] * 1e3 / pt.ms if pt.ms else 100.0,
            f"{name}_idle_ms": first * 1e3,
            f"{name}_top": ", ".join(f"{label} {link} {sec * 1e3:.2f}" for (label, link), sec in top) or "-"}


def run(kind: str, P: int, seed: int, tokens: int, comm: str, topo, cache, totals: Counter,
        ib_scale: float = 1.0, imbalance_tol: float | None = None) -> dict:
    config = SolverConfig(cp_size=P, topology=topo, **({} if imbalance_tol is None else {"imbalance_tol": imbalance_tol}))
    mask = make_mask(kind, P, seed, tokens)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg, _ = cached_assignment(mask, areas, config, plan_cache_path(cache, kind, P, seed, tokens, config))
    plan = build_as_solved(mask, areas, asg, config, topology=topo)
    t = simulate(plan, topo, comm=comm)
    row = {"kind": kind, "P": P, "seed": seed, "vs_ideal": t.step_ms / t.ideal_ms}
    if ib_scale != 1.0:
        fast = simulate(plan, dataclasses.replace(topo, ib_gbps=topo.ib_gbps * ib_scale), comm=comm)
        row.update(ib_vs_ideal=fast.step_ms / t.ideal_ms, ib_vs_step=fast.step_ms / t.step_ms)
    for name, pt in (("fwd", t.fwd), ("bwd", t.bwd)):
        parts = summary(pt.critical)
        row.update(_pass_row(name, pt, parts))
        totals[name, "compute", ""] += parts["compute"] * 1e3
        totals[name, "latency", ""] += parts["latency"] * 1e3
        for (label, link), sec in parts["transfers"].items():
            totals[name, label, link] += sec * 1e3
    print(f"# {kind} P={P} seed={seed}: {row['vs_ideal']:.3f}x ideal; fwd {row['fwd_top']}; bwd {row['bwd_top']}",
          file=sys.stderr, flush=True)
    return row


COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"), ("step / ideal", "vs_ideal", ".3f"),
           ("fwd ms", "fwd_ms", ".2f"), ("fwd compute %", "fwd_compute_pct", ".0f"),
           ("fwd idle before first compute ms", "fwd_idle_ms", ".2f"), ("fwd top transfers ms", "fwd_top", "s"),
           ("bwd ms", "bwd_ms", ".2f"), ("bwd compute %", "bwd_compute_pct", ".0f"),
           ("bwd idle before first compute ms", "bwd_idle_ms", ".2f"), ("bwd top transfers ms", "bwd_top", "s")]
TOTAL_COLUMNS = [("pass", "pass", "s"), ("part", "part", "s"), ("link", "link", "s"), ("ms, all masks", "ms", ".2f"),
                 ("share of the pass %", "pct", ".1f")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cluster_sweep_args(ap)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--comm", default="p2p", choices=COMM_MODES)
    ap.add_argument("--ib-scale", type=float, default=1.0,
                    help="also simulate with this many times the InfiniBand bandwidth (a what-if; default 1: not)")
    ap.add_argument("--imbalance-tol", type=float, default=None,
                    help="solve every mask at this bound mu (default: the config's, 1.05 across nodes)")
    ap.add_argument("--plan-cache", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--json", default=str(Path(RESULTS_DIR) / "critical_path_bench.json"))
    args = ap.parse_args(argv)
    if not args.ib_scale > 0:
        ap.error(f"--ib-scale must be positive, got {args.ib_scale}")
    if args.imbalance_tol is not None and not args.imbalance_tol >= 1.0:
        ap.error(f"--imbalance-tol must be >= 1.0, got {args.imbalance_tol}")
    sizes, kinds, topo = cluster_sweep(ap, args)
    torch.set_num_threads(1)
    totals: Counter = Counter()
    rows = [run(kind, P, seed, args.tokens, args.comm, topo, args.plan_cache, totals, args.ib_scale, args.imbalance_tol)
            for kind in kinds for P in sizes for seed in range(args.seeds)]
    columns = COLUMNS
    what_if = ""
    if args.ib_scale != 1.0:
        k = f"{args.ib_scale:g}"
        columns = COLUMNS[:4] + [(f"step (IB x {k}) / ideal", "ib_vs_ideal", ".3f"),
                                 (f"step (IB x {k}) / step", "ib_vs_step", ".3f")] + COLUMNS[4:]
        ratios = sorted(r["ib_vs_step"] for r in rows)
        what_if = (f"\n\nWith {k}x the InfiniBand bandwidth (the same plans): {sum(r['ib_vs_ideal'] <= 1.15 for r in rows)} "
                   f"of {len(rows)} masks within 1.15x today's ideal bound (today {sum(r['vs_ideal'] <= 1.15 for r in rows)}), "
                   f"the step a median {median(ratios):.3f}x today's ({ratios[0]:.3f}-{ratios[-1]:.3f}x).")
    pass_ms = {name: sum(r[f"{name}_ms"] for r in rows) for name in ("fwd", "bwd")}
    total_rows = [{"pass": name, "part": part, "link": link or "-", "ms": ms, "pct": 100.0 * ms / pass_ms[name]}
                  for (name, part, link), ms in sorted(totals.items(), key=lambda kv: (kv[0][0] != "fwd", -kv[1]))]
    cmd = "python benchmarks/critical_path_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = (f"# Critical path: where the SIMULATED layer time goes ({args.topology}, {args.comm})\n\n"
            f"Command: `{cmd}`\n\nEvery mask is solved on the topology with the default config; every time is "
            "simulated by `gpusolver.sim` (not measured). A pass's critical path is the chain of compute, "
            "transfers and latencies that ends at its last rank's finish (`gpusolver.sim.critical`): a transfer "
            "held back by an earlier one on a busy link side hands the chain to that one, so a queue on one NIC "
            "reads as its transfers one after another. Its parts add up to the pass." + what_if + "\n\n"
            "## Summed over the masks\n\n" + markdown_table(total_rows, TOTAL_COLUMNS)
            + "\n\n## Every mask\n\n" + markdown_table(rows, columns) + "\n")
    print(text)
    write_results(args.json, {"environment": environment(), "command": cmd, "rows": rows, "totals": total_rows},
                  args.md, text)


if __name__ == "__main__":
    main()
