"""Kernel launches per device solve, torch path next to Triton path.

The solve's round loop is static: every round issues the same sequence of
operations whatever the mask, and so does every restart of the local search
(rounds 8 and 16 below P = 32). So a solve of R rounds launches exactly
``fixed + R * per_round + restarts * per_restart`` kernels, and the terms are
measured from three short solves (1 and 2 rounds, and 2 rounds with a restart
at round 1) instead of a full one. Counting: every op seen by a
``TorchDispatchMode`` that is neither a view nor a bare allocation, plus each
Triton kernel launch (the interpreter's own tensor work inside a launch is
not counted). Host reads (``.item()``, ``nonzero``, ...) are counted and must
be 0.

Without a GPU the Triton path runs in the Triton interpreter, which this
script switches on before anything imports triton; launch counts do not
depend on it, times do (none are reported here).

The persistent path (``impl="persistent"``) runs every round in one Triton
launch, so its per-round count is 0 and a solve is its fixed part plus one.

    python benchmarks/solver_launches.py            # P = 4, 8
    python benchmarks/solver_launches.py --P 8,16
    python benchmarks/solver_launches.py --P 64 --paths persistent   # minutes: the interpreter runs it
    python benchmarks/solver_launches.py --P 8 --ranks-per-node 4 --paths torch,triton   # topology-aware
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, run as a script or loaded by path

from _common import (  # noqa: E402
    RESULTS_DIR, LaunchCounter, environment, make_mask, markdown_table, parse_list, write_json,
)
from gpusolver.areas import block_areas  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.solver.device import DEFAULT_ROUNDS, default_local_search, solve_device  # noqa: E402
from gpusolver.topology import h200_hgx  # noqa: E402

PATHS = ("torch", "triton", "persistent")
COLUMNS = [
    ("P", "P", "d"), ("path", "path", ""), ("ranks per node", "ranks_per_node", ""), ("relays", "relays", ""), ("per round", "per_round", "d"), ("fixed", "fixed", "d"),
    ("per restart", "per_restart", "d"), ("restarts", "restarts", "d"),
    ("per solve", "per_solve", "d"), ("triton per solve", "triton_per_solve", "d"), ("host reads", "host_reads", "d"),
]


def count(areas, config, impl: str, rounds: int, restart_every: int = 0) -> LaunchCounter:
    with LaunchCounter() as counter:
        solve_device(areas, config, rounds=rounds, impl=impl, restart_every=restart_every)
    return counter


def measure(P: int, impl: str, device: str, rounds: int = DEFAULT_ROUNDS, ranks_per_node: int = 0,
            direct: bool = False) -> dict:
    """fixed + rounds * per_round + restarts * per_restart, each term from short solves
    (``ranks_per_node`` > 0: topology-aware, nodes of that many ranks with h200_hgx links, priced
    for the relay transport unless ``direct``)."""
    topology = replace(h200_hgx, ranks_per_node=ranks_per_node, nics_per_node=None) if ranks_per_node else None
    spans = topology is not None and ranks_per_node < P  # relay priced (ib_relay=True: at every S) unless direct
    config = SolverConfig(cp_size=P, topology=topology, ib_relay=(not direct) if spans else None)
    mask = make_mask("causal", P, seed=0, device=device)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    one, two = count(areas, config, impl, 1), count(areas, config, impl, 2)
    restarted = count(areas, config, impl, 2, restart_every=1)  # one restart, at round 1
    per_round = two.launches - one.launches
    fixed = one.launches - per_round
    per_restart = restarted.launches - two.launches
    triton_round = two.triton_launches - one.triton_launches
    triton_restart = restarted.triton_launches - two.triton_launches
    every = default_local_search(P)[1]
    restarts = len(range(every, rounds, every)) if every else 0
    return {"P": P, "path": impl, "ranks_per_node": ranks_per_node or None, "relays": config.relays,
            "per_round": per_round, "fixed": fixed, "rounds": rounds,
            "per_restart": per_restart, "restarts": restarts,
            "per_solve": fixed + rounds * per_round + restarts * per_restart,
            "triton_per_solve": (one.triton_launches - triton_round + rounds * triton_round
                                 + restarts * triton_restart),
            "host_reads": max(c.host_reads for c in (one, two, restarted))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--P", default="4,8", help="comma-separated CP sizes (default 4,8)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"solver paths (default {','.join(PATHS)})")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="topology-aware solve over nodes of this many ranks (h200_hgx links; default 0: none)")
    p.add_argument("--direct", action="store_true",
                   help="with --ranks-per-node: price direct transport (ib_relay=False), not the relay")
    p.add_argument("--json", default=str(RESULTS_DIR / "solver_launches.json"))
    args = p.parse_args(argv)
    try:
        sizes = parse_list(args.P, int, name="--P")
        paths = parse_list(args.paths, str, allowed=PATHS, name="--paths")
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.ranks_per_node < 0:
        p.error(f"--ranks-per-node must be >= 0, got {args.ranks_per_node}")
    rows = [measure(P, impl, device, ranks_per_node=args.ranks_per_node, direct=args.direct)
            for P in sizes for impl in paths]
    print(f"## Kernel launches per device solve ({DEFAULT_ROUNDS} rounds, default portfolio, device {device})\n")
    print(markdown_table(rows, COLUMNS))
    payload = {"benchmark": "solver_launches", "environment": environment(), "rows": rows}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
