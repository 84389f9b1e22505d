"""``make gpu-check``: everything that needs a GPU, in at most 8 minutes, summed up in one JSON file.

    PYTHONPATH=. python scripts/gpu_check.py [--out build/gpu_check.json] [--budget 480] [--only a,b]

It installs nothing and runs from the source tree. Without a CUDA GPU it
writes the summary with the reason and exits 2 at once. Each step runs in
its own process under ``timeout`` (a hung grid barrier cannot stall the
rest), within what is left of the budget:

  env         torch / triton versions and the device's properties
  tests       pytest tests/gpu (every solver path equals the CPU one, sync-free, CUDA-graph replay)
  sync_debug  the solve (torch, triton and persistent paths) and dist_attn forward + backward on a
              LocalGroup under torch.cuda.set_sync_debug_mode("error")
  cuda_graph  solve + metas + dist_attn (LocalGroup) captured in one CUDA graph: the replay equals
              eager, and after the mask tensors change in place, equals eager on the new mask
  demo        python -m gpusolver demo on one GPU (fp32 and bf16), checked against dense attention
  latency     full solve (areas, assignment, metas) vs P for the three paths: eager (CUDA events)
              and CUDA-graph replay
  kernels     benchmarks/kernel_bench.py: attention TFLOP/s vs SDPA and FlexAttention

The summary: ``{"ok", "seconds", "machine", "steps": {name: {"ok", "rc", "seconds", "timed_out",
"result", "tail"}}}``; exit status 0 only when every step passed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480
# (step, seconds it may take at most, command; None = a function of this script)
STEPS = [
    ("env", 30, None),
    ("tests", 120, [sys.executable, "-m", "pytest", "tests/gpu", "-x", "-q", "-p", "no:cacheprovider"]),
    ("sync_debug", 60, None),
    ("cuda_graph", 60, None),
    ("demo", 90, None),  # first runs compile the solver's and the attention's kernels at the demo's shapes
    ("latency", 75, None),
    ("kernels", 45, [sys.executable, "benchmarks/kernel_bench.py", "--seqlens", "4096", "16384", "--reps", "5",
                     "--warmup", "2"]),
]
TAIL = 3000


# -- the in-process steps (run as `gpu_check.py --step NAME --result FILE`) -------------------------


def _env() -> dict:
    import torch
    import triton

    p = torch.cuda.get_device_properties(0)
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "device": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}", "devices": torch.cuda.device_count()}


def _layer_case(P: int, c: int, Hq: int, Hkv: int, D: int, seed: int, rows: int | None = None):
    """(config, mask, q, k, v) on CUDA for a packed-document layer (mask padded to ``rows`` slices)."""
    import torch

    from gpusolver import SolverConfig
    from gpusolver.masks import packed_documents
    from gpusolver.runtime import shard
    from groupcomm import LocalGroup

    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.bfloat16)
    mask = packed_documents(P * c, seed=seed, device="cuda", pad_to=rows)
    g = torch.Generator().manual_seed(seed)
    group = LocalGroup(P)
    q, k, v = (shard(torch.randn(P * c, h, D, generator=g), group).to("cuda", torch.bfloat16)
               for h in (Hq, Hkv, Hkv))
    return config, mask, group, q, k, v


def _sync_debug() -> dict:
    import torch

    from gpusolver import solve
    from gpusolver.runtime import dist_attn

    from gpusolver import SolverConfig
    from gpusolver.masks import packed_documents

    out = {}
    config = SolverConfig(cp_size=16)  # GQA 64:8, D = 128, bf16, 8K tokens per rank
    mask = packed_documents(16 * 8192, seed=1, device="cuda")
    for impl in ("torch", "triton", "persistent"):
        solve(mask, config, impl=impl, validate=False)  # compile and warm the allocator first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            solve(mask, config, impl=impl, validate=False)
            out[f"solve {impl}"] = "ok"
        except Exception as e:  # the message names the syncing call
            out[f"solve {impl}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")

    config, mask, group, q, k, v = _layer_case(8, 1024, 8, 2, 128, 2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def layer():
        plan = solve(mask, config, validate=False)
        o, lse = dist_attn(q, k, v, plan, group, validate=False)
        o.float().square().sum().backward()
        return o

    layer()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
        out["dist_attn fwd+bwd LocalGroup"] = "ok"
    except Exception as e:
        out["dist_attn fwd+bwd LocalGroup"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out["ok"] = all(v == "ok" for v in out.values())
    return out


def _cuda_graph() -> dict:
    import torch

    from gpusolver import solve
    from gpusolver.masks import packed_documents
    from gpusolver.runtime import dist_attn

    rows = 64  # static slice count: every mask is padded to it, so a new mask fits the captured shapes
    config, mask, group, q, k, v = _layer_case(8, 2048, 16, 4, 128, 3, rows)
    out = {}
    for impl in ("triton", "persistent"):
        def layer():
            plan = solve(mask, config, impl=impl, validate=False)
            o, lse = dist_attn(q, k, v, plan, group, validate=False)
            return plan.assignment, o, lse

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                layer()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = layer()
        res = {}
        for seed in (3, 4):  # the captured mask, then a new one copied into the same tensors
            new = packed_documents(mask.total_seqlen_q, seed=seed, device="cuda", pad_to=rows)
            mask.q_ranges.copy_(new.q_ranges)
            mask.k_ranges.copy_(new.k_ranges)
            mask.attn_type.copy_(new.attn_type)
            graph.replay()
            eager = layer()
            torch.cuda.synchronize()
            res[f"mask seed {seed} equal"] = all(torch.equal(a, b) for a, b in zip(static, eager))
        t_eager, t_graph = _time(layer), _time(graph.replay)
        res.update(eager_ms=t_eager, replay_ms=t_graph)
        out[impl] = res
    out["ok"] = all(v for r in out.values() for k, v in r.items() if k.endswith("equal"))
    return out


def _time(fn, reps: int = 10) -> float:
    """Median ms of ``fn`` by CUDA events, after one warm-up call."""
    import torch

    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(statistics.median(times), 3)


def _latency(deadline: float) -> dict:
    import torch

    from gpusolver import SolverConfig, solve
    from gpusolver.masks import packed_documents

    rows = []
    for P in (8, 16, 32, 64):
        config = SolverConfig(cp_size=P)  # GQA 64:8, D = 128, bf16: the benchmark shapes
        mask = packed_documents(8192 * P, seed=0, device="cuda")
        for impl in ("torch", "triton", "persistent"):
            if time.monotonic() > deadline:
                rows.append({"P": P, "impl": impl, "skipped": "out of time"})
                continue
            row = {"P": P, "impl": impl}
            try:
                row["eager_ms"] = _time(lambda: solve(mask, config, impl=impl, validate=False), reps=5)
                if impl != "torch":
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        solve(mask, config, impl=impl, validate=False)
                    row["replay_ms"] = _time(graph.replay, reps=10)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"ok": not any("error" in r for r in rows), "rows": rows}


def _run_step(name: str, result_path: str, deadline: float) -> int:
    fns = {"env": _env, "sync_debug": _sync_debug, "cuda_graph": _cuda_graph,
           "latency": lambda: _latency(deadline)}
    try:
        result = fns[name]()
        ok = result.get("ok", True)
    except Exception as e:
        traceback.print_exc()
        result, ok = {"error": f"{type(e).__name__}: {e}"[:2000]}, False
    Path(result_path).write_text(json.dumps(result, indent=1, default=str))
    return 0 if ok else 1


# -- the driver ---------------------------------------------------------------------------------------


def _command(name: str, cmd, result_path: str, out_dir: Path, deadline: float):
    if name == "demo":
        py = sys.executable
        png = str(out_dir / "demo_plan.png")
        return ["bash", "-c", f"{py} -m gpusolver demo --device cuda --out {png} && "
                              f"{py} -m gpusolver demo --device cuda --dtype bf16 --out ''"]
    if cmd is None:
        return [sys.executable, str(Path(__file__).resolve()), "--step", name, "--result", result_path,
                "--deadline", str(deadline)]
    return cmd


def no_gpu_reason() -> str | None:
    try:
        import torch
    except ImportError as e:
        return f"torch does not import: {e}"
    if not torch.cuda.is_available():
        return (f"no CUDA GPU: torch {torch.__version__} reports torch.cuda.is_available() == False "
                f"(CUDA build: {torch.version.cuda or 'none'})")
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else \
        ROOT / "build" / "gpu_check.json"
    p.add_argument("--out", default=str(default_out), help=f"the JSON summary (default {default_out})")
    p.add_argument("--budget", type=int, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S})")
    p.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step:
        return _run_step(args.step, args.result, args.deadline or time.monotonic() + 60)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"ok": False, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    reason = no_gpu_reason()
    if reason:
        summary["error"] = reason
        out.write_text(json.dumps(summary, indent=1))
        print(f"gpu-check FAILED: {reason}.\nThis check needs a CUDA GPU; nothing was run. Summary: {out}",
              file=sys.stderr)
        return 2

    names = [s[0] for s in STEPS]
    only = names if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(names)
    if unknown:
        p.error(f"unknown steps {sorted(unknown)}; steps: {', '.join(names)}")
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x))
    t0 = time.monotonic()
    end = t0 + args.budget
    with tempfile.TemporaryDirectory(prefix="gpu_check") as tmp:
        for name, limit, cmd in STEPS:
            if name not in only:
                continue
            left = end - time.monotonic()
            if left < 10:
                summary["steps"][name] = {"ok": False, "skipped": "the check's time budget is spent"}
                continue
            limit = int(min(limit, left - 5))
            result_path = os.path.join(tmp, f"{name}.json")
            argv_ = ["timeout", "-k", "5", str(limit)] + _command(name, cmd, result_path, out.parent,
                                                                 time.monotonic() + limit - 15)
            print(f"gpu-check: {name} (at most {limit} s) ...", flush=True)
            s0 = time.monotonic()
            proc = subprocess.run(argv_, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace")
            step = {"rc": proc.returncode, "seconds": round(time.monotonic() - s0, 1),
                    "timed_out": proc.returncode in (124, 137), "tail": proc.stdout[-TAIL:]}
            if os.path.exists(result_path):
                step["result"] = json.loads(Path(result_path).read_text())
            step["ok"] = proc.returncode == 0
            summary["steps"][name] = step
            if name == "env" and "result" in step:
                summary["machine"] = step["result"]
            print(f"gpu-check: {name}: {'ok' if step['ok'] else 'FAILED'} in {step['seconds']} s"
                  + (" (timed out)" if step["timed_out"] else ""), flush=True)
            out.write_text(json.dumps(summary, indent=1))  # a killed check still leaves what it had
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["ok"] = all(s.get("ok") for s in summary["steps"].values())
    out.write_text(json.dumps(summary, indent=1))
    failed = [n for n, s in summary["steps"].items() if not s.get("ok")]
    print(f"gpu-check: {'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)}; "
          f"{summary['seconds']} s; summary in {out}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
