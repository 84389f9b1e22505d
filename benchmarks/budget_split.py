"""How to spend the memory budget's room: Q first, K and V first, or each rank by its own fills (a what-if).

SIMULATED (``gpusolver.sim`` on ``h200_hgx``, point-to-point), not measured. For each benchmark mask
(packed causal and full documents, 8K tokens per rank, 64:8, D = 128, bf16, the default S) the plan
is solved once with everything kept, which is also the budget's solve (a kind kept in part is priced
as kept, ``CommCost``), and its step is simulated with the backward of three ways to keep the room
of the default budget (1.5x plain attention: 1.13 G·c of Q rows, or 4.53 G·c of K, V rows):

- ``Q first``: the first 1.13 G·c of the QO buffer kept, K and V cast again (the default,
  ``capacity.PREFIX_ORDER``);
- ``KV first``: the first 4.53 G·c of the KV buffer kept, Q cast again;
- ``per rank``: each rank keeps its Q rows up to the room, then its K, V rows in the room left,
  so only a rank whose own fills pass the room casts anything again. Not built: priced here by
  replacing ``schedule.tail_first_row`` with the per-rank first rows for the duration of one
  simulation (the tails, ``plan.pair_bytes`` and the simulator are otherwise the library's).

Every ratio is over keeping everything on the same plan.

    python benchmarks/budget_split.py --cluster --P 16,32,64
    python benchmarks/budget_split.py --P 8,16,32,64
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gpusolver.plan.schedule as schedule  # noqa: E402
from gpusolver import solve  # noqa: E402
from gpusolver.capacity import keep_for_budget  # noqa: E402
from gpusolver.sim import simulate  # noqa: E402
from gpusolver.topology import Topology  # noqa: E402
from layer_memory import REAL, make_config, make_mask  # noqa: E402
from _common import parse_list  # noqa: E402


def per_rank_first_rows(plan, room_q: int, q_per_kv: int):
    """``tail_first_row`` for kept rows per rank: ``kq = min(fill_q, room_q)`` Q rows, then
    ``kk = min(fill_kv, (room_q - kq) * q_per_kv)`` K, V rows (``q_per_kv``: K, V rows per Q row's bytes)."""
    fill_q, fill_kv = plan.comm.qo_recv_rows.long(), plan.comm.kv_recv_rows.long()
    kept_q = fill_q.clamp(max=room_q)
    kept = {"qo": kept_q, "kv": torch.minimum(fill_kv, (room_q - kept_q) * q_per_kv)}

    def first_row(plan_, op, kept_rows):
        rows = kept[op.route]
        if getattr(plan_.comm, "num_stages", 1) == 1:
            return rows
        (s,) = op.stages
        return (rows - plan_.comm.stage_base(op.route)[s - 1]).clamp(min=0)
    return first_row


def run_cell(kind: str, P: int, seed: int, cluster: bool, topo: Topology) -> dict:
    c = REAL["tokens_per_rank"]
    mask = make_mask(kind, P, seed, c)
    config = make_config(P, REAL, True, None, None, "auto", cluster=topo.name if cluster else None)
    plan = solve(mask, config)
    budget = keep_for_budget(config.replaced(memory_budget=1.5), c)
    room_q = budget.kept_q_rows  # the default budget's Q rows: the room in Q rows
    cost = config.cost()
    q_per_kv = cost.q_fwd // cost.kv_fwd
    keep_ms = simulate(plan, topo, comm="p2p").step_ms
    gc = config.head_groups * c
    row = {"kind": kind, "P": P, "seed": seed, "q_fill": float(plan.comm.qo_recv_rows.max()) / gc,
           "kv_fill": float(plan.comm.kv_recv_rows.max()) / gc}
    for name, rows in (("q_first", dict(kept_q_rows=room_q, kept_kv_rows=0)),
                       ("kv_first", dict(kept_q_rows=0, kept_kv_rows=room_q * q_per_kv))):
        split = config.replaced(memory_budget=None, **rows).cost()
        row[name] = simulate(plan, topo, cost=split, comm="p2p").step_ms / keep_ms
    split = config.replaced(memory_budget=None, kept_q_rows=room_q, kept_kv_rows=0).cost()
    with mock.patch.object(schedule, "tail_first_row", per_rank_first_rows(plan, room_q, q_per_kv)):
        row["per_rank"] = simulate(plan, topo, cost=split, comm="p2p").step_ms / keep_ms
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
