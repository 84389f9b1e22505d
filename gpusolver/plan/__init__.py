"""Plans: an assignment turned into the tensors the collectives and kernels consume.

Shape legend: G head groups, P ranks, c = S / P tokens per chunk, R slices,
U = n * P units (n sub-chunk tiles per chunk, default 1; unit u on rank u // n),
cap slice rows per rank and stage, send_cap rows per send list.

    Plan.assignment         [G, U, U] int32, rank of task (g, i, j), -1 empty
    CommMeta.qo_range       [G, U(unit), P(dest), 2] int64 chunk-local rows sent
    CommMeta.qo_recv_offset [G, U(unit), P(dest)] int64 start in dest's buffer
    CommMeta.qo_split       [P(src), P(dst)] int64 all-to-all-v split sizes
    CommMeta.send_index(kind, r)  [send_cap] int64 gather indices of rank r, -1 padded
    CalcMeta.q_ranges       [P, 2(stage), cap, 2] int32 (k_ranges alike)
    CalcMeta.attn_type      [P, 2, cap] int32
    Plan.status             [] int32 bitfield (IMBALANCED, CALC_OVERFLOW, ...)

Rows are "group-major": local row ``g * c + t`` is token t of the chunk in
head group g (see ``gpusolver.plan.meta``).
"""
from gpusolver.plan.build import build_plan, plan_capacities
from gpusolver.plan.calc_meta import default_stage_capacity, slice_pieces
from gpusolver.plan.meta import (BUFFER_OVERFLOW, CALC_OVERFLOW, IMBALANCED, INVALID_MASK, NEED_MISMATCH, UNASSIGNED,
                                 CalcMeta, CommMeta, Plan, RankPlan, status_names)

__all__ = [
    "build_plan", "plan_capacities", "default_stage_capacity", "slice_pieces",
    "Plan", "CommMeta", "CalcMeta", "RankPlan", "status_names",
    "IMBALANCED", "CALC_OVERFLOW", "BUFFER_OVERFLOW", "UNASSIGNED", "NEED_MISMATCH", "INVALID_MASK",
]

# sparse masks (NSA blocks, DSA top-k): gpusolver.plan.sparse; their solve is gpusolver.sparse_solve
from gpusolver.plan.sparse import SparsePlan, SparseStage, build_sparse_plan  # noqa: E402

__all__ += ["SparsePlan", "SparseStage", "build_sparse_plan"]
