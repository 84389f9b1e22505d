"""The solve of sparse masks (``solve_sparse``), and its assignment as a torch.library custom op.

``solve_sparse`` turns a whole-sequence sparse mask into a ``SparsePlan``
(``gpusolver.plan.sparse``); under ``torch.compile(fullgraph=True)`` its device solve
is one custom op:

    gpusolver::solve_sparse_assignment(area, q_need, k_need, chunk, cp_size, tiles, num_heads_q,
                                       num_heads_kv, head_dim, dtype, imbalance_tol, impl,
                                       selection_bytes, branches, *options)
        -> assignment [G, U, U] int32 (-1 for empty tasks)

``gpusolver::solve_assignment`` (``gpusolver.ops``) with the sparse prices
(``SparseSolverConfig``: selection bytes with Q, one O per branch); ``options``
are that op's trailing arguments (``ops.solve_op_options``: objective, buffers,
the topology's links and rates, the time-aware bound). Traced op
by op, the device solver's rounds take locks Dynamo cannot enter; as one
opaque node with a static shape the compiled sparse layer keeps one graph.
"""
from __future__ import annotations

import torch

from gpusolver.assign import solve_assignment
from gpusolver.config import SolverConfig, check_config
from gpusolver.ops import op_config, solve_op_options
from gpusolver.plan.meta import IMBALANCED
from gpusolver.plan.sparse import (SelectionSpec, SparsePlan, SparseSolverConfig, build_sparse_plan,
                                   default_kv_block, no_worse_than_owner, sparse_config)
from gpusolver.problem import BlockAreas


@torch.library.custom_op("gpusolver::solve_sparse_assignment", mutates_args=())
def solve_sparse_assignment_op(area: torch.Tensor, q_need: torch.Tensor, k_need: torch.Tensor, chunk: int,
                               cp_size: int, tiles: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                               dtype: torch.dtype, imbalance_tol: float, impl: str, selection_bytes: int,
                               branches: int, objective: str, keep_forward_buffers: bool, max_recv_rows: int,
                               auto_tiles: bool, max_qo_recv_rows: int, max_kv_recv_rows: int, max_qo_send_rows: int,
                               max_kv_send_rows: int, keep_only: str, ranks_per_node: int, nvlink_gbps: float,
                               ib_gbps: float, nics_per_node: int, imbalance_auto: bool, attn_tflops: float,
                               bwd_flops_ratio: float, bwd_attn_tflops: float, relays: bool) -> torch.Tensor:
    from gpusolver.solver.device import solve_device

    config = op_config(SparseSolverConfig, area, cp_size, tiles, num_heads_q, num_heads_kv, head_dim, dtype,
                       imbalance_tol, objective, keep_forward_buffers, max_recv_rows, auto_tiles, max_qo_recv_rows,
                       max_kv_recv_rows, max_qo_send_rows, max_kv_send_rows, keep_only, ranks_per_node,
                       nvlink_gbps, ib_gbps, nics_per_node, imbalance_auto, attn_tflops, bwd_flops_ratio,
                       bwd_attn_tflops, relays, selection_bytes=selection_bytes, branches=branches)
    return solve_device(BlockAreas(area, q_need, k_need, chunk, tiles), config, impl=impl).assignment


@solve_sparse_assignment_op.register_fake
def _solve_sparse_assignment_fake(area, q_need, k_need, chunk, cp_size, tiles, *options):
    return area.new_empty(area.shape, dtype=torch.int32)


def solve_sparse_assignment(areas: BlockAreas, config: SparseSolverConfig, impl: str = "auto") -> torch.Tensor:
    """The device solver's assignment of sparse ``areas`` through the op: [G, U, U] int32. The op
    carries everything the eager solve reads (``solve_op_options``: the topology's links and
    rates, the time-aware bound, the buffers), so a compiled sparse layer gets the eager plan."""
    return solve_sparse_assignment_op(areas.area, areas.q_need, areas.k_need, areas.chunk, config.cp_size,
                                      config.chunk_tiles, config.num_heads_q, config.num_heads_kv, config.head_dim,
                                      config.dtype, config.imbalance_tol, impl, config.selection_bytes,
                                      config.branches, *solve_op_options(config))


def sparse_assignment(areas: BlockAreas, config: SparseSolverConfig, *, solver: str = "device",
                      impl: str = "auto") -> torch.Tensor:
    """``solve_assignment`` of sparse areas; under ``torch.compile`` the device solve is the op."""
    if torch.compiler.is_compiling() and solver == "device":
        return solve_sparse_assignment(areas, config, impl)
    return solve_assignment(areas, config, solver=solver, impl=impl)


def solve_sparse(mask, config: SolverConfig, *, areas: BlockAreas | None = None, solver: str = "device",
                 impl: str = "auto", validate: bool | None = None, kv_block: int | None | str = "auto") -> SparsePlan:
    """Solve one sparse layer from a whole-sequence mask (or its already gathered ``areas``).

    mask:     BlockSparseMask, TokenTopKMask or NSALayerMask (rows of the whole sequence, or
              any shard when ``areas`` are given: the sharded flow gathers them first).
    config:   SolverConfig; the solver prices query moves with the selection bytes.
    areas:    BlockAreas of the whole problem (default: computed from ``mask``, which must
              then hold every row).
    solver, impl: as in ``gpusolver.solve``.
    validate: host-side checks of the mask values and the plan status (default: on for CPU).
    kv_block: K and V as blocks of this many keys, or hulls (None); "auto": ``default_kv_block``
              (needs the whole mask's rows).
    """
    from gpusolver.areas.sparse import sparse_areas, used_block_rows

    check_config(config)
    config = config.for_sparse()
    spec = SelectionSpec.of(mask, config.head_groups)
    S = mask.total_seqlen_k
    config.check_seqlen(S)
    if validate is None:
        validate = mask.device.type == "cpu" and not torch.compiler.is_compiling()
    if validate:
        mask.validate()
    if areas is None:
        areas = sparse_areas(mask, config.cp_size, config.head_groups, tiles=config.chunk_tiles)
    if kv_block == "auto":
        kv_block = default_kv_block(mask, config)
    used = None if kv_block is None else used_block_rows(mask, config.num_units, config.head_groups, kv_block)
    priced = sparse_config(config, spec)
    assignment = sparse_assignment(areas, priced, solver=solver, impl=impl)
    assignment = no_worse_than_owner(areas, assignment, config, spec, used, kv_block)
    plan = build_sparse_plan(areas, assignment, config, spec, S, mask_error=mask.value_error(),
                             used_blocks=used, kv_block=kv_block)
    if validate:
        plan.validate(ignore=IMBALANCED)
    return plan
