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
                on its own, a rank's wait ending when its own incoming rows land
                (``TorchGroup(transport="p2p")`` on gloo: waits on receives only);
                "p2p-batch": the same, but a rank's wait covers its sends too (the
                one handle of NCCL's coalesced batch); a "+rs" suffix: a what-if,
                the reduces on a stream of their own

Cost columns per S: collectives and attention launches per training step,
CalcMeta table size (rows of ``[P, S + 1, cap]`` per rank) and the per-stage
CommMeta tables (KB, all ranks), the receive memory (``plan.memory``'s receive
buffers at the default capacity: one per kind, shared by the sub-stages) and the
return buffers (one send list, which the S reduces in flight share), in MB per rank (bf16).

A cell's ``0.75 reachable`` is false when its ideal bound is above 0.75 x its
two-stage a2a step: no schedule of those bytes and FLOPs can be 0.75 x it.

    PYTHONPATH=. python benchmarks/stages_bench.py --P 16,32,64 --seeds 3 --plan-cache build/sim_plans \\
        --md benchmarks/results/stages_bench.md

``--solve-topology`` solves each mask on the topology, as a cluster user does
(``SolverConfig(topology=...)``; the plans of ``stages_bench_topo.md``); without it
the solve sees no topology and only the sub-stage order does (``stages_bench.md``).
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
    PACKED_KINDS, RESULTS_DIR, build_as_solved, cached_assignment, environment, make_mask, markdown_table,
    parse_list, plan_cache_path, write_results,
)

from gpusolver import SolverConfig, block_areas  # noqa: E402
from gpusolver.plan.schedule import plan_ops  # noqa: E402
from gpusolver.sim import simulate  # noqa: E402
from gpusolver.topology import PRESETS  # noqa: E402

MB = 1e6
COMMS = ("a2a", "p2p", "p2p-batch", "a2a+rs", "p2p+rs", "p2p-batch+rs")


def _stage_meta_bytes(comm) -> int:
    """Bytes of the CommMeta tables only sub-stages add (stage pairs, per-stage splits, offsets, bases)."""
    names = ("qo_stage", "kv_stage", "qo_stage_split", "kv_stage_split", "qo_return_split", "kv_return_split",
             "qo_return_offset", "kv_return_offset", "qo_stage_base", "kv_stage_base")
    return sum(t.numel() * t.element_size() for t in (getattr(comm, n, None) for n in names) if t is not None)


def costs(plan, config: SolverConfig, S: int) -> dict:
    comm = plan.comm
    keep = config.keep_forward_buffers
    ops = plan_ops(plan, "fwd", keep) + plan_ops(plan, "bwd", keep)
    mem = plan.memory(config)
    cost = config.cost()
    rows = comm.buffers
    recv = rows.qo_recv * cost.q_fwd + rows.kv_recv * cost.kv_fwd
    calc = plan.calc
    calc_bytes = sum(t.numel() * t.element_size() for t in (calc.q_ranges, calc.k_ranges, calc.attn_type))
    return {"collectives": sum(op.collective for op in ops),
            "attn_launches": sum(op.kind == "attn" for op in ops),
            "calc_rows": (plan.num_stages + 1) * calc.capacity, "calc_kb": calc_bytes / 1e3,
            "stage_meta_kb": _stage_meta_bytes(comm) / 1e3,
            "recv_mb": recv / MB, "return_mb": (mem.fwd_peak - recv) / MB, "fwd_peak_mb": mem.fwd_peak / MB,
            "bwd_peak_mb": mem.bwd_peak / MB}


def run(kind, P, seed, tokens, stages, comms, topo, cache, solve_topology: bool = False) -> list[dict]:
    """solve_topology: solve on ``topo`` (``SolverConfig(topology=...)``, bytes priced by link class, as
    on a cluster); otherwise the solve sees no topology and only the sub-stage order does."""
    config = SolverConfig(cp_size=P, topology=topo if solve_topology else None)
    mask = make_mask(kind, P, seed, tokens)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg, _ = cached_assignment(mask, areas, config, plan_cache_path(cache, kind, P, seed, tokens, config))
    rows, base = [], {}
    for S in stages:
        t0 = time.perf_counter()
        at_s = dataclasses.replace(config, num_stages=S)  # S = 1 on a topology: relay transport
        plan = build_as_solved(mask, areas, asg, at_s, topology=topo)
        build_ms = 1e3 * (time.perf_counter() - t0)
        extra = costs(plan, at_s, S)  # the plan's own config: its budget keeps what its transport runs
        for comm in comms:
            t = simulate(plan, topo, comm=comm.removesuffix("+rs"), reduce_stream=comm.endswith("+rs"))
            if S == 1:
                base[comm] = t.step_ms
            rows.append({"kind": kind, "P": P, "seed": seed, "S": S, "comm": comm, "step_ms": t.step_ms,
                         "fwd_ms": t.fwd_ms, "bwd_ms": t.bwd_ms, "ideal_ms": t.ideal_ms,
                         "compute_ms": t.compute_ms, "vs_ideal": t.step_ms / t.ideal_ms,
                         "vs_s1": t.step_ms / base[comm] if comm in base else None,
                         "vs_s1_a2a": t.step_ms / base["a2a"] if "a2a" in base else None,
                         "exposed_pct": 100.0 * t.exposed_comm_ms / t.step_ms, "build_ms": build_ms,
                         "reachable": ("yes" if t.ideal_ms / base["a2a"] <= 0.75 else "no") if "a2a" in base else None, **extra})
        print(f"# {kind} P={P} seed={seed} S={S}: " + "  ".join(
            f"{r['comm']} {r['step_ms']:.3f} ms ({r['vs_ideal']:.2f}x ideal)" for r in rows[-len(comms):]),
            file=sys.stderr, flush=True)
    return rows


COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"), ("S", "S", "d"), ("comm", "comm", "s"),
           ("step ms (sim)", "step_ms", ".3f"), ("fwd ms", "fwd_ms", ".3f"), ("bwd ms", "bwd_ms", ".3f"),
           ("ideal ms", "ideal_ms", ".3f"), ("/ ideal", "vs_ideal", ".2f"), ("/ S=1", "vs_s1", ".2f"),
           ("/ S=1 a2a", "vs_s1_a2a", ".2f"),
           ("exposed %", "exposed_pct", ".1f"), ("0.75 reachable", "reachable", "s")]

COST_COLUMNS = [("S", "S", "d"), ("collectives / step", "collectives", "d"), ("attn launches / step", "attn_launches", "d"),
                ("CalcMeta rows / rank", "calc_rows", "d"), ("CalcMeta KB (all ranks)", "calc_kb", ".1f"),
                ("stage CommMeta KB (all ranks)", "stage_meta_kb", ".1f"), ("recv buffers MB", "recv_mb", ".1f"),
                ("return (and relay hop) buffers MB", "return_mb", ".1f"), ("fwd peak MB", "fwd_peak_mb", ".1f"),
                ("bwd peak MB", "bwd_peak_mb", ".1f")]


SUMMARY_COLUMNS = [("S", "S", "d"), ("comm", "comm", "s"), ("masks", "n", "d"),
                   ("/ ideal median", "ideal_med", ".2f"), ("/ ideal max", "ideal_max", ".2f"),
                   ("/ S=1 median", "s1_med", ".2f"), ("/ S=1 a2a median", "s1a_med", ".2f"),
                   ("/ S=1 a2a best", "s1a_min", ".2f"), ("exposed % max", "exp_max", ".1f"),
                   ("<= 1.15 ideal", "ok_ideal", "d"), ("<= 0.75 S=1 a2a", "ok_s1", "d"),
                   ("0.75 reachable", "reach", "d"), ("exposed <= 15 %", "ok_exp", "d")]


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
                    "reach": sum(r["reachable"] == "yes" for r in sel),
                    "ok_exp": sum(r["exposed_pct"] <= 15.0 for r in sel)})
    return out


def best_stages(rows: list[dict]) -> dict:
    """Per transport, the S with the lowest median step over the two-stage a2a step (ties: fewer stages)."""
    out = {}
    for comm in sorted({r["comm"] for r in rows}):
        meds = {}
        for S in sorted({r["S"] for r in rows}):
            xs = sorted(r["vs_s1_a2a"] for r in rows if (r["comm"], r["S"]) == (comm, S))
            meds[S] = xs[len(xs) // 2]
        out[comm] = min(meds, key=lambda S: (round(meds[S], 3), S))
    return out


def side_by_side(rows: list[dict], S: int) -> list[dict]:
    """One row per mask: the two-stage a2a step and its ideal, then a2a and p2p at S sub-stages
    against the three targets (step <= 1.15 ideal, <= 0.75 x the two-stage a2a step, exposed <= 15 %)."""
    out = []
    for key in dict.fromkeys((r["kind"], r["P"], r["seed"]) for r in rows):
        pick = {(r["S"], r["comm"]): r for r in rows if (r["kind"], r["P"], r["seed"]) == key}
        base = pick[(1, "a2a")]
        row = {"kind": key[0], "P": key[1], "seed": key[2], "s1_ms": base["step_ms"], "ideal_ms": base["ideal_ms"],
               "s1_ideal": base["vs_ideal"], "floor": base["ideal_ms"] / base["step_ms"]}
        for comm in ("a2a", "p2p"):
            r = pick.get((S, comm))
            if r is None:
                continue
            marks = "".join(m if ok else "." for m, ok in (("I", r["vs_ideal"] <= 1.15), ("T", r["vs_s1_a2a"] <= 0.75),
                                                           ("E", r["exposed_pct"] <= 15.0)))
            row.update({f"{comm}_ideal": r["vs_ideal"], f"{comm}_s1": r["vs_s1_a2a"], f"{comm}_exp": r["exposed_pct"],
                        f"{comm}_ok": marks})
        out.append(row)
    return out


SIDE_COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"), ("S=1 a2a ms", "s1_ms", ".2f"),
                ("ideal ms", "ideal_ms", ".2f"), ("S=1 a2a / ideal", "s1_ideal", ".2f"),
                ("best possible / S=1 a2a", "floor", ".2f"),
                ("a2a / ideal", "a2a_ideal", ".2f"), ("a2a / S=1 a2a", "a2a_s1", ".2f"), ("a2a exposed %", "a2a_exp", ".1f"),
                ("a2a targets", "a2a_ok", "s"),
                ("p2p / ideal", "p2p_ideal", ".2f"), ("p2p / S=1 a2a", "p2p_s1", ".2f"), ("p2p exposed %", "p2p_exp", ".1f"),
                ("p2p targets", "p2p_ok", "s")]


def cost_rows(rows: list[dict]) -> list[dict]:
    """One row per S: the costs of the largest plan measured (the last P, kind and seed in the sweep)."""
    last = rows[-1]
    return [r for r in rows if (r["kind"], r["P"], r["seed"], r["comm"]) ==
            (last["kind"], last["P"], last["seed"], last["comm"])]


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
    ap.add_argument("--own-nic", action="store_true",
                    help="simulate every inter-node send through the source GPU's own NIC (a gloo group, or "
                         "NCCL without PXN) instead of the preset's rail routing (Topology.rail_routing)")
    ap.add_argument("--solve-topology", action="store_true",
                    help="solve on the topology (SolverConfig(topology=...), as a cluster user does; with one "
                         "remote stage such a plan relays inter-node rows); default: solve without it")
    ap.add_argument("--side-stages", type=int, default=None,
                    help="S of the side-by-side table (default: p2p's lowest median)")
    ap.add_argument("--md", default=None)
    ap.add_argument("--json", default=str(Path(RESULTS_DIR) / "stages_bench.json"))
    args = ap.parse_args(argv)
    comms = parse_list(args.comm, str, COMMS, "comm")
    if "a2a" not in comms:  # every summary ratio is against the two-stage a2a step
        ap.error(f"--comm must include a2a (the baseline of every ratio), got {args.comm!r}")
    torch.set_num_threads(1)
    topo = PRESETS[args.topology]
    if args.own_nic:
        topo = dataclasses.replace(topo, rail_routing=False)
    rows = []
    for kind in parse_list(args.kinds, str, PACKED_KINDS, "kind"):
        for P in parse_list(args.P):
            for seed in range(args.seeds):
                rows += run(kind, P, seed, args.tokens_per_rank, parse_list(args.stages),
                            comms, topo, args.plan_cache, args.solve_topology)
    side_S = args.side_stages if args.side_stages else best_stages(rows).get("p2p", max(r["S"] for r in rows))
    cmd = "python benchmarks/stages_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    solved = ("Every mask is solved on the topology (`SolverConfig(topology=...)`: bytes priced by link class, "
              f"mu = {SolverConfig(cp_size=16, topology=PRESETS[args.topology]).imbalance_tol:.2f} across nodes "
              "(the default), relay transport at S = 1, direct with sub-stages)" if args.solve_topology else
              "Every mask is solved without a topology (the topology orders the sub-stages only)")
    routing = ("Inter-node sends leave through the NIC on the destination's rail, reached over NVLink "
               "(`Topology.rail_routing`, NCCL's point-to-point routing)" if topo.rail_routing else
               "Inter-node sends leave through the source GPU's own NIC (`rail_routing=False`)")
    tail = SolverConfig(cp_size=16).local_tail
    text = (f"# Sub-stages: SIMULATED training step ({args.topology})\n\nCommand: `{cmd}`\n\n{solved}. "
            f"{routing}. With S > 1 direct plans also run the local tail (`local_tail={tail}`, the default: "
            "a local-only last sub-stage, `benchmarks/results/local_tail_bench.md`).\n\n"
            "All times are simulated by `gpusolver.sim` (not measured). `/ S=1` is against the same plan's "
            "two-stage step with the same transport, `/ S=1 a2a` against the two-stage step over all-to-all-v "
            "(today's `TorchGroup`).\n\n## Summary over the masks\n\n"
            + markdown_table(summarize(rows), SUMMARY_COLUMNS)
            + "\n\nLowest median step over the two-stage a2a step: "
            + ", ".join(f"{comm} S = {S}" for comm, S in best_stages(rows).items())
            + f".\n\n## Every mask at S = {side_S}, a2a and p2p side by side\n\n"
            + "Targets met: I = step <= 1.15 x ideal, T = step <= 0.75 x the two-stage a2a step, "
            "E = exposed communication <= 15 % of the step ('.' = missed). `best possible` is the ideal bound "
            "over the two-stage a2a step: where it is above 0.75, T cannot be met by any schedule.\n\n"
            + markdown_table(side_by_side(rows, side_S), SIDE_COLUMNS)
            + f"\n\n## Cost per S ({rows[-1]['kind']} P = {rows[-1]['P']} seed {rows[-1]['seed']}, MB per rank)\n\n"
            + markdown_table(cost_rows(rows), COST_COLUMNS) + "\n\n## Every mask\n\n"
            + markdown_table(rows, COLUMNS) + "\n")
    print(text)
    write_results(args.json, {"rows": rows, "environment": environment(), "command": cmd}, args.md, text)
    return rows


if __name__ == "__main__":
    main()
