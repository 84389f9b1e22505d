"""CPU time of the relay-priced solve against today's (no topology), interleaved.

The machine these benchmarks run on is shared, so wall seconds drift with the other load; this
script times both solves of each cell back to back, ``--repeats`` times, and reports the
process CPU seconds (``time.process_time``, one torch thread) next to the wall seconds. Each
solve is ``solve_device`` on precomputed block areas (the CPU torch path, default portfolio).

    python benchmarks/relay_solve_time.py                   # P = 16, 32, 64; seed 0
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PACKED_KINDS, RESULTS_DIR, TOKENS_PER_RANK, environment, make_mask, markdown_table, parse_list, write_json,
)
from gpusolver.areas import block_areas  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.solver.device import solve_device  # noqa: E402
from gpusolver.topology import PRESETS  # noqa: E402

COLUMNS = [("kind", "kind", ""), ("P", "P", "d"), ("today CPU s", "today_cpu_s", ".2f"),
           ("relay CPU s", "relay_cpu_s", ".2f"), ("relay / today (CPU)", "cpu_ratio", ".2f"),
           ("today wall s", "today_wall_s", ".2f"), ("relay wall s", "relay_wall_s", ".2f")]


def _timed(areas, config):
    w, c = time.perf_counter(), time.process_time()
    solve_device(areas, config, impl="torch")
    return time.process_time() - c, time.perf_counter() - w


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--P", default="16,32,64")
    p.add_argument("--kinds", default=",".join(PACKED_KINDS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--topology", default="h200_hgx", choices=sorted(PRESETS))
    p.add_argument("--json", default=str(RESULTS_DIR / "relay_solve_time.json"))
    args = p.parse_args(argv)
    sizes = parse_list(args.P, int, name="--P")
    kinds = parse_list(args.kinds, str, allowed=PACKED_KINDS, name="--kinds")
    torch.set_num_threads(1)
    rows = []
    for kind in kinds:
        for P in sizes:
            mask = make_mask(kind, P, 0, tokens_per_rank=TOKENS_PER_RANK)
            base = SolverConfig(cp_size=P)
            relay = replace(base, topology=PRESETS[args.topology], ib_relay=True)  # relay priced at every S
            areas = block_areas(mask, P, base.head_groups, impl="torch")
            t = {"today": [], "relay": []}
            for _ in range(args.repeats):
                for name, config in (("today", base), ("relay", relay)):
                    t[name].append(_timed(areas, config))
            best = {k: (min(c for c, _ in v), min(w for _, w in v)) for k, v in t.items()}
            rows.append({"kind": kind, "P": P, "today_cpu_s": best["today"][0], "relay_cpu_s": best["relay"][0],
                         "cpu_ratio": best["relay"][0] / best["today"][0], "today_wall_s": best["today"][1],
                         "relay_wall_s": best["relay"][1], "repeats": args.repeats})
            print(markdown_table(rows[-1:], COLUMNS), flush=True)
    print(markdown_table(rows, COLUMNS))
    payload = {"benchmark": "relay_solve_time", "environment": environment(), "rows": rows}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
