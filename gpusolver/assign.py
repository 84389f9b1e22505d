"""``solve_assignment``: block areas in, the rank of every task out (dense and sparse masks alike).

Shape legend: G head groups, P ranks, U = n * P units.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from gpusolver.config import SolverConfig, check_config
from gpusolver.problem import BlockAreas

SOLVERS = ("device", "reference")


def solve_assignment(areas: BlockAreas, config: SolverConfig, *, solver: str = "device",
                     impl: str = "auto") -> torch.Tensor:
    """Assign every task: [G, U, U] int32 rank per task, -1 for empty tasks (U = P, or
    n * P with ``config.chunk_tiles = n``).

    ``solver="device"`` is the sync-free parallel solver (any device, no host
    reads; ``impl`` picks its path, see ``solve_device``); ``"reference"`` is
    the CPU yardstick (numpy, reads the areas; it places whole chunks, so with
    tiles every tile pair of a chunk pair goes where the chunk pair goes).
    """
    if not isinstance(areas, BlockAreas):
        raise TypeError(f"areas must be a BlockAreas (gpusolver.block_areas(mask, P, G)), got {type(areas).__name__}")
    check_config(config)
    if solver == "device":
        from gpusolver.solver.device import solve_device

        return solve_device(areas, config, impl=impl).assignment
    if solver == "reference":
        from gpusolver.solver.reference import solve_assignment as reference_assignment

        if areas.tiles > 1:
            return areas.refine(reference_assignment(areas.coarsen(), replace(config, chunk_tiles=1)))
        return reference_assignment(areas, config)
    raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
