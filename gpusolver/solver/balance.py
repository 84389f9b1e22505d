"""The time-aware imbalance bound (``SolverConfig.imbalance_auto``): candidate bounds and the step model.

A tighter mu lowers the busiest rank's compute and raises the bytes; which pays depends on the
layer. With ``imbalance_auto`` the device solve runs once per candidate bound and keeps the plan
whose modelled step is lowest:

    step ~ w_area * max_r load_r + w_byte * objective

(``gpusolver.step_model``: the busiest rank's attention at the topology's rates plus the solver's
own objective, its link-weighted bytes, in integer units of NVLink byte-times). On the
benchmark masks (benchmarks/balance_sweep.py) it picked the bound of the lowest simulated step
with four sub-stages in most cells, where the ideal bound (the larger of compute and bytes)
always picks the tightest bound, whose extra bytes the pipeline does not fully hide.

The weights (``step_model.time_weights``) are host values made once from the static config.
"""
from __future__ import annotations

from dataclasses import fields

import torch

from gpusolver.solver.core import _BIG, DeviceSolveResult

# The candidate bounds, as fractions of mu's slack above 1: 1 + f (mu - 1). The first (mu itself)
# wins ties. The benchmark masks' lowest simulated steps fell at 1.02-1.06 of an upper bound of 1.10.
AUTO_MU_FRACTIONS = (1.0, 0.6, 0.4, 0.2)


def candidate_tols(imbalance_tol: float) -> tuple[float, ...]:
    """The bounds an ``imbalance_auto`` solve tries, largest first, duplicates dropped (mu = 1: one)."""
    out: list[float] = []
    for f in AUTO_MU_FRACTIONS:
        mu = 1.0 + f * (float(imbalance_tol) - 1.0)
        if mu not in out:
            out.append(mu)
    return tuple(out)


def max_load(area: torch.Tensor, assignment: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[] int64, the busiest rank's entries: ``area`` [G, U, U] summed by ``assignment`` (-1: empty)."""
    rank = torch.where(assignment >= 0, assignment.long(), cp_size).reshape(-1)
    load = torch.zeros(cp_size + 1, dtype=torch.int64, device=area.device)
    return load.scatter_add(0, rank, area.reshape(-1).long())[:cp_size].amax()


def modelled_step(result: DeviceSolveResult, area: torch.Tensor, weights: tuple[int, int, int],
                  cp_size: int) -> torch.Tensor:
    """[] int64, the step model of one solve's plan; ``_BIG`` when it is unbalanced or past a buffer."""
    w_area, w_byte, shift = weights
    key = w_area * (max_load(area, result.assignment, cp_size) >> shift) + w_byte * (result.objective >> shift)
    usable = result.balanced & (result.fits if result.fits is not None else True)
    return torch.where(usable, key, _BIG)


def choose(results: list[DeviceSolveResult], tols: tuple[float, ...], area: torch.Tensor,
           weights: tuple[int, int, int], cp_size: int) -> DeviceSolveResult:
    """The result of the lowest modelled step (the first on ties; the first when none is usable), its
    ``imbalance_tol`` field the bound it was solved at. All on the device, no host reads."""
    keys = torch.stack([modelled_step(r, area, weights, cp_size) for r in results])
    winner = keys.argmin().view(1)  # the first minimum: the largest bound on ties
    pick = lambda xs: torch.stack(xs).index_select(0, winner)[0]  # noqa: E731
    chosen = {f.name: pick([getattr(r, f.name) for r in results]) for f in fields(DeviceSolveResult)
              if getattr(results[0], f.name) is not None and f.name != "imbalance_tol"}
    chosen["imbalance_tol"] = torch.tensor(tols, dtype=torch.float64, device=area.device).index_select(0, winner)[0]
    return DeviceSolveResult(**chosen)
