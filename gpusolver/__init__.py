"""gpusolver: a device-side dynamic attention solver for context parallelism.

Per layer, from mask tensors on the device, it assigns every
(query chunk, key chunk, head group) block of attention work to a rank of
the context-parallel group so that compute is balanced and the bottleneck
communication (Q/O and K/V) is small, and writes the metas the attention
kernels and the group collectives consume. No host reads on the way.

Shape legend:

    S    total tokens (self-attention), divisible by P (by n * P with tiles)
    P    ranks in the CP group (cp_size); rank p holds tokens [p*c, (p+1)*c)
    c    S / P, tokens per chunk
    n    sub-chunk tiles per chunk (SolverConfig.chunk_tiles, default 1)
    U    n * P units of c / n tokens; unit u is tile u % n of rank u // n
    G    head groups (G = Hkv with head-group flattening, else 1)
    Hq, Hkv, D   query heads, KV heads, head dim
    R    slices of a slice mask

    mask.q_ranges / k_ranges  [R, 2] int32   (or [G, R, 2])
    mask.attn_type            [R] int32      (or [G, R])
    BlockAreas.area           [G, U, U] int64 ([G, P, P] untiled)
    Plan.assignment           [G, U, U] int32, rank of task (g, i, j), -1 empty

Entry points: ``solve(mask, config) -> Plan`` and
``solve_assignment(areas, config)``; ``block_areas`` for the per-block work;
``check_errors()`` reads the device error flags of the sync-free path once
(``gpusolver.errors``).
"""
from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.errors import check_errors
from gpusolver.masks import AttnSlices
from gpusolver.metrics import PlanMetrics, evaluate
from gpusolver.plan import Plan
from gpusolver.problem import BlockAreas, CommCost
from gpusolver.solve import solve, solve_assignment

__all__ = ["AttnSlices", "SolverConfig", "BlockAreas", "CommCost", "Plan", "PlanMetrics",
           "block_areas", "check_errors", "evaluate", "solve", "solve_assignment"]
