"""Relay transport on today's plans: InfiniBand bytes and time, and the simulated step, vs direct and USP.

For each benchmark mask (packed causal and full documents, 8K tokens per rank,
GQA 64:8, D = 128, bf16, mu = 1.10) it solves today's plan once on the CPU
torch path (no topology: the assignment the solver gives today; cached with
``--plan-cache``) and builds it twice on ``h200_hgx`` (nodes of 8, NVLink
450 GB/s, one 50 GB/s NIC per GPU): with direct transport (``ib_relay=False``,
today's plans byte for byte) and with relay transport (``Plan.relay``: each
(unit, remote node) crosses InfiniBand once to the node's rail-aligned relay
and fans out over NVLink; partials merge on the relay before they cross back;
with more than two nodes the rails are matched to the bytes per node pair,
``plan.relay.matched_rails``, the host's rows reaching another rail's NIC over
an NVLink pre-hop).
Per plan, from its own bytes per (source, destination) and hop (``Plan.pair_bytes``):

- IB fwd / bwd MB/GPU: the largest over GPUs of max(sent, received) to and from
  other nodes (one NIC per GPU: the NIC bottleneck);
- USP IB fwd MB/GPU: USP's ring over nodes (its all-to-all stays in a node);
- IB ms (simulated, ideal: bytes / NIC bandwidth, no latency, no overlap): (IB fwd + IB bwd)
  of a training step;
- step ms (simulated): ``gpusolver.sim.simulate`` of the runtime's own op lists (relay hops
  priced on the NIC and NVLink sides), and USP's and load-balanced USP's
  (``simulate_baseline``) on the same shards;
- IB fwd side: whether the forward IB bottleneck is a GPU's send or receive side;
- node floor MB/GPU: the busiest node's forward IB bytes (sent, or received) over its GPUs, the
  least any spreading over a node's NICs could reach with this assignment;
- relayed: the share of inter-node transfer rows (forward, both kinds) that went through a
  relay (the rest went direct: a hull longer than its consumers' rows, or past a relay's capacity).

    python benchmarks/relay_bench.py --plan-cache build/relay_plans     # P = 16, 32, 64; seed 0

With ``--stages S`` (default 4; 1 skips it) a second table gives the SIMULATED training step of the
relay-priced solve's assignment (``SolverConfig(topology=..., ib_relay=True)``; the default at S = 1) built
four ways: one remote stage with direct and with relay transport (a2a), and S sub-stages with
direct and with relay transport (p2p: ``TorchGroup(transport="p2p")``, each rank starting when its
own rows land; and a2a), next to its ideal bound, USP and load-balanced USP (``simulate_baseline``):

    python benchmarks/relay_bench.py --plan-cache build/relay_plans --step-only   # relay_stages.md

With ``--pricing`` it prints only a third table, the price-what-runs check at S sub-stages over p2p
(``--seeds``, default 0): (a) the relay-priced solve's assignment run with direct transport (what
``num_stages="auto"`` did before the solve priced the transport that runs), (b) the direct-priced
solve's run direct (the default now: ``SolverConfig(topology=...)`` prices direct at S > 1) and
(c) the relay-priced solve's run with relay transport (``ib_relay=True``), each with its forward
IB bytes per GPU next to USP's, its IB time and its SIMULATED step next to USP's and load-balanced
USP's:

    python benchmarks/relay_bench.py --plan-cache build/relay_plans --pricing --seeds 0,1   # relay_pricing.md

With ``--balance`` it prints only a fourth table, the imbalance bound at S sub-stages over p2p (direct
transport, the default's at S > 1): (b) mu = 1.10 on the topology (the default before 2026-12-05; the
default across nodes is now 1.05, ``CLUSTER_IMBALANCE_TOL``, chosen from this table), (d)
``imbalance_auto=True`` (one solve per candidate bound, the lowest modelled step kept) and (e) each fixed
bound of ``--balance-tols`` (default 1.05, 1.03), with the SIMULATED step next to USP's and load-balanced
USP's, the plan's imbalance and the CPU solve's wall time (saved with the cached plan); per plan, its forward
IB bytes per GPU over USP's, its IB time and solve time over today's plan's (the same mask solved without
topology), and its busiest rank's compute; per cell, the compute floor (the whole mask's forward plus backward
attention time over P at the topology's rates: no plan's step is below it) over load-balanced USP's step and
over the issue's step target (0.85 / 0.75 / 0.65 x USP at P = 16 / 32 / 64):

    python benchmarks/relay_bench.py --plan-cache build/balance_plans --balance --seeds 0,1   # relay_balance.md

``--balance-relay`` adds relay cases to that table, each solved relay-priced (``ib_relay=True``) and built
with relay transport at S sub-stages: (f) at mu = 1.10, (g) at each bound of ``--balance-tols``:

    python benchmarks/relay_bench.py --plan-cache build/balance_plans --balance --balance-relay \
        --balance-tols 1.05,1.03 --seeds 0,1   # relay_balance.md
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
    RESULTS_DIR, add_cluster_sweep_args, build_as_solved, cached_assignment, cluster_sweep,
    compute_floor_ms, environment, keep_tag, make_mask, markdown_table, median, mu_tag, parse_list, ratio,
    write_results,
)
from topology_solve import link_bottlenecks, usp_ib_fwd  # noqa: E402
from gpusolver.areas import block_areas  # noqa: E402
from gpusolver.capacity import keep_for_budget  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.plan import Plan, status_names  # noqa: E402
from gpusolver.plan.relay import DIRECT, FAN_OUT, SELF  # noqa: E402
from gpusolver.sim import simulate, simulate_baseline  # noqa: E402

COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("transport", "transport", ""),
    ("IB fwd MB/GPU", "ib_fwd_mb", ".1f"), ("USP IB fwd MB/GPU", "usp_ib_fwd_mb", ".1f"),
    ("IB fwd / USP", "ib_fwd_vs_usp", ".2f"), ("IB bwd MB/GPU", "ib_bwd_mb", ".1f"),
    ("NV fwd MB/GPU", "nv_fwd_mb", ".1f"), ("IB ms (sim.)", "ib_ms", ".2f"), ("IB / direct", "ib_vs_direct", ".2f"),
    ("relayed", "relayed", ".2f"), ("IB fwd side", "ib_side", ""), ("node floor MB/GPU", "node_floor_mb", ".1f"),
    ("step ms (sim.)", "step_ms", ".2f"), ("step / direct", "step_vs_direct", ".2f"),
    ("step / USP", "step_vs_usp", ".2f"), ("step / bal. USP", "step_vs_usp_bal", ".2f"),
]


def solved_assignment(kind: str, P: int, seed: int, tokens: int, cache, topology=None, relay_priced=False):
    """The solver's assignment (without topology: today's; with: the topology-aware solve, priced
    for direct transport (``ib_relay=False``, the plans of the default at S > 1) or, with
    ``relay_priced``, for the relay transport (``ib_relay=True``; the prices the default gave every
    S before the solve priced the transport that runs)) and its CPU solve seconds (None when read
    from the cache)."""
    config = SolverConfig(cp_size=P, topology=topology,
                          ib_relay=None if topology is None else bool(relay_priced))
    tag = (("" if topology is None else f"_{topology.name}" + ("_relay" if relay_priced else "")) + mu_tag(config)
           + keep_tag(config, tokens))
    path = None if not cache else Path(cache) / f"{kind}_P{P}_s{seed}_c{tokens}{tag}.pt"
    if path is not None and path.exists():
        return Plan.load(path).assignment, None
    assert topology is None or config.relays == relay_priced
    mask = make_mask(kind, P, seed, tokens_per_rank=tokens)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    return cached_assignment(mask, areas, config, path)


def ib_side_and_floor(pair: torch.Tensor, per_node: int) -> tuple[str, int]:
    """("send" / "recv": the side of the IB bottleneck GPU, the busiest node's IB bytes per GPU)."""
    P = pair.shape[0]
    node = torch.arange(P) // per_node
    m = torch.where(node[:, None] != node[None, :], pair, 0)
    sent, recv = m.sum(1), m.sum(0)
    side = "send" if int(sent.max()) >= int(recv.max()) else "recv"
    per_node_bytes = torch.maximum(sent.view(-1, per_node).sum(1), recv.view(-1, per_node).sum(1))
    return side, int(per_node_bytes.max()) // per_node


def relayed_share(plan) -> float | None:
    """Share of the forward's inter-node transfer rows (QO and KV) that travel by relay."""
    if plan.relay is None:
        return None
    P, L = plan.comm.cp_size, plan.relay.ranks_per_node
    host = plan.comm.unit_host()
    cross = (host[:, None] // L) != (torch.arange(P)[None, :] // L)
    relayed = total = 0
    for kind in ("qo", "kv"):
        rng = plan.comm.qo_range if kind == "qo" else plan.comm.kv_range
        rows = (rng[..., 1] - rng[..., 0]) * cross
        via = plan.relay.route(kind).via
        relayed += int((rows * ((via == FAN_OUT) | (via == SELF))).sum())
        total += int((rows * ((via == DIRECT) | (via == FAN_OUT) | (via == SELF))).sum())
    return relayed / total if total else None


def measure(kind: str, P: int, seed: int, topology, tokens: int, cache, topo_solve: bool) -> list[dict]:
    mask = make_mask(kind, P, seed, tokens_per_rank=tokens)
    base = SolverConfig(cp_size=P)
    asg, solve_s = solved_assignment(kind, P, seed, tokens, cache)
    areas = block_areas(mask, P, base.head_groups, impl="torch")
    usp_fwd = usp_ib_fwd(base, mask.total_seqlen_q, topology.ranks_per_node)
    usp_ms = simulate_baseline("usp", mask, base, topology).step_ms
    usp_bal_ms = simulate_baseline("usp_balanced", mask, base, topology).step_ms
    L = topology.ranks_per_node
    nic_bps = topology.ib_gbps * 1e9 * topology.nics_per_node / L
    rows = []
    cases = [("direct", False, asg), ("relay", True, asg)]
    if topo_solve:
        cases.append(("topo solve + relay", True, solved_assignment(kind, P, seed, tokens, cache, topology)[0]))
        cases.append(("relay solve + relay", True,
                      solved_assignment(kind, P, seed, tokens, cache, topology, relay_priced=True)[0]))
    for name, relay, asg in cases:
        config = replace(base, topology=topology, ib_relay=relay)
        plan = build_as_solved(mask, areas, asg, config)
        assert (plan.relay is not None) == relay
        ib_fwd, nv_fwd = link_bottlenecks(plan.pair_bytes("fwd"), L)
        ib_bwd, _ = link_bottlenecks(plan.pair_bytes("bwd"), L)
        side, floor = ib_side_and_floor(plan.pair_bytes("fwd"), L)
        step_ms = simulate(plan, topology).step_ms
        rows.append({"kind": kind, "P": P, "seed": seed, "transport": name, "ib_fwd_mb": ib_fwd / 1e6,
                     "usp_ib_fwd_mb": usp_fwd / 1e6, "ib_fwd_vs_usp": ib_fwd / usp_fwd, "ib_bwd_mb": ib_bwd / 1e6,
                     "nv_fwd_mb": nv_fwd / 1e6, "ib_ms": (ib_fwd + ib_bwd) / nic_bps * 1e3,
                     "relayed": relayed_share(plan), "ib_side": side, "node_floor_mb": floor / 1e6,
                     "imbalance": float(plan.metrics.imbalance),
                     "step_ms": step_ms, "usp_step_ms": usp_ms, "usp_balanced_step_ms": usp_bal_ms,
                     "step_vs_usp": step_ms / usp_ms, "step_vs_usp_bal": step_ms / usp_bal_ms,
                     "status": int(plan.status), "solve_s": solve_s})
    direct = rows[0]
    for r in rows:
        r["ib_vs_direct"] = r["ib_ms"] / direct["ib_ms"] if direct["ib_ms"] else None
        r["step_vs_direct"] = r["step_ms"] / direct["step_ms"]
    return rows


STEP_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("S", "S", "d"), ("transport", "transport", ""), ("comm", "comm", ""),
    ("step ms (sim.)", "step_ms", ".2f"), ("fwd ms", "fwd_ms", ".2f"), ("bwd ms", "bwd_ms", ".2f"),
    ("ideal ms", "ideal_ms", ".2f"), ("step / ideal", "vs_ideal", ".2f"), ("exposed %", "exposed_pct", ".1f"),
    ("step / bal. USP", "step_vs_usp_bal", ".3f"), ("step / USP", "step_vs_usp", ".3f"),
    ("ideal / bal. USP", "ideal_vs_usp_bal", ".3f"),
]
# (S, relay transport, comm): one remote stage (a2a, as the first table), then S sub-stages
STEP_CASES = ((1, False, "a2a"), (1, True, "a2a"), ("S", False, "a2a"), ("S", False, "p2p"), ("S", True, "a2a"),
              ("S", True, "p2p"))


def step_rows(kind: str, P: int, seed: int, topology, tokens: int, cache, stages: int) -> list[dict]:
    """The simulated step of the relay-priced solve's assignment with and without relay and sub-stages,
    and USP's and load-balanced USP's on the same shards (rows with transport "USP" / "bal. USP")."""
    mask = make_mask(kind, P, seed, tokens_per_rank=tokens)
    base = SolverConfig(cp_size=P)
    asg = solved_assignment(kind, P, seed, tokens, cache, topology, relay_priced=True)[0]
    areas = block_areas(mask, P, base.head_groups, impl="torch")
    usp = simulate_baseline("usp", mask, base, topology)
    bal = simulate_baseline("usp_balanced", mask, base, topology)
    rows, plans = [], {}
    for S, relay, comm in STEP_CASES:
        S = stages if S == "S" else S
        if (S, relay) not in plans:
            plans[S, relay] = build_as_solved(mask, areas, asg, replace(base, topology=topology, ib_relay=relay,
                                                                   num_stages=S))
        plan = plans[S, relay]
        assert (plan.relay is not None) == relay and plan.num_stages == (S if relay or S == 1 else S + 1)  # + the tail
        t = simulate(plan, topology, comm=comm)
        rows.append({"kind": kind, "P": P, "seed": seed, "S": S, "transport": "relay" if relay else "direct",
                     "comm": comm, "step_ms": t.step_ms, "fwd_ms": t.fwd_ms, "bwd_ms": t.bwd_ms,
                     "ideal_ms": t.ideal_ms, "vs_ideal": t.step_ms / t.ideal_ms,
                     "exposed_pct": 100 * t.exposed_comm_ms / t.step_ms, "status": int(plan.status),
                     "imbalance": float(plan.metrics.imbalance)})
    for name, t in (("USP", usp), ("bal. USP", bal)):
        rows.append({"kind": kind, "P": P, "seed": seed, "S": None, "transport": name, "comm": "",
                     "step_ms": t.step_ms, "fwd_ms": t.fwd_ms, "bwd_ms": t.bwd_ms})
    for r in rows:
        r["step_vs_usp"], r["step_vs_usp_bal"] = r["step_ms"] / usp.step_ms, r["step_ms"] / bal.step_ms
        # above 1: no schedule of this plan's FLOPs and bytes reaches load-balanced USP's step
        r["ideal_vs_usp_bal"] = r["ideal_ms"] / bal.step_ms if "ideal_ms" in r else None
    return rows


PRICING_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("seed", "seed", "d"), ("case", "case", ""),
    ("priced", "priced", ""), ("runs", "runs", ""),
    ("step ms (sim.)", "step_ms", ".2f"), ("step / (b)", "step_vs_b", ".3f"),
    ("IB fwd MB/GPU", "ib_fwd_mb", ".1f"), ("USP IB fwd MB/GPU", "usp_ib_fwd_mb", ".1f"),
    ("IB fwd / USP", "ib_fwd_vs_usp", ".2f"), ("IB ms (sim.)", "ib_ms", ".2f"),
    ("exposed %", "exposed_pct", ".1f"), ("imbalance", "imbalance", ".3f"),
    ("step / USP", "step_vs_usp", ".3f"), ("step / bal. USP", "step_vs_usp_bal", ".3f"),
]
# (case, solve priced for relay, plan runs relay): what the default did at S > 1 before this table,
# what it does now, and relay at every sub-stage (ib_relay=True)
PRICING_CASES = (("(a)", True, False), ("(b)", False, False), ("(c)", True, True))


def pricing_rows(kind: str, P: int, seed: int, topology, tokens: int, cache, stages: int) -> list[dict]:
    """The three (priced, runs) cases of ``PRICING_CASES`` at ``stages`` sub-stages over p2p, and
    USP's and load-balanced USP's step on the same shards (SIMULATED)."""
    mask = make_mask(kind, P, seed, tokens_per_rank=tokens)
    base = SolverConfig(cp_size=P)
    areas = block_areas(mask, P, base.head_groups, impl="torch")
    usp = simulate_baseline("usp", mask, base, topology).step_ms
    bal = simulate_baseline("usp_balanced", mask, base, topology).step_ms
    usp_fwd = usp_ib_fwd(base, mask.total_seqlen_q, topology.ranks_per_node)
    L = topology.ranks_per_node
    nic_bps = topology.ib_gbps * 1e9 * topology.nics_per_node / L
    default = SolverConfig(cp_size=P, topology=topology)
    rows = []
    for case, relay_priced, relay_runs in PRICING_CASES:
        asg = solved_assignment(kind, P, seed, tokens, cache, topology, relay_priced=relay_priced)[0]
        config = replace(base, topology=topology, ib_relay=relay_runs, num_stages=stages)
        plan = build_as_solved(mask, areas, asg, config)
        assert (plan.relay is not None) == relay_runs and plan.num_stages == config.plan_stages
        t = simulate(plan, topology, comm="p2p")
        ib_fwd, _ = link_bottlenecks(plan.pair_bytes("fwd"), L)
        ib_bwd, _ = link_bottlenecks(plan.pair_bytes("bwd"), L)
        rows.append({"kind": kind, "P": P, "seed": seed, "S": stages, "case": case,
                     "priced": "relay" if relay_priced else "direct", "runs": "relay" if relay_runs else "direct",
                     # the default config prices (and, at this S, runs) this case's transport
                     "default": default.relays == relay_priced == relay_runs and default.num_stages == stages,
                     "step_ms": t.step_ms, "fwd_ms": t.fwd_ms, "bwd_ms": t.bwd_ms, "ideal_ms": t.ideal_ms,
                     "exposed_pct": 100 * t.exposed_comm_ms / t.step_ms, "ib_fwd_mb": ib_fwd / 1e6,
                     "ib_bwd_mb": ib_bwd / 1e6, "usp_ib_fwd_mb": usp_fwd / 1e6, "ib_fwd_vs_usp": ib_fwd / usp_fwd,
                     "ib_ms": (ib_fwd + ib_bwd) / nic_bps * 1e3, "imbalance": float(plan.metrics.imbalance),
                     "status": int(plan.status), "usp_step_ms": usp, "usp_balanced_step_ms": bal,
                     "step_vs_usp": t.step_ms / usp, "step_vs_usp_bal": t.step_ms / bal})
    b = next(r for r in rows if r["case"] == "(b)")
    for r in rows:
        r["step_vs_b"] = r["step_ms"] / b["step_ms"]
    return rows


BALANCE_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("seed", "seed", "d"), ("case", "case", ""), ("config", "config", ""),
    ("mu", "mu", ".2f"), ("step ms (sim.)", "step_ms", ".2f"), ("step / (b)", "step_vs_b", ".3f"),
    ("step / USP", "step_vs_usp", ".3f"), ("step / bal. USP", "step_vs_usp_bal", ".3f"),
    ("imbalance", "imbalance", ".3f"), ("status", "status_names", ""), ("exposed %", "exposed_pct", ".1f"),
    ("solve s (CPU)", "solve_s", ".1f"), ("solve / (b)", "solve_vs_b", ".2f"),
    ("IB fwd / USP", "ib_fwd_vs_usp", ".2f"), ("IB / today", "ib_vs_today", ".2f"),
    ("solve / today", "solve_vs_today", ".2f"), ("compute ms (sim.)", "compute_ms", ".2f"),
    ("compute floor ms", "floor_ms", ".2f"), ("floor / bal. USP", "floor_vs_usp_bal", ".3f"),
    ("floor / (target x USP)", "floor_vs_target", ".3f"),
]


BALANCE_FLOOR_NOTE = (
    "Targets and floors. IB fwd / USP: the plan's forward InfiniBand bytes per GPU (the largest over GPUs of "
    "max(sent, received) to and from other nodes, `Plan.pair_bytes`) over USP's (its ring over nodes). IB / "
    "today: the plan's IB time ((IB fwd + IB bwd) / NIC bandwidth, ideal) over today's plan's (the same mask "
    "solved without topology, `SolverConfig(cp_size=P)`, built direct at the same S); solve / today: the CPU "
    "solve's wall time over today's solve's (`solve_device(impl=\"torch\")` both; cached with the plan). "
    "compute ms: the plan's busiest rank's simulated attention compute, forward plus backward (`LayerTime."
    "compute_ms`). compute floor ms: the whole mask's forward plus backward attention time at the topology's "
    "rates (`Topology.attn_seconds`, what the simulator prices a compute at) over P: the mean compute per rank. "
    "Every plan's step is at least its busiest rank's compute, which is at least this floor, so a step target "
    "below the floor is unreachable by any plan; load-balanced USP's compute is exactly the floor (every ring "
    "step at the mean area), so floor / bal. USP is the share of its step that is compute. floor / (target x USP): "
    "the floor over the issue's step target, target 0.85 / 0.75 / 0.65 at P = 16 / 32 / 64; above 1.0 no plan "
    "meets the target in that cell. A plan that uses all its imbalance slack has its busiest rank at mu x floor; "
    "compute ms / floor is the plan's achieved imbalance (its max / mean compute), so the step's distance from "
    "the floor splits into that imbalance and the exposed communication.")


def balance_cases(tols, relay: bool = False) -> list[tuple[str, str, dict]]:
    """(case, config label, SolverConfig overrides) of the --balance table: (b) mu = 1.10 with a
    topology (the default before the cluster default became 1.05), (d) the time-aware bound, (e) each
    fixed tighter bound of ``tols``; with ``relay`` also (f) relay transport at mu = 1.10 and (g) relay
    at each bound of ``tols`` (``ib_relay=True``: the relay-priced solve, built relay)."""
    return ([("(b)", "imbalance_tol=1.10", {"imbalance_tol": 1.10}),
             ("(d)", "imbalance_auto=True", {"imbalance_auto": True})]
            + [("(e)", f"imbalance_tol={mu:.2f}", {"imbalance_tol": mu}) for mu in tols]
            + ([("(f)", "relay imbalance_tol=1.10", {"ib_relay": True, "imbalance_tol": 1.10})]
               + [("(g)", f"relay imbalance_tol={mu:.2f}", {"ib_relay": True, "imbalance_tol": mu}) for mu in tols]
               if relay else []))


def timed_solve(areas, config: SolverConfig, path: Path | None):
    """(assignment, the bound it ran at (with ``imbalance_auto``: the one it chose), CPU solve
    seconds). A fresh solve is saved at ``path`` with its seconds, so a rerun from the cache keeps
    the seconds the solve took when it ran (the table's solve column is those)."""
    from gpusolver.solver.device import solve_device

    if path is not None and path.exists():
        saved = torch.load(path)
        return saved["assignment"], saved["imbalance_tol"], saved["solve_s"]
    t0 = time.perf_counter()
    res = solve_device(areas, keep_for_budget(config, areas.rank_tokens), impl="torch")  # priced as solve() prices it
    seconds = time.perf_counter() - t0
    mu = config.imbalance_tol if res.imbalance_tol is None else float(res.imbalance_tol)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"assignment": res.assignment, "imbalance_tol": mu, "solve_s": seconds}, path)
    return res.assignment, mu, seconds


def _sweep(kinds, sizes, seeds, columns, rows_of) -> list[dict]:
    """``rows_of(kind, P, seed)`` over every cell, each cell's table printed as it lands (with its
    wall time): the rows of all cells, in that order."""
    rows = []
    for kind in kinds:
        for P in sizes:
            for seed in seeds:
                t0 = time.perf_counter()
                got = rows_of(kind, P, seed)
                rows += got
                print(markdown_table(got, columns) + f"\n({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def balance_rows(kind: str, P: int, seed: int, topology, tokens: int, cache, stages: int, tols,
                 relay: bool = False) -> list[dict]:
    """mu = 1.10's plan (b) against the time-aware bound (d) and fixed tighter bounds (e),
    each solved on ``topology`` and built (as the default does) with ``stages`` sub-stages and direct
    transport, and with ``relay`` the relay cases (f), (g) built with relay transport, simulated over
    p2p next to USP's and load-balanced USP's step (SIMULATED)."""
    mask = make_mask(kind, P, seed, tokens_per_rank=tokens)
    base = SolverConfig(cp_size=P)
    areas = block_areas(mask, P, base.head_groups, impl="torch")
    usp = simulate_baseline("usp", mask, base, topology).step_ms
    bal = simulate_baseline("usp_balanced", mask, base, topology).step_ms
    # the same mask's mean compute per rank, and the step target at P (None: no target at this P)
    floor, target = compute_floor_ms(areas, base, topology), USP_STEP_TARGETS.get(P)
    usp_fwd = usp_ib_fwd(base, mask.total_seqlen_q, topology.ranks_per_node)
    L = topology.ranks_per_node
    nic_bps = topology.ib_gbps * 1e9 * topology.nics_per_node / L

    def ib_ms(plan) -> tuple[float, float]:  # (forward IB bytes per GPU, (fwd + bwd) IB ms: ideal)
        fwd, bwd = (link_bottlenecks(plan.pair_bytes(phase), L)[0] for phase in ("fwd", "bwd"))
        return fwd, (fwd + bwd) / nic_bps * 1e3

    # today's plan (solved without topology, direct transport), built as the cases are: the IB and solve reference
    today_path = None if not cache else Path(cache) / f"{kind}_P{P}_s{seed}_c{tokens}_today{keep_tag(base, tokens)}.pt"
    today_asg, _, today_s = timed_solve(areas, base, today_path)
    today_ib = ib_ms(build_as_solved(mask, areas, today_asg, replace(base, topology=topology, ib_relay=False,
                                                                num_stages=stages)))[1]
    rows = []
    for case, label, overrides in balance_cases(tols, relay):
        config = SolverConfig(cp_size=P, topology=topology, **overrides)
        tag = ("relay_" if config.ib_relay else "") + ("auto" if config.imbalance_auto else "mu")
        path = None if not cache else Path(cache) / (
            f"{kind}_P{P}_s{seed}_c{tokens}_{topology.name}_bal_{tag}{config.imbalance_tol:.2f}"
            f"{keep_tag(config, tokens)}.pt")
        asg, mu, solve_s = timed_solve(areas, config, path)
        plan = build_as_solved(mask, areas, asg, replace(config, imbalance_tol=mu, imbalance_auto=False,
                                                    num_stages=stages))
        # the default's transport at S > 1: direct (no relay); the relay cases: relay
        assert (plan.relay is not None) == bool(config.ib_relay) and plan.num_stages == replace(
            config, num_stages=stages).plan_stages
        t = simulate(plan, topology, comm="p2p")
        ib_fwd, ib = ib_ms(plan)
        rows.append({"kind": kind, "P": P, "seed": seed, "S": stages, "case": case, "config": label, "mu": mu,
                     "transport": "relay" if plan.relay is not None else "direct",
                     "step_ms": t.step_ms, "fwd_ms": t.fwd_ms, "bwd_ms": t.bwd_ms, "ideal_ms": t.ideal_ms,
                     "exposed_pct": 100 * t.exposed_comm_ms / t.step_ms, "imbalance": float(plan.metrics.imbalance),
                     "status": int(plan.status), "status_names": ",".join(status_names(int(plan.status))) or "ok",
                     "usp_step_ms": usp, "usp_balanced_step_ms": bal,
                     "step_vs_usp": t.step_ms / usp, "step_vs_usp_bal": t.step_ms / bal, "solve_s": solve_s,
                     "ib_fwd_mb": ib_fwd / 1e6, "usp_ib_fwd_mb": usp_fwd / 1e6, "ib_fwd_vs_usp": ib_fwd / usp_fwd,
                     "ib_ms": ib, "today_ib_ms": today_ib, "ib_vs_today": ratio(ib, today_ib),
                     "today_solve_s": today_s, "solve_vs_today": solve_s / today_s,
                     "compute_ms": t.compute_ms, "floor_ms": floor, "usp_target": target,
                     "floor_vs_usp_bal": floor / bal, "floor_vs_target": ratio(floor, None if target is None
                                                                               else target * usp)})
    b = rows[0]
    for r in rows:
        r["step_vs_b"], r["solve_vs_b"] = r["step_ms"] / b["step_ms"], r["solve_s"] / b["solve_s"]
    return rows


def _balance_summary(rows: list[dict]) -> str:
    """Per case: medians of step / bal. USP and of step / (b), the cells at <= 1.0x bal. USP, the solve cost."""
    out = []
    for label in dict.fromkeys(r["config"] for r in rows):
        cells = [r for r in rows if r["config"] == label]
        vs_bal = [r["step_vs_usp_bal"] for r in cells]
        vs_b = [r["step_vs_b"] for r in cells]
        worst = max(cells, key=lambda r: r["step_vs_b"])
        out.append(f"- {cells[0]['case']} {label}: step / bal. USP median {median(vs_bal):.3f} "
                   f"(range {min(vs_bal):.3f}-{max(vs_bal):.3f}), <= 1.0 in {sum(v <= 1 for v in vs_bal)} of "
                   f"{len(cells)} cells; step / (b) median {median(vs_b):.3f} (range {min(vs_b):.3f}-{max(vs_b):.3f}), "
                   f"below (b) in {sum(v < 1 for v in vs_b)}, above 1.02 in {sum(v > 1.02 for v in vs_b)} (worst "
                   f"{worst['kind']} P = {worst['P']} seed {worst['seed']}); step / USP median "
                   f"{median([r['step_vs_usp'] for r in cells]):.3f}; IB fwd / USP median "
                   f"{median([r['ib_fwd_vs_usp'] for r in cells]):.2f}; solve / (b) median "
                   f"{median([r['solve_vs_b'] for r in cells]):.2f}.\n")
        met = [r for r in cells if r["usp_target"] is not None and r["step_vs_usp"] <= r["usp_target"]]
        out.append(f"  Targets: IB fwd <= USP's in {sum(r['ib_fwd_vs_usp'] <= 1 for r in cells)} of {len(cells)} "
                   f"cells (worst {max(r['ib_fwd_vs_usp'] for r in cells):.2f}x); IB time <= 0.4x today's in "
                   f"{sum(r['ib_vs_today'] is not None and r['ib_vs_today'] <= 0.4 for r in cells)} (worst "
                   f"{max((r['ib_vs_today'] or 0) for r in cells):.2f}x); step <= 1.0x bal. USP in "
                   f"{sum(r['step_vs_usp_bal'] <= 1 for r in cells)}, <= target x USP in {len(met)}; solve <= 1.5x "
                   f"today's in {sum(r['solve_vs_today'] <= 1.5 for r in cells)} (median "
                   f"{median([r['solve_vs_today'] for r in cells]):.2f}x); busiest compute / floor median "
                   f"{median([r['compute_ms'] / r['floor_ms'] for r in cells]):.3f}.\n")
    cells = [r for r in rows if r["case"] == "(b)"]  # one row per cell: the floor is the mask's, not the plan's
    fb = [r["floor_vs_usp_bal"] for r in cells]
    ft = [r["floor_vs_target"] for r in cells if r["floor_vs_target"] is not None]
    out.append(f"- compute floor (every cell): floor / bal. USP median {median(fb):.3f} (range {min(fb):.3f}-"
               f"{max(fb):.3f}); floor / (target x USP) above 1.0 (the target below the floor: no plan reaches it) "
               f"in {sum(v > 1 for v in ft)} of {len(ft)} cells (range {min(ft, default=0):.3f}-"
               f"{max(ft, default=0):.3f}).\n")
    return "".join(out)


def _pricing_summary(rows: list[dict]) -> str:
    """Per case: the median and range of step / (b), and the cells where it beats (b)."""
    out = []
    for case, relay_priced, relay_runs in PRICING_CASES:
        cells = [r for r in rows if r["case"] == case]
        vs = [r["step_vs_b"] for r in cells]
        wins = sum(v < 1 for v in vs)
        out.append(f"- {case} priced {'relay' if relay_priced else 'direct'}, runs "
                   f"{'relay' if relay_runs else 'direct'}: step / (b) median {median(vs):.3f} "
                   f"(range {min(vs):.3f}-{max(vs):.3f}), below (b) in {wins} of {len(cells)} cells; "
                   f"step / bal. USP median {median([r['step_vs_usp_bal'] for r in cells]):.3f}, "
                   f"step / USP median {median([r['step_vs_usp'] for r in cells]):.3f}; "
                   f"IB fwd / USP worst {max(r['ib_fwd_vs_usp'] for r in cells):.2f}.\n")
    return "".join(out)


# issue 28's step targets: step <= this x USP's step at P
USP_STEP_TARGETS = {16: 0.85, 32: 0.75, 64: 0.65}


def _step_verdict(rows: list[dict], stages: int) -> str:
    targets = USP_STEP_TARGETS
    out = []
    for transport in ("direct", "relay"):
        for comm in ("p2p", "a2a"):
            cells = [r for r in rows if r["S"] == stages and r["transport"] == transport and r["comm"] == comm]
            if not cells:
                continue
            bal = max(r["step_vs_usp_bal"] for r in cells)
            usp = all(r["step_vs_usp"] <= targets.get(r["P"], 0.65) for r in cells)
            reach = sum(r["ideal_vs_usp_bal"] <= 1 for r in cells)
            out.append(f"- S = {stages} {transport} {comm}: step <= 1.0x load-balanced USP in every cell: "
                       f"{'met' if bal <= 1 else 'not met'} (worst {bal:.3f}x); step <= 0.85 / 0.75 / 0.65x USP at "
                       f"P = 16 / 32 / 64: {'met' if usp else 'not met'}; the plan's ideal bound is <= load-balanced "
                       f"USP's step in {reach} of {len(cells)} cells.\n")
    return "".join(out)


def _verdict(name: str, rows: list[dict]) -> str:
    usp = max(r["ib_fwd_vs_usp"] for r in rows)
    ib = max(r["ib_vs_direct"] for r in rows)
    return (f"- {name}: forward IB bytes per GPU <= USP's in every cell: {'met' if usp <= 1 else 'not met'} "
            f"(worst {usp:.2f}x); IB time <= 0.4x direct: {'met' if ib <= 0.4 else 'not met'} (worst {ib:.2f}x).\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_sweep_args(p)
    p.add_argument("--seed", type=int, default=0, help="mask seed (default 0)")
    p.add_argument("--plan-cache", default=None, help="folder of solved plans (read, and written)")
    p.add_argument("--no-topology-solve", action="store_true",
                   help="skip the third row (the topology-aware solve's assignment with relay transport)")
    p.add_argument("--json", default=str(RESULTS_DIR / "relay_bench.json"))
    p.add_argument("--md", default=str(RESULTS_DIR / "relay_bench.md"))
    p.add_argument("--stages", type=int, default=4, help="sub-stages of the step table (default 4; 1: no table)")
    p.add_argument("--step-only", action="store_true", help="only the step table (relay with sub-stages)")
    p.add_argument("--stages-json", default=str(RESULTS_DIR / "relay_stages.json"))
    p.add_argument("--stages-md", default=str(RESULTS_DIR / "relay_stages.md"))
    p.add_argument("--pricing", action="store_true",
                   help="only the price-what-runs table at --stages sub-stages over p2p (relay_pricing.md)")
    p.add_argument("--seeds", default="0", help="mask seeds of the --pricing table (default 0)")
    p.add_argument("--pricing-json", default=str(RESULTS_DIR / "relay_pricing.json"))
    p.add_argument("--pricing-md", default=str(RESULTS_DIR / "relay_pricing.md"))
    p.add_argument("--balance", action="store_true",
                   help="only the imbalance-bound table at --stages sub-stages over p2p: mu = 1.10 (b), "
                        "imbalance_auto=True (d), fixed --balance-tols (e) (relay_balance.md)")
    p.add_argument("--balance-tols", default="1.05,1.03", help="the fixed bounds (e) of --balance (default 1.05,1.03)")
    p.add_argument("--balance-relay", action="store_true",
                   help="with --balance: add relay transport (ib_relay=True) at mu = 1.10 (f) and at each "
                        "--balance-tols bound (g)")
    p.add_argument("--balance-json", default=str(RESULTS_DIR / "relay_balance.json"))
    p.add_argument("--balance-md", default=str(RESULTS_DIR / "relay_balance.md"))
    args = p.parse_args(argv)
    sizes, kinds, topology = cluster_sweep(p, args)
    if args.stages < 1:
        p.error(f"--stages must be >= 1, got {args.stages}")
    torch.set_num_threads(1)
    cmd = "python benchmarks/relay_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.balance_relay and not args.balance:
        p.error("--balance-relay adds cases to the --balance table: give --balance")
    if args.pricing or args.balance:
        if args.pricing and args.balance:
            p.error("--pricing and --balance are two tables: give one of them")
        if args.stages < 2:
            p.error(f"--{'pricing' if args.pricing else 'balance'} needs --stages >= 2 (the sub-stages of the "
                    f"default's plans), got {args.stages}")
        try:
            seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            p.error(f"--seeds must be comma-separated ints, got {args.seeds!r}")
        if not seeds or any(x < 0 for x in seeds):
            p.error(f"--seeds must list seeds >= 0, got {args.seeds!r}")
    if args.balance:
        try:
            tols = parse_list(args.balance_tols, float, name="--balance-tols")
        except ValueError as e:
            p.error(str(e))
        if any(not 1.0 <= mu < SolverConfig(cp_size=2).imbalance_tol for mu in tols):
            p.error(f"--balance-tols must be in [1.0, the default imbalance_tol), got {args.balance_tols!r}")
        got_rows = _sweep(kinds, sizes, seeds, BALANCE_COLUMNS, lambda kind, P, seed: balance_rows(
            kind, P, seed, topology, args.tokens, args.plan_cache, args.stages, tols, args.balance_relay))
        text = (f"# The imbalance bound: mu = 1.10 against tighter bounds at S = {args.stages} over p2p "
                f"({topology.name}, SIMULATED)\n\n"
                f"Packed causal and full documents, seeds {', '.join(map(str, seeds))}, {args.tokens} tokens per rank, "
                "GQA 64:8, D = 128, bf16, nodes of 8, S sub-stages, p2p (`TorchGroup(transport=\"p2p\")`), direct "
                "transport (the default's at S > 1) unless the case says relay. Every case is solved on the topology "
                "(CPU torch path, `solve_device(impl=\"torch\")`): (b) `SolverConfig(topology=..., imbalance_tol=1.10)` "
                "(the default before the default across nodes became `CLUSTER_IMBALANCE_TOL` = 1.05, from this table); "
                "(d) `imbalance_auto=True` (one solve per candidate bound 1.10, 1.06, 1.04, 1.02; the plan of the "
                "lowest modelled step kept; mu: the bound it chose); (e) a fixed tighter `imbalance_tol`"
                + ("; (f) relay: `SolverConfig(topology=..., ib_relay=True)` (the relay-priced solve, mu = 1.10), "
                   "built with relay transport (inter-node rows cross IB once per node and fan out over NVLink); "
                   "(g) relay at a fixed tighter `imbalance_tol`" if args.balance_relay else "")
                + ". imbalance: "
                "the plan's max / mean compute; status: the plan's flags (IMBALANCED: above the bound it ran at). Every time is simulated by `gpusolver.sim` (the runtime's own op "
                "lists, priced), not measured; USP and bal. USP: `simulate_baseline` on the same shards. solve s: the "
                "wall time of the CPU solve when it ran (kept with the cached plan; other jobs shared the machine's "
                "2 cores, so take the ratios as rough). Command: `PYTHONPATH=. " + cmd + "`.\n\n"
                + markdown_table(got_rows, BALANCE_COLUMNS) + "\n\n" + BALANCE_FLOOR_NOTE + "\n\n"
                + _balance_summary(got_rows))
        print("\n" + text)
        write_results(args.balance_json, {"environment": environment(), "rows": got_rows}, args.balance_md, text)
        return {"balance": got_rows}
    if args.pricing:
        prices = _sweep(kinds, sizes, seeds, PRICING_COLUMNS, lambda kind, P, seed: pricing_rows(
            kind, P, seed, topology, args.tokens, args.plan_cache, args.stages))
        text = (f"# Price what runs: the solve's transport at S = {args.stages} over p2p ({topology.name}, SIMULATED)\n\n"
                f"Packed causal and full documents, seeds {', '.join(map(str, seeds))}, {args.tokens} tokens per rank, "
                "GQA 64:8, D = 128, bf16, mu = 1.10, nodes of 8, S sub-stages, p2p (`TorchGroup(transport=\"p2p\")`). "
                "(a) the relay-priced solve's assignment (`ib_relay=True` prices) run with direct transport: what "
                "`num_stages=\"auto\"` gave before the solve priced the transport that runs; (b) the direct-priced "
                "solve's (`ib_relay=False` prices: the default's now) run direct; (c) the relay-priced solve's run "
                "with relay (`ib_relay=True`). IB fwd MB/GPU: the largest over GPUs of max(sent, received) to and "
                "from other nodes (`Plan.pair_bytes`); USP's: its ring over nodes; IB ms: (IB fwd + IB bwd) / NIC "
                "bandwidth, ideal. Every time is simulated by `gpusolver.sim` (the runtime's own op lists, priced), "
                "not measured; USP and bal. USP: `simulate_baseline` on the same shards. "
                "Command: `PYTHONPATH=. " + cmd + "`.\n\n"
                + markdown_table(prices, PRICING_COLUMNS) + "\n\n" + _pricing_summary(prices))
        print("\n" + text)
        write_results(args.pricing_json, {"environment": environment(), "rows": prices}, args.pricing_md, text)
        return {"pricing": prices}
    steps = []
    if args.stages > 1:
        for kind in kinds:
            for P in sizes:
                got = step_rows(kind, P, args.seed, topology, args.tokens, args.plan_cache, args.stages)
                steps += got
                print(markdown_table(got, STEP_COLUMNS), flush=True)
        text = (f"# Relay transport with sub-stages: the training step ({topology.name}, SIMULATED)\n\n"
                f"Packed causal and full documents, seed {args.seed}, {args.tokens} tokens per rank, GQA 64:8, "
                f"D = 128, bf16, mu = {SolverConfig(cp_size=16, topology=topology).imbalance_tol:.2f} (the default "
                "across nodes), nodes of 8. One assignment per cell: the relay-priced solve's "
                "(`SolverConfig(topology=..., ib_relay=True)`), built with one remote stage (S = 1) and with S sub-stages, "
                "direct (`ib_relay=False`) or relay transport. Every time is simulated by `gpusolver.sim` "
                "(the runtime's own op lists, priced), not measured. comm: a2a, every collective an "
                "all-to-all-v; p2p, `TorchGroup(transport=\"p2p\")`. USP and bal. USP: "
                "`simulate_baseline` on the same shards. Command: `PYTHONPATH=. " + cmd + "`.\n\n"
                + markdown_table(steps, STEP_COLUMNS) + "\n\n" + _step_verdict(steps, args.stages))
        print("\n" + text)
        write_results(args.stages_json, {"environment": environment(), "rows": steps}, args.stages_md, text)
    if args.step_only:
        return {"steps": steps}
    rows = []
    for kind in kinds:
        for P in sizes:
            got = measure(kind, P, args.seed, topology, args.tokens, args.plan_cache, not args.no_topology_solve)
            rows += got
            print(markdown_table(got, COLUMNS), flush=True)
    relay = [r for r in rows if r["transport"] != "direct"]
    text = (f"# Relay transport on today's plans ({topology.name})\n\n"
            f"Packed causal and full documents, seed {args.seed}, {args.tokens} tokens per rank, GQA 64:8, D = 128, "
            "bf16, mu = 1.10; today's assignment (solved without topology), built with direct and with relay "
            "transport, and the topology-aware solve's assignment (`SolverConfig(topology=..., ib_relay=False)`, "
            "which prices direct transport) built with relay, and the relay-priced solve's "
            "(`SolverConfig(topology=..., ib_relay=True)`, the default's prices at S = 1) built with relay. With more than two nodes a relay plan matches its hosts' "
            "crossings to rails per node pair (`plan.relay.matched_rails`, egress pre-hop over NVLink). "
            "IB ms and step ms are simulated (`gpusolver.sim`; IB ms: ideal bytes / NIC bandwidth). "
            "Command: `python benchmarks/relay_bench.py --plan-cache build/relay_plans`.\n\n"
            + markdown_table(rows, COLUMNS) + "\n\n"
            + "".join(_verdict(name, [r for r in relay if r["transport"] == name])
                      for name in dict.fromkeys(r["transport"] for r in relay)))
    print("\n" + text)
    write_results(args.json, {"environment": environment(), "rows": rows}, args.md, text)
    return {"rows": rows, "steps": steps}


if __name__ == "__main__":
    main()
