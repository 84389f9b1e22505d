"""The floor of a layer's transient buffers: the plan's collective buffers sized to what they fill.

A layer receives every remote row of a pass into receive buffers and takes every partial
result back into return buffers (``gpusolver.plan.memory``: the forward's Q, K, V receive and
partial O return buffers; the backward's dO, lse, delta, the Q, K, V it keeps or receives
again, and the dQ and dK, dV return buffers). Sized at the default capacities they are the
plan's ``plan.memory()``; sized to the rows the plan really moves (each buffer's largest fill
over the ranks, ``CommMeta.*_recv_rows`` and the send splits) they are the least those buffers
can take for this mask, whatever the runtime around them does. This prints both next to the
layer's own q, k, v and out per rank (the ``own`` of ``layer_memory.py``), per benchmark mask
(packed causal / full documents, 8K tokens per rank, 64:8, D = 128, bf16). Host arithmetic on
static sizes and the plans' row counts: no layer runs.

A second table prices the pipelined layer's operands over the received rows (``runtime.pipelined``:
X's receive rows of Q, K, V and the forward's running (out fp32, lse); in the backward Q, K, V again,
dO, lse and delta, and the fp32 sums of dQ, dK, dV) at the plan's capacity, what a static-shape
group allocates (``LocalGroup``, ``SymmMemGroup``), and at each rank's own fill, what ``TorchGroup``
allocates (``pipelined.receive_rows``), the larger over the ranks. With ``--relay`` a third table
does the same for the relay layer with sub-stages (``ib_relay=True``, the relay-priced solve):
X's receive rows and running out, and every cast hop's buffer (direct, fan-out, relay, egress) of
the forward, at their capacities and at each rank's fill (``relay_stages``).

    PYTHONPATH=. python benchmarks/memory_floor.py --P 16,32,64 --seeds 3 --plan-cache build/sim_plans \\
        --solve-topology --md benchmarks/results/memory_floor.md
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PACKED_KINDS, build_as_solved, cached_assignment, make_mask, markdown_table, parse_list, plan_cache_path,
    print_and_write,
)

from gpusolver import SolverConfig, block_areas  # noqa: E402
from gpusolver.capacity import BufferRows  # noqa: E402
from gpusolver.plan.memory import buffer_memory  # noqa: E402
from gpusolver.topology import PRESETS  # noqa: E402

MB = 1e6


def fill_rows(comm) -> BufferRows:
    """Each buffer's largest fill over the ranks (rows): what a buffer sized to this plan must hold."""
    top = lambda t: int(t.max())  # noqa: E731
    return BufferRows(qo_recv=top(comm.qo_recv_rows), kv_recv=top(comm.kv_recv_rows),
                      qo_send=top(comm.qo_split.sum(1)), kv_send=top(comm.kv_split.sum(1)))


def own_bytes(config: SolverConfig, chunk: int) -> int:
    """A rank's q, k, v and out: ``c * (2 Hq + 2 Hkv) * D * b`` bytes."""
    return chunk * 2 * (config.num_heads_q + config.num_heads_kv) * config.head_dim * config.dtype_bytes


def floor_row(plan, config: SolverConfig, chunk: int) -> dict:
    """Forward and backward buffer bytes at the default capacities and at the plan's fill, and own."""
    comm = plan.comm
    at = lambda rows: buffer_memory(SimpleNamespace(head_groups=comm.head_groups, buffers=rows),  # noqa: E731
                                    config.num_heads_q, config.num_heads_kv, config.head_dim, config.dtype)
    cap, fill, own = at(comm.buffers), at(fill_rows(comm)), own_bytes(config, chunk)
    unit = comm.head_groups * chunk
    f = fill_rows(comm)
    return {"qo_recv": f.qo_recv / unit, "kv_recv": f.kv_recv / unit, "qo_send": f.qo_send / unit,
            "kv_send": f.kv_send / unit, "own_mb": own / MB,
            "cap_fwd_mb": cap.fwd_peak / MB, "cap_bwd_mb": cap.bwd_peak / MB,
            "fill_fwd_mb": fill.fwd_peak / MB, "fill_bwd_mb": fill.bwd_peak / MB,
            "cap_own": max(cap.fwd_peak, cap.bwd_peak) / own, "fill_own": max(fill.fwd_peak, fill.bwd_peak) / own}


def operand_bytes(config: SolverConfig, G: int, q_rows, kv_rows) -> tuple:
    """(forward, backward) bytes of the pipelined layer's operands over ``q_rows`` received Q rows and
    ``kv_rows`` received K, V rows (ints or tensors of them per rank)."""
    hq, hkv, D, b = config.num_heads_q // G, config.num_heads_kv // G, config.head_dim, config.dtype_bytes
    fwd = q_rows * (hq * D * b + hq * D * 4 + hq * 4) + kv_rows * 2 * hkv * D * b
    bwd = q_rows * (2 * hq * D * b + 8 * hq + hq * D * 4) + kv_rows * 2 * hkv * D * (b + 4)
    return fwd, bwd


def operand_row(plan, config: SolverConfig) -> dict:
    """The operands' bytes at the receive capacity and at the largest rank's fill, per pass."""
    comm = plan.comm
    G = comm.head_groups
    cap = operand_bytes(config, G, comm.buffers.qo_recv, comm.buffers.kv_recv)
    fill = operand_bytes(config, G, comm.qo_recv_rows.long(), comm.kv_recv_rows.long())
    fill = tuple(int(t.max()) for t in fill)
    return {"op_cap_fwd_mb": cap[0] / MB, "op_cap_bwd_mb": cap[1] / MB, "op_fill_fwd_mb": fill[0] / MB,
            "op_fill_bwd_mb": fill[1] / MB, "op_saved_mb": (max(cap) - max(fill)) / MB}


def relay_cast_bytes(plan, config: SolverConfig, at_fill: bool) -> int:
    """The relay forward's cast-side bytes on the largest rank: X's receive rows of Q, K, V and the
    running (out fp32, lse), and each cast hop's buffer of Q and of K, V (hop 3: the egress rows)."""
    comm, relay = plan.comm, plan.relay
    G, P, S = comm.head_groups, comm.cp_size, relay.num_stages
    every = lambda rows: torch.full((P,), rows)  # noqa: E731  (each rank at a capacity)
    recv = ((comm.qo_recv_rows.long(), comm.kv_recv_rows.long()) if at_fill
            else (every(comm.buffers.qo_recv), every(comm.buffers.kv_recv)))
    fwd, _ = operand_bytes(config, G, *recv)
    hq, hkv, D, b = config.num_heads_q // G, config.num_heads_kv // G, config.head_dim, config.dtype_bytes
    row = {"qo": hq * D * b, "kv": 2 * hkv * D * b}
    hops = (0, 1, 2, 3) if relay.egress else (0, 1, 2)
    for kind in ("qo", "kv"):
        first = relay.stage(kind, 1, "cast")
        for h in hops:
            if at_fill:
                rows = sum(relay.stage(kind, s, "cast").split(h).sum(0) for s in range(1, S + 1))
            else:
                rows = every({1: first.relay_capacity, 3: first.egress_capacity}.get(h, comm.buffers.recv(kind)))
            fwd = fwd + rows.long() * row[kind]
    return int(fwd.max())


def relay_row(kind: str, P: int, seed: int, tokens: int, cache, topology) -> dict:
    """The relay layer's forward cast-side bytes at capacity and at fill (relay-priced solve, the
    default S)."""
    from relay_bench import solved_assignment  # its cache names the relay-priced solves apart

    config = SolverConfig(cp_size=P, topology=topology, ib_relay=True)
    mask = make_mask(kind, P, seed, tokens)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg, _ = solved_assignment(kind, P, seed, tokens, cache, topology, relay_priced=True)
    plan = build_as_solved(mask, areas, asg, config)
    cap, fill = relay_cast_bytes(plan, config, False), relay_cast_bytes(plan, config, True)
    return {"kind": kind, "P": P, "seed": seed, "relay_cap_mb": cap / MB, "relay_fill_mb": fill / MB,
            "relay_saved_mb": (cap - fill) / MB}


def run(kind: str, P: int, seed: int, tokens: int, cache, topology) -> dict:
    config = SolverConfig(cp_size=P, topology=topology)
    mask = make_mask(kind, P, seed, tokens)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    asg, _ = cached_assignment(mask, areas, config, plan_cache_path(cache, kind, P, seed, tokens, config))
    # the default S: its transport sizes the buffers (capacity.default_chunks)
    plan = build_as_solved(mask, areas, asg, config)
    return {"kind": kind, "P": P, "seed": seed, **floor_row(plan, config, tokens), **operand_row(plan, config)}


COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"),
           ("QO recv (G·c)", "qo_recv", ".2f"), ("KV recv", "kv_recv", ".2f"), ("QO send", "qo_send", ".2f"),
           ("KV send", "kv_send", ".2f"), ("own q,k,v,out MB", "own_mb", ".1f"),
           ("fwd MB at capacity", "cap_fwd_mb", ".1f"), ("bwd MB at capacity", "cap_bwd_mb", ".1f"),
           ("peak / own at capacity", "cap_own", ".2f"), ("fwd MB at fill", "fill_fwd_mb", ".1f"),
           ("bwd MB at fill", "fill_bwd_mb", ".1f"), ("peak / own at fill", "fill_own", ".2f")]
OPERAND_COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"),
                   ("fwd MB at capacity", "op_cap_fwd_mb", ".1f"), ("bwd MB at capacity", "op_cap_bwd_mb", ".1f"),
                   ("fwd MB at fill (TorchGroup)", "op_fill_fwd_mb", ".1f"),
                   ("bwd MB at fill (TorchGroup)", "op_fill_bwd_mb", ".1f"),
                   ("larger pass saved MB", "op_saved_mb", ".1f")]
RELAY_COLUMNS = [("kind", "kind", "s"), ("P", "P", "d"), ("seed", "seed", "d"),
                 ("fwd cast side MB at capacity", "relay_cap_mb", ".1f"),
                 ("at fill (TorchGroup)", "relay_fill_mb", ".1f"), ("saved MB", "relay_saved_mb", ".1f")]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--P", default="16,32,64")
    ap.add_argument("--kinds", default=",".join(PACKED_KINDS))
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--topology", default="h200_hgx", choices=sorted(PRESETS))
    ap.add_argument("--solve-topology", action="store_true", help="solve on the topology, as a cluster user does")
    ap.add_argument("--plan-cache", default=None)
    ap.add_argument("--relay", action="store_true", help="add the relay layer's table (solves ib_relay=True plans)")
    ap.add_argument("--relay-plan-cache", default=None, help="the relay solves' cache (relay_bench.py's)")
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be positive, got {args.seeds}")
    torch.set_num_threads(1)
    topology = PRESETS[args.topology] if args.solve_topology else None
    rows = [run(kind, P, seed, args.tokens_per_rank, args.plan_cache, topology)
            for kind in parse_list(args.kinds, str, PACKED_KINDS, "kind") for P in parse_list(args.P)
            for seed in range(args.seeds)]
    worst = max(rows, key=lambda r: r["fill_own"])
    cmd = "python benchmarks/memory_floor.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = ("# The floor of a layer's collective buffers (per rank)\n\n"
            f"Command: `{cmd}`\n\n"
            "Fill: each buffer's largest rows over the ranks, in G·c (G head groups of c tokens). At capacity: "
            "`plan.memory()` at the default capacities; at fill: the same buffers sized to the fill, the least "
            "they take for this plan. peak: the larger pass. Not counted: the runtime's work around the "
            "buffers (operand copies, partial outputs, fp32 running sums), which `layer_memory.py` measures.\n\n"
            + markdown_table(rows, COLUMNS)
            + f"\n\nLargest peak / own at fill: {worst['fill_own']:.2f} ({worst['kind']} P = {worst['P']} seed "
            f"{worst['seed']}); smallest: {min(r['fill_own'] for r in rows):.2f}.\n"
            "\n## The pipelined layer's operands over the received rows (per rank)\n\n"
            "At capacity: what a static-shape group allocates (`LocalGroup`, `SymmMemGroup`, meta, "
            "`torch.compile`); at fill: what `TorchGroup` allocates, each rank its own fill (the largest "
            "rank shown). Host arithmetic on the plans' row counts, not measured; "
            "`test_stages_gloo_operands_hold_the_rank_fill` checks on gloo that the runtime allocates these rows.\n\n"
            + markdown_table(rows, OPERAND_COLUMNS)
            + "\n\nLarger pass saved on TorchGroup: "
            f"{min(r['op_saved_mb'] for r in rows):.0f}-{max(r['op_saved_mb'] for r in rows):.0f} MB per rank "
            f"(own q, k, v, out: {rows[0]['own_mb']:.0f} MB).\n")
    if args.relay:
        relay = [relay_row(kind, P, seed, args.tokens_per_rank, args.relay_plan_cache, PRESETS[args.topology])
                 for kind in parse_list(args.kinds, str, PACKED_KINDS, "kind") for P in parse_list(args.P)
                 for seed in range(args.seeds)]
        text += ("\n## The relay layer's forward cast side (per rank, `ib_relay=True`)\n\n"
                 "X's receive rows and running (out fp32, lse) and every cast hop's buffer (direct, fan-out, "
                 "relay, egress) of Q and of K, V, at the capacities (static-shape groups) and at each rank's "
                 "fill (`TorchGroup`, `relay_stages`), the largest rank. Host arithmetic on the plans' splits, "
                 "not measured.\n\n" + markdown_table(relay, RELAY_COLUMNS) + "\n")
    print_and_write(text, args.md)
    return rows


if __name__ == "__main__":
    main()
