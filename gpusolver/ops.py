"""The solve as torch.library custom ops, for ``torch.compile(fullgraph=True)``.

Two ops with fakes, so a compiled layer sees each as one opaque node with a
static output shape (a function of P, G and the tiles per chunk n only;
U = n * P units):

    gpusolver::block_areas(q_ranges [R, 2] int32, k_ranges [R, 2] int32,
                           attn_type [R] int32, seqlen, cp_size, head_groups, tiles, impl)
        -> (area [G, U, U] int64, q_need [G, U, U, 2] int64, k_need [G, U, U, 2] int64)
    gpusolver::solve_assignment(area, q_need, k_need, chunk, cp_size, tiles, num_heads_q,
                                num_heads_kv, head_dim, dtype, imbalance_tol, impl)
        -> assignment [G, U, U] int32 (-1 for empty tasks)

Both run on the device of their inputs without host reads; ``impl`` is
"auto", "torch" or "triton" as in ``block_areas`` and ``solve_device``.
"""
from __future__ import annotations

import torch

from gpusolver.areas import block_areas as _block_areas
from gpusolver.capacity import buffer_fields, buffer_ints
from gpusolver.config import SolverConfig
from gpusolver.masks.slices import AttnSlices
from gpusolver.problem import BlockAreas


@torch.library.custom_op("gpusolver::block_areas", mutates_args=())
def block_areas_op(q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
                   seqlen: int, cp_size: int, head_groups: int, tiles: int, impl: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    areas = _block_areas(AttnSlices(q_ranges, k_ranges, attn_type, seqlen, seqlen), cp_size, head_groups, impl,
                         tiles=tiles)
    return areas.area, areas.q_need, areas.k_need


@block_areas_op.register_fake
def _block_areas_fake(q_ranges, k_ranges, attn_type, seqlen, cp_size, head_groups, tiles, impl):
    G, U = head_groups, cp_size * tiles
    return (q_ranges.new_empty((G, U, U), dtype=torch.int64), q_ranges.new_empty((G, U, U, 2), dtype=torch.int64),
            q_ranges.new_empty((G, U, U, 2), dtype=torch.int64))


@torch.library.custom_op("gpusolver::solve_assignment", mutates_args=())
def solve_assignment_op(area: torch.Tensor, q_need: torch.Tensor, k_need: torch.Tensor, chunk: int,
                        cp_size: int, tiles: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                        dtype: torch.dtype, imbalance_tol: float, impl: str, objective: str = "training",
                        keep_forward_buffers: bool = True, max_recv_rows: int = -1,
                        auto_tiles: bool = False, max_qo_recv_rows: int = -1, max_kv_recv_rows: int = -1,
                        max_qo_send_rows: int = -1, max_kv_send_rows: int = -1, keep_only: str = "",
                        ranks_per_node: int = 0, nvlink_gbps: float = 0.0, ib_gbps: float = 0.0,
                        nics_per_node: int = 0, imbalance_auto: bool = False, attn_tflops: float = 1.0,
                        bwd_flops_ratio: float = 2.5, bwd_attn_tflops: float = 1.0,
                        relays: bool = False) -> torch.Tensor:
    from gpusolver.solver.device import solve_device

    config = op_config(SolverConfig, area, cp_size, tiles, num_heads_q, num_heads_kv, head_dim, dtype, imbalance_tol,
                       objective, keep_forward_buffers, max_recv_rows, auto_tiles, max_qo_recv_rows,
                       max_kv_recv_rows, max_qo_send_rows, max_kv_send_rows, keep_only, ranks_per_node,
                       nvlink_gbps, ib_gbps, nics_per_node, imbalance_auto, attn_tflops, bwd_flops_ratio,
                       bwd_attn_tflops, relays)
    return solve_device(BlockAreas(area, q_need, k_need, chunk, tiles), config, impl=impl).assignment


def op_config(cls, area, cp_size, tiles, num_heads_q, num_heads_kv, head_dim, dtype, imbalance_tol, objective,
              keep_forward_buffers, max_recv_rows, auto_tiles, max_qo_recv_rows, max_kv_recv_rows,
              max_qo_send_rows, max_kv_send_rows, keep_only, ranks_per_node, nvlink_gbps, ib_gbps, nics_per_node,
              imbalance_auto, attn_tflops, bwd_flops_ratio, bwd_attn_tflops, relays, **extra) -> SolverConfig:
    """The ``cls`` config a solve op's arguments describe (``solve_op_options`` in reverse): what
    decides a plan must be an op argument, or a compiled solve would price by what it was traced
    with. ``extra``: ``cls``'s own fields (the sparse prices)."""
    from gpusolver.topology import Topology

    rows = buffer_fields(max_recv_rows, max_qo_recv_rows, max_kv_recv_rows, max_qo_send_rows, max_kv_send_rows)
    # the solver reads the links of a topology (ranks_per_node 0: none), and with imbalance_auto its
    # attention rates (the step model of ``solver.balance``); ``relays`` is the caller's resolved
    # transport (``SolverConfig.relays``: it hangs on ``ib_relay`` and ``num_stages``), priced as given
    topology = None if ranks_per_node <= 0 else Topology(ranks_per_node=ranks_per_node, nvlink_gbps=nvlink_gbps,
                                                         ib_gbps=ib_gbps, attn_tflops=attn_tflops,
                                                         bwd_flops_ratio=bwd_flops_ratio,
                                                         bwd_attn_tflops=bwd_attn_tflops,
                                                         nics_per_node=nics_per_node)
    return cls(cp_size=cp_size, num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, head_dim=head_dim,
               dtype=dtype, imbalance_tol=imbalance_tol, head_group_flatten=area.shape[0] != 1, chunk_tiles=tiles,
               objective=objective, keep_forward_buffers=keep_only or keep_forward_buffers,
               auto_tiles=auto_tiles, topology=topology, imbalance_auto=imbalance_auto,
               ib_relay=bool(relays), **rows, **extra)


@solve_assignment_op.register_fake
def _solve_assignment_fake(area, q_need, k_need, chunk, cp_size, tiles, num_heads_q, num_heads_kv, head_dim, dtype,
                           imbalance_tol, impl, objective="training", keep_forward_buffers=True, max_recv_rows=-1,
                           auto_tiles=False, max_qo_recv_rows=-1, max_kv_recv_rows=-1, max_qo_send_rows=-1,
                           max_kv_send_rows=-1, keep_only="", ranks_per_node=0, nvlink_gbps=0.0, ib_gbps=0.0,
                           nics_per_node=0, imbalance_auto=False, attn_tflops=1.0, bwd_flops_ratio=2.5,
                           bwd_attn_tflops=1.0, relays=False):
    return area.new_empty(area.shape, dtype=torch.int32)


def solve_assignment_compiled(mask: AttnSlices, config: SolverConfig, impl: str = "auto") -> torch.Tensor:
    """Block areas and the device solve through the custom ops: [G, U, U] int32 (U = P untiled).

    The same result as ``solve_assignment(block_areas(mask, ...), config)``,
    traceable whole by ``torch.compile(fullgraph=True)``.
    """
    if mask.grouped:
        raise ValueError("solve_assignment_compiled takes an ungrouped mask ([R, 2] ranges)")
    area, q_need, k_need = block_areas_op(mask.q_ranges, mask.k_ranges, mask.attn_type, mask.total_seqlen_q,
                                          config.cp_size, config.head_groups, config.chunk_tiles, impl)
    unit_tokens = config.check_seqlen(mask.total_seqlen_q) // config.chunk_tiles
    return solve_assignment_op(area, q_need, k_need, unit_tokens, config.cp_size, config.chunk_tiles,
                               config.num_heads_q, config.num_heads_kv, config.head_dim, config.dtype,
                               config.imbalance_tol, impl, *solve_op_options(config))


def solve_op_options(config: SolverConfig) -> tuple:
    """The trailing arguments of ``solve_assignment_op`` from a config: objective, kept buffers,
    receive rows (-1 for the default), auto tiles, the per-kind buffer rows, the one kind kept
    ("qo" / "kv", or "" when ``keep_forward_buffers`` is a bool), the topology's links (ranks
    per node 0: none), ``imbalance_auto``, the topology's attention rates (what it prices by) and
    ``config.relays`` (the transport the plan will run, so the compiled solve prices it too)."""
    shared, *kinds = buffer_ints(config)
    keep = config.keep_forward_buffers
    only = keep if isinstance(keep, str) else ""
    topo = config.topology
    links = (0, 0.0, 0.0, 0) if topo is None else (topo.ranks_per_node, float(topo.nvlink_gbps),
                                                   float(topo.ib_gbps), topo.nics_per_node)
    rates = (1.0, 2.5, 1.0) if topo is None else (float(topo.attn_tflops), float(topo.bwd_flops_ratio),
                                                  float(topo.bwd_attn_tflops))
    return (config.objective, keep is True, shared, config.auto_tiles, *kinds, only) + links + \
        (config.imbalance_auto,) + rates + (config.relays,)
