"""The time-aware imbalance bound (``SolverConfig.imbalance_auto``): candidate bounds and the step model.

A tighter mu lowers the busiest rank's compute and raises the bytes; which pays depends on the
layer. With ``imbalance_auto`` the device solve runs once per candidate bound and keeps the plan
whose modelled step is lowest:

    step ~ w_area * max_r load_r + w_byte * objective

the busiest rank's attention entries priced at the topology's attention rate (forward, and the
backward's FLOPs at its own rate with ``objective="training"``), plus the solver's own objective
(link-weighted bytes, an NVLink byte weighing 1: bytes over NVLink bandwidth is their time), both
in integer units of 1 / ``TIME_SCALE`` NVLink byte-times. The model is the no-overlap sum: on the
benchmark masks (benchmarks/balance_sweep.py) it picked the bound of the lowest simulated step
with four sub-stages in most cells, where the ideal bound (the larger of compute and bytes)
always picks the tightest bound, whose extra bytes the pipeline does not fully hide.

Integers (no float compare), so the choice is bit-identical on every rank and path; the weights
are host values made once from the static config.
"""
from __future__ import annotations

from dataclasses import fields

import torch

from gpusolver.config import SolverConfig
from gpusolver.solver.core import _BIG, DeviceSolveResult

# The candidate bounds, as fractions of mu's slack above 1: 1 + f (mu - 1). The first (mu itself)
# wins ties. The benchmark masks' lowest simulated steps fell at 1.02-1.06 of an upper bound of 1.10.
AUTO_MU_FRACTIONS = (1.0, 0.6, 0.4, 0.2)
# Units of the modelled step: 1 / TIME_SCALE of one NVLink byte's time (16: the attention weight
# rounds within 0.5 % on h200_hgx).
TIME_SCALE = 16
# Bounds of the terms, so the key stays within int64: the objective stays below 2^52
# (``core.state_key``); a load is at most the whole sequence's entries, G * S^2.
_OBJECTIVE_BOUND = 1 << 52
_KEY_BITS = 62


def candidate_tols(imbalance_tol: float) -> tuple[float, ...]:
    """The bounds an ``imbalance_auto`` solve tries, largest first, duplicates dropped (mu = 1: one)."""
    out: list[float] = []
    for f in AUTO_MU_FRACTIONS:
        mu = 1.0 + f * (float(imbalance_tol) - 1.0)
        if mu not in out:
            out.append(mu)
    return tuple(out)


def time_weights(config: SolverConfig, total_seqlen: int) -> tuple[int, int, int]:
    """(w_area, w_byte, shift): the step model's integer weights of one attention entry of the
    busiest rank and of one unit of the objective, and the right shift both terms take so that
    ``w_area * (G * S^2 >> shift) + w_byte * (2^52 >> shift)`` stays below 2^62 (0 at every
    benchmark size)."""
    topo = config.topology
    if topo is None:
        raise ValueError("time_weights needs config.topology (the attention rate and NVLink bandwidth)")
    cost = config.cost()
    flops = 4.0 * config.head_dim * cost.hq  # one entry of one head group, forward
    seconds = flops / (topo.attn_tflops * 1e12)
    if config.objective == "training":
        seconds += flops * topo.bwd_flops_ratio / (topo.bwd_attn_tflops * 1e12)
    w_area = max(1, round(seconds * topo.nvlink_gbps * 1e9 * TIME_SCALE))
    w_byte = TIME_SCALE
    bound = w_area * config.head_groups * total_seqlen * total_seqlen + w_byte * _OBJECTIVE_BOUND
    return w_area, w_byte, max(0, bound.bit_length() - _KEY_BITS)


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
