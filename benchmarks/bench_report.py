"""One markdown report of the benchmarks that apply to this machine, headed by the machine's description.

    python benchmarks/bench_report.py [--quick] [--only quality,latency] [--out report.md]
    python -m gpusolver bench ...            # the same

Runs, each in its own process under a timeout, with small options so the
whole report takes minutes (``--quick``: about a minute on 2 CPU cores):

  quality   benchmarks/solver_quality.py  both solvers vs USP / owner-computes (8K tokens per rank, 64:8)
  latency   benchmarks/solver_latency.py  solve time and launches per solve (CUDA paths on a GPU)
  layer     benchmarks/layer_bench.py     bytes, buffer fill and simulated layer time (the real
                                          dist_attn run only on a GPU: on CPU it takes minutes)
  kernels   benchmarks/kernel_bench.py    on a GPU: TFLOP/s vs SDPA and FlexAttention; on CPU: the
                                          plan stages' static cost (no compile)

Each benchmark writes its JSON and markdown into a temporary folder, so the
committed ``benchmarks/results/`` stay as they are; the report quotes the
markdown (or the output's tail when a benchmark writes none) with the
command that regenerates it.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ("quality", "latency", "layer", "kernels")
TAIL = 4000


def machine() -> dict:
    """Host facts for the report's head (no device reads beyond torch's own queries)."""
    import torch
    import triton

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        kb = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                  if ln.startswith("MemTotal"))
        mem = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    gpu = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = f"{torch.cuda.device_count()} x {p.name} ({p.multi_processor_count} SMs, " \
              f"{p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor})"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, False
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "gpu": gpu, "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": (commit + (" (uncommitted changes)" if dirty else "")) if commit else "unknown"}


def commands(tmp: Path, *, quick: bool, gpu: bool) -> dict[str, list[str]]:
    """The command of each benchmark for this machine (scripts relative to the source tree)."""
    P = "8" if quick else "8,16"
    seeds = "1" if quick else "3"
    out = {
        "quality": ["benchmarks/solver_quality.py", "--P", P, "--seeds", seeds],
        "latency": ["benchmarks/solver_latency.py", "--P", P, "--repeats", "1" if quick else "3"],
        "layer": ["benchmarks/layer_bench.py", "--P", "8", "--seeds", seeds] + ([] if gpu else ["--no-real"]),
    }
    for name in out:
        out[name] += ["--json", str(tmp / f"{name}.json"), "--md", str(tmp / f"{name}.md")]
    if gpu:
        out["kernels"] = ["benchmarks/kernel_bench.py", "--seqlens", "4096", "16384", "--reps", "3" if quick else "10"]
    else:
        out["kernels"] = ["benchmarks/kernel_bench.py", "--static", "--no-compile", "--cp", "8",
                          "--tokens-per-rank", "1024", "--out", str(tmp / "kernels.md")]
    return out


def run_one(name: str, cmd: list[str], tmp: Path, timeout: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x))
    env.setdefault("TRITON_INTERPRET", "0")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace", timeout=timeout)
        rc, text = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:  # what it printed before the timeout still goes in the report
        rc, text = None, e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    md = tmp / f"{name}.md"
    return {"rc": rc, "seconds": time.monotonic() - t0, "output": text,
            "markdown": md.read_text() if md.exists() else None}


def _shown(cmd: list[str]) -> str:
    """The command as a user would type it (the temporary output paths left out)."""
    shown, skip = [], False
    for a in cmd:
        if not skip and a not in ("--json", "--md", "--out"):
            shown.append(a)
        skip = not skip and a in ("--json", "--md", "--out")
    return "python " + " ".join(shown)


def render(info: dict, results: dict, cmds: dict, *, quick: bool) -> str:
    head = [
        "# gpusolver benchmark report",
        "",
        f"- machine: {info['cpu']}, {info['cores']} cores"
        + (f", {info['memory_gib']} GiB" if info["memory_gib"] else "")
        + f"; GPU: {info['gpu'] or 'none'}",
        f"- software: {info['os']}, Python {info['python']}, torch {info['torch']}, triton {info['triton']}",
        f"- source: commit {info['commit']}; {time.strftime('%Y-%m-%d %H:%M')}",
        f"- regenerate: `python -m gpusolver bench{' --quick' if quick else ''}`",
        "",
        "| benchmark | status | seconds | command |",
        "|---|---|---:|---|",
    ]
    for name, r in results.items():
        status = "timed out" if r["rc"] is None else ("ok" if r["rc"] == 0 else f"failed (exit {r['rc']})")
        head.append(f"| {name} | {status} | {r['seconds']:.0f} | `{_shown(cmds[name])}` |")
    body = []
    for name, r in results.items():
        body += ["", f"## {name}", "", f"`{_shown(cmds[name])}`", ""]
        if r["markdown"] and r["rc"] == 0:
            text = r["markdown"].strip()
            # the benchmarks' own headings sit one level below this report's
            body.append("\n".join(("#" + ln) if ln.startswith("#") else ln for ln in text.splitlines()))
        else:
            body += ["```", r["output"][-TAIL:].rstrip(), "```"]
    return "\n".join(head + body) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_report.md"), help="report path")
    p.add_argument("--quick", action="store_true", help="the smallest options (about a minute on 2 cores)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(BENCHES)}")
    p.add_argument("--timeout", type=int, default=600, help="seconds per benchmark (default 600)")
    args = p.parse_args(argv)
    only = BENCHES if args.only is None else tuple(b.strip() for b in args.only.split(",") if b.strip())
    bad = [b for b in only if b not in BENCHES]
    if bad:
        p.error(f"unknown benchmarks {bad}; choose from {', '.join(BENCHES)}")
    info = machine()
    with tempfile.TemporaryDirectory(prefix="bench") as tmp_name:
        tmp = Path(tmp_name)
        cmds = {k: v for k, v in commands(tmp, quick=args.quick, gpu=info["gpu"] is not None).items() if k in only}
        results = {}
        for name, cmd in cmds.items():
            print(f"bench: {name}: {_shown(cmd)}", flush=True)
            results[name] = run_one(name, cmd, tmp, args.timeout)
            r = results[name]
            print(f"bench: {name}: {'timed out' if r['rc'] is None else 'exit ' + str(r['rc'])} "
                  f"in {r['seconds']:.0f} s", flush=True)
        text = render(info, results, cmds, quick=args.quick)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"report: {out}")
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
