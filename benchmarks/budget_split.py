"""How to spend the memory budget's room: Q first, K and V first, or each rank by its own fills.

SIMULATED (``gpusolver.sim`` on ``h200_hgx``, point-to-point), not measured. For each benchmark mask
(packed causal and full documents, 8K tokens per rank, 64:8, D = 128, bf16, the default S) the plan
is solved once with everything kept, which is also the budget's solve (a kind kept in part is priced
as kept, ``CommCost``), and its step is simulated with the backward of three ways to keep the room
of the default budget (1.5x plain attention: 1.13 G·c of Q rows, or 4.53 G·c of K, V rows):

- ``Q first``: the first 1.13 G·c of the QO buffer kept on every rank, K and V cast again
  (``kept_q_rows`` alone);
- ``KV first``: the first 4.53 G·c of the KV buffer kept on every rank, Q cast again;
- ``per rank``: each rank keeps its Q rows up to the room, then its K, V rows in the room left
  (``kept_per_rank``, what ``capacity.keep_for_budget`` resolves the default budget to), so only a
  rank whose own fills pass the room casts anything again.

Every ratio is over keeping everything on the same plan.

    python benchmarks/budget_split.py --cluster --P 16,32,64
    python benchmarks/budget_split.py --P 8,16,32,64
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpusolver import solve  # noqa: E402
from gpusolver.capacity import keep_for_budget  # noqa: E402
from gpusolver.sim import simulate  # noqa: E402
from gpusolver.topology import Topology  # noqa: E402
from layer_memory import REAL, make_config, make_mask  # noqa: E402
from _common import parse_list  # noqa: E402


def run_cell(kind: str, P: int, seed: int, cluster: bool, topo: Topology) -> dict:
    c = REAL["tokens_per_rank"]
    mask = make_mask(kind, P, seed, c)
    config = make_config(P, REAL, True, None, None, "auto", cluster=topo.name if cluster else None)
    plan = solve(mask, config)
    budget = keep_for_budget(config.replaced(memory_budget=1.5), c)
    assert budget.kept_per_rank and budget.kept_kv_rows == 0, "the default budget's room is Q rows alone"
    room_q = budget.kept_q_rows  # the default budget's room in Q rows
    cost = config.cost()
    q_per_kv = cost.q_fwd // cost.kv_fwd
    keep_ms = simulate(plan, topo, comm="p2p").step_ms
    gc = config.head_groups * c
    row = {"kind": kind, "P": P, "seed": seed, "q_fill": float(plan.comm.qo_recv_rows.max()) / gc,
           "kv_fill": float(plan.comm.kv_recv_rows.max()) / gc}
    for name, rows in (("q_first", dict(kept_q_rows=room_q, kept_kv_rows=0)),
                       ("kv_first", dict(kept_q_rows=0, kept_kv_rows=room_q * q_per_kv)),
                       ("per_rank", dict(kept_q_rows=room_q, kept_kv_rows=0, kept_per_rank=True))):
        split = config.replaced(memory_budget=None, **rows).cost()
        row[name] = simulate(plan, topo, cost=split, comm="p2p").step_ms / keep_ms
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--P", default="16,32,64")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--kinds", default="causal,full")
    p.add_argument("--cluster", action="store_true", help="solve on the topology (a cluster user's default)")
    p.add_argument("--topology", default="h200_hgx")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    topo = Topology.preset(args.topology)
    rows = []
    print(f"SIMULATED on {topo.name}, p2p; solved {'on the topology' if args.cluster else 'without a topology'}; "
          "step over keeping everything on the same plan")
    print("| kind | P | seed | QO fill (G·c) | KV fill (G·c) | Q first | KV first | per rank |")
    print("|:---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in parse_list(args.kinds, str, name="--kinds"):
        for P in parse_list(args.P, name="--P"):
            for seed in parse_list(args.seeds, name="--seeds", minimum=0):
                r = run_cell(kind, P, seed, args.cluster, topo)
                rows.append(r)
                print(f"| {kind} | {P} | {seed} | {r['q_fill']:.2f} | {r['kv_fill']:.2f} | {r['q_first']:.3f} | "
                      f"{r['kv_first']:.3f} | {r['per_rank']:.3f} |", flush=True)
    for name in ("q_first", "kv_first", "per_rank"):
        v = [r[name] for r in rows]
        print(f"{name}: median {statistics.median(v):.3f}, max {max(v):.3f}, "
              f"{sum(x <= 1.03 for x in v)} of {len(v)} within 3 % (simulated)")
    return rows


if __name__ == "__main__":
    main()
