"""``solve``: mask tensors in, Plan out, on the mask's device, per layer.

Shape legend: S tokens, P ranks, c = S / P, G head groups, R slices.
"""
from __future__ import annotations

import warnings

import torch

from gpusolver.areas import block_areas
from gpusolver.assign import SOLVERS, solve_assignment  # noqa: F401  (part of this module's API)
from gpusolver.capacity import buffer_ints, keep_for_budget
from gpusolver.config import SolverConfig, check_config
from gpusolver.masks.slices import AttnSlices
from gpusolver.masks.sparse import BlockSparseMask, NSALayerMask, TokenTopKMask
from gpusolver.nvtx import nvtx_range
from gpusolver.plan import IMBALANCED, Plan, build_plan
from gpusolver.plan.sparse import SparsePlan
from gpusolver.problem import BlockAreas
from gpusolver.sparse_solve import solve_sparse

SPARSE_MASKS = (BlockSparseMask, TokenTopKMask, NSALayerMask)


def _solve_as_ops(mask: AttnSlices, config: SolverConfig, areas_impl: str, impl: str):
    """Areas and assignment through the custom ops (``gpusolver.ops``): under ``torch.compile``
    each is one opaque node with a static shape, so the rounds are not traced op by op."""
    from gpusolver.ops import block_areas_op, solve_assignment_op, solve_op_options

    n, S = config.chunk_tiles, mask.total_seqlen_q
    area, q_need, k_need = block_areas_op(mask.q_ranges, mask.k_ranges, mask.attn_type, S, config.cp_size,
                                          config.head_groups, n, areas_impl)
    unit = S // config.num_units
    assignment = solve_assignment_op(area, q_need, k_need, unit, config.cp_size, n, config.num_heads_q,
                                     config.num_heads_kv, config.head_dim, config.dtype, config.imbalance_tol, impl,
                                     *solve_op_options(config))
    return BlockAreas(area, q_need, k_need, unit, n), assignment


def solve(mask, config: SolverConfig, *, solver: str = "device", areas_impl: str = "auto",
          impl: str = "auto", validate: bool | None = None) -> Plan | SparsePlan:
    """Solve one layer: block areas, assignment, then the Plan's metas.

    mask:       AttnSlices with q_ranges / k_ranges [R, 2] (or [G, R, 2]) int32
                and attn_type [R] int32, self-attention with S divisible by P;
                or a sparse mask of the whole sequence (BlockSparseMask,
                TokenTopKMask, NSALayerMask), solved by ``solve_sparse``.
    config:     SolverConfig (P, Hq, Hkv, D, dtype, mu, capacities).
    solver:     "device" (default; sync-free) or "reference" (CPU yardstick).
    areas_impl: "torch", "triton" or "auto" (Triton on CUDA).
    impl:       the device solver's path: "torch", "triton", "persistent" (one
                kernel for all rounds) or "auto" (triton on CUDA, torch elsewhere).
    validate:   host-side value checks of the mask and of the plan's status
                (reads device values). Default: on for CPU tensors, off on GPU
                so the per-layer path stays sync-free.

    Returns a Plan (for ``dist_attn``); a sparse mask gives a SparsePlan (for
    ``sparse_dist_attn``: same assignment, metrics and status fields, K and V
    as the mask's measured transfer, ``default_kv_block``; ``areas_impl`` does
    not apply). ``plan.status`` flags imbalance (mu not reached: the plan
    keeps the best balance found within its buffers) and capacity overflows.
    """
    check_config(config)
    if isinstance(mask, SPARSE_MASKS):
        return solve_sparse(mask, config, solver=solver, impl=impl, validate=validate)
    if not isinstance(mask, AttnSlices):
        raise TypeError(f"mask must be an AttnSlices, BlockSparseMask, TokenTopKMask or NSALayerMask, got "
                        f"{type(mask).__name__}; for block areas alone use solve_assignment(areas, config)")
    config = config.tiles_for(mask.total_seqlen_q)  # chunk_tiles="auto": the cap of its coarse-to-fine choice
    # memory_budget: the kinds of receive buffers kept for the backward, which the solve prices
    c = config.check_seqlen(mask.total_seqlen_q)
    config = keep_for_budget(config, c)
    if solver == "reference" and all(v < 0 for v in buffer_ints(config)):
        # the CPU reference places tasks with no buffer limit: its plan gets buffers that hold any plan
        config = config.replaced(max_recv_rows=config.head_groups * c * (config.cp_size - 1))
    if validate is None:
        validate = mask.device.type == "cpu"
    if validate:
        mask.validate(cp_size=config.cp_size)
    if torch.compiler.is_compiling() and solver == "device" and not mask.grouped:
        with nvtx_range("solve/areas+assign"):
            areas, assignment = _solve_as_ops(mask, config, areas_impl, impl)
    else:
        with nvtx_range("solve/areas"):
            areas = block_areas(mask, config.cp_size, config.head_groups, impl=areas_impl, tiles=config.chunk_tiles)
        with nvtx_range("solve/assign"):
            assignment = solve_assignment(areas, config, solver=solver, impl=impl)
    with nvtx_range("solve/metas"):
        plan = build_plan(mask, areas, assignment, config)
    if validate:
        plan.validate(ignore=IMBALANCED)
        if int(plan.status.item()) & IMBALANCED:
            # a plan within the buffers ranks before a balanced one past them (that one cannot run), so
            # the buffers are often what stands between the plan and mu: say which knobs move it
            warnings.warn(f"imbalance_tol={config.imbalance_tol} not reached: the plan keeps the best "
                          f"balance found within its receive and send buffers, {plan.metrics.imbalance.item():.3f}; "
                          "larger buffers (max_recv_rows, max_qo_recv_rows, max_kv_recv_rows, ...), finer tiles "
                          "(chunk_tiles) or a looser imbalance_tol may reach it", stacklevel=2)
    return plan
