"""The relay-priced solve against today's plans: InfiniBand bytes and time, balance, CPU solve time.

For each benchmark mask (packed causal and full documents, 8K tokens per rank,
GQA 64:8, D = 128, bf16, mu = 1.10, nodes of 8 on h200_hgx) it solves on the
CPU torch path three ways:

- today: no topology, today's direct transport (every consumer pulls its own
  copy across nodes): its bytes are the plan's own (``Plan.pair_bytes``);
- direct: ``SolverConfig(topology=..., ib_relay=False)``, bytes priced by link
  for direct transport (the plan's own bytes again);
- relay: ``SolverConfig(topology=..., num_stages=1)`` (one remote stage: relays by default;
  with sub-stages the default prices and runs direct), priced by the relay
  transport's hops; its bytes are the relay transport's own (``plan.relay``,
  ``Plan.pair_bytes(phase, hop=)``: each (unit, remote node) crosses InfiniBand
  once, host to ``Topology.relay_rank``, with the node hull of the rows its
  consumers need, then NVLink from the relay; with more than two nodes the plan
  moves crossings to other rails of the host's node, ``plan.relay.matched_rails``,
  when that lowers the busiest NIC; a hull longer than the rows, or
  past a relay's buffers, goes direct). "solver's IB fwd" is the same counted
  by the solver's model (``solver.state.relay.relay_hops``: every relay buffer
  large enough).

Today's plans are also counted under the relay transport ("today+relay": the
transport alone, without a solve that prices it). Per GPU: IB fwd / bwd is
the largest over GPUs of max(bytes sent, received) across nodes; NV fwd the
same inside a node; USP IB fwd is USP's ring over nodes; IB step ms is
simulated (ideal: (IB fwd + IB bwd) / NIC bandwidth, no latency, no overlap).

    python benchmarks/relay_solve.py                   # P = 16, 32, 64; seed 0
    python benchmarks/relay_solve.py --P 16 --kinds causal
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, run as a script or loaded by path

from _common import (  # noqa: E402
    RESULTS_DIR, add_cluster_sweep_args, cluster_sweep, environment, make_mask, markdown_table, median, write_json,
)
from topology_solve import link_bottlenecks, usp_ib_fwd  # noqa: E402
from gpusolver.areas import block_areas  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.plan import build_plan  # noqa: E402
from gpusolver.solve import solve  # noqa: E402
from gpusolver.solver.core import Tasks  # noqa: E402
from gpusolver.solver.state.ref import state  # noqa: E402
from gpusolver.solver.state.relay import relay_hops  # noqa: E402

COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("solve", "solve", ""), ("transport", "transport", ""),
    ("IB fwd MB/GPU", "ib_fwd_mb", ".1f"), ("IB fwd / USP", "ib_fwd_vs_usp", ".2f"),
    ("IB bwd MB/GPU", "ib_bwd_mb", ".1f"), ("NV fwd MB/GPU", "nv_fwd_mb", ".1f"),
    ("solver's IB fwd MB/GPU", "model_ib_fwd_mb", ".1f"),
    ("IB step ms (sim.)", "ib_step_ms", ".2f"), ("IB step / today", "ib_vs_today", ".2f"),
    ("imbalance", "imbalance", ".3f"), ("solve s (CPU)", "solve_s", ".2f"), ("solve / today", "solve_vs_today", ".2f"),
]


def relay_pair_bytes(plan, mask, config: SolverConfig):
    """{(phase, class): [P, P] int64 bytes} of ``plan``'s assignment under the relay transport as
    the solver prices it (phase "fwd"/"bwd", class 0 NVLink, 1 InfiniBand): each hop's down
    tokens (Q, K/V there) and, on the reversed hop, the results back (O; dQ, dK/dV). The same
    rule as the transport's, but with every relay buffer large enough."""
    cfg = config if config.relays else replace(config, ib_relay=True)
    areas = block_areas(mask, cfg.cp_size, cfg.head_groups, impl="torch", tiles=cfg.chunk_tiles)
    tasks = Tasks(areas, cfg)
    a = plan.assignment.long().reshape(-1)
    A = torch.cat((torch.where(a >= 0, a, tasks.P), torch.tensor([tasks.P]))).view(1, -1)
    st = state(tasks, A)
    q = relay_hops(tasks, st.qlen, st.q_lo, st.q_hi)[:, 0]  # [2, P, P]
    k = relay_hops(tasks, st.klen, st.k_lo, st.k_hi)[:, 0]
    out = {}
    for c in (0, 1):
        qt, kt = q[c], k[c]
        out["fwd", c] = qt * tasks.q + kt * tasks.kv + qt.T * tasks.o
        out["bwd", c] = qt * tasks.qb + kt * tasks.kvb + qt.T * tasks.dqb + kt.T * tasks.dkv
    return out


def _peak(pair: torch.Tensor) -> int:
    return int(torch.maximum(pair.sum(1), pair.sum(0)).max())


def measure(kind: str, P: int, seed: int, topology, tokens: int) -> list[dict]:
    mask = make_mask(kind, P, seed, tokens_per_rank=tokens)
    base = SolverConfig(cp_size=P)
    relay_cfg = replace(base, topology=topology, num_stages=1)  # one remote stage: relay priced and run
    usp_fwd = usp_ib_fwd(base, mask.total_seqlen_q, topology.ranks_per_node)
    nic_bps = topology.ib_gbps * 1e9 * topology.nics_per_node / topology.ranks_per_node
    rows = []
    for name, config in (("today", base), ("direct", replace(relay_cfg, ib_relay=False)), ("relay", relay_cfg)):
        t0 = time.perf_counter()
        plan = solve(mask, config, impl="torch", validate=False)
        seconds = time.perf_counter() - t0
        transports = ("direct", "relay") if name == "today" else (("relay",) if name == "relay" else ("direct",))
        for transport in transports:
            model_ib_fwd, built = None, plan
            if transport == "relay":  # every hop's bytes: InfiniBand between nodes, NVLink inside one
                built = plan if plan.relay is not None else build_plan(
                    mask, block_areas(mask, P, base.head_groups, impl="torch"), plan.assignment, relay_cfg)
                model_ib_fwd = _peak(relay_pair_bytes(plan, mask, relay_cfg)["fwd", 1])
            ib_fwd, nv_fwd = link_bottlenecks(built.pair_bytes("fwd"), topology.ranks_per_node)
            ib_bwd, _ = link_bottlenecks(built.pair_bytes("bwd"), topology.ranks_per_node)
            rows.append({"kind": kind, "P": P, "seed": seed, "solve": name, "transport": transport,
                         "ib_fwd_mb": ib_fwd / 1e6, "usp_ib_fwd_mb": usp_fwd / 1e6, "ib_fwd_vs_usp": ib_fwd / usp_fwd,
                         "ib_bwd_mb": ib_bwd / 1e6, "nv_fwd_mb": nv_fwd / 1e6,
                         "model_ib_fwd_mb": None if model_ib_fwd is None else model_ib_fwd / 1e6,
                         "ib_step_ms": (ib_fwd + ib_bwd) / nic_bps * 1e3,
                         "imbalance": float(plan.metrics.imbalance), "solve_s": seconds})
    today = rows[0]
    for r in rows:
        r["ib_vs_today"] = r["ib_step_ms"] / today["ib_step_ms"] if today["ib_step_ms"] else None
        r["solve_vs_today"] = r["solve_s"] / today["solve_s"]
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_sweep_args(p)
    p.add_argument("--seeds", default="0", help="comma-separated mask seeds (default 0)")
    p.add_argument("--json", default=str(RESULTS_DIR / "relay_solve.json"))
    args = p.parse_args(argv)
    sizes, kinds, topology = cluster_sweep(p, args)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(1)
    rows = []
    for kind in kinds:
        for P in sizes:
            for seed in seeds:
                cell = measure(kind, P, seed, topology, args.tokens)
                rows += cell
                print(markdown_table(cell, COLUMNS), flush=True)
    print(f"\n## Relay-priced solve vs today's on {topology.name} ({args.tokens} tokens per rank, GQA 64:8, "
          f"D = 128, bf16, mu = 1.10; CPU torch path, 1 thread; IB time simulated: bytes / NIC bandwidth)\n")
    print(markdown_table(rows, COLUMNS))
    relay = [r for r in rows if r["solve"] == "relay"]
    print(f"\nmedians of the relay-priced solve: IB fwd / USP {median([r['ib_fwd_vs_usp'] for r in relay]):.2f}, "
          f"IB step / today {median([r['ib_vs_today'] for r in relay]):.2f}, "
          f"solve time / today {median([r['solve_vs_today'] for r in relay]):.2f}")
    payload = {"benchmark": "relay_solve", "environment": environment(), "topology": args.topology,
               "tokens_per_rank": args.tokens, "rows": rows}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
