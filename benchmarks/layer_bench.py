"""Layer benchmark: one attention layer's time on a cluster (SIMULATED), bytes, and buffers, next to USP.

Masks: the quality benchmark's (packed causal / full documents drawn from the
length histogram, ``--tokens-per-rank`` 8K), GQA Hq:Hkv = 64:8, D = 128, bf16,
G = 8 head groups, ``SolverConfig``'s defaults as a cluster user runs them: solved on
``--topology`` (``SolverConfig(topology=...)``: bytes priced by link class, mu = 1.05 where the
group spans nodes, 1.10 inside one), S = 4 sub-stages, run over ``TorchGroup``'s default
point-to-point transport (``--comm``). Per (kind, P, seed):

    solve ms     block areas + device solve + plan build (``gpusolver.solve``'s
                 path without validation), torch path on CPU, one thread
                 (blank when the plan came from ``--plan-cache``)
    fwd / bwd MB bottleneck bytes per rank, ``max_r max(send_r, recv_r)``, of
                 the plan (what its layer moves, ``plan.pair_bytes``: the backward
                 of the default memory budget, what it casts again included), of
                 USP and of ring attention for the same mask (10^6 B)
    sim ms       SIMULATED layer time (``gpusolver.sim``, not measured):
                 forward, backward and training step (their sum) of the plan
                 run by the runtime's own schedule (over ``--comm``), of USP and of a
                 load-balanced USP on the same sequential shards, and the
                 plan's ideal bound; hidden %: the share of the plan's
                 communication time that runs under compute
    IB / USP     InfiniBand bytes of the busiest NIC side over a step, ours / USP's
    fill         the largest QO / KV receive and send rows of the plan, as a
                 multiple of G * c: what sizes the default receive capacity
                 (``plan_capacities``); with ``--tiles 1,2,4`` also for tiled plans

Then, per P, the receive-buffer memory per rank at the default capacity and
at the old worst case ``G * c * (P - 1)``; a small real run of the layer
through ``dist_attn`` on ``LocalGroup`` (CPU), whose byte counters must equal
the plan's per-phase bytes (``plan.pair_bytes``); and, on a GPU only, each
rank's attention time of both stages at the real shapes next to the
simulator's compute.

The simulator: ``--topology`` (default ``h200_hgx``: nodes of 8, NVLink 450
GB/s per direction per GPU, one 50 GB/s InfiniBand NIC per GPU, attention at
400 TFLOP/s forward with 4·D FLOPs per (q, k) entry per query head, 2.5x
backward). See ``gpusolver.sim`` for what it models.

    python benchmarks/layer_bench.py                           # P = 8,16,32,64, 3 seeds
    python benchmarks/layer_bench.py --P 8 --seeds 1 --tokens-per-rank 1024
    python benchmarks/layer_bench.py --plan-cache build/sim_plans \
        --md benchmarks/results/layer_bench.md                 # the committed results
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, run as a script or loaded by path

from _common import (  # noqa: E402
    KINDS, PACKED_KINDS, RESULTS_DIR, TOKENS_PER_RANK, build_as_solved, cached_assignment, cuda_time, environment,
    make_mask, markdown_table, median, parse_list, plan_cache_path, write_results,
)
from gpusolver.areas import block_areas  # noqa: E402
from gpusolver.baselines import baseline_table  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.capacity import BufferRows  # noqa: E402
from gpusolver.plan import BUFFER_OVERFLOW, plan_capacities  # noqa: E402
from gpusolver.plan.comm_meta import build_comm_meta  # noqa: E402
from gpusolver.plan.schedule import PHASES, stage_area  # noqa: E402
from gpusolver.sim import simulate, simulate_baseline  # noqa: E402
from gpusolver.sim.engine import COMM_MODES  # noqa: E402
from gpusolver.solve import solve, solve_assignment  # noqa: E402
from gpusolver.topology import PRESETS, Topology  # noqa: E402

FULL_P, FULL_SEEDS = (8, 16, 32, 64), 3
TOPOLOGY = "h200_hgx"
MB, GB = 1e6, 1e9
# the small real run (P and tokens per rank are options): shapes the CPU torch path handles in seconds
REAL = {"P": 8, "tokens_per_rank": 256, "num_heads_q": 8, "num_heads_kv": 2, "head_dim": 32, "dtype": torch.float32}

RUN_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("seed", "seed", "d"), ("solve ms", "solve_ms", ".0f"),
    ("imbalance", "imbalance", ".3f"),
    ("fwd MB", "fwd_mb", ".1f"), ("USP fwd", "usp_fwd_mb", ".1f"), ("ring fwd", "ring_fwd_mb", ".1f"),
    ("bwd MB", "bwd_mb", ".1f"), ("USP bwd", "usp_bwd_mb", ".1f"), ("ring bwd", "ring_bwd_mb", ".1f"),
]
SIM_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("runs", "runs", "d"),
    ("fwd ms", "sim_fwd_ms", ".2f"), ("bwd ms", "sim_bwd_ms", ".2f"), ("step ms", "sim_step_ms", ".2f"),
    ("USP fwd", "usp_fwd_ms", ".2f"), ("USP bwd", "usp_bwd_ms", ".2f"), ("USP step", "usp_step_ms", ".2f"),
    ("bal. USP fwd", "usp_bal_fwd_ms", ".2f"), ("bal. USP bwd", "usp_bal_bwd_ms", ".2f"),
    ("bal. USP step", "usp_bal_step_ms", ".2f"),
    ("ideal fwd", "ideal_fwd_ms", ".2f"), ("ideal bwd", "ideal_bwd_ms", ".2f"), ("ideal step", "ideal_step_ms", ".2f"),
    ("step / USP", "step_vs_usp", ".2f"), ("step / bal. USP", "step_vs_usp_bal", ".2f"),
    ("step / ideal", "step_vs_ideal", ".2f"), ("hidden %", "hidden_pct", ".0f"),
    ("compute ms", "compute_ms", ".2f"), ("stage 0 %", "stage0_pct", ".0f"), ("IB / USP", "ib_vs_usp", ".2f"),
]
SUMMARY_COLUMNS = [("kind", "kind", ""), ("P", "P", "d"), ("runs", "runs", "d")] + RUN_COLUMNS[3:]
FILL_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("tiles", "tiles", "d"), ("runs", "runs", "d"),
    ("QO recv", "qo_recv", ".2f"), ("KV recv", "kv_recv", ".2f"), ("QO send", "qo_send", ".2f"),
    ("KV send", "kv_send", ".2f"), ("QO recv cap", "qo_recv_cap", ".1f"), ("KV recv cap", "kv_recv_cap", ".1f"),
    ("QO send cap", "qo_send_cap", ".1f"), ("KV send cap", "kv_send_cap", ".1f"),
    ("worst", "worst", ".0f"), ("fits", "fits", ""),
]
CAP_KEYS = ("qo_recv", "kv_recv", "qo_send", "kv_send")  # BufferRows order
MEMORY_COLUMNS = [
    ("P", "P", "d"), ("capacity", "capacity", ""), ("keep", "keep", ""), ("QO recv rows", "qo_recv_rows", "d"),
    ("KV recv rows", "kv_recv_rows", "d"), ("QO send rows", "qo_send_rows", "d"),
    ("KV send rows", "kv_send_rows", "d"), ("fwd GB", "fwd_gb", ".2f"), ("bwd GB", "bwd_gb", ".2f"),
    ("held GB", "held_gb", ".2f"), ("peak GB", "peak_gb", ".2f"),
]
REAL_COLUMNS = [
    ("kind", "kind", ""), ("keep", "keep", ""), ("P", "P", "d"), ("tokens/rank", "tokens_per_rank", "d"),
    ("Hq:Hkv", "heads", ""), ("D", "head_dim", "d"), ("max recv rows", "recv_capacity", "d"),
    ("counted = metrics", "bytes_match", ""),
    ("fwd MB", "fwd_mb", ".3f"), ("bwd MB", "bwd_mb", ".3f"), ("fwd+bwd ms (CPU)", "wall_ms", ".0f"),
]
GPU_COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"),
    ("stage 0 fwd ms", "s0_fwd_ms", ".3f"), ("stage 1 fwd ms", "s1_fwd_ms", ".3f"), ("fwd ms", "fwd_ms", ".3f"), ("stage 0 bwd ms", "s0_bwd_ms", ".3f"), ("stage 1 bwd ms", "s1_bwd_ms", ".3f"),
    ("bwd ms", "bwd_ms", ".3f"), ("simulated compute fwd ms", "sim_compute_fwd_ms", ".3f"),
]


# -- simulated layer time -------------------------------------------------------------------------

def ib_bytes(pass_times, topo: Topology) -> int:
    """InfiniBand bytes of the busiest NIC side (send or receive) over the given passes."""
    load: dict = {}
    for pt in pass_times:
        for s, row in enumerate(pt.pair_bytes):
            for d, b in enumerate(row):
                if b and not topo.same_node(s, d):
                    for side, nic, _ in topo.link_sides(s, d):
                        if side.startswith("ib"):
                            load[side, nic] = load.get((side, nic), 0) + b
    return max(load.values(), default=0)


def simulated(plan, mask, config: SolverConfig, topo: Topology, comm: str = "p2p") -> dict:
    """The row's simulated figures (ms): ours (over ``comm``), USP, balanced USP, the ideal bound, and ratios."""
    areas = block_areas(mask, config.cp_size, 1, impl="torch")
    ours = simulate(plan, topo, comm=comm)
    usp = simulate_baseline("usp", mask, config, topo, areas=areas)
    bal = simulate_baseline("usp_balanced", mask, config, topo, areas=areas)
    sa = stage_area(plan)
    ib_usp = ib_bytes((usp.fwd, usp.bwd), topo)
    row = {"sim_fwd_ms": ours.fwd_ms, "sim_bwd_ms": ours.bwd_ms, "sim_step_ms": ours.step_ms,
           "ideal_fwd_ms": ours.fwd.ideal_ms, "ideal_bwd_ms": ours.bwd.ideal_ms, "ideal_step_ms": ours.ideal_ms,
           "compute_ms": ours.compute_ms, "compute_fwd_ms": ours.fwd.compute_ms,
           "compute_bwd_ms": ours.bwd.compute_ms, "exposed_comm_ms": ours.exposed_comm_ms,
           "hidden_pct": 100.0 * ours.hidden_share,
           "stage0_pct": 100.0 * float(sa[:, 0].sum()) / max(float(sa.sum()), 1.0),
           "ib_bytes": ib_bytes((ours.fwd, ours.bwd), topo), "usp_ib_bytes": ib_usp}
    for name, t in (("usp", usp), ("usp_bal", bal)):
        row.update({f"{name}_fwd_ms": t.fwd_ms, f"{name}_bwd_ms": t.bwd_ms, f"{name}_step_ms": t.step_ms,
                    f"{name}_hidden_pct": 100.0 * t.hidden_share})
    row["step_vs_usp"] = ours.step_ms / usp.step_ms
    row["step_vs_usp_bal"] = ours.step_ms / bal.step_ms
    row["step_vs_ideal"] = ours.step_ms / ours.ideal_ms
    row["ib_vs_usp"] = row["ib_bytes"] / ib_usp if ib_usp else None
    return row


# -- capacity: fill and memory ---------------------------------------------------------------------

def comm_fill(comm, head_groups: int) -> dict:
    """Largest QO / KV receive and send rows of a CommMeta, as multiples of G * c."""
    unit = head_groups * comm.chunk
    f = lambda t: float(t.max()) / unit  # noqa: E731
    return {"qo_recv": f(comm.qo_recv_rows), "kv_recv": f(comm.kv_recv_rows),
            "qo_send": f(comm.qo_split.sum(1)), "kv_send": f(comm.kv_split.sum(1))}


def buffer_memory(config: SolverConfig, chunk: int, rows: BufferRows) -> dict:
    """Bytes per rank of the capacity-sized collective buffers of one layer.

    fwd:  Q, K, V receive buffers (``rows``' QO and KV receive rows) and the QO
          send-capacity buffer the partial O and lse come back into.
    bwd:  dO, lse, delta receive buffers; Q, K, V (kept from the forward, or cast again);
          the send-capacity buffers partial dQ and dK, dV come back into.
    held: what stays allocated from a layer's forward to its backward: the kept Q, K, V
          with ``keep_forward_buffers``, nothing without (a model holds one per layer).
    peak: the larger pass. Not counted: the runtime's stage-1 copies (local rows
          concatenated with the buffer) and partial outputs over received rows, which
          scale with the capacity as well.
    """
    cost = config.cost()
    hq, D, b = cost.hq, config.head_dim, config.dtype_bytes
    q, kv = rows.qo_recv * cost.q_fwd, rows.kv_recv * cost.kv_fwd
    fwd = q + kv + rows.qo_send * cost.o_fwd
    bwd = rows.qo_recv * hq * (D * b + 8) + q + kv + rows.qo_send * hq * D * b + rows.kv_send * cost.kv_fwd
    held = q + kv if config.keep_forward_buffers else 0
    return {"fwd": fwd, "bwd": bwd, "held": held, "peak": max(fwd, bwd)}


def memory_rows(cp_sizes, tokens_per_rank: int, topology=None) -> list[dict]:
    rows = []
    for P in cp_sizes:
        for keep in (True, False):
            config = SolverConfig(cp_size=P, keep_forward_buffers=keep, topology=topology)
            G, c = config.head_groups, tokens_per_rank
            _, default = plan_capacities(config, 1, c)
            worst = G * c * (P - 1)
            for label, b in (("default", default), ("worst case", BufferRows(worst, worst, worst, worst))):
                m = buffer_memory(config, c, b)
                rows.append({"P": P, "capacity": label, "keep": keep, **{f"{k}_rows": v for k, v in
                                                                         zip(CAP_KEYS, b.as_tuple())},
                             **{f"{k}_gb": v / GB for k, v in m.items()}})
    return rows


def fill_summary(fills: list[dict], tokens_per_rank: int, topology=None) -> list[dict]:
    """Max fill per (kind, P, tiles) next to the default capacities on ``topology`` (multiples of G * c)."""
    out = []
    for key in dict.fromkeys((f["kind"], f["P"], f["tiles"]) for f in fills):
        fs = [f for f in fills if (f["kind"], f["P"], f["tiles"]) == key]
        config = SolverConfig(cp_size=key[1], topology=topology)
        unit = config.head_groups * tokens_per_rank
        _, caps = plan_capacities(config, 1, tokens_per_rank)
        row = {"kind": key[0], "P": key[1], "tiles": key[2], "runs": len(fs),
               **{k: max(f[k] for f in fs) for k in CAP_KEYS},
               **{f"{k}_cap": v / unit for k, v in zip(CAP_KEYS, caps.as_tuple())}, "worst": float(key[1] - 1)}
        row["fits"] = all(row[k] <= row[f"{k}_cap"] for k in CAP_KEYS)
        out.append(row)
    return out


# -- one mask at real shapes -----------------------------------------------------------------------

def run_instance(kind: str, P: int, seed: int, tokens_per_rank: int, tiles=(1,), *, topology: Topology,
                 plan_cache=None, comm: str = "p2p") -> tuple[dict, list[dict], tuple]:
    """(row, fills, (mask, config, plan)) for one benchmark mask: the default config solved on
    ``topology`` (as the README tells a cluster user), whole chunks, the default capacities; its
    layer simulated over ``comm``. A plan cached under ``plan_cache`` (``_common.plan_cache_path``,
    shared with the other cluster benchmarks) is reused: its assignment, the plan rebuilt."""
    config = SolverConfig(cp_size=P, topology=topology)
    mask = make_mask(kind, P, seed, tokens_per_rank)
    t0 = time.perf_counter()
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    t1 = time.perf_counter()
    asg, solve_s = cached_assignment(mask, areas, config, plan_cache_path(plan_cache, kind, P, seed,
                                                                          tokens_per_rank, config))
    plan = build_as_solved(mask, areas, asg, config)
    solve_ms = None if solve_s is None else 1e3 * (time.perf_counter() - t0)
    if int(plan.status) & BUFFER_OVERFLOW:
        print(f"# {kind} P={P} seed={seed}: BUFFER_OVERFLOW at the default capacity", file=sys.stderr)
    m = plan.metrics
    fwd, bwd = plan.pair_bytes("fwd"), plan.pair_bytes("bwd")
    # the forward as the solve priced it; the backward's bytes are what the layer moves (pair_bytes):
    # PlanMetrics prices a kind the budget keeps in part as kept, a lower bound
    match = all(torch.equal(a.sum(dim).cpu(), b.cpu()) for a, dim, b in ((fwd, 1, m.fwd_send), (fwd, 0, m.fwd_recv)))
    moved = {ph: int(torch.maximum(pb.sum(1), pb.sum(0)).max()) for ph, pb in (("fwd", fwd), ("bwd", bwd))}
    base = baseline_table(areas, config)
    row = {
        "kind": kind, "P": P, "seed": seed, "num_slices": mask.num_slices, "areas_ms": 1e3 * (t1 - t0),
        "solve_ms": solve_ms, "imbalance": float(m.imbalance), "status": int(plan.status),
        "fwd_bytes": moved["fwd"], "bwd_bytes": moved["bwd"], "fwd_bytes_match_metrics": match,
        "fwd_mb": moved["fwd"] / MB, "bwd_mb": moved["bwd"] / MB,
        **{f"{n}_{p}_mb": base[key][f"{p}_bottleneck"] / MB
           for n, key in (("usp", "usp"), ("ring", "ring")) for p in ("fwd", "bwd")},
        **simulated(plan, mask, config, topology, comm),
    }
    fills = [{"kind": kind, "P": P, "seed": seed, "tiles": 1, **comm_fill(plan.comm, config.head_groups)}]
    for n in tiles:
        if n == 1:
            continue
        fills.append(fill_only(kind, P, seed, tokens_per_rank, n, mask=mask, topology=topology))
    return row, fills, (mask, config, plan)


def fill_only(kind: str, P: int, seed: int, tokens_per_rank: int, tiles: int = 1, mask=None, topology=None) -> dict:
    """The fill of the device solver's plan of one mask (solve and CommMeta only), solved on ``topology``
    as the layer's rows are."""
    config = SolverConfig(cp_size=P, chunk_tiles=tiles, topology=topology)
    mask = make_mask(kind, P, seed, tokens_per_rank) if mask is None else mask
    units = block_areas(mask, P, config.head_groups, impl="torch", tiles=tiles)
    asg = solve_assignment(units, config, impl="torch")
    big = config.head_groups * tokens_per_rank * P  # never overflows: only the fill is read
    comm, _ = build_comm_meta(units, asg, buffers=BufferRows(big, big, big, big))
    return {"kind": kind, "P": P, "seed": seed, "tiles": tiles, **comm_fill(comm, config.head_groups)}


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for kind, P in dict.fromkeys((r["kind"], r["P"]) for r in rows):
        rs = [r for r in rows if r["kind"] == kind and r["P"] == P]
        keys = dict.fromkeys(k for _, k, spec in SUMMARY_COLUMNS + SIM_COLUMNS if spec and k not in ("P", "runs"))
        med = {k: median([r[k] for r in rs if r.get(k) is not None]) if any(r.get(k) is not None for r in rs)
               else None for k in keys}
        out.append({"kind": kind, "P": P, "runs": len(rs), **med})
    return out


# -- the real run (CPU) and the GPU stage times -----------------------------------------------------

def real_run(kind: str, keep: bool, seed: int = 0, repeats: int = 3, *, cp_size: int = REAL["P"],
             tokens_per_rank: int = REAL["tokens_per_rank"]) -> dict:
    """The layer through ``dist_attn`` on ``LocalGroup`` at ``REAL``'s heads and dtype: counted bytes
    per phase against the plan's, totals against ``PlanMetrics``, and the wall time of fwd + bwd."""
    from groupcomm import LocalGroup
    from gpusolver.runtime import dist_attn
    from gpusolver.runtime.pipelined import stage_phase

    P, c = cp_size, tokens_per_rank
    Hq, Hkv, D, dtype = REAL["num_heads_q"], REAL["num_heads_kv"], REAL["head_dim"], REAL["dtype"]
    # the keep mode is the row's (True or False), not a memory budget's
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=dtype,
                          keep_forward_buffers=keep, memory_budget=None)
    mask = make_mask(kind, P, seed, c)
    # The CPU attention path builds a dense [slices, rows, rows] mask per stage, so the capacities are
    # sized to what this plan needs (the solve ignores them: the same assignment comes back).
    probe = solve(mask, config, impl="torch")
    rows = max(int(t.max()) for t in (probe.comm.qo_recv_rows, probe.comm.kv_recv_rows,
                                      probe.comm.qo_split.sum(1), probe.comm.kv_split.sum(1)))
    config = dataclasses.replace(config, max_recv_rows=max(rows, 1),
                                 max_stage_slices=max(int(probe.calc.needed_rows.max()), 1))
    plan = solve(mask, config, impl="torch")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(P, c, h, D, generator=gen, dtype=dtype) for h in (Hq, Hkv, Hkv))
    d_out = torch.randn(P, c, Hq, D, generator=gen, dtype=dtype)
    group = LocalGroup(P)

    def step():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, _ = dist_attn(qq, kk, vv, plan, group, keep_forward_buffers=keep)
        out.backward(d_out)

    step()  # warm-up, and the one call the counters see
    # with S > 1 sub-stages the group counts each collective under its sub-stage's phase
    S = plan.num_stages
    stages = [None] if S == 1 else list(range(1, S + 1))

    def counter(ph, s):
        return ph if s is None else stage_phase(ph, s)

    counted = {ph: sum(torch.stack(group.traffic(counter(ph, s))) for s in stages) for ph in PHASES}
    # pair by pair and stage by stage: what the group moved from each rank to each other rank is the
    # plan's pair_bytes
    match = all(torch.equal(group.pair_traffic(counter(ph, s)).cpu(), plan.pair_bytes(ph, stage=s).cpu())
                for ph in PHASES for s in stages)
    m = plan.metrics
    for ph, total in (("fwd", (m.fwd_send, m.fwd_recv)), ("bwd", (m.bwd_send, m.bwd_recv))):
        got = sum(counted[k_] for k_ in PHASES if k_.startswith(ph))
        match = match and torch.equal(got[0], total[0].cpu()) and torch.equal(got[1], total[1].cpu())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"kind": kind, "keep": keep, "P": P, "tokens_per_rank": c, "heads": f"{Hq}:{Hkv}", "head_dim": D,
            "dtype": str(dtype).removeprefix("torch."), "bytes_match": match, "recv_capacity": config.max_recv_rows,
            "stage_capacity": config.max_stage_slices, "num_stages": S,
            "counted": {ph: t.tolist() for ph, t in counted.items()},
            "fwd_mb": int(m.fwd_bottleneck) / MB, "bwd_mb": int(m.bwd_bottleneck) / MB,
            "wall_ms": 1e3 * median(times)}


def gpu_stage_times(config: SolverConfig, plan, repeats: int = 3, *, topology: Topology) -> dict:
    """Max over ranks of each stage's attention time on the GPU at the layer's real shapes (random bf16
    activations; every rank's stages run on this one GPU in turn), forward and backward."""
    from attn_kernels import flex_attn, flex_attn_backward, row_delta

    dev = torch.device("cuda")
    G, c, cap = config.head_groups, plan.comm.chunk, plan.comm.buffers.largest_recv
    hq, hkv, D = config.num_heads_q // G, config.num_heads_kv // G, config.head_dim
    n = G * c + cap
    q = torch.randn(n, hq, D, device=dev, dtype=config.dtype)
    k, v = (torch.randn(n, hkv, D, device=dev, dtype=config.dtype) for _ in range(2))
    d_out = torch.randn_like(q)
    calc = plan.calc
    times = torch.zeros(config.cp_size, 2, 2, dtype=torch.float64)  # [rank, stage, fwd / bwd]
    for r in range(config.cp_size):
        for s in (0, 1):
            rows = G * c if s == 0 else n
            sl = [t[r, s].to(dev) for t in (calc.q_ranges, calc.k_ranges, calc.attn_type)]
            fwd = lambda: flex_attn(q[:rows], k[:rows], v[:rows], *sl)  # noqa: E731
            times[r, s, 0], (out, lse) = cuda_time(fwd, repeats)
            delta = row_delta(d_out[:rows], out)
            bwd = lambda: flex_attn_backward(d_out[:rows], q[:rows], k[:rows], v[:rows], lse, delta, *sl)  # noqa: E731
            times[r, s, 1], _ = cuda_time(bwd, repeats)
    ms = 1e3 * times
    return {"s0_fwd_ms": float(ms[:, 0, 0].max()), "s1_fwd_ms": float(ms[:, 1, 0].max()),
            "fwd_ms": float(ms[:, :, 0].sum(1).max()), "s0_bwd_ms": float(ms[:, 0, 1].max()),
            "s1_bwd_ms": float(ms[:, 1, 1].max()), "bwd_ms": float(ms[:, :, 1].sum(1).max()),
            "sim_compute_fwd_ms": simulate(plan, topology).fwd.compute_ms}


# -- provenance, arguments, main -------------------------------------------------------------------

def provenance(argv) -> dict:
    """Commit (``-dirty`` when tracked files differ from it), command line and machine of this run."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "--short=12", "HEAD") or None
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    args = sys.argv[1:] if argv is None else list(argv)
    return {"commit": commit, "command": shlex.join(["python", "benchmarks/layer_bench.py", *args]),
            "machine": f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--P", default=",".join(map(str, FULL_P)), help="CP sizes, comma-separated")
    p.add_argument("--seeds", type=int, default=FULL_SEEDS, help="seeds per (kind, P), 0..n-1")
    p.add_argument("--kinds", default=",".join(PACKED_KINDS), help="mask kinds: causal, full (packed documents)")
    p.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK)
    p.add_argument("--tiles", default="1", help="chunk_tiles values whose plans' fill is measured (default 1)")
    p.add_argument("--fill-seeds", type=int, default=0,
                   help="measure the fill (only) of seeds --seeds..N-1 too, whole chunks")
    p.add_argument("--fill-kinds", default="",
                   help="extra mask kinds whose fill (only) is measured, seed 0 (e.g. causal-seq,full-seq)")
    p.add_argument("--topology", choices=sorted(PRESETS), default=TOPOLOGY,
                   help=f"the simulated cluster (default {TOPOLOGY})")
    p.add_argument("--comm", choices=COMM_MODES, default="p2p",
                   help="our layer's transport as simulated: p2p (TorchGroup's default), a2a (all-to-all-v), p2p-batch")
    p.add_argument("--plan-cache", default=None,
                   help="folder of saved plans (kind_P<P>_s<seed>_c<tokens>.pt): load them instead of solving, "
                        "save the plans solved here (solve ms is then blank for a loaded plan)")
    p.add_argument("--no-real", action="store_true", help="skip the small real run through dist_attn")
    p.add_argument("--real-P", type=int, default=REAL["P"], help="P of the real run")
    p.add_argument("--real-tokens-per-rank", type=int, default=REAL["tokens_per_rank"],
                   help="tokens per rank of the real run")
    p.add_argument("--json", default=str(RESULTS_DIR / "layer_bench.json"), help="JSON output path")
    p.add_argument("--md", default=None, help="also write the printed tables to this markdown file")
    args = p.parse_args(argv)
    try:
        args.P = parse_list(args.P, int, name="--P")
        args.kinds = parse_list(args.kinds, str, allowed=tuple(KINDS), name="--kinds")
        args.tiles = parse_list(args.tiles, int, name="--tiles")
        args.fill_kinds = parse_list(args.fill_kinds, str, allowed=tuple(KINDS), name="--fill-kinds") \
            if args.fill_kinds else []
    except ValueError as e:
        p.error(str(e))
    if args.seeds <= 0:
        p.error(f"--seeds must be positive, got {args.seeds}")
    return args


def main(argv=None) -> dict:
    """Run the benchmark; prints the tables and returns the JSON payload."""
    torch.set_num_threads(1)
    args = parse_args(argv)
    topology = Topology.preset(args.topology)
    t_start = time.perf_counter()
    solve_assignment(block_areas(make_mask("causal", 2, 0, 64), 2, 8), SolverConfig(cp_size=2), impl="torch")  # warm-up
    rows, fills, gpu_rows = [], [], []
    for kind in args.kinds:
        for P in args.P:
            for seed in range(args.seeds):
                row, fill, (mask, config, plan) = run_instance(
                    kind, P, seed, args.tokens_per_rank, args.tiles, topology=topology, plan_cache=args.plan_cache,
                    comm=args.comm)
                rows.append(row)
                fills += fill
                if seed == 0 and torch.cuda.is_available():
                    cmask = make_mask(kind, P, seed, args.tokens_per_rank, device="cuda")
                    cplan = solve(cmask, config, validate=False)
                    gpu_rows.append({"kind": kind, "P": P,
                                     **gpu_stage_times(config, cplan, topology=topology)})
                print(f"# done {kind} P={P} seed={seed}", file=sys.stderr, flush=True)
            for seed in range(args.seeds, args.fill_seeds):
                fills.append(fill_only(kind, P, seed, args.tokens_per_rank, topology=topology))
    for kind in args.fill_kinds:
        for P in args.P:
            fills.append(fill_only(kind, P, 0, args.tokens_per_rank, topology=topology))
    real = [] if args.no_real else [real_run(kind, keep, cp_size=args.real_P, tokens_per_rank=args.real_tokens_per_rank)
                                    for kind in args.kinds for keep in (True, False)]
    summary, fill_rows = summarize(rows), fill_summary(fills, args.tokens_per_rank, topology)
    memory = memory_rows(args.P, args.tokens_per_rank, topology)
    prov = provenance(argv)
    prov["seconds"] = time.perf_counter() - t_start
    gpu_text = markdown_table(gpu_rows, GPU_COLUMNS) if gpu_rows else \
        "Not measured: no CUDA device in this run (the stage times need a GPU)."
    text = "\n\n".join([
        f"## Layer: {', '.join(KINDS[k][1] for k in args.kinds)}, {args.tokens_per_rank} tokens per rank, "
        "Hq:Hkv = 64:8, D = 128, bf16, G = 8; the default config solved on the topology "
        f"(`SolverConfig(cp_size=P, topology={topology.name})`: mu = "
        + ", ".join(f"{SolverConfig(cp_size=P, topology=topology).imbalance_tol:.2f} at P = {P}" for P in args.P)
        + f", S = {SolverConfig(cp_size=max(args.P), topology=topology).num_stages} sub-stages and the local tail of "
        f"{SolverConfig(cp_size=max(args.P), topology=topology).local_tail:g}), "
        f"run over `{args.comm}`",
        f"commit {prov['commit']}; `{prov['command']}`; {prov['machine']}; {prov['seconds']:.0f} s",
        "### Layer time on a cluster, SIMULATED (medians over seeds)",
        f"**Every time in this table is simulated (`gpusolver.sim`), not measured.** Topology `{topology.name}`: "
        f"nodes of {topology.ranks_per_node} GPUs, NVLink {topology.nvlink_gbps:g} GB/s per direction per GPU, "
        f"{topology.nics_per_node} InfiniBand NICs of {topology.ib_gbps:g} GB/s per direction per node, attention at "
        f"{topology.attn_tflops:g} TFLOP/s forward (4·D FLOPs per (q, k) entry per query head) and "
        f"{topology.bwd_flops_ratio:g}× the FLOPs backward, {topology.nvlink_latency_us:g} / "
        f"{topology.ib_latency_us:g} µs per collective inside / across nodes. Ours: the plan run by the runtime's "
        "own schedule (`gpusolver.plan.schedule`: every cast of the S sub-stages issued up front, stage 0 while "
        "they fly, each sub-stage after its own casts, its partial O reduced while the next computes; backward: "
        "the dO casts, the sub-stages with their dQ and dK, dV reduces, the local stage last), every collective "
        f"{'point-to-point (a rank waits for its own rows only)' if args.comm == 'p2p' else args.comm}. USP: Ulysses of degree 8 inside a node, ring across nodes, "
        "each hop overlapped with the block in hand, on the same sequential shards; bal. USP: every ring step's "
        "compute at the mean (what any token permutation could reach). ideal: max(busiest rank's compute, per "
        "link class the busiest GPU's or NIC's bytes / bandwidth), per pass. hidden %: share of our communication "
        "time that runs under compute. compute ms: the busiest rank's attention, forward + backward. stage 0 %: "
        "share of the area that runs while the casts are in flight. IB / USP: InfiniBand bytes of the busiest NIC "
        "side over a step, ours / USP's.",
        markdown_table(summary, SIM_COLUMNS),
        "### Bytes and solve (medians over seeds)",
        "solve ms: block areas + device solve + plan build, torch path on CPU, one thread (blank: the plan came "
        "from --plan-cache). fwd / bwd MB: bottleneck bytes per rank (10^6 B), ours, USP's and ring's.",
        markdown_table(summary, SUMMARY_COLUMNS),
        "### Receive capacity: largest fill as a multiple of G·c (max over the runs)",
        "QO / KV recv: rows a rank receives; QO / KV send: rows a rank sends. caps: each buffer's default "
        "(`plan_capacities`, `gpusolver.capacity.default_chunks`: sized per P across nodes); worst: P − 1.",
        markdown_table(fill_rows, FILL_COLUMNS),
        "### Receive-buffer memory per rank and layer",
        "fwd: Q, K, V receive buffers plus the buffer partial O and lse return into (send capacity); bwd: dO, lse, "
        "delta plus Q, K, V (kept or cast again) plus the dQ and dK, dV return buffers; held: kept from the "
        "forward to the backward (one per layer of the model); peak: the larger pass. The runtime's stage-1 "
        "copies and partial outputs are not counted.",
        markdown_table(memory, MEMORY_COLUMNS),
        "### Real run: `dist_attn` on `LocalGroup` (CPU, fp32)",
        "counted = metrics: every phase's bytes counted by the group, pair by pair, equal `plan.pair_bytes`, and "
        "their sums equal "
        "`PlanMetrics`' per-rank send and receive. recv cap: rows, sized to the plan (the CPU attention path "
        "builds a dense mask per stage). The wall time is CPU torch, for what it is worth.",
        markdown_table(real, REAL_COLUMNS) if real else "Skipped (--no-real).",
        "### Attention time per rank on the GPU (seed 0; max over ranks)", gpu_text,
        "### Runs", markdown_table(rows, RUN_COLUMNS),
    ]) + "\n"
    print(text)
    payload = {
        "benchmark": "layer_bench", **prov,
        "config": {"P": args.P, "seeds": args.seeds, "kinds": args.kinds, "tiles": args.tiles,
                   "fill_seeds": max(args.fill_seeds, args.seeds), "fill_kinds": args.fill_kinds,
                   "tokens_per_rank": args.tokens_per_rank, "num_heads_q": 64, "num_heads_kv": 8, "head_dim": 128,
                   "dtype": "bfloat16", "head_groups": 8, "imbalance_tol": 1.10},
        "simulated": {"note": "every *_ms figure of the summary and rows except solve_ms and areas_ms is simulated "
                              "(gpusolver.sim), not measured", "topology": dataclasses.asdict(topology),
                      "fwd_flops_per_entry_per_head": "4 * D"},
        "environment": environment(), "summary": summary, "fill": fill_rows, "fill_runs": fills,
        "memory": memory, "real_run": real, "gpu_stages": gpu_rows, "rows": rows,
    }
    write_results(args.json, payload, args.md, text)
    return payload


if __name__ == "__main__":
    main()
