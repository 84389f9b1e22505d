"""Command line: ``python -m gpusolver {demo,show,solve,quality,bench}``.

demo     a few model-like layers over P ranks (simulated in one process, or
         real ones under torchrun), each solving a fresh mask on the device and
         running dist_attn forward and backward, checked against dense attention.
show     the picture of a plan (PNG): from a mask kind and P, or a saved plan.
solve    one full plan of a mask at real shapes: its summary; --save keeps it.
quality  both solvers on one mask at real shapes vs owner-computes, USP, ring.
simulate one mask's layer time on a cluster (simulated): ours, USP, balanced USP, ideal bound.
bench    the benchmarks that apply to this machine, as one markdown report.

``python -m gpusolver <command> --help`` lists each command's options.
"""
from __future__ import annotations

import argparse
import sys

from gpusolver.cli import args as a

HEAD_DIMS = (16, 32, 64, 128)  # the attention kernels' head dims


def _shape_options(p, *, P: int | None, tokens: int, heads: str, head_dim: int, dtype: str,
                   head_dims=None) -> None:
    p.add_argument("-P", "--cp-size", type=a.positive_int, default=P,
                   help="ranks in the CP group" + (" (default 8, or the torchrun world size)" if P is None
                                                   else f" (default {P})"))
    p.add_argument("--tokens-per-rank", type=a.positive_int, default=tokens,
                   help=f"tokens per rank, c = S / P (default {tokens})")
    p.add_argument("--heads", type=a.heads, default=a.heads(heads), metavar="HQ:HKV",
                   help=f"query and KV heads (default {heads})")
    p.add_argument("--head-dim", type=a.positive_int, default=head_dim, choices=head_dims,
                   help=f"head dim D (default {head_dim})")
    p.add_argument("--dtype", type=a.dtype, default=a.dtype(dtype), help=f"activation dtype (default {dtype})")
    p.add_argument("--seed", type=a.non_negative_int, default=0, help="mask and data seed (default 0)")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="gpusolver", description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[2:11]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    subs = {}

    p = subs["demo"] = sub.add_parser(
        "demo", help="model-like layers over dist_attn, checked against dense attention",
        description="A few attention layers over a CP group: each draws a fresh mask, solves it on the device "
                    "and runs dist_attn forward and backward over LocalGroup(P), or over real ranks under "
                    "torchrun (NCCL on GPUs, gloo on CPU). Every layer is checked against single-process "
                    "dense attention. Needs no GPU and no data.")
    _shape_options(p, P=None, tokens=128, heads="8:2", head_dim=32, dtype="float32", head_dims=HEAD_DIMS)
    p.add_argument("--mask", choices=a.MASK_KINDS, default="docs", help=a.MASK_HELP)
    p.add_argument("--layers", type=a.positive_int, default=4, help="layers, each with its own mask (default 4)")
    p.add_argument("--device", type=a.device, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default="build/demo_plan.png",
                   help="PNG of the last layer's plan ('' for none; default build/demo_plan.png)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the dense reference check (it bounds S at 16384 tokens)")
    p.add_argument("--profile", action="store_true",
                   help="after the checked pass, run the layers again with NVTX ranges on, between "
                        "cudaProfilerStart/Stop (benchmarks/profile/nsys_demo.sh)")

    p = subs["show"] = sub.add_parser(
        "show", help="draw a plan as a PNG",
        description="Draw a plan: the task grid of each head group coloured by the rank that computes it "
                    "(dots mark local tasks), per-rank load, and per-rank send/receive bytes next to USP's. "
                    "The plan is solved here from a mask kind, or loaded with --plan (solve --save).")
    _shape_options(p, P=8, tokens=8192, heads="64:8", head_dim=128, dtype="bfloat16")
    p.add_argument("--mask", choices=a.MASK_KINDS, default="docs", help=a.MASK_HELP)
    p.add_argument("--tiles", type=a.positive_int, default=1, help="sub-chunk tiles per chunk (default 1)")
    p.add_argument("--solver", choices=("device", "reference"), default="device")
    p.add_argument("--plan", default=None, help="a saved plan (Plan.save) to draw instead of solving")
    p.add_argument("--out", default="build/plan.png", help="PNG path (default build/plan.png)")

    p = subs["solve"] = sub.add_parser(
        "solve", help="solve one mask and print the plan's summary",
        description="Solve one mask (areas, assignment, metas) and print the plan's metrics and status.")
    _shape_options(p, P=8, tokens=8192, heads="64:8", head_dim=128, dtype="bfloat16")
    p.add_argument("--mask", choices=a.MASK_KINDS, default="docs", help=a.MASK_HELP)
    p.add_argument("--tiles", type=a.positive_int, default=1, help="sub-chunk tiles per chunk (default 1)")
    p.add_argument("--solver", choices=("device", "reference"), default="device")
    p.add_argument("--save", default=None, help="write the plan (with its config) to this file")

    p = subs["quality"] = sub.add_parser(
        "quality", help="both solvers vs owner-computes, USP and ring on one mask",
        description="Solve one mask with both solvers and compare the plans' balance and bottleneck bytes "
                    "with owner-computes, USP, ring and all-gather KV (no attention runs).")
    p.add_argument("-P", "--cp-size", type=a.positive_int, default=8)
    p.add_argument("--tokens-per-rank", type=a.positive_int, default=8192)
    p.add_argument("--heads", type=a.heads, default=(64, 8), metavar="HQ:HKV", help="default 64:8")
    p.add_argument("--head-dim", type=a.positive_int, default=128)
    p.add_argument("--seed", type=a.non_negative_int, default=0)
    p.add_argument("--full", dest="causal", action="store_false", help="full (bidirectional) documents")
    p.add_argument("--tiles", type=a.positive_int, default=1,
                   help="sub-chunk tiles per chunk: adds a row for the device solver on tiles")
    p.add_argument("--mask", choices=("docs", "nsa", "dsa"), default="docs",
                   help="packed documents (default), or a sparse indexer's selection")

    p = subs["simulate"] = sub.add_parser(
        "simulate", help="simulated layer time on a cluster: ours, USP, balanced USP, ideal bound",
        description="Solve one mask and simulate the layer (forward, backward, training step) on a cluster "
                    "topology: the runtime's own schedule priced per link and per rank, next to USP and a "
                    "load-balanced USP on the same sequential shards, and the plan's ideal bound. Every figure "
                    "is SIMULATED (a model), not measured. Writes the timeline as a PNG.")
    _shape_options(p, P=32, tokens=8192, heads="64:8", head_dim=128, dtype="bfloat16")
    p.add_argument("--topology", choices=("h100_hgx", "h200_hgx", "gb200_nvl72", "single_node"), default="h200_hgx",
                   help="cluster preset (default h200_hgx: nodes of 8, NVLink 450 GB/s, one 50 GB/s NIC per GPU)")
    p.add_argument("--own-nic", action="store_true",
                   help="send every inter-node byte through the source GPU's own NIC (a gloo group, or NCCL with "
                        "NCCL_P2P_PXN_LEVEL=0); default: the preset's rail routing, as NCCL sends (Topology.rail_routing)")
    p.add_argument("--mask", choices=a.MASK_KINDS, default="docs", help=a.MASK_HELP)
    p.add_argument("--tiles", type=a.positive_int, default=1, help="sub-chunk tiles per chunk (default 1)")
    p.add_argument("--solver", choices=("device", "reference"), default="device")
    p.add_argument("--stages", type=a.stages, default="auto",
                   help="remote sub-stages, SolverConfig.num_stages: an int, or auto (default, the library's: 4 "
                        "for these masks, the simulated best); 1 for the two-stage layer")
    p.add_argument("--comm", choices=("a2a", "p2p", "p2p-batch"), default="p2p",
                   help="TorchGroup's transport as simulated: p2p (default, TorchGroup's: a handle per send "
                        "and receive, as on gloo), a2a (transport=\"a2a\": all-to-all-v), p2p-batch (p2p on "
                        "NCCL's coalesced batch)")
    p.add_argument("--out", default="build/timeline.png", help="timeline PNG ('' for none; default build/timeline.png)")
    p.add_argument("--critical-path", action="store_true",
                   help="also print where each pass's time went: the chain of compute, transfers and latencies "
                        "that ends at its last rank's finish (gpusolver.sim.critical)")

    p = subs["bench"] = sub.add_parser(
        "bench", help="the benchmarks that apply here, as one markdown report",
        description="Run the quality, latency, layer and kernel benchmarks that apply to this machine with "
                    "small options, and write one markdown report headed by the machine's description. "
                    "Needs the source tree (benchmarks/).")
    p.add_argument("--out", default="benchmarks/results/bench_report.md", help="report path")
    p.add_argument("--quick", action="store_true", help="the smallest options (a smoke run)")
    p.add_argument("--timeout", type=a.positive_int, default=600, help="seconds per benchmark (default 600)")
    p.add_argument("--only", default=None, help="comma-separated subset of quality, latency, layer, kernels")
    return parser, subs


def _check(args, subs) -> None:
    """Cross-option checks, as one-line usage errors."""
    from gpusolver.config import SolverConfig

    p = subs[args.command]
    if args.command == "bench":
        return
    hq, hkv = args.heads
    P = args.cp_size if args.cp_size is not None else 1
    try:
        config = SolverConfig(cp_size=P, num_heads_q=hq, num_heads_kv=hkv, head_dim=args.head_dim,
                              chunk_tiles=getattr(args, "tiles", 1), num_stages=getattr(args, "stages", "auto"))
        if args.cp_size is not None:
            config.check_seqlen(args.tokens_per_rank * P)
    except ValueError as e:
        p.error(str(e).splitlines()[0])
    if args.command == "demo" and args.check and args.tokens_per_rank * (args.cp_size or 8) > 16384:
        p.error(f"S = {args.tokens_per_rank * (args.cp_size or 8)} tokens: the demo checks every layer against "
                "dense attention, so keep S <= 16384 or pass --no-check")
    import os

    if getattr(args, "plan", None) and args.command == "show":
        if not os.path.exists(args.plan):
            p.error(f"--plan {args.plan}: no such file")
    save = getattr(args, "save", None)
    if save and not os.path.isdir(os.path.dirname(os.path.abspath(save))):
        p.error(f"--save {save}: the folder {os.path.dirname(os.path.abspath(save))} does not exist")


def main(argv=None) -> int:
    parser, subs = build_parser()
    args = parser.parse_args(argv)
    _check(args, subs)
    if args.command == "demo":
        from gpusolver.cli import demo

        return demo.run(args)
    if args.command == "show":
        from gpusolver.cli import show

        return show.run(args)
    if args.command == "solve":
        from gpusolver.cli.quality import solve_command

        solve_command(args)
        return 0
    if args.command == "quality":
        from gpusolver.cli.quality import quality

        quality(args)
        return 0
    if args.command == "simulate":
        from gpusolver.cli import simulate

        return simulate.run(args)
    from gpusolver.cli import bench

    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
