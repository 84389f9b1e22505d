"""build_plan: an assignment -> the tensors the collectives and kernels consume.

Shape legend: G head groups, P ranks, c = S / P tokens per chunk, R slices.
Sync-free (static shapes, no host reads): it runs inside the per-layer solve.
"""
from __future__ import annotations

import torch

from gpusolver.config import SolverConfig
from gpusolver.limits import check_plan_rows
from gpusolver.masks.slices import AttnSlices
from gpusolver.metrics import evaluate
from gpusolver.plan.calc_meta import build_calc_meta, default_stage_capacity
from gpusolver.plan.comm_meta import build_comm_meta
from gpusolver.plan.meta import (BUFFER_OVERFLOW, CALC_OVERFLOW, IMBALANCED, INVALID_MASK, NEED_MISMATCH, UNASSIGNED,
                                 Plan)
from gpusolver.problem import BlockAreas


def _check_args(mask: AttnSlices, areas: BlockAreas, assignment: torch.Tensor, config: SolverConfig) -> None:
    """Shape / dtype / device checks (host metadata only)."""
    G, P, n = config.head_groups, config.cp_size, config.chunk_tiles
    if areas.head_groups != G or areas.cp_size != P or areas.tiles != n:
        raise ValueError(f"areas are for G={areas.head_groups}, P={areas.cp_size}, tiles={areas.tiles} but the "
                         f"config has head_groups={G}, cp_size={P}, chunk_tiles={n}")
    if mask.total_seqlen_q != mask.total_seqlen_k:
        raise ValueError(f"mask must be self-attention, got total_seqlen_q={mask.total_seqlen_q} "
                         f"!= total_seqlen_k={mask.total_seqlen_k}")
    c = config.check_seqlen(mask.total_seqlen_q)
    if areas.rank_tokens != c:
        raise ValueError(f"areas have {areas.rank_tokens} tokens per rank but the mask gives c = S / P = {c}")
    if mask.grouped and mask.q_ranges.shape[0] != G:
        raise ValueError(f"mask has a head-group dim of {mask.q_ranges.shape[0]} but head_groups={G}")
    U = areas.num_units
    if tuple(assignment.shape) != (G, U, U):
        dims = "[G, P, P]" if n == 1 else "[G, U, U] (U = chunk_tiles * P)"
        raise ValueError(f"assignment must be {dims} = {(G, U, U)}, got {tuple(assignment.shape)}")
    if assignment.dtype.is_floating_point or assignment.dtype == torch.bool:
        raise ValueError(f"assignment must be an integer tensor, got {assignment.dtype}")
    for name, t in (("mask", mask.q_ranges), ("areas", areas.area)):
        if t.device != assignment.device:
            raise ValueError(f"{name} is on {t.device} but assignment is on {assignment.device}")


_DEFAULT_CHUNKS = 16  # default receive and send capacity, in units of G * c rows


def plan_capacities(config: SolverConfig, num_slices: int, chunk: int, *, recv_capacity: int | None = None,
                    send_capacity: int | None = None) -> tuple[int, int, int]:
    """Static capacities (stage slice rows, receive rows, send rows), host ints.

    stage:  ``config.max_stage_slices``, else ``default_stage_capacity(R, G, P, n)``
            = ``3 * G * n * max(R, 2 * P)``.
    recv / send: ``config.max_recv_rows``, else ``min(G * c * (P - 1), 16 * G * c)``
            rows. ``G * c * (P - 1)`` is the worst case (every other rank's
            whole chunk, or the whole local chunk to every other rank), about
            1 GB per K buffer at P = 64; the default equals it up to P = 17.
    Raises ValueError when ``G * c + recv`` is past ``limits.MAX_PLAN_ROWS`` (int32 rows).

    The default comes from the device solver's plans of the quality benchmark
    masks (packed documents, 8K tokens per rank, 64:8), measured by
    ``benchmarks/layer_bench.py --tiles 1,2,4 --fill-seeds 20 --fill-kinds
    causal-seq,full-seq`` (its run at commit 995ec0e; the file now leads with simulated layer times). Largest
    rows a rank receives / sends (QO or KV; KV always the larger), as a
    multiple of G * c, over seeds 0-19 with whole chunks (seeds 0-2 with 2 and
    4 tiles stay below these), next to one causal sequence:

        P     causal recv  send     full recv  send     one causal sequence recv  send
        8          1.85     1.49         2.87   2.12                         3.88  5.25
        16         3.12     2.88         4.67   3.88                         6.62  8.00
        32         4.73     5.72         7.93   7.12                        10.25 11.00
        64         8.63    10.57         7.95   8.62                        14.75 15.00

    Receiving stays near 8 G * c as P grows (a helper receives about the work
    it takes on), sending grows with P (a long document's key chunk is wanted
    by many helpers; 13.1 at P = 128 over 3 seeds). 16 is at least 1.5x the
    largest packed-document need up to P = 64 and also holds one causal or
    full sequence there (its last rank needs nearly every key chunk). The
    solve does not yet treat capacity as a constraint: a mask that needs more
    gets BUFFER_OVERFLOW (one causal sequence past P = 64 will); set
    ``max_recv_rows`` for it.
    """
    G, P = config.head_groups, config.cp_size
    worst = G * chunk * (P - 1)
    stage = config.max_stage_slices
    if stage is None:
        stage = default_stage_capacity(num_slices, G, P, config.chunk_tiles)
    default = min(worst, _DEFAULT_CHUNKS * G * chunk) if config.max_recv_rows is None else config.max_recv_rows
    recv = default if recv_capacity is None else recv_capacity
    send = default if send_capacity is None else send_capacity
    for name, v in (("max_stage_slices", stage), ("recv_capacity", recv), ("send_capacity", send)):
        if not isinstance(v, int) or v < (1 if name == "max_stage_slices" else 0):
            raise ValueError(f"{name} must be a {'positive' if name == 'max_stage_slices' else 'non-negative'} "
                             f"int, got {v!r}")
    check_plan_rows(G, chunk, recv)  # CalcMeta rows index local rows, then the receive buffer, in int32
    return stage, recv, send


def build_plan(mask: AttnSlices, areas: BlockAreas, assignment: torch.Tensor, config: SolverConfig, *,
               imbalance_tol: float | None = None, recv_capacity: int | None = None,
               send_capacity: int | None = None) -> Plan:
    """The Plan of an assignment, for all ranks at once. Sync-free.

    mask:          AttnSlices, q_ranges / k_ranges [R, 2] or [G, R, 2], attn_type
                   [R] or [G, R]; self-attention with S = total_seqlen_q.
    areas:         BlockAreas of that mask (area [G, U, U] int64, needs
                   [G, U, U, 2] int64; U = P, or n * P with ``config.chunk_tiles = n``).
    assignment:    [G, U, U] integer, rank computing task (g, i, j); -1 for empty tasks.
    config:        SolverConfig (P, G, byte costs, mu, ``max_stage_slices``).
    imbalance_tol: mu for the IMBALANCED bit (default ``config.imbalance_tol``).
    recv_capacity, send_capacity: rows of each receive buffer / send list
                   (default: ``plan_capacities``).

    Returns a Plan whose shapes depend only on (config, R, c, capacities).
    Problems are reported in ``plan.status``; call ``plan.validate()`` on the
    host to turn them into errors.
    """
    _check_args(mask, areas, assignment, config)
    stage_cap, recv_cap, send_cap = plan_capacities(
        config, mask.num_slices, areas.rank_tokens, recv_capacity=recv_capacity, send_capacity=send_capacity)
    mu = config.imbalance_tol if imbalance_tol is None else float(imbalance_tol)
    assignment = assignment.to(torch.int32)

    cost = config.cost()
    metrics = evaluate(areas, assignment, cost)
    comm, comm_overflow = build_comm_meta(areas, assignment, recv_capacity=recv_cap, send_capacity=send_cap)
    calc, flags = build_calc_meta(mask, areas, assignment, comm, stage_cap)

    def bit(flag: torch.Tensor, value: int) -> torch.Tensor:
        return flag.to(torch.int32) * value

    status = (bit(metrics.imbalance > mu, IMBALANCED) | bit(flags["calc_overflow"], CALC_OVERFLOW)
              | bit(comm_overflow | flags["buffer_overflow"], BUFFER_OVERFLOW)
              | bit(flags["unassigned"], UNASSIGNED) | bit(flags["mismatch"], NEED_MISMATCH)
              | bit(mask.value_error(), INVALID_MASK))
    return Plan(assignment=assignment, metrics=metrics, comm=comm, calc=calc, status=status,
                area=areas.area, imbalance_tol=mu, cost=cost)
