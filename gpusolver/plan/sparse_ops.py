"""The sparse solve as a torch.library custom op, for ``torch.compile(fullgraph=True)``.

    gpusolver::solve_sparse_assignment(area, q_need, k_need, chunk, cp_size, tiles, num_heads_q,
                                       num_heads_kv, head_dim, dtype, imbalance_tol, impl,
                                       objective, keep_forward_buffers, max_recv_rows, auto_tiles,
                                       selection_bytes, branches)
        -> assignment [G, U, U] int32 (-1 for empty tasks)

``gpusolver::solve_assignment`` (``gpusolver.ops``) with the sparse prices
(``SparseSolverConfig``: selection bytes with Q, one O per branch;
``max_recv_rows`` -1 for the default). Traced op
by op, the device solver's rounds take locks Dynamo cannot enter; as one
opaque node with a static shape the compiled sparse layer keeps one graph.
"""
from __future__ import annotations

import torch

from gpusolver.capacity import buffer_fields, buffer_ints
from gpusolver.plan.sparse import SparseSolverConfig
from gpusolver.problem import BlockAreas


@torch.library.custom_op("gpusolver::solve_sparse_assignment", mutates_args=())
def solve_sparse_assignment_op(area: torch.Tensor, q_need: torch.Tensor, k_need: torch.Tensor, chunk: int,
                               cp_size: int, tiles: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                               dtype: torch.dtype, imbalance_tol: float, impl: str, objective: str,
                               keep_forward_buffers: bool, max_recv_rows: int, auto_tiles: bool, selection_bytes: int,
                               branches: int, max_qo_recv_rows: int = -1, max_kv_recv_rows: int = -1,
                               max_qo_send_rows: int = -1, max_kv_send_rows: int = -1) -> torch.Tensor:
    from gpusolver.solver.device import solve_device

    config = SparseSolverConfig(cp_size=cp_size, num_heads_q=num_heads_q, num_heads_kv=num_heads_kv,
                                head_dim=head_dim, dtype=dtype, imbalance_tol=imbalance_tol,
                                head_group_flatten=area.shape[0] != 1, chunk_tiles=tiles, objective=objective,
                                keep_forward_buffers=keep_forward_buffers,
                                auto_tiles=auto_tiles, selection_bytes=selection_bytes, branches=branches,
                                **buffer_fields(max_recv_rows, max_qo_recv_rows, max_kv_recv_rows, max_qo_send_rows,
                                                max_kv_send_rows))
    return solve_device(BlockAreas(area, q_need, k_need, chunk, tiles), config, impl=impl).assignment


@solve_sparse_assignment_op.register_fake
def _solve_sparse_assignment_fake(area, q_need, k_need, chunk, cp_size, tiles, num_heads_q, num_heads_kv, head_dim,
                                  dtype, imbalance_tol, impl, objective, keep_forward_buffers, max_recv_rows,
                                  auto_tiles, selection_bytes, branches, max_qo_recv_rows=-1, max_kv_recv_rows=-1,
                                  max_qo_send_rows=-1, max_kv_send_rows=-1):
    return area.new_empty(area.shape, dtype=torch.int32)


def solve_sparse_assignment(areas: BlockAreas, config: SparseSolverConfig, impl: str = "auto") -> torch.Tensor:
    """The device solver's assignment of sparse ``areas`` through the op: [G, U, U] int32."""
    shared, *kinds = buffer_ints(config)
    return solve_sparse_assignment_op(areas.area, areas.q_need, areas.k_need, areas.chunk, config.cp_size,
                                      config.chunk_tiles, config.num_heads_q, config.num_heads_kv, config.head_dim,
                                      config.dtype, config.imbalance_tol, impl, config.objective,
                                      config.keep_forward_buffers, shared, config.auto_tiles,
                                      config.selection_bytes, config.branches, *kinds)


def sparse_assignment(areas: BlockAreas, config: SparseSolverConfig, *, solver: str = "device",
                      impl: str = "auto") -> torch.Tensor:
    """``solve_assignment`` of sparse areas; under ``torch.compile`` the device solve is the op."""
    if torch.compiler.is_compiling() and solver == "device":
        return solve_sparse_assignment(areas, config, impl)
    from gpusolver.solve import solve_assignment

    return solve_assignment(areas, config, solver=solver, impl=impl)
