"""Topology-aware solve against today's: InfiniBand bytes, balance and CPU solve time.

For each benchmark mask (packed causal and full documents, 8K tokens per rank,
GQA 64:8, D = 128, bf16, mu = 1.10) it solves twice on the CPU torch path,
once as today (no topology) and once with ``SolverConfig(topology=...)``
(h200_hgx: nodes of 8, NVLink 450 GB/s, one 50 GB/s NIC per GPU), builds
both plans and reads each plan's own bytes per (source, destination)
(``Plan.pair_bytes``, the bytes its collectives move). From them, per GPU:

- IB fwd / bwd: the largest over GPUs of max(bytes sent, received) to and
  from other nodes, forward and backward (the plan's InfiniBand bottleneck;
  with one NIC per GPU its IB time is that over the NIC bandwidth).
- NV fwd: the same over NVLink (pairs inside a node).
- USP IB fwd: USP's ring over nodes (``baselines.usp``; its all-to-all stays
  inside a node), the same for every GPU.
- IB time (simulated, ideal: bytes / bandwidth, no latency, no overlap) of a
  training step: (IB fwd + IB bwd) / NIC bandwidth, in ms.
- step ms (simulated): the layer's training step, forward plus backward, from
  ``gpusolver.sim.simulate`` (the runtime's own schedule on the topology,
  today's transport and stages), and USP's and load-balanced USP's from
  ``simulate_baseline`` on the same shards.

    python benchmarks/topology_solve.py                      # P = 16, 32, 64; seed 0
    python benchmarks/topology_solve.py --P 16 --seeds 0,1
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
from gpusolver.baselines import usp  # noqa: E402
from gpusolver.sim import simulate, simulate_baseline  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.solve import solve  # noqa: E402

COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("seed", "seed", "d"), ("solve", "solve", ""),
    ("IB fwd MB/GPU", "ib_fwd_mb", ".1f"), ("USP IB fwd MB/GPU", "usp_ib_fwd_mb", ".1f"),
    ("IB fwd / USP", "ib_fwd_vs_usp", ".2f"), ("IB bwd MB/GPU", "ib_bwd_mb", ".1f"),
    ("NV fwd MB/GPU", "nv_fwd_mb", ".1f"), ("IB step ms (sim.)", "ib_step_ms", ".2f"),
    ("IB step / today", "ib_vs_today", ".2f"), ("imbalance", "imbalance", ".3f"),
    ("step ms (sim.)", "step_ms", ".2f"), ("step / USP", "step_vs_usp", ".2f"),
    ("step / bal. USP", "step_vs_usp_bal", ".2f"),
    ("solve s (CPU)", "solve_s", ".2f"), ("solve / today", "solve_vs_today", ".2f"),
]


def link_bottlenecks(pair: torch.Tensor, per_node: int) -> tuple[int, int]:
    """(IB, NVLink) bottleneck of a [P, P] byte matrix: the largest over GPUs of max(sent,
    received) over pairs on different nodes, and on the same node."""
    P = pair.shape[0]
    node = torch.arange(P) // per_node
    cross = node[:, None] != node[None, :]
    out = []
    for links in (cross, ~cross):
        m = torch.where(links, pair, 0)
        out.append(int(torch.maximum(m.sum(1), m.sum(0)).max()))
    return out[0], out[1]


def usp_ib_fwd(config: SolverConfig, seqlen: int, per_node: int) -> int:
    """USP's forward InfiniBand bytes per GPU: its volume less the all-to-all inside a node
    (the same formula over one node, where the ring is empty)."""
    kw = dict(num_heads_q=config.num_heads_q, num_heads_kv=config.num_heads_kv, head_dim=config.head_dim,
              dtype_bytes=config.dtype_bytes)
    whole = usp(seqlen=seqlen, cp_size=config.cp_size, **kw).fwd_bottleneck
    one_node = usp(seqlen=seqlen * per_node // config.cp_size, cp_size=per_node, **kw).fwd_bottleneck
    return int(whole) - int(one_node)


def measure(kind: str, P: int, seed: int, topology, tokens: int) -> list[dict]:
    mask = make_mask(kind, P, seed, tokens_per_rank=tokens)
    base = SolverConfig(cp_size=P)
    usp_fwd = usp_ib_fwd(base, mask.total_seqlen_q, topology.ranks_per_node)
    usp_ms = simulate_baseline("usp", mask, base, topology).step_ms
    usp_bal_ms = simulate_baseline("usp_balanced", mask, base, topology).step_ms
    rows = []
    for name, config in (("today", base), ("topology", replace(base, topology=topology))):
        t0 = time.perf_counter()
        plan = solve(mask, config, impl="torch", validate=False)
        seconds = time.perf_counter() - t0
        ib_fwd, nv_fwd = link_bottlenecks(plan.pair_bytes("fwd"), topology.ranks_per_node)
        ib_bwd, _ = link_bottlenecks(plan.pair_bytes("bwd"), topology.ranks_per_node)
        nic_bps = topology.ib_gbps * 1e9 * topology.nics_per_node / topology.ranks_per_node
        step_ms = simulate(plan, topology).step_ms
        rows.append({"kind": kind, "P": P, "seed": seed, "solve": name, "ib_fwd_mb": ib_fwd / 1e6,
                     "usp_ib_fwd_mb": usp_fwd / 1e6, "ib_fwd_vs_usp": ib_fwd / usp_fwd,
                     "ib_bwd_mb": ib_bwd / 1e6, "nv_fwd_mb": nv_fwd / 1e6,
                     "ib_step_ms": (ib_fwd + ib_bwd) / nic_bps * 1e3,
                     "imbalance": float(plan.metrics.imbalance), "solve_s": seconds, "step_ms": step_ms,
                     "usp_step_ms": usp_ms, "usp_balanced_step_ms": usp_bal_ms, "step_vs_usp": step_ms / usp_ms,
                     "step_vs_usp_bal": step_ms / usp_bal_ms})
    today, topo = rows
    for r in rows:
        r["ib_vs_today"] = r["ib_step_ms"] / today["ib_step_ms"] if today["ib_step_ms"] else None
        r["solve_vs_today"] = r["solve_s"] / today["solve_s"]
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_sweep_args(p)
    p.add_argument("--seeds", default="0", help="comma-separated mask seeds (default 0)")
    p.add_argument("--json", default=str(RESULTS_DIR / "topology_solve.json"))
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
                rows += measure(kind, P, seed, topology, args.tokens)
                print(markdown_table(rows[-2:], COLUMNS), flush=True)
    print(f"\n## Topology-aware solve vs today's on {topology.name} ({args.tokens} tokens per rank, GQA 64:8, "
          f"D = 128, bf16, mu = 1.10; CPU torch path, 1 thread; IB time simulated: bytes / NIC bandwidth)\n")
    print(markdown_table(rows, COLUMNS))
    topo = [r for r in rows if r["solve"] == "topology"]
    print(f"\nmedians of the topology-aware solve: IB fwd / USP {median([r['ib_fwd_vs_usp'] for r in topo]):.2f}, "
          f"IB step / today {median([r['ib_vs_today'] for r in topo]):.2f}, "
          f"step / USP {median([r['step_vs_usp'] for r in topo]):.2f} (simulated), "
          f"solve time / today {median([r['solve_vs_today'] for r in topo]):.2f}")
    payload = {"benchmark": "topology_solve", "environment": environment(), "topology": args.topology,
               "tokens_per_rank": args.tokens, "rows": rows}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
