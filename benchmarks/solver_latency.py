"""Solve latency and kernel launches per solve vs P, next to the CPU reference solver.

For each P (packed-document masks, 8K tokens per rank, GQA 64:8, D = 128,
bf16, G = 8) and backend:

``cpu/torch``   block areas (torch implementation) then ``solve_device`` on
                CPU tensors; wall time, median of ``--repeats`` after a warm-up.
``cuda/...``    (only where ``torch.cuda.is_available()``) block areas
                (Triton implementation) then ``solve_device`` on CUDA tensors,
                for each Triton path (``CUDA_PATHS``: a few kernels per
                round; the persistent kernel with 1 and with the default
                number of workers per variant):
                CUDA-event times after warm-up, the same pipeline captured in
                a CUDA graph and replayed, and one run under
                ``torch.cuda.set_sync_debug_mode("error")`` to prove it never
                waits on the device.

Launches per solve are counted in the (untimed) warm-up run: every op seen by
a ``TorchDispatchMode`` is a kernel launch on a GPU (views excepted), plus
every Triton kernel launch. Host reads (``.item()``, ``nonzero``, ...) are
counted too and must be 0. On CPU the times are not GPU latency; the launch
count is the proxy for it. Next to each row: the CPU reference solver's time
on the same mask, and quality (both imbalances, device / reference forward
and backward bottleneck). The torch path runs with ``torch.set_num_threads(1)``
(the fair comparison with the single-threaded reference, which always runs
so); ``--threads 1,2`` adds a row per thread count, e.g. both cores of a
2-core machine.

    python benchmarks/solver_latency.py                      # P = 8..128, 3 repeats
    python benchmarks/solver_latency.py --P 8,16 --repeats 5
    python benchmarks/solver_latency.py --quick              # P = 8,16, 1 repeat
    python benchmarks/solver_latency.py --P 8 --tiles 4      # with sub-chunk tiles (chunk_tiles = 4)
    python benchmarks/solver_latency.py --P 64 --threads 1,2 # the torch path on 1 and on 2 threads
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, run as a script or loaded by path

from _common import (  # noqa: E402
    KINDS, RESULTS_DIR, TOKENS_PER_RANK, LaunchCounter, cuda_time, environment, make_mask, markdown_table,
    parse_list, ratio, wall_time, write_results,
)
from gpusolver.areas import block_areas  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.metrics import evaluate  # noqa: E402
from gpusolver.solver.device import solve_device  # noqa: E402
from gpusolver.solver.reference import assign  # noqa: E402

FULL_P, QUICK_P = (8, 16, 32, 64, 128), (8, 16)
FULL_REPEATS, QUICK_REPEATS = 3, 1
ANCHOR_LINE = ("Anchor (MagiAttention host solver, GQA 64:8, 8K tokens per device): ≤ 30 ms for CP ≤ 64; "
               "document masks ≤ 45 ms up to CP = 128. CPU torch-path times are not GPU latency: "
               "launches per solve are the proxy (a few dozen fused launches fit well under 1 ms on an H200).")

COLUMNS = [
    ("kind", "kind", ""), ("P", "P", "d"), ("tiles", "tiles", "d"), ("backend", "backend", ""),
    ("areas ms", "areas_ms", ".1f"), ("solve ms", "solve_ms", ".1f"), ("total ms", "total_ms", ".1f"),
    ("graph ms", "graph_ms", ".3f"), ("sync-free", "sync_free", ""),
    ("areas launches", "areas_launches", "d"), ("solve launches", "solve_launches", "d"),
    ("triton launches", "triton_launches", "d"), ("host reads", "host_reads", "d"),
    ("ref ms", "ref_ms", ".1f"), ("imb dev", "imbalance_device", ".3f"), ("imb ref", "imbalance_reference", ".3f"),
    ("fwd dev/ref", "fwd_dev_over_ref", ".2f"), ("bwd dev/ref", "bwd_dev_over_ref", ".2f"),
]


def _counts(areas_count: LaunchCounter, solve_count: LaunchCounter) -> dict:
    return {
        "areas_launches": areas_count.launches, "solve_launches": solve_count.launches,
        "launches": areas_count.launches + solve_count.launches,
        "triton_launches": areas_count.triton_launches + solve_count.triton_launches,
        "host_reads": areas_count.host_reads + solve_count.host_reads,
        "areas_ops": areas_count.to_dict(), "solve_ops": solve_count.to_dict(),
        "triton_hooked": areas_count.triton_hooked and solve_count.triton_hooked,
        "note": areas_count.note or solve_count.note,
    }


def _quality(areas, dev_asg, ref_asg, config) -> dict:
    cost = config.cost()
    md, mr = evaluate(areas, dev_asg, cost), evaluate(areas, ref_asg, cost)
    return {
        "imbalance_device": float(md.imbalance), "imbalance_reference": float(mr.imbalance),
        "fwd_device_bytes": int(md.fwd_bottleneck), "fwd_reference_bytes": int(mr.fwd_bottleneck),
        "bwd_device_bytes": int(md.bwd_bottleneck), "bwd_reference_bytes": int(mr.bwd_bottleneck),
        "fwd_dev_over_ref": ratio(int(md.fwd_bottleneck), int(mr.fwd_bottleneck)),
        "bwd_dev_over_ref": ratio(int(md.bwd_bottleneck), int(mr.bwd_bottleneck)),
    }


def cpu_rows(kind: str, cp_size: int, seed: int, repeats: int, tokens_per_rank: int, tiles: int = 1,
             threads=(1,)):
    """The torch path on CPU, timed with each of ``threads`` intra-op thread counts, and the
    reference solver (on whole chunks, one thread, timed once for all rows).

    Returns (one row per thread count, device assignment, reference assignment), both
    [G, U, U] int32 on CPU (U = tiles * P; the reference's chunk pairs spread over their tiles).
    """
    config = SolverConfig(cp_size=cp_size, chunk_tiles=tiles)
    mask = make_mask(kind, cp_size, seed, tokens_per_rank)
    run_areas = lambda: block_areas(mask, cp_size, config.head_groups, impl="torch", tiles=tiles)  # noqa: E731
    with LaunchCounter() as count_areas:  # doubles as the warm-up
        areas = run_areas()
    with LaunchCounter() as count_solve:
        solve_device(areas, config)
    times = []
    for n in threads:
        torch.set_num_threads(n)
        try:
            areas_s, areas = wall_time(run_areas, repeats, warmup=0)
            solve_s, res = wall_time(lambda: solve_device(areas, config), repeats, warmup=0)
        finally:
            torch.set_num_threads(1)
        times.append((n, areas_s, solve_s))
    whole = areas.coarsen()
    ref_s, ref = wall_time(lambda: assign(whole, dataclasses.replace(config, chunk_tiles=1)), repeats, warmup=0)
    ref_asg = areas.refine(ref.assignment)
    common = {"kind": kind, "P": cp_size, "tiles": tiles, "seed": seed, "num_slices": mask.num_slices,
              "graph_ms": None, "sync_free": None, "ref_ms": 1e3 * ref_s, "reference_feasible": ref.feasible,
              "balanced_device": bool(res.balanced), **_counts(count_areas, count_solve),
              **_quality(areas, res.assignment, ref_asg, config)}
    rows = [{**common, "backend": "cpu/torch" + ("" if n == 1 else f" {n} threads"), "threads": n,
             "areas_ms": 1e3 * areas_s, "solve_ms": 1e3 * solve_s, "total_ms": 1e3 * (areas_s + solve_s)}
            for n, areas_s, solve_s in times]
    return rows, res.assignment, ref_asg


def _sync_free(fn) -> tuple[bool, str]:
    """Run ``fn`` once with ``set_sync_debug_mode("error")``: (no sync happened, error text)."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        ok, err = True, ""
    except RuntimeError as e:
        ok, err = False, str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    return ok, err


def _graph_replay(fn, repeats: int):
    """Capture ``fn`` in a CUDA graph (after a side-stream warm-up) and time its replay.

    Returns (median replay seconds, fn's output as the graph's static tensors).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    secs, _ = cuda_time(graph.replay, repeats, warmup=1)
    return secs, out


# The CUDA paths timed side by side: (impl, workers per variant of the persistent kernel, None = auto).
CUDA_PATHS = (("triton", None), ("persistent", 1), ("persistent", None))


def cuda_row(kind: str, cp_size: int, seed: int, repeats: int, tokens_per_rank: int, cpu: dict,
             cpu_asg, ref_asg_cpu, impl: str = "triton", workers: int | None = None, tiles: int = 1) -> dict:
    """One Triton path on CUDA: event times, launches, CUDA-graph replay, sync-free check."""
    config = SolverConfig(cp_size=cp_size, chunk_tiles=tiles)
    mask = make_mask(kind, cp_size, seed, tokens_per_rank, device="cuda")
    run_areas = lambda: block_areas(mask, cp_size, config.head_groups, impl="triton", tiles=tiles)  # noqa: E731
    solve = lambda areas: solve_device(areas, config, impl=impl, workers=workers)  # noqa: E731
    pipeline = lambda: solve(run_areas())  # noqa: E731
    backend = f"cuda/{impl}" + ("" if impl != "persistent" else f" W={workers or 'auto'}")
    for _ in range(2):  # compile the Triton kernels, warm the allocator
        pipeline()
    torch.cuda.synchronize()
    with LaunchCounter() as count_areas:
        areas = run_areas()
    with LaunchCounter() as count_solve:
        solve(areas)
    torch.cuda.synchronize()
    areas_s, areas = cuda_time(run_areas, repeats)
    solve_s, res = cuda_time(lambda: solve(areas), repeats)
    sync_free, sync_err = _sync_free(pipeline)
    try:
        graph_s, graph_out = _graph_replay(pipeline, repeats)
        graph_ms, graph_err = 1e3 * graph_s, ""
        graph_same = bool(torch.equal(graph_out.assignment, res.assignment))
    except Exception as e:  # noqa: BLE001 - report the failure in the table rather than stop the benchmark
        graph_ms, graph_err, graph_same = None, f"{type(e).__name__}: {str(e).splitlines()[0]}", None
        torch.cuda.synchronize()
    ref_asg = ref_asg_cpu.to("cuda")
    return {"kind": kind, "P": cp_size, "tiles": tiles, "seed": seed, "backend": backend,
            "num_slices": mask.num_slices,
            "areas_ms": 1e3 * areas_s, "solve_ms": 1e3 * solve_s, "total_ms": 1e3 * (areas_s + solve_s),
            "graph_ms": graph_ms, "graph_error": graph_err, "graph_matches_eager": graph_same,
            "sync_free": sync_free, "sync_error": sync_err, "ref_ms": cpu["ref_ms"],
            "reference_feasible": cpu["reference_feasible"], "balanced_device": bool(res.balanced),
            "matches_cpu": bool(torch.equal(res.assignment.cpu(), cpu_asg)),
            **_counts(count_areas, count_solve), **_quality(areas, res.assignment, ref_asg, config)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--P", default=None, help=f"CP sizes, comma-separated (default {','.join(map(str, FULL_P))})")
    p.add_argument("--repeats", type=int, default=None, help=f"timed repeats (default {FULL_REPEATS})")
    p.add_argument("--kinds", default="causal", help="mask kinds: causal, full, causal-seq, full-seq (default causal)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiles", type=int, default=1, help="sub-chunk tiles per chunk (SolverConfig.chunk_tiles)")
    p.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK)
    p.add_argument("--threads", default="1", help="torch-path thread counts, comma-separated (default 1)")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA path even when a GPU is present")
    p.add_argument("--json", default=str(RESULTS_DIR / "solver_latency.json"), help="JSON output path")
    p.add_argument("--md", default=None, help="also write the printed tables to this markdown file")
    p.add_argument("--quick", action="store_true", help=f"P = {','.join(map(str, QUICK_P))}, {QUICK_REPEATS} repeat")
    args = p.parse_args(argv)
    try:
        args.P = parse_list(args.P, int, name="--P") if args.P else list(QUICK_P if args.quick else FULL_P)
        args.kinds = parse_list(args.kinds, str, allowed=tuple(KINDS), name="--kinds")
        args.threads = parse_list(args.threads, int, name="--threads")
    except ValueError as e:
        p.error(str(e))
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else FULL_REPEATS
    if args.repeats <= 0:
        p.error(f"--repeats must be positive, got {args.repeats}")
    if args.tiles <= 0:
        p.error(f"--tiles must be positive, got {args.tiles}")
    return args


def main(argv=None) -> dict:
    """Run the benchmark; prints the table and returns the JSON payload (``rows``, ...)."""
    torch.set_num_threads(1)
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.no_cuda
    rows = []
    for kind in args.kinds:
        for P in args.P:
            cpus, cpu_asg, ref_asg = cpu_rows(kind, P, args.seed, args.repeats, args.tokens_per_rank, args.tiles,
                                              args.threads)
            rows.extend(cpus)
            cpu = cpus[0]
            if use_cuda:
                rows.extend(cuda_row(kind, P, args.seed, args.repeats, args.tokens_per_rank, cpu, cpu_asg, ref_asg,
                                     impl, workers, args.tiles) for impl, workers in CUDA_PATHS)
            print(f"# done {kind} P={P}", file=sys.stderr, flush=True)
    notes = sorted({r["note"] for r in rows if r["note"]} | {f"P={r['P']}: graph failed: {r['graph_error']}"
                                                            for r in rows if r.get("graph_error")}
                   | {f"P={r['P']}: sync check failed: {r['sync_error']}" for r in rows if r.get("sync_error")})
    text = "\n\n".join([
        f"## Solver latency: packed documents, {args.tokens_per_rank} tokens per rank, Hq:Hkv = 64:8, D = 128, "
        f"bf16, G = 8, mu = 1.10; {args.repeats} repeats (median), "
        f"{'CUDA: ' + torch.cuda.get_device_name() if use_cuda else 'no GPU: CPU torch path only'}",
        markdown_table(rows, COLUMNS), ANCHOR_LINE, *notes,
    ]) + "\n"
    print(text)
    payload = {
        "benchmark": "solver_latency",
        "config": {"P": args.P, "repeats": args.repeats, "kinds": args.kinds, "seed": args.seed, "tiles": args.tiles,
                   "threads": args.threads,
                   "tokens_per_rank": args.tokens_per_rank, "cuda": use_cuda},
        "environment": environment(), "rows": rows,
    }
    write_results(args.json, payload, args.md, text)
    return payload


if __name__ == "__main__":
    main()
