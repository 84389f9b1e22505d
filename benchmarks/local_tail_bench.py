"""Local tail benchmark: the SIMULATED training step with and without a local-only last sub-stage.

Masks: the layer benchmark's (packed causal / full documents, 8K tokens per
rank, GQA 64:8, D = 128, bf16, G = 8), solved once on the topology as a
cluster user solves them (``SolverConfig(topology=...)``; ``--plan-cache``
reuses ``stages_bench --solve-topology``'s saved assignments). Each plan is
rebuilt at S remote sub-stages for every ``local_tail`` share (the same
assignment and bytes; only where each rank's local work runs differs:
``gpusolver.plan.stages``) and simulated (``gpusolver.sim.simulate``, not
measured) over each transport. Per (kind, P, seed, tail, comm):

    step ms    SIMULATED forward + backward
    / ideal    step over the plan's ideal bound (the same for every tail: the
               work and the bytes do not move)
    / no tail  step over the same plan's step with ``local_tail=0``

    PYTHONPATH=. python benchmarks/local_tail_bench.py --P 16,32,64 --seeds 3 --plan-cache build/sim_plans \\
        --md benchmarks/results/local_tail_bench.md
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    RESULTS_DIR, add_cluster_sweep_args, build_as_solved, cached_assignment, cluster_sweep, environment, make_mask,
    markdown_table, median, parse_list, plan_cache_path, write_results,
)

from gpusolver import SolverConfig, block_areas  # noqa: E402
from gpusolver.config import LOCAL_TAIL  # noqa: E402
from gpusolver.sim import simulate  # noqa: E402

COMMS = ("a2a", "p2p", "p2p-batch")


def run(kind: str, P: int, seed: int, tokens: int, S: int, tails, comms, topo, cache) -> list[dict]:
    config = SolverConfig(cp_size=P, topology=topo)
    mask = make_mask(kind, P, seed, tokens)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg, _ = cached_assignment(mask, areas, config, plan_cache_path(cache, kind, P, seed, tokens, config))
    rows, base = [], {}
    for tail in sorted(tails):  # 0 first: every other tail's baseline
        plan = build_as_solved(mask, areas, asg, dataclasses.replace(config, num_stages=S, local_tail=tail),
                               topology=topo)
        for comm in comms:
            t = simulate(plan, topo, comm=comm)
            base.setdefault(comm, t.step_ms)
            rows.append({"kind": kind, "P": P, "seed": seed, "tail": tail, "comm": comm, "sub_stages": plan.num_stages,
                         "step_ms": t.step_ms, "fwd_ms": t.fwd_ms, "bwd_ms": t.bwd_ms, "ideal_ms": t.ideal_ms,
                         "vs_ideal": t.step_ms / t.ideal_ms, "vs_none": t.step_ms / base[comm],
                         "exposed_pct": 100.0 * t.exposed_comm_ms / t.step_ms})
        print(f"# {kind} P={P} seed={seed} tail={tail}: " + "  ".join(
            f"{r['comm']} {r['vs_ideal']:.3f}x ideal ({r['vs_none']:.3f}x no tail)" for r in rows[-len(comms):]),
            file=sys.stderr, flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for tail in sorted({r["tail"] for r in rows}):
        for comm in dict.fromkeys(r["comm"] for r in rows):
            sel = [r for r in rows if r["tail"] == tail and r["comm"] == comm]
            out.append({"tail": tail, "comm": comm, "n": len(sel),
                        "ideal_med": median([r["vs_ideal"] for r in sel]), "ideal_max": max(r["vs_ideal"] for r in sel),
                        "none_med": median([r["vs_none"] for r in sel]), "none_max": max(r["vs_none"] for r in sel),
                        "none_min": min(r["vs_none"] for r in sel),
                        "ok_ideal": sum(r["vs_ideal"] <= 1.15 for r in sel),
                        "ok_exp": sum(r["exposed_pct"] <= 15.0 for r in sel)})
    return out


COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"), ("local_tail", "tail", ".2f"),
           ("comm", "comm", "s"), ("sub-stages run", "sub_stages", "d"), ("step ms (sim)", "step_ms", ".3f"),
           ("fwd ms", "fwd_ms", ".3f"), ("bwd ms", "bwd_ms", ".3f"), ("ideal ms", "ideal_ms", ".3f"),
           ("/ ideal", "vs_ideal", ".3f"), ("/ no tail", "vs_none", ".3f"), ("exposed %", "exposed_pct", ".1f")]
SUMMARY_COLUMNS = [("local_tail", "tail", ".2f"), ("comm", "comm", "s"), ("masks", "n", "d"),
                   ("/ ideal median", "ideal_med", ".3f"), ("/ ideal max", "ideal_max", ".3f"),
                   ("/ no tail median", "none_med", ".3f"), ("/ no tail best", "none_min", ".3f"),
                   ("/ no tail worst", "none_max", ".3f"), ("<= 1.15 ideal", "ok_ideal", "d"),
                   ("exposed <= 15 %", "ok_exp", "d")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cluster_sweep_args(ap)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--stages", type=int, default=4, help="S, remote sub-stages (> 1)")
    ap.add_argument("--tails", default=f"0,0.25,{LOCAL_TAIL},0.75",
                    help="local_tail shares to compare (0, the baseline, is always added)")
    ap.add_argument("--comm", default=",".join(COMMS))
    ap.add_argument("--plan-cache", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--json", default=str(Path(RESULTS_DIR) / "local_tail_bench.json"))
    args = ap.parse_args(argv)
    if args.stages < 2:
        ap.error(f"--stages must be at least 2 (a tail follows remote sub-stages), got {args.stages}")
    sizes, kinds, topo = cluster_sweep(ap, args)
    tails = sorted(set(parse_list(args.tails, float, None, "tail")) | {0.0})
    comms = parse_list(args.comm, str, COMMS, "comm")
    torch.set_num_threads(1)
    rows = []
    for kind in kinds:
        for P in sizes:
            for seed in range(args.seeds):
                rows += run(kind, P, seed, args.tokens, args.stages, tails, comms, topo, args.plan_cache)
    cmd = "python benchmarks/local_tail_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = (f"# Local tail: SIMULATED training step ({args.topology}, S = {args.stages})\n\nCommand: `{cmd}`\n\n"
            "Every mask is solved on the topology (`SolverConfig(topology=...)`, direct transport with sub-stages). "
            "All times are simulated by `gpusolver.sim` (not measured). `/ no tail` is against the same plan "
            "with `local_tail=0` over the same transport; a tail adds one local-only sub-stage "
            f"(`sub-stages run`). The library's default is `local_tail={LOCAL_TAIL}`.\n\n## Summary over the masks\n\n"
            + markdown_table(summarize(rows), SUMMARY_COLUMNS) + "\n\n## Every mask\n\n" + markdown_table(rows, COLUMNS)
            + "\n")
    print(text)
    write_results(args.json, {"environment": environment(), "command": cmd, "rows": rows}, args.md, text)


if __name__ == "__main__":
    main()
