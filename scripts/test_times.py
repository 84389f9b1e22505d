"""The suite's tiers timed: the 20 slowest tests and each tier's totals.

    python scripts/test_times.py                 # run both tiers (pytest -n 2), then report
    python scripts/test_times.py --tier fast     # only ``make test``'s tier (-m "not slow")
    python scripts/test_times.py --read          # report the last run again (build/test_times/)
    python scripts/test_times.py --tier fast -n 1 tests/gpusolver   # other arguments go to pytest

Each tier runs as its own pytest process with a JUnit XML report (per test:
set-up + call + tear-down seconds); the report lists the slowest tests of all
tiers run and, per tier, its test count, the summed test seconds and the
tier's wall time. Times move with other load on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "test_times"
TIERS = {"fast": "not slow", "slow": "slow"}


def run_tier(tier: str, workers: int, extra: list[str]) -> float:
    """Run one tier under pytest, its JUnit report into OUT; returns wall seconds."""
    OUT.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", TIERS[tier],
           f"--junitxml={OUT / f'{tier}.xml'}", *(["-n", str(workers)] if workers > 1 else []), *(extra or ["tests"])]
    env = dict(os.environ, TRITON_INTERPRET="1")
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    (OUT / f"{tier}.json").write_text(json.dumps({"wall_s": wall, "rc": rc, "command": " ".join(cmd)}))
    return wall


def read_tier(tier: str) -> tuple[list[tuple[float, str, str]], dict]:
    """(seconds, test id, outcome) per test of the tier's last report, and its run record."""
    xml, meta = OUT / f"{tier}.xml", OUT / f"{tier}.json"
    if not xml.exists():
        return [], {}
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tests.append((float(case.get("time", 0.0)), name, outcome))
    return tests, json.loads(meta.read_text()) if meta.exists() else {}


def report(tiers: list[str], top: int = 20) -> dict:
    rows, totals = [], {}
    for tier in tiers:
        tests, meta = read_tier(tier)
        if not tests:
            print(f"{tier}: no report in {OUT} (run without --read first)")
            continue
        rows += [(t, name, tier, outcome) for t, name, outcome in tests]
        failed = sum(o in ("failure", "error") for _, _, o in tests)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tier", choices=("all", *TIERS), default="all")
    ap.add_argument("--read", action="store_true", help="report the last run, run nothing")
    ap.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (1: none)")
    ap.add_argument("--top", type=int, default=20)
    args, extra = ap.parse_known_args(argv)
    tiers = list(TIERS) if args.tier == "all" else [args.tier]
    if not args.read:
        for tier in tiers:
            run_tier(tier, args.workers, extra)
    totals = report(tiers, args.top)
    return 0 if all(t["rc"] in (0, None) for t in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
