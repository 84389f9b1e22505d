"""Sub-stage benchmark: the layer's SIMULATED training step with the remote work in S sub-stages.

Masks: the layer benchmark's (packed causal / full documents, 8K tokens per
rank, GQA 64:8, D = 128, bf16, G = 8, mu = 1.10). Each mask is solved once
(device solver, whole chunks; ``--plan-cache`` reuses ``layer_bench``'s saved
assignments) and its plan is rebuilt for every S (``build_plan(...,
num_stages=S, topology=...)``): the same assignment and bytes, only the
sub-stages differ. Per (kind, P, seed, S, comm):

    step ms     SIMULATED forward + backward (``gpusolver.sim.simulate``: the
                runtime's own op lists for S sub-stages), not measured
    / ideal     step over the plan's ideal bound (max of busiest compute and
                busiest link, per pass, summed)
    / S=1       step over the same plan's two-stage step (S = 1)
    exposed %   step time beyond the busiest rank's compute, share of the step
    comm        "a2a": every collective an all-to-all-v that completes as one
                (``TorchGroup``); "p2p": each (source, destination) transfer
                on its own (``SymmMemGroup``)

Cost columns per S: collectives per training step, CalcMeta table size (rows of
``[P, S + 1, cap]`` per rank), the receive memory of the per-stage buffers at
the default capacity, and the largest per-stage fill over ranks (what a tight
capacity would need), in MB per rank (Q + K + V buffers, bf16).

    python benchmarks/stages_bench.py --P 16,32,64 --seeds 1 --plan-cache build/sim_plans \\
        --md benchmarks/results/stages_bench.md
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PACKED_KINDS, RESULTS_DIR, environment, make_mask, markdown_table, parse_list, write_results,
)

from gpusolver import SolverConfig, block_areas  # noqa: E402
from gpusolver.assign import solve_assignment  # noqa: E402
from gpusolver.plan import Plan  # noqa: E402
from gpusolver.plan.build import build_plan  # noqa: E402
from gpusolver.plan.schedule import plan_ops  # noqa: E402
from gpusolver.sim import simulate  # noqa: E402
from gpusolver.topology import PRESETS  # noqa: E402

MB = 1e6


def _assignment(kind, P, seed, tokens, cache, mask, areas, config):
    path = Path(cache) / f"{kind}_P{P}_s{seed}_c{tokens}.pt" if cache else None
    if path is not None and path.exists():
        return Plan.load(path).assignment
    asg = solve_assignment(areas, config, impl="torch")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        build_plan(mask, areas, asg, config).save(path, config=config)
    return asg


def costs(plan, config: SolverConfig, S: int) -> dict:
    comm = plan.comm
    ops = plan_ops(plan, "fwd", config.keep_forward_buffers) + plan_ops(plan, "bwd", config.keep_forward_buffers)
    cost = config.cost()
    row_bytes = {"qo": cost.q_fwd, "kv": cost.kv_fwd}  # a Q row, a K+V row (per group-major row)
    fill = {k: int(comm.stage_split(k).sum(1).max()) for k in ("qo", "kv")}
    return {"collectives": sum(op.collective for op in ops),
            "calc_rows": (S + 1) * plan.calc.capacity,
            "recv_mb": S * sum(comm.buffers.recv(k) * row_bytes[k] for k in row_bytes) / MB,
            "fill_mb": S * sum(fill[k] * row_bytes[k] for k in row_bytes) / MB}


def run(kind, P, seed, tokens, stages, comms, topo, cache) -> list[dict]:
    config = SolverConfig(cp_size=P)
    mask = make_mask(kind, P, seed, tokens)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg = _assignment(kind, P, seed, tokens, cache, mask, areas, config)
    rows, base = [], {}
    for S in stages:
        t0 = time.perf_counter()
        plan = build_plan(mask, areas, asg, dataclasses.replace(config, num_stages=S), topology=topo)
        build_ms = 1e3 * (time.perf_counter() - t0)
        extra = costs(plan, config, S)
        for comm in comms:
            t = simulate(plan, topo, comm=comm)
            if S == 1:
                base[comm] = t.step_ms
            rows.append({"kind": kind, "P": P, "seed": seed, "S": S, "comm": comm, "step_ms": t.step_ms,
                         "fwd_ms": t.fwd_ms, "bwd_ms": t.bwd_ms, "ideal_ms": t.ideal_ms,
                         "compute_ms": t.compute_ms, "vs_ideal": t.step_ms / t.ideal_ms,
                         "vs_s1": t.step_ms / base[comm] if comm in base else None,
                         "vs_s1_a2a": t.step_ms / base["a2a"] if "a2a" in base else None,
                         "exposed_pct": 100.0 * t.exposed_comm_ms / t.step_ms, "build_ms": build_ms, **extra})
        print(f"# {kind} P={P} seed={seed} S={S}: " + "  ".join(
            f"{r['comm']} {r['step_ms']:.3f} ms ({r['vs_ideal']:.2f}x ideal)" for r in rows[-len(comms):]),
            file=sys.stderr, flush=True)
    return rows


COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"), ("S", "S", "d"), ("comm", "comm", "s"),
           ("step ms (sim)", "step_ms", ".3f"), ("fwd ms", "fwd_ms", ".3f"), ("bwd ms", "bwd_ms", ".3f"),
           ("ideal ms", "ideal_ms", ".3f"), ("/ ideal", "vs_ideal", ".2f"), ("/ S=1", "vs_s1", ".2f"),
           ("/ S=1 a2a", "vs_s1_a2a", ".2f"),
           ("exposed %", "exposed_pct", ".1f"), ("collectives", "collectives", "d"),
           ("CalcMeta rows", "calc_rows", "d"), ("recv MB", "recv_mb", ".1f"), ("fill MB", "fill_mb", ".1f")]


SUMMARY_COLUMNS = [("S", "S", "d"), ("comm", "comm", "s"), ("masks", "n", "d"),
                   ("/ ideal median", "ideal_med", ".2f"), ("/ ideal max", "ideal_max", ".2f"),
                   ("/ S=1 median", "s1_med", ".2f"), ("/ S=1 a2a median", "s1a_med", ".2f"),
                   ("/ S=1 a2a best", "s1a_min", ".2f"), ("exposed % max", "exp_max", ".1f"),
                   ("<= 1.15 ideal", "ok_ideal", "d"), ("<= 0.75 S=1 a2a", "ok_s1", "d"),
                   ("exposed <= 15 %", "ok_exp", "d")]


def summarize(rows: list[dict]) -> list[dict]:
    """Per (S, comm) over the masks: the ratios' median and extremes, and how many meet each target."""
    out = []
    for key in sorted({(r["S"], r["comm"]) for r in rows}):
        sel = [r for r in rows if (r["S"], r["comm"]) == key]
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731  (upper median)
        out.append({"S": key[0], "comm": key[1], "n": len(sel),
                    "ideal_med": med([r["vs_ideal"] for r in sel]), "ideal_max": max(r["vs_ideal"] for r in sel),
                    "s1_med": med([r["vs_s1"] for r in sel]), "s1a_med": med([r["vs_s1_a2a"] for r in sel]),
                    "s1a_min": min(r["vs_s1_a2a"] for r in sel), "exp_max": max(r["exposed_pct"] for r in sel),
                    "ok_ideal": sum(r["vs_ideal"] <= 1.15 for r in sel),
                    "ok_s1": sum(r["vs_s1_a2a"] <= 0.75 for r in sel),
                    "ok_exp": sum(r["exposed_pct"] <= 15.0 for r in sel)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--P", default="16,32,64")
    ap.add_argument("--kinds", default=",".join(PACKED_KINDS))
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--stages", default="1,2,4,8")
    ap.add_argument("--comm", default="a2a,p2p")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--topology", default="h200_hgx", choices=sorted(PRESETS))
    ap.add_argument("--plan-cache", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--json", default=str(Path(RESULTS_DIR) / "stages_bench.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    topo = PRESETS[args.topology]
    rows = []
    for kind in parse_list(args.kinds, str, PACKED_KINDS, "kind"):
        for P in parse_list(args.P):
            for seed in range(args.seeds):
                rows += run(kind, P, seed, args.tokens_per_rank, parse_list(args.stages),
                            parse_list(args.comm, str, ("a2a", "p2p"), "comm"), topo, args.plan_cache)
    cmd = "python benchmarks/stages_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = (f"# Sub-stages: SIMULATED training step ({args.topology})\n\nCommand: `{cmd}`\n\n"
            "All times are simulated by `gpusolver.sim` (not measured). `/ S=1` is against the same plan's "
            "two-stage step with the same transport, `/ S=1 a2a` against the two-stage step over all-to-all-v "
            "(today's `TorchGroup`).\n\n## Summary over the masks\n\n"
            + markdown_table(summarize(rows), SUMMARY_COLUMNS) + "\n\n## Every mask\n\n"
            + markdown_table(rows, COLUMNS) + "\n")
    print(text)
    write_results(args.json, {"rows": rows, "environment": environment(), "command": cmd}, args.md, text)
    return rows


if __name__ == "__main__":
    main()
