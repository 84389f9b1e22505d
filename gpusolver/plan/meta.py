"""The plan's frozen dataclasses: CommMeta, CalcMeta, Plan, RankPlan.

Shape legend: G head groups, P ranks, c = S / P tokens per chunk, n
sub-chunk tiles per chunk (``SolverConfig.chunk_tiles``, default 1), U = n * P
units (unit u is tile u % n of rank u // n's chunk, rows [(u % n) * c / n,
(u % n + 1) * c / n) of it), ``cap`` = CalcMeta slice rows per rank and stage,
``send_cap`` = send rows per rank.

Layout "group-major" (binding for every row coordinate in this package): a
rank's local Q ``[c, Hq, D]`` is viewed as G blocks of c rows; row
``g * c + t`` is token ``t`` of the chunk with the ``Hq / G`` query heads of
group ``g``. Local K and V are viewed the same way with ``Hkv / G`` heads.
A receive buffer holds remote units back to back, ordered by host rank
ascending, then group ascending, then tile, then token.

Every tensor describes all P ranks at once: every rank builds the same plan
and picks its own rows (``Plan.for_rank``). Nothing here reads device values
except ``validate()`` and ``summary()``, which are host-side by design.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpusolver.plan import records
from gpusolver.plan.gather import send_index

# Status bits of Plan.status (a 0-dim int32 bitfield computed on device).
IMBALANCED = 1       # max load > imbalance_tol * mean load
CALC_OVERFLOW = 2    # some rank/stage needs more slice rows than CalcMeta's capacity
BUFFER_OVERFLOW = 4  # some rank sends or receives more rows than the buffer capacity
UNASSIGNED = 8       # a non-empty task has no valid rank in the assignment
NEED_MISMATCH = 16   # a slice piece lies outside its block's needs: areas do not match the mask
INVALID_MASK = 32    # a slice range is reversed or outside [0, S], or a type code is not 0..3

STATUS_NAMES = {
    IMBALANCED: "IMBALANCED",
    CALC_OVERFLOW: "CALC_OVERFLOW",
    BUFFER_OVERFLOW: "BUFFER_OVERFLOW",
    UNASSIGNED: "UNASSIGNED",
    NEED_MISMATCH: "NEED_MISMATCH",
    INVALID_MASK: "INVALID_MASK",
}


def status_names(status: int) -> list[str]:
    """Names of the bits set in a host int status."""
    return [name for bit, name in STATUS_NAMES.items() if status & bit]


@dataclass(frozen=True)
class CommMeta:
    """Who sends which rows of which unit to whom, for QO and for KV.

    Units: QO unit ``(g, u)`` and KV unit ``(g, u)`` live on host rank ``u // n``
    (``u`` itself without tiling). All ranges are token rows of the host's
    chunk (chunk-local), half-open, inside the unit's tile.

    qo_range, kv_range:             [G, U(unit), P(dest), 2] int64 — rows of unit
                                    (g, u) that travel to dest (hulls from
                                    ``transfer_ranges``); [0, 0) when nothing travels
                                    (always for dest == host).
    qo_recv_offset, kv_recv_offset: [G, U(unit), P(dest)] int64 — where unit
                                    (g, u)'s rows start in dest's receive buffer
                                    (exclusive prefix sum over (host, g, tile) in that order).
    qo_split, kv_split:             [P(src), P(dst)] int64 — rows src sends to dst
                                    (the all-to-all-v split sizes).
    qo_recv_rows, kv_recv_rows:     [P] int64 — rows each rank receives (its buffer fill).
    chunk:                          c, tokens per chunk (host int).
    qo_recv_capacity, kv_recv_capacity: rows of each rank's QO / KV receive buffer
                                    (host ints, static; ``gpusolver.capacity``).
    qo_send_capacity, kv_send_capacity: rows of each rank's QO / KV send list (host
                                    ints, static), and of the buffer the partial
                                    results of those rows come back into.
    tiles:                          n, units per rank (host int, default 1).

    A remote QO row ``t`` (chunk-local) of unit (g, u) on dest r sits at buffer row
    ``qo_recv_offset[g, u, r] + t - qo_range[g, u, r, 0]``. Rows beyond
    a receive or send capacity are never indexed: the plan's status gets
    BUFFER_OVERFLOW instead and the collectives must not run.
    """

    qo_range: torch.Tensor
    kv_range: torch.Tensor
    qo_recv_offset: torch.Tensor
    kv_recv_offset: torch.Tensor
    qo_split: torch.Tensor
    kv_split: torch.Tensor
    qo_recv_rows: torch.Tensor
    kv_recv_rows: torch.Tensor
    chunk: int
    qo_recv_capacity: int
    kv_recv_capacity: int
    qo_send_capacity: int
    kv_send_capacity: int
    tiles: int = 1

    @property
    def buffers(self):
        """The four capacities as a ``gpusolver.capacity.BufferRows``."""
        from gpusolver.capacity import BufferRows

        return BufferRows(self.qo_recv_capacity, self.kv_recv_capacity, self.qo_send_capacity,
                          self.kv_send_capacity)

    def send_index(self, kind: str, rank: int) -> torch.Tensor:
        """[send_cap(kind)] int64 gather indices into ``rank``'s group-major local rows of
        the ``kind`` ("qo" or "kv") units it sends, in send order (dst ascending,
        then g, then tile, then token); -1 pads. Built on demand (sync-free) so a plan never
        holds the send lists of all P ranks."""
        if kind not in ("qo", "kv"):
            raise ValueError(f"kind must be 'qo' or 'kv', got {kind!r}")
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {rank}")
        rng = self.qo_range if kind == "qo" else self.kv_range
        n = self.tiles
        return send_index(rng[:, rank * n:(rank + 1) * n], self.chunk, self.buffers.send(kind))

    @property
    def head_groups(self) -> int:
        return self.qo_range.shape[0]

    @property
    def cp_size(self) -> int:
        return self.qo_range.shape[2]

    def unit_host(self) -> torch.Tensor:
        """[U] int64, the rank holding each unit."""
        return torch.arange(self.qo_range.shape[1], device=self.qo_range.device) // self.tiles


@dataclass(frozen=True)
class CalcMeta:
    """The slice lists the attention kernel runs, per rank and stage.

    Stage 0 holds the pieces of rank r's tasks whose two units are both hosted
    on r (task (g, r, r) without tiling); stage 1 the rest of rank r's tasks.

    q_ranges:    [P, 2, cap, 2] int32 — query rows of each piece.
    k_ranges:    [P, 2, cap, 2] int32 — key rows of each piece.
    attn_type:   [P, 2, cap] int32 — FULL / CAUSAL / INV_CAUSAL / BI_CAUSAL codes.
    num_rows:    [P, 2] int32 — rows in use (the first ``num_rows``); the rest are
                 dummies [0, 0) with type FULL.
    needed_rows: [P, 2] int32 — rows the rank's tasks need; above ``cap`` means
                 CALC_OVERFLOW (``num_rows`` is then clipped and work is missing).

    Coordinates. Stage 0: group-major local rows for both q and k
    (``g * c + t``, t chunk-local). Stage 1: q rows index ``concat(local Q [G*c rows],
    QO receive buffer)`` — a remote row is ``G*c + qo_recv_offset[g, i, r] + t -
    qo_range[g, i, r, 0]``; k rows index ``concat(local KV, KV receive buffer)``
    likewise. A kernel runs them as they are with ``Hq / G`` query and
    ``Hkv / G`` KV heads per row.

    Each piece is the part of one slice inside one block (g, i, j) of units, split into
    at most three rows so that each has a single type; the pieces of all ranks
    cover the mask exactly once.
    """

    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type: torch.Tensor
    num_rows: torch.Tensor
    needed_rows: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.q_ranges.shape[2]


@dataclass(frozen=True)
class RankPlan:
    """One rank's view of a Plan (views, plus its send lists built on demand; no host reads).

    q_ranges, k_ranges: [2, cap, 2] int32; attn_type: [2, cap] int32;
    num_rows: [2] int32 — the rank's two CalcMeta stages.
    qo_send_index, kv_send_index: [send_cap] int64 — gather indices into local rows.
    qo_send_split, kv_send_split: [P] int64 — rows sent to each destination.
    qo_recv_split, kv_recv_split: [P] int64 — rows received from each source.
    """

    rank: int
    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type: torch.Tensor
    num_rows: torch.Tensor
    qo_send_index: torch.Tensor
    kv_send_index: torch.Tensor
    qo_send_split: torch.Tensor
    kv_send_split: torch.Tensor
    qo_recv_split: torch.Tensor
    kv_recv_split: torch.Tensor


@dataclass(frozen=True)
class Plan:
    """A solved layer: who computes what, what moves, and what each kernel runs.

    assignment: [G, U, U] int32 — rank computing task (g, i, j); -1 for an empty task.
    metrics:    PlanMetrics (loads, volumes, bottlenecks, imbalance; tensors).
    comm:       CommMeta.
    calc:       CalcMeta.
    status:     [] int32 bitfield of IMBALANCED, CALC_OVERFLOW, BUFFER_OVERFLOW,
                UNASSIGNED, NEED_MISMATCH, INVALID_MASK (0 = usable and balanced).
    area:       [G, U, U] int64 — the block areas the plan was built from.
    imbalance_tol: mu the IMBALANCED bit was judged against (host float, config).
    cost:       the CommCost the metrics were priced with (host ints; None for a plan built
                without one): bytes per row of each collective (``pair_bytes``) and
                heads and head dim for the simulator's FLOPs.

    ``validate()`` and ``summary()`` read the tensors on the host; everything
    else stays on device.
    """

    assignment: torch.Tensor
    metrics: Any
    comm: CommMeta
    calc: CalcMeta
    status: torch.Tensor
    area: torch.Tensor
    imbalance_tol: float
    cost: Any = None

    def pair_bytes(self, phase: str, cost=None) -> torch.Tensor:
        """[P(src), P(dst)] int64 bytes the layer moves from source to destination (sync-free).

        phase: "fwd", "bwd", or one collective (``"fwd.qo"``, ``"fwd.kv"``, ``"fwd.o"``, ``"bwd.qo"``,
        ``"bwd.kv"``, ``"bwd.dq"``, ``"bwd.dkv"``); cost: default the plan's own CommCost.
        The sums over destinations and sources are the metrics' send and receive volumes.
        """
        from gpusolver.plan.schedule import pair_bytes

        return pair_bytes(self, phase, self.cost if cost is None else cost)

    @property
    def task_stage(self) -> torch.Tensor:
        """[G, U, U] int32: -1 empty task, 0 local stage (both units on its rank), 1 remote stage."""
        from gpusolver.plan.schedule import task_stage

        return task_stage(self)

    def for_rank(self, rank: int) -> RankPlan:
        """Rank ``rank``'s CalcMeta stages and send/receive lists (views)."""
        P = self.comm.cp_size
        if not 0 <= rank < P:
            raise ValueError(f"rank must be in [0, {P}), got {rank}")
        c, m = self.calc, self.comm
        return RankPlan(
            rank=rank, q_ranges=c.q_ranges[rank], k_ranges=c.k_ranges[rank],
            attn_type=c.attn_type[rank], num_rows=c.num_rows[rank],
            qo_send_index=m.send_index("qo", rank), kv_send_index=m.send_index("kv", rank),
            qo_send_split=m.qo_split[rank], kv_send_split=m.kv_split[rank],
            qo_recv_split=m.qo_split[:, rank], kv_recv_split=m.kv_split[:, rank])

    def validate(self, ignore: int = 0) -> "Plan":
        """Raise ValueError naming each status bit set (except those in ``ignore``).

        Host-side: reads the status and the counts behind it. Returns self.
        """
        problems = _explain_status(self, ignore)
        if problems:
            raise ValueError("plan is not usable:\n  " + "\n  ".join(problems))
        return self

    def summary(self) -> str:
        """Human-readable metrics table and status (host-side)."""
        status = int(self.status.item())
        names = status_names(status)
        lines = []
        if hasattr(self.metrics, "summary"):
            lines.append(self.metrics.summary())
        c = self.calc
        lines.append(f"calc rows per stage (max over ranks): stage0 {int(c.needed_rows[:, 0].max())}, "
                     f"stage1 {int(c.needed_rows[:, 1].max())}, capacity {c.capacity}")
        m = self.comm
        lines.append(f"recv rows (max over ranks): qo {int(m.qo_recv_rows.max())} of {m.qo_recv_capacity}, "
                     f"kv {int(m.kv_recv_rows.max())} of {m.kv_recv_capacity}")
        lines.append("status: " + ("OK" if not names else " | ".join(names)))
        return "\n".join(lines)

    def memory(self, config, keep_forward_buffers=None):
        """Bytes per rank of this plan's collective buffers (``plan.memory.BufferMemory``:
        forward peak, backward peak, kept for the backward), for ``config``'s heads, head dim
        and dtype. ``keep_forward_buffers``: what helpers keep (True, False, "qo", "kv"; default
        the config's, within its ``memory_budget``). Host ints from static shapes: no device read."""
        from gpusolver.capacity import keep_for_budget
        from gpusolver.plan.memory import buffer_memory

        keep = keep_forward_buffers
        if keep is None:
            keep = keep_for_budget(config, self.comm.chunk).keep_forward_buffers
        return buffer_memory(self.comm, config.num_heads_q, config.num_heads_kv, config.head_dim, config.dtype, keep)

    def save(self, path, *, config=None) -> None:
        """Write the plan (and its ``SolverConfig``, if given) to ``path`` (the ``plan.records`` format)."""
        records.write(self, path, config)

    @staticmethod
    def load(path, *, map_location="cpu") -> "Plan":
        """The plan saved at ``path``, its tensors on ``map_location``."""
        from gpusolver.metrics import PlanMetrics
        from gpusolver.problem import CommCost

        p = records.read(path, map_location)["plan"]
        return records.from_plain(Plan, p, {
            "metrics": lambda d: records.from_plain(PlanMetrics, d, {}),
            "comm": lambda d: records.from_plain(CommMeta, d, {}),
            "calc": lambda d: records.from_plain(CalcMeta, d, {}),
            "cost": lambda d: None if d is None else records.from_plain(CommCost, d, {}),
        })


def _explain_status(plan: Plan, ignore: int) -> list[str]:
    """One host-side message per status bit set, naming the limit and the fix."""
    status = int(plan.status.item()) & ~ignore
    out = []
    if status & UNASSIGNED:
        P = plan.comm.cp_size
        a = plan.assignment.long().cpu()
        bad = ((plan.area.cpu() > 0) & ((a < 0) | (a >= P))).nonzero()
        if bad.numel():
            g, i, j = bad[0].tolist()
            out.append(f"UNASSIGNED: task (g={g}, i={i}, j={j}) has area {int(plan.area[g, i, j])} but "
                       f"assignment {int(a[g, i, j])}; every non-empty task needs a rank in [0, {P})")
        else:
            out.append("UNASSIGNED: a task with slice pieces but area 0 has no rank; "
                       "the BlockAreas do not match the mask")
    if status & IMBALANCED:
        load = plan.metrics.load.double().cpu()
        mean = load.mean().item()
        r = int(load.argmax())
        out.append(f"IMBALANCED: rank {r} load {int(load[r])} is {load[r].item() / mean:.3f} x the mean "
                   f"{mean:.1f}, above imbalance_tol {plan.imbalance_tol}")
    if status & CALC_OVERFLOW:
        need, cap = plan.calc.needed_rows.cpu(), plan.calc.capacity
        over = (need > cap).nonzero()
        if over.numel():
            r, s = over[0].tolist()
            out.append(f"CALC_OVERFLOW: rank {r} stage {s} needs {int(need[r, s])} slice rows, capacity {cap}: "
                       "raise SolverConfig.max_stage_slices")
        else:
            out.append(f"CALC_OVERFLOW: the mask has more slice pieces than the plan can hold with "
                       f"capacity {cap}: raise SolverConfig.max_stage_slices")
    if status & BUFFER_OVERFLOW:
        m = plan.comm
        for kind, rows, split in (("qo", m.qo_recv_rows, m.qo_split), ("kv", m.kv_recv_rows, m.kv_split)):
            rows, sent = rows.cpu(), split.sum(1).cpu()
            recv_cap, send_cap = m.buffers.recv(kind), m.buffers.send(kind)
            if (rows > recv_cap).any():
                r = int(rows.argmax())
                out.append(f"BUFFER_OVERFLOW: rank {r} receives {int(rows[r])} {kind.upper()} rows, receive "
                           f"capacity {recv_cap}: raise SolverConfig.max_{kind}_recv_rows")
            if (sent > send_cap).any():
                r = int(sent.argmax())
                out.append(f"BUFFER_OVERFLOW: rank {r} sends {int(sent[r])} {kind.upper()} rows, send capacity "
                           f"{send_cap}: raise SolverConfig.max_{kind}_send_rows")
    if status & INVALID_MASK:
        out.append("INVALID_MASK: a slice range is reversed or outside [0, S), or a type code is not 0..3; "
                   "mask.validate() names the row")
    if status & NEED_MISMATCH:
        out.append("NEED_MISMATCH: a slice piece lies outside its block's q_need/k_need (or in a block of "
                   "area 0): build the BlockAreas from the same mask")
    return out
