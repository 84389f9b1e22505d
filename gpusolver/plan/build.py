"""build_plan: an assignment -> the tensors the collectives and kernels consume.

Shape legend: G head groups, P ranks, c = S / P tokens per chunk, R slices.
Sync-free (static shapes, no host reads): it runs inside the per-layer solve.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from gpusolver.capacity import BufferRows, RelayRows, buffer_rows, relay_rows as default_relay_rows
from gpusolver.config import SolverConfig
from gpusolver.limits import check_plan_rows
from gpusolver.masks.slices import AttnSlices
from gpusolver.metrics import evaluate
from gpusolver.plan.calc_meta import build_calc_meta, default_stage_capacity
from gpusolver.plan.comm_meta import build_comm_meta
from gpusolver.plan.meta import (BUFFER_OVERFLOW, CALC_OVERFLOW, IMBALANCED, INVALID_MASK, NEED_MISMATCH, UNASSIGNED,
                                 Plan)
from gpusolver.plan.relay import build_relay_meta
from gpusolver.plan.stages import assign_stages
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


def plan_capacities(config: SolverConfig, num_slices: int, chunk: int, *, recv_capacity: int | None = None,
                    send_capacity: int | None = None, buffers: BufferRows | None = None) -> tuple[int, BufferRows]:
    """Static capacities: (stage slice rows, the four collective buffers' rows), host values.

    stage:   ``config.max_stage_slices``, else ``default_stage_capacity(R, G, P, n)``
             = ``3 * G * n * max(R, 2 * P)``.
    buffers: ``buffers`` when given, else ``capacity.buffer_rows(config, chunk)`` (per kind:
             its ``max_*_rows`` field, else ``max_recv_rows``, else ``min(G * c * (P - 1),
             k * G * c)`` with k from ``capacity.default_chunks(config)``, sized from the benchmark
             masks' fills); ``recv_capacity`` / ``send_capacity`` then set both kinds' receive /
             send rows. ``G * c * (P - 1)`` is the worst case (every other rank's whole chunk, or
             the whole local chunk to every other rank).
    Raises ValueError when ``G * c + recv`` is past ``limits.MAX_PLAN_ROWS`` (int32 rows).
    """
    G, P = config.head_groups, config.cp_size
    stage = config.max_stage_slices
    if stage is None:
        stage = default_stage_capacity(num_slices, G, P, config.chunk_tiles)
    if not isinstance(stage, int) or stage < 1:
        raise ValueError(f"max_stage_slices must be a positive int, got {stage!r}")
    rows = buffer_rows(config, chunk) if buffers is None else buffers
    for name, v in (("recv_capacity", recv_capacity), ("send_capacity", send_capacity)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    if recv_capacity is not None:
        rows = replace(rows, qo_recv=recv_capacity, kv_recv=recv_capacity)
    if send_capacity is not None:
        rows = replace(rows, qo_send=send_capacity, kv_send=send_capacity)
    # CalcMeta rows index local rows, then the receive buffer of each kind (shared by the sub-stages), in int32
    check_plan_rows(G, chunk, rows.largest_recv)
    return stage, rows


def build_plan(mask: AttnSlices, areas: BlockAreas, assignment: torch.Tensor, config: SolverConfig, *,
               imbalance_tol: float | None = None, recv_capacity: int | None = None,
               send_capacity: int | None = None, buffers: BufferRows | None = None, topology=None,
               relay_rows: RelayRows | None = None) -> Plan:
    """The Plan of an assignment, for all ranks at once. Sync-free.

    mask:          AttnSlices, q_ranges / k_ranges [R, 2] or [G, R, 2], attn_type
                   [R] or [G, R]; self-attention with S = total_seqlen_q.
    areas:         BlockAreas of that mask (area [G, U, U] int64, needs
                   [G, U, U, 2] int64; U = P, or n * P with ``config.chunk_tiles = n``).
    assignment:    [G, U, U] integer, rank computing task (g, i, j); -1 for empty tasks.
    config:        SolverConfig (P, G, byte costs, mu, ``max_stage_slices``).
    imbalance_tol: mu for the IMBALANCED bit (default ``config.imbalance_tol``).
    recv_capacity, send_capacity, buffers: the collective buffers' rows
                   (default: ``plan_capacities``); with ``config.num_stages`` S > 1 the
                   sub-stages share the one QO and the one KV receive buffer.
    topology:      the cluster (``gpusolver.topology.Topology``) for the order of the
                   sub-stages (intra-node sources first); None: ``config.topology`` if the
                   config has one, else one link class.
    relay_rows:    the relay buffers' rows (default ``capacity.relay_rows``) when
                   ``config.relays``: then ``plan.relay`` routes inter-node transfers through
                   each node's relay (``gpusolver.plan.relay``) on ``config.topology``'s nodes.

    Returns a Plan whose shapes depend only on (config, R, c, capacities).
    Problems are reported in ``plan.status``; call ``plan.validate()`` on the
    host to turn them into errors.
    """
    _check_args(mask, areas, assignment, config)
    relays = relay_transport(config)
    stage_cap, rows = plan_capacities(config, mask.num_slices, areas.rank_tokens, recv_capacity=recv_capacity,
                                      send_capacity=send_capacity, buffers=buffers)
    mu = config.imbalance_tol if imbalance_tol is None else float(imbalance_tol)
    assignment = assignment.to(torch.int32)

    cost = config.cost()
    metrics = evaluate(areas, assignment, cost)
    S = config.plan_stages  # the remote sub-stages, and a local tail with direct transport
    if topology is None:  # the config's cluster, where the config carries one
        topology = getattr(config, "topology", None)
    task_stage = assign_stages(areas, assignment, config.num_stages, cost=cost, topology=topology,
                               local_tail=config.tail)
    comm, comm_overflow = build_comm_meta(areas, assignment, buffers=rows, task_stage=task_stage, num_stages=S)
    calc, flags = build_calc_meta(mask, areas, assignment, comm, stage_cap, task_stage if S > 1 else None)

    def bit(flag: torch.Tensor, value: int) -> torch.Tensor:
        return flag.to(torch.int32) * value

    status = (bit(metrics.imbalance > mu, IMBALANCED) | bit(flags["calc_overflow"], CALC_OVERFLOW)
              | bit(comm_overflow | flags["buffer_overflow"], BUFFER_OVERFLOW)
              | bit(flags["unassigned"], UNASSIGNED) | bit(flags["mismatch"], NEED_MISMATCH)
              | bit(mask.value_error(), INVALID_MASK))
    relay = None
    if relays:
        L = config.topology.ranks_per_node
        rows_r = default_relay_rows(config, areas.rank_tokens, L) if relay_rows is None else relay_rows
        relay = build_relay_meta(comm, L, rows_r, cost)
    return Plan(assignment=assignment, metrics=metrics, comm=comm, calc=calc, status=status,
                area=areas.area, imbalance_tol=mu, cost=cost, stage_of_task=task_stage, relay=relay)


def relay_transport(config: SolverConfig, sparse: bool = False) -> bool:
    """Whether a plan of ``config`` routes inter-node rows by relay.

    Slice-mask plans: ``config.relays``, the same answer the solver prices its moves by
    (``solver.core.Tasks.relays``), so a plan runs the transport its assignment was chosen for.
    By default (``ib_relay=None``) that is relay with one remote stage and direct with sub-stages
    (the default S = 4; why, with the figures: ``SolverConfig.relays``);
    ``ib_relay=True`` relays every sub-stage's casts and reduces on their own
    (``plan.relay.stage_relay_routes``). Sparse plans (``sparse``) travel direct
    (docs/support_matrix.md); ``ib_relay=True`` there is a ValueError.
    """
    if not sparse:
        return config.relays
    if config.ib_relay:
        raise ValueError("ib_relay=True is not supported with a sparse plan (relay transport runs slice-mask "
                         "plans): set SolverConfig(ib_relay=False) or leave ib_relay=None for direct transport there")
    return False
