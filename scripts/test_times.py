"""The suite's tiers timed: the 20 slowest tests and each tier's totals.

    python scripts/test_times.py                 # run both tiers (pytest -n 2), then report
    python scripts/test_times.py --tier fast     # only ``make test``'s tier (-m "not slow")
    python scripts/test_times.py --read          # report the last run again (build/test_times/)
    python scripts/test_times.py --tier fast -n 1 tests/gpusolver   # other arguments go to pytest

Each tier runs as its own pytest process that records every test's phase
times as it finishes (``GPUSOLVER_TEST_TIMES``, tests/conftest.py; a run cut
short keeps what it finished); the report lists the slowest tests of all
tiers run (set-up + call + tear-down seconds) and, per tier, its test count,
the summed test seconds and the tier's wall time. Times move with other load
on the machine. ``--file PATH`` reports one such times file instead.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "test_times"
TIERS = {"fast": "not slow", "slow": "slow"}


def run_tier(tier: str, workers: int, extra: list[str]) -> float:
    """Run one tier under pytest, its JUnit report into OUT; returns wall seconds."""
    OUT.mkdir(parents=True, exist_ok=True)
    times = OUT / f"{tier}.tsv"
    times.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", TIERS[tier],
           *(["-n", str(workers)] if workers > 1 else []), *(extra or ["tests"])]
    env = dict(os.environ, TRITON_INTERPRET="1", GPUSOLVER_TEST_TIMES=str(times))
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    (OUT / f"{tier}.json").write_text(json.dumps({"wall_s": wall, "rc": rc, "command": " ".join(cmd)}))
    return wall


def read_times(path: Path) -> list[tuple[float, str, str]]:
    """(seconds, test id, outcome) per test from a GPUSOLVER_TEST_TIMES file (tests/conftest.py):
    set-up + call + tear-down seconds; the outcome is the first phase that did not pass."""
    seconds, outcome = {}, {}
    for line in path.read_text().splitlines():
        nodeid, phase, t, result = line.split("\t")
        seconds[nodeid] = seconds.get(nodeid, 0.0) + float(t)
        if outcome.get(nodeid, "passed") == "passed":
            outcome[nodeid] = result if phase == "call" or result != "passed" else "passed"
    return [(t, nodeid, outcome[nodeid]) for nodeid, t in seconds.items()]


def read_tier(tier: str) -> tuple[list[tuple[float, str, str]], dict]:
    """The tier's last run: its tests (``read_times``) and its run record (wall seconds, exit status)."""
    times, meta = OUT / f"{tier}.tsv", OUT / f"{tier}.json"
    if not times.exists():
        return [], {}
    return read_times(times), json.loads(meta.read_text()) if meta.exists() else {}


def report(tiers: list[str], top: int = 20) -> dict:
    rows, totals = [], {}
    for tier in tiers:
        tests, meta = read_tier(tier)
        if not tests:
            print(f"{tier}: no report in {OUT} (run without --read first)")
            continue
        rows += [(t, name, tier, outcome) for t, name, outcome in tests]
        failed = sum(o == "failed" for _, _, o in tests)
        totals[tier] = dict(tests=len(tests), failed=failed, skipped=sum(o == "skipped" for _, _, o in tests),
                            test_s=sum(t for t, _, _ in tests), wall_s=meta.get("wall_s"), rc=meta.get("rc"))
    rows.sort(reverse=True)
    print(f"{min(top, len(rows))} slowest tests (seconds: set-up + call + tear-down):")
    for t, name, tier, outcome in rows[:top]:
        print(f"  {t:8.2f}  {tier:4}  {name}{'' if outcome == 'passed' else f'  [{outcome}]'}")
    print("tier totals:")
    for tier, tot in totals.items():
        wall = "n/a" if tot["wall_s"] is None else f"{tot['wall_s']:.0f} s"
        print(f"  {tier:4}  {tot['tests']} tests ({tot['failed']} failed, {tot['skipped']} skipped), "
              f"{tot['test_s']:.0f} s of test time, wall {wall}, pytest exit {tot['rc']}")
    return totals


def report_file(path: Path, top: int) -> int:
    tests = sorted(read_times(path), reverse=True)
    print(f"{min(top, len(tests))} slowest tests of {path} (seconds: set-up + call + tear-down):")
    for t, name, outcome in tests[:top]:
        print(f"  {t:8.2f}  {name}{'' if outcome == 'passed' else f'  [{outcome}]'}")
    print(f"{len(tests)} tests, {sum(t for t, _, _ in tests):.0f} s of test time")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tier", choices=("all", *TIERS), default="all")
    ap.add_argument("--read", action="store_true", help="report the last run, run nothing")
    ap.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (1: none)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--file", type=Path, help="report this GPUSOLVER_TEST_TIMES file, run nothing")
    args, extra = ap.parse_known_args(argv)
    if args.file:
        return report_file(args.file, args.top)
    tiers = list(TIERS) if args.tier == "all" else [args.tier]
    if not args.read:
        for tier in tiers:
            run_tier(tier, args.workers, extra)
    totals = report(tiers, args.top)
    return 0 if all(t["rc"] in (0, None) for t in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
