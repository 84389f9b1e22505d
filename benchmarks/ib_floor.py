"""The InfiniBand floor: the fewest IB bytes per GPU any plan within the imbalance bound must move.

Issue 28 asks for forward IB bytes per GPU <= USP's and IB time <= 0.4x today's plans' in every
benchmark cell. Whether a cell can meet them at all depends on the mask: when a node's own work
(tasks whose query and key units both live on it) cannot be balanced against the others' within
mu, work has to cross nodes, and with it its rows. ``gpusolver.bounds.ib_lower_bound`` bounds that
from below by a linear program over the nodes that every plan within mu satisfies, whatever the
solver or transport; this prints it per benchmark mask next to USP's, today's plans' (solved
without topology), the default topology-solved plans' (direct) and the relay-priced plans' (relay,
at the default sub-stages and at one remote stage).

    PYTHONPATH=. python benchmarks/ib_floor.py --P 16,32,64 --seeds 3 --plan-cache build/sim_plans \\
        --md benchmarks/results/ib_floor.md
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_cluster_sweep_args, build_as_solved, cached_assignment, cluster_sweep, keep_tag, make_mask, markdown_table,
    median, plan_cache_path, print_and_write,
)
from topology_solve import link_bottlenecks, usp_ib_fwd  # noqa: E402

from gpusolver import SolverConfig, block_areas  # noqa: E402
from gpusolver.bounds import ib_lower_bound  # noqa: E402
from gpusolver.capacity import keep_for_budget  # noqa: E402

MB = 1e6


def ib_floor(areas, config: SolverConfig, ranks_per_node: int, mu: float | None = None) -> dict:
    """``bounds.ib_lower_bound`` of the forward and of the step (forward plus backward), bytes per GPU,
    at the solver's own prices (``config.cost()`` with ``keep_for_budget`` resolved, as the solve
    prices); mu defaults to ``config.imbalance_tol``."""
    cost = keep_for_budget(config, areas.chunk).cost()
    mu = config.imbalance_tol if mu is None else mu
    return {d: ib_lower_bound(areas, cost, ranks_per_node, mu, direction=d) for d in ("fwd", "step")}


def node_spread(pair: torch.Tensor, per_node: int) -> int:
    """The forward IB bytes per GPU of ``pair`` [P, P] if every node spread its IB bytes evenly over
    its NICs: the largest over nodes of max(out, in) / L. A plan's per-GPU figure over this is what
    its NICs' uneven load costs; this over the floor is what its choice of crossings costs."""
    node = torch.arange(pair.shape[0]) // per_node
    cross = torch.where(node[:, None] != node[None, :], pair, 0)
    N = pair.shape[0] // per_node
    out = cross.sum(1).view(N, per_node).sum(1)
    into = cross.sum(0).view(N, per_node).sum(1)
    return int(torch.maximum(out, into).max()) // per_node


def run(kind: str, P: int, seed: int, tokens: int, cache, topology) -> dict:
    """One cell: the floors next to USP's and today's and the topology-solved plan's IB bytes."""
    L = topology.ranks_per_node
    base = SolverConfig(cp_size=P)
    mask = make_mask(kind, P, seed, tokens)
    areas = block_areas(mask, P, base.head_groups, impl="torch")
    t0 = time.perf_counter()
    floor = ib_floor(areas, base, L)
    lp_s = time.perf_counter() - t0
    usp = usp_ib_fwd(base, mask.total_seqlen_q, L)
    nic_bps = topology.ib_gbps * 1e9 * topology.nics_per_node / L
    row = {"kind": kind, "P": P, "seed": seed, "usp_fwd_mb": usp / MB, "floor_fwd_mb": floor["fwd"] / MB,
           "floor_vs_usp": floor["fwd"] / usp, "floor_ib_ms": floor["step"] / nic_bps * 1e3, "lp_s": lp_s}
    topo, relay = replace(base, topology=topology), replace(base, topology=topology, ib_relay=True)
    for name, config, path in (
            ("today", base, plan_cache_path(cache, kind, P, seed, tokens, base)),
            ("topo", topo, plan_cache_path(cache, kind, P, seed, tokens, topo)),
            # the relay-priced solve's assignment is another one: a file of its own
            ("relay", relay,
             cache and Path(cache) / f"{kind}_P{P}_s{seed}_c{tokens}_topo_relay{keep_tag(relay, tokens)}.pt")):
        asg, _ = cached_assignment(mask, areas, config, path)
        # today and topo built direct, as the default runs at S > 1; relay with relay transport at the
        # default S (its returns cross once per sub-stage) and at one remote stage ("relay1")
        builds = [(name, replace(config, topology=topology, ib_relay=name == "relay"))]
        if name == "relay":
            builds.append(("relay1", replace(builds[0][1], num_stages=1)))
        for label, built in builds:
            plan = build_as_solved(mask, areas, asg, built)
            fwd, bwd = (link_bottlenecks(plan.pair_bytes(phase), L)[0] for phase in ("fwd", "bwd"))
            row[f"{label}_fwd_mb"], row[f"{label}_ib_ms"] = fwd / MB, (fwd + bwd) / nic_bps * 1e3
            row[f"{label}_even_mb"] = node_spread(plan.pair_bytes("fwd"), L) / MB
    row["floor_vs_today"] = row["floor_ib_ms"] / row["today_ib_ms"] if row["today_ib_ms"] else None
    for name in ("topo", "relay", "relay1"):
        row[f"{name}_vs_floor"] = row[f"{name}_fwd_mb"] / row["floor_fwd_mb"] if row["floor_fwd_mb"] else None
        row[f"{name}_vs_usp"] = row[f"{name}_fwd_mb"] / row["usp_fwd_mb"]
        row[f"{name}_vs_today"] = row[f"{name}_ib_ms"] / row["today_ib_ms"] if row["today_ib_ms"] else None
        row[f"{name}_even_vs_floor"] = row[f"{name}_even_mb"] / row["floor_fwd_mb"] if row["floor_fwd_mb"] else None
        row[f"{name}_vs_even"] = row[f"{name}_fwd_mb"] / row[f"{name}_even_mb"] if row[f"{name}_even_mb"] else None
    return row


COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"),
           ("USP IB fwd MB/GPU", "usp_fwd_mb", ".1f"), ("floor IB fwd MB/GPU", "floor_fwd_mb", ".1f"),
           ("floor / USP", "floor_vs_usp", ".2f"), ("plan IB fwd MB/GPU", "topo_fwd_mb", ".1f"),
           ("plan / USP", "topo_vs_usp", ".2f"), ("plan / floor", "topo_vs_floor", ".2f"),
           ("plan even / floor", "topo_even_vs_floor", ".2f"), ("plan / even", "topo_vs_even", ".2f"),
           ("relay plan IB fwd MB/GPU", "relay_fwd_mb", ".1f"), ("relay / USP", "relay_vs_usp", ".2f"),
           ("relay / floor", "relay_vs_floor", ".2f"), ("relay even / floor", "relay_even_vs_floor", ".2f"),
           ("relay / even", "relay_vs_even", ".2f"),
           ("relay S=1 IB fwd MB/GPU", "relay1_fwd_mb", ".1f"), ("relay S=1 / USP", "relay1_vs_usp", ".2f"),
           ("relay S=1 / floor", "relay1_vs_floor", ".2f"), ("relay S=1 / even", "relay1_vs_even", ".2f"),
           ("today IB ms", "today_ib_ms", ".2f"), ("floor IB ms", "floor_ib_ms", ".2f"),
           ("floor / today", "floor_vs_today", ".2f"), ("plan IB ms", "topo_ib_ms", ".2f"),
           ("plan / today", "topo_vs_today", ".2f"), ("relay IB ms", "relay_ib_ms", ".2f"),
           ("relay / today", "relay_vs_today", ".2f"), ("relay S=1 / today", "relay1_vs_today", ".2f"),
           ("LP s", "lp_s", ".1f")]


def summary(rows: list[dict]) -> str:
    n = len(rows)
    fwd_ok = [r for r in rows if r["floor_vs_usp"] <= 1.0]
    time_ok = [r for r in rows if r["floor_vs_today"] is not None and r["floor_vs_today"] <= 0.4]
    out = [f"- IB fwd <= USP's is reachable (floor / USP <= 1) in {len(fwd_ok)} of {n} cells; IB time <= 0.4x "
           f"today's (floor / today <= 0.4) in {len(time_ok)} of {n}.\n"]
    # a floor under 1 % of USP's is a node balance that needs next to nothing: its ratios say little
    crossing = [r for r in rows if r["floor_vs_usp"] >= 0.01]
    for name, label in (("topo", "plan (default: topology-solved, direct)"),
                        ("relay", "relay plan (ib_relay=True, the default S)"),
                        ("relay1", "relay plan at S = 1 (num_stages=1)")):
        met_fwd = sum(r[f"{name}_vs_usp"] <= 1.0 for r in rows)
        met_time = sum(r[f"{name}_vs_today"] is not None and r[f"{name}_vs_today"] <= 0.4 for r in rows)
        line = f"- {label}: IB fwd <= USP's in {met_fwd} of {n}; IB time <= 0.4x today's in {met_time}"
        if crossing:
            gaps = [r[f"{name}_vs_floor"] for r in crossing]
            even = [r[f"{name}_vs_even"] for r in rows if r[f"{name}_vs_even"] is not None]
            line += (f"; IB fwd / floor median {median(gaps):.2f}, range {min(gaps):.2f}-{max(gaps):.2f} (over "
                     f"the {len(gaps)} cells whose floor is at least 1 % of USP's): crossings chosen (even / floor) "
                     f"median {median([r[f'{name}_even_vs_floor'] for r in crossing]):.2f}, NICs' uneven load "
                     f"(IB fwd / even) median {median(even):.2f}" if even else "")
        out.append(line + ".\n")
    return "".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cluster_sweep_args(ap)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--plan-cache", default=None, help="where solved plans are cached (as stages_bench's)")
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be positive, got {args.seeds}")
    sizes, kinds, topology = cluster_sweep(ap, args)
    torch.set_num_threads(1)
    rows = []
    for kind in kinds:
        for P in sizes:
            for seed in range(args.seeds):
                rows.append(run(kind, P, seed, args.tokens, args.plan_cache, topology))
                print(markdown_table(rows[-1:], COLUMNS), flush=True)
    cmd = "python benchmarks/ib_floor.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = ("# The InfiniBand floor of a plan within the imbalance bound (per GPU)\n\n"
            f"Command: `{cmd}`\n\n"
            f"Packed documents, {args.tokens} tokens per rank, GQA 64:8, D = 128, bf16, mu = 1.10, "
            f"`{topology.name}` (nodes of {topology.ranks_per_node}). floor: the optimum of a linear program "
            "that every plan within mu satisfies (each (unit, node) crossing once, its rows at least each "
            "task's need, a node's bytes spread evenly over its NICs: `gpusolver.bounds.ib_lower_bound`), so no solver "
            "and no transport moves less; a target below it is out of reach in that cell. IB fwd: the "
            "largest per-GPU max(sent, received) to other nodes, forward (as `relay_bench.py`); IB ms: "
            "(IB fwd + IB bwd) / NIC bandwidth, ideal. even: the plan's forward IB bytes per GPU were each node's "
            "spread evenly over its NICs (`node_spread`), so plan / floor = (even / floor) x (plan / even). "
            "USP: its ring over nodes. today: the plan solved "
            "without topology; plan: solved with `SolverConfig(topology=...)`; both built direct, as the "
            "default runs with sub-stages; relay: solved with `ib_relay=True` and built with relay transport at "
            "the default sub-stages (its returns cross once per sub-stage) and at S = 1. Bytes are counted, "
            "not simulated.\n\n"
            + markdown_table(rows, COLUMNS) + "\n\n" + summary(rows))
    print_and_write(text, args.md)
    return rows


if __name__ == "__main__":
    main()
