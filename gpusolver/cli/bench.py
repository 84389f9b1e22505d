"""``python -m gpusolver bench``: runs ``benchmarks/bench_report.py`` from the source tree."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_report.py"


def run(args) -> int:
    if not SCRIPT.exists():
        raise SystemExit(f"gpusolver bench: {SCRIPT} is missing; bench runs from a source checkout "
                         "(the benchmarks are not installed with the package)")
    cmd = [sys.executable, str(SCRIPT), "--out", args.out, "--timeout", str(args.timeout)]
    if args.quick:
        cmd.append("--quick")
    if args.only:
        cmd += ["--only", args.only]
    return subprocess.run(cmd).returncode
