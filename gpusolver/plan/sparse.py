"""Plans for sparse masks (NSA block selection, DSA token top-k): SparsePlan and its per-rank stages.

Shape legend: G head groups, P ranks, c tokens per rank, n sub-chunk tiles, U =
n * P units of cu = c / n tokens, cap receive rows, hs selection heads per
group-major row (1 for token top-k, Hkv / G for blocks), w selection width.

What travels is planned as for slices (``CommMeta``: hulls of the needed rows
per (unit, destination)); what differs is what a stage runs. A stage's
attention is one sparse-kernel call over a query buffer and a key buffer:

- query rows: stage 0 the rank's G * c group-major local rows; stage 1 those
  followed by the QO receive buffer (``cap`` rows). ``q_pos`` gives each
  row's global position (-1 for buffer rows past the fill) and ``q_class`` its
  query unit ``(g, i)`` as ``g * U + i``.
- ``kv_windows [G * U, U, 3]``: for query unit (g, i) and key unit j, the
  global keys ``[lo, hi)`` of unit j this stage may use and the offset from a
  global key to its key-buffer row, exactly when task (g, i, j) is this
  rank's in this stage; ``lo = hi`` elsewhere. A local unit's window is its
  whole tile at rows ``g * c + key - rank * c``; a remote one is the range
  received (``kv_range``) at its receive-buffer rows.

The selection indices of a remote query row travel with its Q in the same
group-cast (as int32 columns) and are priced in the plan's metrics
(``SparseCommCost``).

Sub-stages (``SolverConfig.num_stages`` S > 1, as for slices): ``plan.stages.assign_stages``
puts each remote task in sub-stage 1..S by when its bytes land (priced with the selection
bytes); ``CommMeta`` routes the Q hulls per sub-stage into the one shared QO buffer, and key
blocks are routed the same way (``KVBlocks.staged``). Stage s's tables keep the query rows
of stage 1 (local rows, then the whole buffer: ``_recv_rows`` reads each segment's start,
stage-major) and windows only for the tasks of sub-stage s, which read rows of casts 1..s
only. An NSA layer mask's window branch (``window_calc``) has its slices in the same sub-stages
(``build_calc_meta(task_stage=...)``): a task's selection and window pieces run together.

KV as key blocks (``kv_block``, ``KVBlocks``): instead of one hull per (unit,
destination), a destination receives exactly the blocks of ``kv_block`` keys
that its tasks' rows attend (from every rank's all-gathered ``used`` block
bitmaps). On NSA selections with ``kv_block = l`` that is the exact token set
up to the causal clip of a query's own block, which moves less than hulls;
on DSA top-k it moves what hulls move (the figures:
``benchmarks/results/sparse_bench.md``). The stage tables then have one
window per key block.

What the solver optimises and what moves: the device solver prices K and V
as hulls per (unit, destination) (its state holds intervals), so with key
blocks it minimises an upper bound of the bytes that move. A plan's
``metrics`` are what moves (the runtime's byte counters equal them), and
``no_worse_than_owner`` compares the solver's plan with owner-computes by a
modelled step: the busiest rank's attention plus what moves, per link class
(``modelled_step``, ``gpusolver.step_model``). The gap between moved and priced bytes is reported per run in
``benchmarks/results/sparse_bench.md`` (none on DSA, where hulls move).
Nothing here reads device values except ``validate()`` and ``summary()``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from gpusolver.config import CONFIG_ARGS, DEFAULT_IMBALANCE_TOL, SolverConfig
from gpusolver.masks.constructors import sliding_window_mask
from gpusolver.masks.slices import AttnSlices
from gpusolver.masks.sparse import BlockSparseMask, NSALayerMask, TokenTopKMask
from gpusolver.metrics import PlanMetrics, _volumes, evaluate
from gpusolver.plan.build import plan_capacities, relay_transport
from gpusolver.plan.calc_meta import build_calc_meta
from gpusolver.plan.comm_meta import _recv_offsets, build_comm_meta, shared_offset, stage_routing
from gpusolver.plan.gather import send_index
from gpusolver.plan.stages import assign_stages
from gpusolver.plan.meta import (BUFFER_OVERFLOW, CALC_OVERFLOW, IMBALANCED, INVALID_MASK, NEED_MISMATCH, UNASSIGNED,
                                 CalcMeta, CommMeta, _explain_status)
from gpusolver.problem import BlockAreas, CommCost, kept_kinds
from gpusolver.step_model import time_weights
from gpusolver.topology import h200_hgx
from gpusolver.transfers import transfer_ranges

_INDEX_BYTES = 4  # selection indices travel as int32
# The rates (attention FLOP/s over NVLink bandwidth) of ``modelled_step`` when the config names no
# topology: one node of H200s, the cluster preset the benchmarks simulate.
RATES_WITHOUT_TOPOLOGY = h200_hgx


@dataclass(frozen=True)
class SparseCommCost(CommCost):
    """``CommCost`` plus what a sparse layer moves besides Q, O and K, V.

    selection_bytes: bytes of one group-major row's selection indices, sent with Q in the
                     forward (and again in the backward when buffers are not kept).
    branches:        outputs per query row (1; 2 for an NSA layer's selection and window
                     branches): each has its own O and lse back in the forward and its own
                     dO, lse and delta out in the backward.
    """

    selection_bytes: int = 0
    branches: int = 1

    # CommCost's row prices written out: under torch.compile ``super().<property>`` reads the
    # property object itself (TypeError: 'property' + int) and ``fget`` calls do not trace
    @property
    def _q_row(self) -> int:
        return self.hq * self.head_dim * self.dtype_bytes

    @property
    def q_fwd(self) -> int:
        return self._q_row + self.selection_bytes

    @property
    def o_fwd(self) -> int:
        return self.branches * self.hq * (self.head_dim * self.dtype_bytes + 4)

    @property
    def q_bwd(self) -> int:
        per_branch = self.hq * (self.head_dim * self.dtype_bytes + 8)  # dO, fp32 lse and delta
        again = 0 if "qo" in kept_kinds(self.keep_forward_buffers) else self._q_row + self.selection_bytes
        return self.branches * per_branch + again


@dataclass(frozen=True)
class SparseSolverConfig(SolverConfig):
    """``SolverConfig`` whose byte prices include the selection indices (``SparseCommCost``),
    so the solver weighs a query row's move at what it really costs."""

    selection_bytes: int = 0
    branches: int = 1

    # ``capacity.DEFAULT_CHUNKS`` on clusters too: the smaller buffers were measured on slice masks only
    cluster_buffers: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        # both price every query row: a negative or fractional one would skew the solve without an error
        if isinstance(self.selection_bytes, bool) or not isinstance(self.selection_bytes, int) \
                or self.selection_bytes < 0:
            raise ValueError(f"selection_bytes must be a non-negative int, got {self.selection_bytes!r}")
        if type(self.branches) is not int or self.branches not in (1, 2):
            raise ValueError(f"branches must be 1 (a selection) or 2 (an NSA layer's selection and window), "
                             f"got {self.branches!r}")

    def _auto_imbalance_tol(self) -> float:
        """``DEFAULT_IMBALANCE_TOL`` on clusters too: the tighter bound was measured on slice masks only."""
        return DEFAULT_IMBALANCE_TOL

    @property
    def relays(self) -> bool:
        """False: sparse plans travel direct (``plan.build.relay_transport(sparse=True)``), so their
        solve prices direct transport, each byte still weighed by its link (``link_weights``)."""
        return False

    @property
    def tail(self) -> float:
        """0: sparse plans take no local tail (their sub-stages were measured without one,
        ``benchmarks/results/sparse_stages.md``), so ``plan_stages`` is S."""
        return 0.0

    def cost(self) -> SparseCommCost:
        return SparseCommCost(self.num_heads_q, self.num_heads_kv, self.head_dim, self.dtype_bytes,
                              self.head_groups, self.keep_forward_buffers,
                              selection_bytes=self.selection_bytes, branches=self.branches)


@dataclass(frozen=True)
class SelectionSpec:
    """The static facts of a sparse mask that size the plan and the kernels (host ints).

    block_size:  l, keys per selection slot (1 for token top-k).
    heads:       hs, selection heads per group-major row (1: shared by the row's KV heads).
    width:       w, slots per (row, selection head).
    window_size: the sliding-window branch's w of an NSA layer (0: none).
    """

    block_size: int
    heads: int
    width: int
    window_size: int = 0

    @staticmethod
    def of(mask, head_groups: int) -> "SelectionSpec":
        if isinstance(mask, TokenTopKMask):
            return SelectionSpec(1, 1, mask.topk_indices.shape[1])
        sel = mask.selection if isinstance(mask, NSALayerMask) else mask
        if not isinstance(sel, BlockSparseMask):
            raise TypeError(f"mask must be a BlockSparseMask, TokenTopKMask or NSALayerMask, got "
                            f"{type(mask).__name__}")
        Hkv, n = sel.block_indices.shape[1], sel.block_indices.shape[2]
        if Hkv % head_groups:
            raise ValueError(f"block_indices has Hkv={Hkv} KV heads, not divisible by head_groups={head_groups}")
        window = mask.window_size if isinstance(mask, NSALayerMask) else 0
        return SelectionSpec(sel.block_size, Hkv // head_groups, n, window)

    @property
    def row_bytes(self) -> int:
        """Bytes of one group-major row's selection on the wire."""
        return self.heads * self.width * _INDEX_BYTES


def sparse_config(config: SolverConfig, spec: SelectionSpec) -> SparseSolverConfig:
    """``config`` priced for a sparse mask of this ``spec`` (selection bytes, branches)."""
    fields = {name: getattr(config, name) for name in CONFIG_ARGS}
    if config.auto_mu:  # the sparse default, not the dense one the field resolved to
        fields["imbalance_tol"] = "auto"
    return SparseSolverConfig(**fields, selection_bytes=spec.row_bytes, branches=2 if spec.window_size else 1)


@dataclass(frozen=True)
class SparseStage:
    """One rank's stage of a sparse plan: the sparse kernel's row and key-window tables.

    q_pos:      [N] int32 global position of each query row, -1 for unused buffer rows
                (N = G * c in stage 0, G * c + cap in stage 1).
    q_class:    [N] int32 query unit (g, i) of each row as ``g * U + i`` (0 for unused rows).
    kv_windows: [G * U, U, 3] int32 (lo, hi, offset) per (query unit, key unit), see the module docstring.
    window:     cu, keys per unit (host int).
    """

    q_pos: torch.Tensor
    q_class: torch.Tensor
    kv_windows: torch.Tensor
    window: int


@dataclass(frozen=True)
class KVBlocks:
    """K and V routed as key blocks: which blocks of ``block`` keys travel where.

    need:           [G, NB, P(dest)] bool — block b of group g travels to dest (never to its host).
    kv_range:       [G, NB, P(dest), 2] int64 — its chunk-local rows on the host, [0, 0) when not sent.
    kv_recv_offset: [G, NB, P(dest)] int64 — where it starts in dest's KV receive buffer (sources
                    ascending, then g, then block).
    kv_split:       [P(src), P(dst)] int64 — rows src sends to dst.
    kv_recv_rows:   [P] int64 — rows each rank receives.
    block:          keys per block (host int, divides the unit size); NB = S / block.
    blocks_per_rank: c / block (host int).
    staged:         with S > 1 remote sub-stages, the blocks' routing per sub-stage as a
                    ``CommMeta`` whose units are the key blocks (``tiles`` = blocks per rank; its
                    QO fields repeat the KV ones): block b travels in the cast of the first
                    sub-stage on dest that reads it and its dK, dV return after the last, into
                    one receive buffer shared by the casts (``kv_recv_offset`` is then the start
                    in it); None with one remote stage.
    """

    need: torch.Tensor
    kv_range: torch.Tensor
    kv_recv_offset: torch.Tensor
    kv_split: torch.Tensor
    kv_recv_rows: torch.Tensor
    block: int
    blocks_per_rank: int
    staged: CommMeta | None = None

    def send_index(self, rank: int, chunk: int, send_capacity: int) -> torch.Tensor:
        """[send_cap] int64 gather indices into ``rank``'s group-major local K, V rows, in send order
        (dest, g, block, token); -1 pads. Sync-free."""
        nb = self.blocks_per_rank
        return send_index(self.kv_range[:, rank * nb:(rank + 1) * nb], chunk, send_capacity)


def build_kv_blocks(used: torch.Tensor, assignment: torch.Tensor, tiles: int, chunk: int, block: int,
                    recv_capacity: int, send_capacity: int, *, task_stage: torch.Tensor | None = None,
                    num_stages: int = 1) -> tuple[KVBlocks, torch.Tensor]:
    """KVBlocks of an assignment, plus an overflow flag. Sync-free.

    used:       [G, U(query unit), NB] bool — key block b attended by some row of unit i, group g
                (``areas.sparse.used_block_rows``, all-gathered).
    assignment: [G, U, U] integer rank per task, -1 for empty tasks.
    tiles, chunk: units per rank, tokens per rank; ``block`` must divide chunk / tiles.
    task_stage, num_stages: with S > 1, the sub-stage of every task (``plan.stages``): the blocks
                are routed per sub-stage (``KVBlocks.staged``).
    """
    G, U = assignment.shape[0], assignment.shape[1]
    P, NB = U // tiles, used.shape[2]
    cu, nb = chunk // tiles, chunk // block
    dev = assignment.device
    b = torch.arange(NB, device=dev)
    unit = b * block // cu  # key unit of each block
    host = b // nb
    need = torch.zeros(G, NB * P + 1, dtype=torch.bool, device=dev)  # [g, (block, dest)], last: a sink
    asg = assignment.long()
    for g in range(G):  # static
        on = asg[g][:, unit]  # [U(i), NB]: the rank of task (g, i, unit(b))
        hit = used[g] & (on >= 0) & (on != host)  # nothing travels to its own host
        need[g].index_fill_(0, torch.where(hit, b * P + on.clamp(min=0), NB * P).reshape(-1), True)
    need = need[:, :-1].view(G, NB, P)
    lo = ((b % nb) * block).view(1, NB, 1)
    kv_range = torch.stack((torch.where(need, lo, 0), torch.where(need, lo + block, 0)), dim=-1)
    length = need.long() * block
    offset, rows = _recv_offsets(length, nb)
    split = length.sum(0).view(P, nb, P).sum(1)
    overflow = (rows > recv_capacity).any() | (split.sum(1) > send_capacity).any()
    staged = None
    if num_stages > 1:
        if task_stage is None:
            raise ValueError(f"num_stages={num_stages} needs the task_stage of the assignment")
        first, last = _block_stages(used, assignment, task_stage, unit, need)
        staged = _staged_blocks(kv_range, length, first, last, num_stages, nb, chunk, recv_capacity, send_capacity)
        offset = staged.kv_recv_offset
    return KVBlocks(need=need, kv_range=kv_range, kv_recv_offset=offset, kv_split=split, kv_recv_rows=rows,
                    block=block, blocks_per_rank=nb, staged=staged), overflow


def _block_stages(used: torch.Tensor, assignment: torch.Tensor, task_stage: torch.Tensor, unit: torch.Tensor,
                  need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) ``[G, NB, P(dest)]`` int64 sub-stage of dest reading key block b (its tasks
    (g, i, unit(b)) whose rows attend b); 0 where the block does not travel."""
    G, NB, P = need.shape
    ranks = torch.arange(P, device=need.device)
    first, last = [], []
    for g in range(G):  # static; [U(i), NB, P] per group
        on = (assignment[g][:, unit].long()[..., None] == ranks) & used[g][..., None]
        st = task_stage[g][:, unit].long()[..., None]
        first.append(torch.where(on, st, 1 << 30).amin(0))
        last.append(torch.where(on, st, 0).amax(0))
    first, last = torch.stack(first), torch.stack(last)
    return torch.where(need, first, 0), torch.where(need, last, 0)


def _staged_blocks(kv_range, length, first, last, num_stages: int, nb: int, chunk: int, recv_capacity: int,
                   send_capacity: int) -> CommMeta:
    """The key blocks' routing per sub-stage as a CommMeta over block units (``KVBlocks.staged``):
    ``plan.comm_meta``'s stage routing with a block as the unit."""
    off, cast, base = stage_routing(length, first, num_stages, nb)
    off = shared_offset(off, first, base)
    ret_off, ret, _ = stage_routing(length, last, num_stages, nb)
    stage = torch.stack((first, last), dim=-1)
    split = length.sum(0).view(length.shape[2], nb, length.shape[2]).sum(1)
    rows = split.sum(0)
    return CommMeta(qo_range=kv_range, kv_range=kv_range, qo_recv_offset=off, kv_recv_offset=off, qo_split=split,
                    kv_split=split, qo_recv_rows=rows, kv_recv_rows=rows, chunk=chunk,
                    qo_recv_capacity=recv_capacity, kv_recv_capacity=recv_capacity, qo_send_capacity=send_capacity,
                    kv_send_capacity=send_capacity, tiles=nb, num_stages=num_stages, qo_stage=stage, kv_stage=stage,
                    qo_stage_split=cast, kv_stage_split=cast, qo_return_split=ret, kv_return_split=ret,
                    qo_return_offset=ret_off, kv_return_offset=ret_off, qo_stage_base=base, kv_stage_base=base)


@dataclass(frozen=True)
class SparsePlan:
    """A solved sparse layer: who computes what, what moves, what each stage runs.

    assignment:    [G, U, U] int32 rank of task (g, i, j), -1 for empty tasks.
    metrics:       PlanMetrics priced with ``SparseCommCost`` (selection bytes included) for what
                   moves: K, V as key blocks when ``kv_blocks`` is set (then below the hull price
                   the solver minimised), else hulls.
    comm:          CommMeta (hull ranges per (unit, destination), offsets, splits).
    status:        [] int32 bitfield (IMBALANCED, BUFFER_OVERFLOW, UNASSIGNED, INVALID_MASK;
                   CALC_OVERFLOW / NEED_MISMATCH from the window branch's slices).
    area:          [G, U, U] int64 block areas the plan was built from.
    imbalance_tol: mu of the IMBALANCED bit (host float).
    spec:          SelectionSpec (block size, selection heads and width, window branch).
    window_calc:   CalcMeta of the NSA window branch's slices (None without one).
    kv_blocks:     KVBlocks when K and V travel as key blocks (then ``comm``'s KV fields are the
                   hulls the solver priced, not what moves), None for hulls.
    cost:          the SparseCommCost of the metrics (None for a plan built without one).
    stage_of_task: [G, U, U] int32 stage of each task: -1 empty, 0 local, 1..S remote sub-stage
                   (``gpusolver.plan.stages.assign_stages``; S = ``comm.num_stages``); None in
                   plans built without it (then 0 / 1 by locality).

    ``stage(rank, s)`` builds a stage's tables on demand (sync-free), so a plan
    never holds every rank's [G * c + cap] row tables.
    """

    assignment: torch.Tensor
    metrics: PlanMetrics
    comm: CommMeta
    status: torch.Tensor
    area: torch.Tensor
    imbalance_tol: float
    spec: SelectionSpec
    window_calc: CalcMeta | None = None
    kv_blocks: KVBlocks | None = None
    cost: SparseCommCost | None = None
    stage_of_task: torch.Tensor | None = None

    def pair_bytes(self, phase: str, cost=None, stage: int | None = None) -> torch.Tensor:
        """[P(src), P(dst)] int64 bytes moved per (source, destination): ``Plan.pair_bytes`` (stage:
        None for every sub-stage, s in 1..S for sub-stage s's collectives alone)."""
        from gpusolver.plan.schedule import pair_bytes

        return pair_bytes(self, phase, self.cost if cost is None else cost, stage)

    @property
    def num_stages(self) -> int:
        """S, remote sub-stages."""
        return self.comm.num_stages

    @property
    def task_stage(self) -> torch.Tensor:
        """[G, U, U] int32: -1 empty task, 0 local stage, 1..S remote sub-stage."""
        from gpusolver.plan.schedule import task_stage

        return task_stage(self)

    @property
    def head_groups(self) -> int:
        return self.comm.head_groups

    @property
    def num_units(self) -> int:
        return self.assignment.shape[1]

    def stage(self, rank: int, stage: int) -> SparseStage:
        """Rank ``rank``'s stage ``stage`` (0: both units local; 1..S: the remote sub-stages)."""
        P, S = self.comm.cp_size, self.comm.num_stages
        if not 0 <= rank < P or isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= S:
            raise ValueError(f"need 0 <= rank < {P} and 0 <= stage <= S = {S}, got rank={rank}, stage={stage!r}")
        return sparse_stage(self.assignment, self.comm, rank, stage, self.kv_blocks,
                            self.stage_of_task if S > 1 else None)

    def validate(self, ignore: int = 0) -> "SparsePlan":
        """Raise ValueError naming each status bit set (except ``ignore``). Host-side."""
        status = int(self.status.item()) & ~ignore
        problems = _explain_status(self, ignore | INVALID_MASK | (0 if self.window_calc is not None
                                                                   else CALC_OVERFLOW))
        if status & INVALID_MASK:
            problems.append("INVALID_MASK: a selection index is out of range or repeated in a row; "
                            "mask.validate() names the row")
        if problems:
            raise ValueError("plan is not usable:\n  " + "\n  ".join(problems))
        return self

    @property
    def calc(self) -> CalcMeta:
        """The window branch's CalcMeta (``_explain_status`` reads it for CALC_OVERFLOW)."""
        return self.window_calc

    def summary(self) -> str:
        from gpusolver.plan.meta import status_names

        names = status_names(int(self.status.item()))
        lines = [self.metrics.summary(),
                 f"recv rows (max over ranks): qo {int(self.comm.qo_recv_rows.max())}, "
                 f"kv {int(self.comm.kv_recv_rows.max())}, capacities qo {self.comm.qo_recv_capacity} "
                 f"kv {self.comm.kv_recv_capacity}",
                 "status: " + ("OK" if not names else " | ".join(names))]
        return "\n".join(lines)


def _unit_table(comm: CommMeta, G: int, U: int):
    """(tiles, P, c, unit tokens, device, unit ids [U], unit hosts [U]) of a plan's CommMeta."""
    n, P = comm.tiles, comm.cp_size
    c = comm.chunk
    cu = c // n
    dev = comm.qo_range.device
    units = torch.arange(U, device=dev)
    return n, P, c, cu, dev, units, units // n


def sparse_stage(assignment: torch.Tensor, comm: CommMeta, rank: int, stage: int,
                 kv_blocks: KVBlocks | None = None, task_stage: torch.Tensor | None = None) -> SparseStage:
    """The tables of one rank's stage (see ``SparseStage``; with ``kv_blocks`` one window per key
    block instead of per key unit). task_stage: [G, U, U] sub-stage of each task (plans with S > 1
    remote sub-stages; None: stage 0 the local tasks, stage 1 the rest). A remote sub-stage's query
    rows are the local rows and the whole shared receive buffer; its windows cover its own tasks
    only, so rows cast for later sub-stages are not read. Sync-free: static shapes, no host reads."""
    G, U = assignment.shape[0], assignment.shape[1]
    n, P, c, cu, dev, units, host = _unit_table(comm, G, U)
    g = torch.arange(G, device=dev)
    # local rows g * c + t: token rank * c + t of group g
    t = torch.arange(c, device=dev)
    pos_local = (rank * c + t).expand(G, c).reshape(-1)
    cls_local = (g[:, None] * U + (rank * c + t)[None, :] // cu).reshape(-1)
    if stage >= 1:
        pos_recv, cls_recv = _recv_rows(comm, rank, G, U)
        q_pos, q_class = torch.cat((pos_local, pos_recv)), torch.cat((cls_local, cls_recv))
    else:
        q_pos, q_class = pos_local, cls_local

    # [G, U(i), U(j)] tasks of this rank in this stage
    both_local = (host.view(1, U, 1) == rank) & (host.view(1, 1, U) == rank)
    if task_stage is None:
        mine = (assignment.long() == rank) & (both_local if stage == 0 else ~both_local)
    else:
        mine = (assignment.long() == rank) & (task_stage.long() == stage)
    if kv_blocks is not None:
        win = _block_windows(kv_blocks, mine, rank, G, c, cu, stage)
        return SparseStage(q_pos=q_pos.to(torch.int32), q_class=q_class.to(torch.int32), kv_windows=win,
                           window=kv_blocks.block)
    j_local = (host == rank).view(1, 1, U)
    local_lo = (units * cu).view(1, 1, U)
    local_off = (g * c - rank * c).view(G, 1, 1)
    kv_lo = comm.kv_range[:, :, rank, 0] + host * c  # [G, U(j)] global
    kv_hi = comm.kv_range[:, :, rank, 1] + host * c
    remote_off = G * c + comm.kv_recv_offset[:, :, rank] - kv_lo
    lo = torch.where(j_local, local_lo, kv_lo[:, None, :])
    hi = torch.where(j_local, local_lo + cu, kv_hi[:, None, :])
    off = torch.where(j_local, local_off, remote_off[:, None, :])
    lo, hi = torch.where(mine, lo, 0), torch.where(mine, hi, 0)
    off = torch.where(mine, off, 0)
    win = torch.stack(torch.broadcast_tensors(lo, hi, off), dim=-1).reshape(G * U, U, 3)
    return SparseStage(q_pos=q_pos.to(torch.int32), q_class=q_class.to(torch.int32),
                       kv_windows=win.to(torch.int32).contiguous(), window=cu)


def _block_windows(kb: KVBlocks, mine: torch.Tensor, rank: int, G: int, c: int, cu: int,
                   stage: int) -> torch.Tensor:
    """[G * U, NB, 3] int32 windows, one per (query unit, key block).

    With sub-stages (``kb.staged``) remote sub-stage s windows only the blocks that have landed by
    then (first read in a sub-stage <= s): a block first read later is used by none of this stage's
    query units (its first stage is the lowest over the tasks that read it), and its rows may still
    be in flight."""
    U = mine.shape[1]
    NB, nb, block = kb.need.shape[1], kb.blocks_per_rank, kb.block
    dev = mine.device
    b = torch.arange(NB, device=dev)
    unit, host = b * block // cu, b // nb
    lo = (b * block).view(1, 1, NB)
    local = (host == rank).view(1, 1, NB)
    need = kb.need[:, :, rank]                                          # [G, NB]
    if kb.staged is not None and stage >= 1:
        need = need & (kb.staged.kv_stage[:, :, rank, 0] <= stage)
    held = local | need.view(G, 1, NB)
    task = mine[:, :, unit] & held  # [G, U(i), NB]
    off = torch.where(local, (torch.arange(G, device=dev) * c - rank * c).view(G, 1, 1),
                      (G * c + kb.kv_recv_offset[:, :, rank]).view(G, 1, NB) - lo)
    win = torch.stack(torch.broadcast_tensors(torch.where(task, lo, 0), torch.where(task, lo + block, 0),
                                              torch.where(task, off, 0)), dim=-1)
    return win.reshape(G * U, NB, 3).to(torch.int32).contiguous()


def _recv_rows(comm: CommMeta, rank: int, G: int, U: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global position and query unit class of each row of ``rank``'s QO receive buffer ([cap] int64 each;
    -1 / 0 past the fill). Segment (g, u) starts at ``qo_recv_offset[g, u, rank]``: (host, g, tile)
    order with one remote stage, stage-major with sub-stages; the segments with rows tile the buffer
    from row 0 without gaps, so in order of their starts their ends rise."""
    n, P, c, cu, dev, units, host = _unit_table(comm, G, U)
    cap = comm.qo_recv_capacity
    rng = comm.qo_range[:, :, rank].reshape(G * U, 2)  # chunk-local, segment g * U + u
    length = rng[:, 1] - rng[:, 0]
    big = 1 << 40
    start = torch.where(length > 0, comm.qo_recv_offset[:, :, rank].reshape(-1), big)
    order = torch.sort(start, stable=True).indices
    ends = (start + length)[order]
    b = torch.arange(cap, device=dev)
    k = torch.searchsorted(ends, b, right=True).clamp_(max=G * U - 1)
    seg = order[k]
    used = b < comm.qo_recv_rows[rank]
    pos = host[seg % U] * c + rng[seg, 0] + b - start[seg]
    return torch.where(used, pos, -1), torch.where(used, seg, 0)


def _unit_lengths(areas: BlockAreas, assignment: torch.Tensor, used_blocks: torch.Tensor | None,
                  kv_block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(qo_len, kv_len), each ``[G, U, P]`` int64: the rows each unit sends to each rank, K and V as
    hulls, or as the key blocks of ``kv_block`` keys that move. Sync-free."""
    qo, kv = transfer_ranges(areas, assignment)
    if kv_block is None:
        return qo[..., 1] - qo[..., 0], kv[..., 1] - kv[..., 0]
    G, U, P, n = areas.head_groups, areas.num_units, areas.cp_size, areas.tiles
    big = 1 << 40  # capacities play no part in the price
    kb, _ = build_kv_blocks(used_blocks, assignment, n, areas.rank_tokens, kv_block, big, big)
    return qo[..., 1] - qo[..., 0], kb.need.long().view(G, U, -1, P).sum(2) * kv_block


def step_bytes(areas: BlockAreas, assignment: torch.Tensor, config: SolverConfig, spec: SelectionSpec,
               used_blocks: torch.Tensor | None = None, kv_block: int | None = None):
    """(balanced [] bool, forward + backward bottleneck bytes [] int64) of an assignment, priced by
    what moves: hulls, or key blocks with ``kv_block``. Sync-free."""
    priced = sparse_config(config, spec)
    cost = priced.cost()
    m = evaluate(areas, assignment, cost)
    balanced = m.imbalance <= priced.imbalance_tol  # the sparse mu (``sparse_config``), as the solve's
    if kv_block is None:
        return balanced, m.fwd_bottleneck + m.bwd_bottleneck
    fs, fr, bs, br = _volumes(*_unit_lengths(areas, assignment, used_blocks, kv_block), cost, areas.tiles)
    return balanced, torch.maximum(fs, fr).amax() + torch.maximum(bs, br).amax()


def modelled_step(areas: BlockAreas, assignment: torch.Tensor, config: SolverConfig, spec: SelectionSpec,
                  used_blocks: torch.Tensor | None = None, kv_block: int | None = None):
    """(balanced [] bool, modelled training step [] int64) of an assignment: ``gpusolver.step_model``'s
    busiest rank's attention plus the forward and backward bottleneck bytes of what moves (hulls, or
    key blocks with ``kv_block``), each phase the larger over link classes of the class bottleneck
    times its weight (``SolverConfig.link_weights``; one class inside a node). The rates are
    ``config.topology``'s, else ``RATES_WITHOUT_TOPOLOGY``'s. Sync-free; integers, so the same on
    every rank."""
    priced = sparse_config(config, spec)
    cost = priced.cost()
    m = evaluate(areas, assignment, cost)
    balanced = m.imbalance <= priced.imbalance_tol  # the sparse mu (``sparse_config``), as the solve's
    qo_len, kv_len = _unit_lengths(areas, assignment, used_blocks, kv_block)
    link = priced.link_weights
    if link is None:
        classes = [(None, 1)]
    else:
        per_node, w_nvlink, w_ib = link
        P = areas.cp_size
        rank = torch.arange(P, device=qo_len.device)
        inter = (areas.unit_host().view(1, -1, 1) // per_node) != (rank.view(1, 1, P) // per_node)  # [1, U, P]
        classes = [(~inter, w_nvlink), (inter, w_ib)]
    fwd = bwd = torch.zeros((), dtype=torch.int64, device=qo_len.device)
    for on, weight in classes:
        cut = (lambda x: x) if on is None else (lambda x, on=on: torch.where(on, x, 0))
        fs, fr, bs, br = _volumes(cut(qo_len), cut(kv_len), cost, areas.tiles)
        fwd = torch.maximum(fwd, torch.maximum(fs, fr).amax() * weight)
        bwd = torch.maximum(bwd, torch.maximum(bs, br).amax() * weight)
    total = areas.rank_tokens * areas.cp_size
    w_area, w_byte, shift = time_weights(priced, total, config.topology or RATES_WITHOUT_TOPOLOGY)
    return balanced, w_area * (m.load.amax() >> shift) + w_byte * ((fwd + bwd) >> shift)


def no_worse_than_owner(areas: BlockAreas, assignment: torch.Tensor, config: SolverConfig, spec: SelectionSpec,
                        used_blocks: torch.Tensor | None = None, kv_block: int | None = None) -> torch.Tensor:
    """The solver's assignment, or owner-computes when that is balanced too and its modelled training
    step is shorter (``modelled_step``: the busiest rank's attention plus the bytes that move, by
    link class). Sparse masks have nearly uniform work per query, so owner-computes is often
    balanced, and tighter than the solver's plan, which spends the bound's slack on fewer bytes: on
    the benchmark masks at P = 8 that traded 3-7 % of the bytes for 8 % more attention on the busiest
    rank, a slower step. The solver prices K, V as hulls, so with key blocks owner-computes can move
    fewer bytes too. Sync-free (a ``torch.where``)."""
    from gpusolver.metrics import owner_computes_assignment

    owner = owner_computes_assignment(areas)
    ok_s, step_s = modelled_step(areas, assignment, config, spec, used_blocks, kv_block)
    ok_o, step_o = modelled_step(areas, owner, config, spec, used_blocks, kv_block)
    take_owner = ok_o & (~ok_s | (step_o < step_s))
    return torch.where(take_owner, owner, assignment.to(owner.dtype))


def window_slices(total_seqlen: int, window_size: int, device) -> AttnSlices:
    """The sliding-window branch of an NSA layer as slices (row t: keys (t - w, t])."""
    return sliding_window_mask(total_seqlen, window_size, device=device)


def build_sparse_plan(areas: BlockAreas, assignment: torch.Tensor, config: SolverConfig, spec: SelectionSpec,
                      total_seqlen: int, *, mask_error: torch.Tensor | None = None,
                      imbalance_tol: float | None = None, recv_capacity: int | None = None,
                      send_capacity: int | None = None, used_blocks: torch.Tensor | None = None,
                      kv_block: int | None = None) -> SparsePlan:
    """The SparsePlan of an assignment, for all ranks at once. Sync-free.

    areas:       BlockAreas of the sparse mask (area [G, U, U] int64, needs [G, U, U, 2]).
    assignment:  [G, U, U] integer rank per task, -1 for empty tasks.
    config:      SolverConfig (priced here with the selection bytes, ``sparse_config``).
    spec:        SelectionSpec of the mask.
    total_seqlen: S.
    mask_error:  [] bool device flag of bad mask values (``mask.value_error()``), or None.
    recv_capacity, send_capacity: rows of both kinds' receive buffers / send lists (default
                 ``plan_capacities``: per kind from the config).
    used_blocks, kv_block: K and V travel as blocks of ``kv_block`` keys (``KVBlocks``); used_blocks
                 [G, U, S / kv_block] bool is every query unit's ``used_block_rows``. None: hulls.
                 Not with a window branch (its slices address hull buffers).
    """
    config = config.for_sparse()
    S = config.num_stages
    relay_transport(config, sparse=True)  # sparse plans travel direct; ib_relay=True is refused
    G, P, n = config.head_groups, config.cp_size, config.chunk_tiles
    if areas.head_groups != G or areas.cp_size != P or areas.tiles != n:
        raise ValueError(f"areas are for G={areas.head_groups}, P={areas.cp_size}, tiles={areas.tiles} but the "
                         f"config has head_groups={G}, cp_size={P}, chunk_tiles={n}")
    c = config.check_seqlen(total_seqlen)
    U = areas.num_units
    if tuple(assignment.shape) != (G, U, U):
        raise ValueError(f"assignment must be [G, U, U] = {(G, U, U)}, got {tuple(assignment.shape)}")
    priced = sparse_config(config, spec)
    # the priced config's buffers: the ones its solve kept the plan within (``SparseSolverConfig.cluster_buffers``)
    stage_cap, rows = plan_capacities(priced, 2, c, recv_capacity=recv_capacity, send_capacity=send_capacity)
    mu = config.imbalance_tol if imbalance_tol is None else float(imbalance_tol)
    assignment = assignment.to(torch.int32)
    cost = priced.cost()
    metrics = evaluate(areas, assignment, cost)
    # sub-stages (``plan.stages``): by when each task's bytes land, priced with the selection bytes
    task_stage = assign_stages(areas, assignment, S, cost=cost, topology=getattr(config, "topology", None))
    comm, overflow = build_comm_meta(areas, assignment, buffers=rows, task_stage=task_stage, num_stages=S)
    kv_blocks = None
    if kv_block is not None:
        if spec.window_size:
            raise ValueError("kv_block: an NSA layer mask's window branch needs hull transfers (kv_block=None)")
        if used_blocks is None or areas.chunk % kv_block:
            raise ValueError(f"kv_block={kv_block} needs used_blocks and must divide the unit size {areas.chunk}")
        kv_blocks, kv_overflow = build_kv_blocks(used_blocks, assignment, n, c, kv_block, rows.kv_recv,
                                                 rows.kv_send, task_stage=task_stage, num_stages=S)
        # what moves: Q hulls as before, K and V blocks
        overflow = ((comm.qo_recv_rows > rows.qo_recv).any() | (comm.qo_split.sum(1) > rows.qo_send).any()
                    | kv_overflow)
        qo_len = comm.qo_range[..., 1] - comm.qo_range[..., 0]
        kv_len = kv_blocks.need.long().view(G, U, -1, P).sum(2) * kv_block
        fs, fr, bs, br = _volumes(qo_len, kv_len, cost, n)
        metrics = replace(metrics, fwd_send=fs, fwd_recv=fr, bwd_send=bs, bwd_recv=br,
                          fwd_bottleneck=torch.maximum(fs, fr).amax(), bwd_bottleneck=torch.maximum(bs, br).amax())
    a = assignment.long()
    unassigned = ((areas.area > 0) & ((a < 0) | (a >= P))).any()

    def bit(flag: torch.Tensor, value: int) -> torch.Tensor:
        return flag.to(torch.int32) * value

    status = (bit(metrics.imbalance > mu, IMBALANCED) | bit(overflow, BUFFER_OVERFLOW)
              | bit(unassigned, UNASSIGNED))
    if mask_error is not None:
        status = status | bit(mask_error, INVALID_MASK)
    window_calc = None
    if spec.window_size:
        slices = window_slices(total_seqlen, spec.window_size, assignment.device)
        # the window branch's slices in the same sub-stages as the selection's tasks: both branches
        # of sub-stage s read the rows of casts 1..s only
        window_calc, flags = build_calc_meta(slices, areas, assignment, comm, stage_cap,
                                             task_stage if S > 1 else None)
        status = (status | bit(flags["calc_overflow"], CALC_OVERFLOW)
                  | bit(flags["buffer_overflow"], BUFFER_OVERFLOW) | bit(flags["mismatch"], NEED_MISMATCH))
    return SparsePlan(assignment=assignment, metrics=metrics, comm=comm, status=status, area=areas.area,
                      imbalance_tol=mu, spec=spec, window_calc=window_calc, kv_blocks=kv_blocks, cost=cost,
                      stage_of_task=task_stage)


def default_kv_block(mask, config: SolverConfig) -> int | None:
    """How K and V travel, as measured (``benchmarks/sparse_bench.py``): NSA selections as blocks of
    their block size l (the exact token sets up to the causal clip: fewer bytes per step than
    hulls), when l divides the unit size; token top-k and NSA layer masks as hulls (top-k
    spreads over whole units: blocks would move the same; a window branch needs hull buffers)."""
    if isinstance(mask, BlockSparseMask):
        unit = mask.total_seqlen_k // config.num_units
        return mask.block_size if unit % mask.block_size == 0 else None
    return None
