"""How full the relay transport's buffers get, next to their default capacities.

Relay transport (``SolverConfig(topology=..., ib_relay=True)``, and the default with one remote
stage across nodes; ``gpusolver.plan.relay``) adds three buffers per kind (QO, KV) to each rank:
its relay buffer (the hulls it receives over InfiniBand for its node), its fan-out send list
(the rows it forwards over NVLink) and its egress buffer (what its NIC sends for its node's
other hosts). Each is sized by ``gpusolver.capacity.RELAY_CHUNKS`` in multiples of G·c, capped at
its worst case; a candidate past a capacity travels direct instead, so the capacities bound
memory, never correctness. This prints each buffer's largest fill over the ranks (its rows in
G·c; with S sub-stages the S casts share each buffer, so their fills add up) next to its
capacity, per mask: the benchmark masks (packed causal and full documents) and one causal or
full sequence (``--kinds causal-seq,full-seq``), solved as a cluster user's config does (on the
topology, the relay-priced solve, the default mu). Host arithmetic on the plans' routes: no
layer runs.

    PYTHONPATH=. python benchmarks/relay_fill.py --P 16,32,64 --seeds 3 \\
        --kinds causal,full,causal-seq,full-seq --plan-cache build/relay_plans \\
        --md benchmarks/results/relay_fill.md
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    KINDS, build_as_solved, cached_assignment, make_mask, markdown_table, parse_list, plan_cache_path,
    print_and_write,
)

from gpusolver import SolverConfig, block_areas  # noqa: E402
from gpusolver.capacity import RELAY_CHUNKS  # noqa: E402
from gpusolver.topology import PRESETS  # noqa: E402

BUFFERS = ("relay", "fan", "egress")


def relay_fill(plan, unit: int) -> dict:
    """Each relay buffer's largest fill over the ranks and its capacity, in multiples of ``unit`` rows
    (``{"qo_relay": ..., "qo_relay_cap": ..., ...}``); the S casts of a sub-stage plan share a buffer."""
    relay = plan.relay
    out = {}
    for kind in ("qo", "kv"):
        casts = [relay.stage(kind, s) for s in range(1, relay.num_stages + 1)]
        fill = {"relay": sum(r.relay_rows for r in casts),                 # [P] rows received by hop 1
                "fan": sum(r.hop2_split.sum(1) for r in casts),            # [P] rows forwarded by hop 2
                "egress": sum(r.egress_split.sum(0) for r in casts)}       # [P] rows brought by hop 3
        route = relay.route(kind)
        caps = {"relay": route.relay_capacity, "fan": route.fan_capacity, "egress": route.egress_capacity}
        for b in BUFFERS:
            out[f"{kind}_{b}"] = int(fill[b].max()) / unit
            out[f"{kind}_{b}_cap"] = caps[b] / unit
    return out


def run(kind: str, P: int, seed: int, tokens: int, stages: int, cache, topology) -> dict:
    config = SolverConfig(cp_size=P, topology=topology, ib_relay=True, num_stages=stages)
    mask = make_mask(kind, P, seed, tokens)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg, _ = cached_assignment(mask, areas, config, plan_cache_path(cache, kind, P, seed, tokens, config))
    plan = build_as_solved(mask, areas, asg, config)
    return {"kind": kind, "P": P, "seed": seed, "S": stages, **relay_fill(plan, config.head_groups * tokens)}


COLUMNS = ([("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"), ("S", "S", "d")]
           + [(f"{k.upper()} {b}", f"{k}_{b}", ".2f") for k in ("qo", "kv") for b in BUFFERS])
SUMMARY = ([("P", "P", "d"), ("masks", "masks", "d")]
           + [(f"{k.upper()} {b} max / cap", f"{k}_{b}", "s") for k in ("qo", "kv") for b in BUFFERS])


def summary(rows: list[dict]) -> list[dict]:
    """Per P: each buffer's largest fill over the masks / its capacity (G·c)."""
    out = []
    for P in dict.fromkeys(r["P"] for r in rows):
        rs = [r for r in rows if r["P"] == P]
        row = {"P": P, "masks": len(rs)}
        for k in ("qo", "kv"):
            for b in BUFFERS:
                key = f"{k}_{b}"
                row[key] = f"{max(r[key] for r in rs):.2f} / {rs[0][key + '_cap']:.2f}"
        out.append(row)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--P", default="16,32,64")
    ap.add_argument("--kinds", default="causal,full")
    ap.add_argument("--seeds", type=int, default=1, help="seeds of the packed masks (one-sequence masks: seed 0)")
    ap.add_argument("--stages", type=int, default=1, help="num_stages of the plans (the fills add up over casts)")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--topology", default="h200_hgx", choices=sorted(PRESETS))
    ap.add_argument("--plan-cache", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be positive, got {args.seeds}")
    try:
        kinds = parse_list(args.kinds, str, tuple(KINDS), "--kinds")
        sizes = parse_list(args.P, int, name="--P")
    except ValueError as e:
        ap.error(str(e))
    topology = PRESETS[args.topology]
    for P in sizes:
        if P <= topology.ranks_per_node:
            ap.error(f"--P {P} fits one node of {args.topology} ({topology.ranks_per_node} ranks): no relay")
    torch.set_num_threads(1)
    rows = [run(kind, P, seed, args.tokens_per_rank, args.stages, args.plan_cache, topology)
            for kind in kinds for P in sizes
            for seed in (range(args.seeds) if not kind.endswith("-seq") else (0,))]
    cmd = "python benchmarks/relay_fill.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = ("# Relay buffers: fill next to the default capacities (per rank)\n\n"
            f"Command: `{cmd}`\n\n"
            f"Topology `{topology.name}` (nodes of {topology.ranks_per_node}); every mask solved with "
            "`SolverConfig(cp_size=P, topology=..., ib_relay=True)` (relay-priced, the default mu). Fill: a "
            "buffer's largest rows over the ranks, in G·c (G head groups of c tokens): relay, the hulls a rank "
            "receives over InfiniBand for its node; fan, the rows it forwards to its node over NVLink; egress, "
            "the rows it sends over its NIC for its node's other hosts. Capacities: "
            f"`capacity.RELAY_CHUNKS` = {RELAY_CHUNKS}, each capped at its worst case. A row past a capacity "
            "travels direct instead.\n\n## Largest fill / capacity per P\n\n"
            + markdown_table(summary(rows), SUMMARY) + "\n\n## Every mask\n\n" + markdown_table(rows, COLUMNS) + "\n")
    print_and_write(text, args.md)
    return rows


if __name__ == "__main__":
    main()
