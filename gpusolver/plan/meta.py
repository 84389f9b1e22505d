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

import operator
from dataclasses import dataclass
from typing import Any

import torch

from gpusolver.plan import records
from gpusolver.plan.gather import return_gather, send_index

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

    Sub-stages (``num_stages`` S > 1; with S = 1 the fields below are None and
    everything is one cast, one buffer, one reduce):

    qo_stage, kv_stage:             [G, U(unit), P(dest), 2] int64 — (first, last) sub-stage
                                    of dest that uses the transfer; 0 when nothing travels.
                                    Its rows travel in cast ``first`` and its partial results
                                    return in reduce ``last``. The casts share dest's one receive
                                    buffer per kind (``*_recv_offset`` is the start within it).
    qo_stage_split, kv_stage_split: [S, P(src), P(dst)] int64 — split sizes of each cast.
    qo_return_split, kv_return_split: [S, P(src), P(dst)] int64 — rows src sent to dst whose
                                    partials come back in reduce s.
    qo_return_offset, kv_return_offset: [G, U, P(dest)] int64 — where the transfer's rows start
                                    in reduce ``last``'s buffer (same (host, g, tile) order).
    qo_stage_base, kv_stage_base:   [S, P(dest)] int64 — the row of dest's shared receive buffer
                                    where cast s's rows start: cast s lands after casts 1..s-1,
                                    each in (host, g, tile) order, so the whole fill is the
                                    one-stage plan's and no sub-stage costs receive memory.

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
    num_stages: int = 1
    qo_stage: torch.Tensor | None = None
    kv_stage: torch.Tensor | None = None
    qo_stage_split: torch.Tensor | None = None
    kv_stage_split: torch.Tensor | None = None
    qo_return_split: torch.Tensor | None = None
    kv_return_split: torch.Tensor | None = None
    qo_return_offset: torch.Tensor | None = None
    kv_return_offset: torch.Tensor | None = None
    qo_stage_base: torch.Tensor | None = None
    kv_stage_base: torch.Tensor | None = None

    @property
    def buffers(self):
        """The four capacities as a ``gpusolver.capacity.BufferRows``."""
        from gpusolver.capacity import BufferRows

        return BufferRows(self.qo_recv_capacity, self.kv_recv_capacity, self.qo_send_capacity,
                          self.kv_send_capacity)

    def _kind(self, kind: str) -> str:
        if kind not in ("qo", "kv"):
            raise ValueError(f"kind must be 'qo' or 'kv', got {kind!r}")
        return kind

    def _stage_arg(self, stage, which: str) -> None:
        if which not in ("cast", "return"):
            raise ValueError(f"which must be 'cast' or 'return', got {which!r}")
        if stage is not None and not (isinstance(stage, int) and 1 <= stage <= self.num_stages):
            raise ValueError(f"stage must be None or an int in [1, {self.num_stages}], got {stage!r}")

    def send_index(self, kind: str, rank: int, stage: int | None = None, which: str = "cast") -> torch.Tensor:
        """[send_cap(kind)] int64 gather indices into ``rank``'s group-major local rows of
        the ``kind`` ("qo" or "kv") units it sends, in send order (dst ascending,
        then g, then tile, then token); -1 pads. Built on demand (sync-free) so a plan never
        holds the send lists of all P ranks.

        stage: None for every row; s in 1..S for the rows of cast s (``which="cast"``) or
        those whose partials return in reduce s (``which="return"``)."""
        self._kind(kind)
        self._stage_arg(stage, which)
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {rank}")
        rng = self.qo_range if kind == "qo" else self.kv_range
        n = self.tiles
        rng = rng[:, rank * n:(rank + 1) * n]
        if stage is not None and self.num_stages > 1:
            st = (self.qo_stage if kind == "qo" else self.kv_stage)[:, rank * n:(rank + 1) * n]
            rng = torch.where((st[..., 0 if which == "cast" else 1] == stage)[..., None], rng, 0)
        return send_index(rng, self.chunk, self.buffers.send(kind))

    def stage_send_index(self, kind: str, ranks, which: str = "cast", capacity: int | None = None) -> torch.Tensor:
        """[len(ranks), S, send_cap(kind)] int64: ``send_index(kind, r, s, which)`` of every rank
        ``r`` of ``ranks`` and sub-stage s in 1..S (S = 1: every row), built in one batch (a
        handful of ops, however many ranks and sub-stages, as per-call lists would take each).
        capacity: the first this many positions of each list only (a caller that knows how many
        rows each list holds, from a host copy of the splits); default the send capacity."""
        self._kind(kind)
        self._stage_arg(None, which)
        capacity = self.buffers.send(kind) if capacity is None else capacity
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        ranks = tuple(ranks)
        if not ranks or not all(isinstance(r, int) and 0 <= r < self.cp_size for r in ranks):
            raise ValueError(f"ranks must be a non-empty tuple of ints in [0, {self.cp_size}), got {ranks!r}")
        rng = self.qo_range if kind == "qo" else self.kv_range                  # [G, P * n, P, 2]
        G, n, P, S = rng.shape[0], self.tiles, self.cp_size, self.num_stages
        pick = torch.tensor(ranks, device=rng.device)

        def per_source(t):  # [G, P * n, ...] -> [R, G, n, ...]
            t = t.reshape(G, P, n, *t.shape[2:]).index_select(1, pick)
            return t.transpose(0, 1)

        rng = per_source(rng)[:, None]                                          # [R, 1, G, n, P, 2]
        if S > 1:
            st = per_source(self.qo_stage if kind == "qo" else self.kv_stage)[..., 0 if which == "cast" else 1]
            s = torch.arange(1, S + 1, device=st.device).view(1, S, 1, 1, 1)
            rng = torch.where((st[:, None] == s)[..., None], rng, 0)           # [R, S, G, n, P, 2]
        return send_index(rng, self.chunk, capacity)

    def stage_split(self, kind: str, which: str = "cast") -> torch.Tensor:
        """[S, P(src), P(dst)] int64 split sizes of each cast (``"cast"``) or reduce (``"return"``)."""
        self._kind(kind)
        self._stage_arg(None, which)
        if self.num_stages == 1:
            return (self.qo_split if kind == "qo" else self.kv_split)[None]
        name = f"{kind}_{'stage' if which == 'cast' else 'return'}_split"
        return getattr(self, name)

    def stage_base(self, kind: str) -> torch.Tensor:
        """[S, P(dest)] int64: where cast s's rows start in each rank's shared receive buffer."""
        self._kind(kind)
        if self.num_stages == 1:
            return torch.zeros(1, self.cp_size, dtype=torch.int64, device=self.qo_split.device)
        return self.qo_stage_base if kind == "qo" else self.kv_stage_base

    def return_gather(self, kind: str, rank: int, capacity: int | None = None) -> torch.Tensor:
        """[S, recv_capacity(kind)] int64: row p of reduce s's buffer on ``rank`` is row
        ``gather[s - 1, p]`` of the rank's receive buffer (shared by the sub-stages); -1 past
        the fill. Sync-free. capacity: the first this many positions only (as ``stage_send_index``)."""
        self._kind(kind)
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {rank}")
        capacity = self.buffers.recv(kind) if capacity is None else capacity
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        if self.num_stages == 1:
            pos = torch.arange(capacity, device=self.qo_split.device)
            fill = (self.qo_recv_rows if kind == "qo" else self.kv_recv_rows)[rank]
            return torch.where(pos < fill, pos, -1)[None]
        return return_gather(self, kind, rank, capacity)

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
    on r (task (g, r, r) without tiling); stages 1..S the rest of rank r's tasks,
    by their sub-stage (``Plan.task_stage``; S = 1: all of them in stage 1).

    q_ranges:    [P, S + 1, cap, 2] int32 — query rows of each piece.
    k_ranges:    [P, S + 1, cap, 2] int32 — key rows of each piece.
    attn_type:   [P, S + 1, cap] int32 — FULL / CAUSAL / INV_CAUSAL / BI_CAUSAL codes.
    num_rows:    [P, S + 1] int32 — rows in use (the first ``num_rows``); the rest are
                 dummies [0, 0) with type FULL.
    needed_rows: [P, S + 1] int32 — rows the rank's tasks need; above ``cap`` means
                 CALC_OVERFLOW (``num_rows`` is then clipped and work is missing).

    Coordinates. Stage 0: group-major local rows for both q and k
    (``g * c + t``, t chunk-local). Stage s >= 1: q rows index ``concat(local Q [G*c rows],
    QO receive buffer [qo_recv_capacity rows])``, the one buffer the S casts share — a remote
    row is ``G*c + qo_recv_offset[g, i, r] + t - qo_range[g, i, r, 0]``; k rows index the
    KV buffer likewise. A kernel runs them as they are with ``Hq / G`` query and
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

    @property
    def num_stages(self) -> int:
        """S, remote sub-stages (stages 1..S after the local stage 0)."""
        return self.q_ranges.shape[1] - 1


@dataclass(frozen=True)
class RankPlan:
    """One rank's view of a Plan (views, plus its send lists built on demand; no host reads).

    q_ranges, k_ranges: [S + 1, cap, 2] int32; attn_type: [S + 1, cap] int32;
    num_rows: [S + 1] int32 — the rank's CalcMeta stages (local, then S remote).
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
    stage_of_task: [G, U, U] int32 — stage of each task: -1 empty, 0 local, 1..S remote
                (``gpusolver.plan.stages``); None in plans built without it (then 0 / 1 by
                locality, ``task_stage``).
    relay:      ``plan.relay.RelayMeta`` when inter-node rows travel by relay
                (``SolverConfig.relays``): how each transfer of ``comm`` reaches its
                consumer (direct, or InfiniBand to the node's relay then NVLink); None:
                every transfer is direct.

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
    stage_of_task: torch.Tensor | None = None
    relay: Any = None

    @property
    def num_stages(self) -> int:
        """S, remote sub-stages."""
        return self.calc.num_stages

    def pair_bytes(self, phase: str, cost=None, stage: int | None = None, hop: int | None = None) -> torch.Tensor:
        """[P(src), P(dst)] int64 bytes the layer moves from source to destination (sync-free).

        phase: "fwd", "bwd", or one collective (``"fwd.qo"``, ``"fwd.kv"``, ``"fwd.o"``, ``"bwd.qo"``,
        ``"bwd.kv"``, ``"bwd.dq"``, ``"bwd.dkv"``); cost: default the plan's own CommCost;
        stage: None for all sub-stages, s in 1..S for sub-stage s's collectives alone;
        hop: None for every hop, or one hop of relay transport (0 direct, 1 InfiniBand to or
        from a relay, 2 NVLink between a relay and its node's consumers, 3 NVLink between a host and
        its egress, ``RelayMeta.egress``); a plan without
        relay has hop 0 only. The groups count hop h of phase ph as ``schedule.hop_phase(ph, h)``.
        Without relay the sums over destinations and sources are the metrics' send and receive
        volumes.
        """
        from gpusolver.plan.schedule import pair_bytes

        return pair_bytes(self, phase, self.cost if cost is None else cost, stage, hop)

    @property
    def task_stage(self) -> torch.Tensor:
        """[G, U, U] int32: -1 empty task, 0 local stage (both units on its rank), 1..S remote sub-stage."""
        if self.stage_of_task is not None:
            return self.stage_of_task
        from gpusolver.plan.schedule import task_stage

        return task_stage(self)

    def for_rank(self, rank: int) -> RankPlan:
        """Rank ``rank``'s CalcMeta stages and send/receive lists (views)."""
        P = self.comm.cp_size
        try:  # numpy and 0-dim integer tensors too; a str would fail the compare below with no name
            rank = operator.index(rank)
        except TypeError:
            raise TypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}") from None
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
        if isinstance(ignore, bool) or not isinstance(ignore, int):
            raise TypeError(f"ignore must be an int of status bits (e.g. IMBALANCED), got {type(ignore).__name__} "
                            f"{ignore!r}")
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
        per = ", ".join(f"stage{s} {int(c.needed_rows[:, s].max())}" for s in range(c.num_stages + 1))
        lines.append(f"calc rows per stage (max over ranks): {per}, capacity {c.capacity}")
        m = self.comm
        lines.append(f"recv rows (max over ranks): qo {int(m.qo_recv_rows.max())} of {m.qo_recv_capacity}, "
                     f"kv {int(m.kv_recv_rows.max())} of {m.kv_recv_capacity}")
        lines.append("status: " + ("OK" if not names else " | ".join(names)))
        return "\n".join(lines)

    def memory(self, config, keep_forward_buffers=None):
        """Bytes per rank of this plan's collective buffers (``plan.memory.BufferMemory``:
        forward peak, backward peak, kept for the backward), for ``config``'s heads, head dim
        and dtype. ``keep_forward_buffers``: what helpers keep (True, False, "qo", "kv"; default
        the config's, within its ``memory_budget``, with the rows it keeps, ``kept_q_rows`` and
        ``kept_kv_rows``).
        A relay plan's (``self.relay``) counts every hop's buffers too (``gpusolver.plan.memory``
        says which). Host ints from static shapes: no device read."""
        from gpusolver.capacity import keep_for_budget
        from gpusolver.config import check_config
        from gpusolver.plan.memory import buffer_memory

        check_config(config)
        keep, kv_rows, q_rows = keep_forward_buffers, config.kept_kv_rows, config.kept_q_rows
        per_rank = config.kept_per_rank
        if keep is None:
            resolved = keep_for_budget(config, self.comm.chunk)
            keep, kv_rows, q_rows = resolved.keep_forward_buffers, resolved.kept_kv_rows, resolved.kept_q_rows
            per_rank = resolved.kept_per_rank
        return buffer_memory(self.comm, config.num_heads_q, config.num_heads_kv, config.head_dim, config.dtype, keep,
                             kv_rows, relay=self.relay, kept_q_rows=q_rows, kept_per_rank=per_rank)

    def save(self, path, *, config=None) -> None:
        """Write the plan (and its ``SolverConfig``, if given) to ``path`` (the ``plan.records`` format)."""
        records.write(self, path, config)

    @staticmethod
    def load(path, *, map_location="cpu") -> "Plan":
        """The plan saved at ``path``, its tensors on ``map_location``."""
        from gpusolver.metrics import PlanMetrics
        from gpusolver.plan.relay import RelayMeta, RelayRoute
        from gpusolver.problem import CommCost

        p = records.read(path, map_location)["plan"]
        route = lambda d: records.from_plain(RelayRoute, d, {})  # noqa: E731
        return records.from_plain(Plan, p, {
            "metrics": lambda d: records.from_plain(PlanMetrics, d, {}),
            "comm": lambda d: records.from_plain(CommMeta, d, {}),
            "calc": lambda d: records.from_plain(CalcMeta, d, {}),
            "cost": lambda d: None if d is None else records.from_plain(CommCost, d, {}),
            "relay": lambda d: None if d is None else records.from_plain(RelayMeta, d, {
                "qo": route, "kv": route, "qo_back": lambda b: None if b is None else route(b),
                "kv_back": lambda b: None if b is None else route(b)}),
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
        before = len(out)
        for kind, split in (("qo", m.qo_split), ("kv", m.kv_split)):
            sent = split.sum(1).cpu()
            recv_cap, send_cap = m.buffers.recv(kind), m.buffers.send(kind)
            # the sub-stages share one receive buffer per kind: the whole fill of each rank counts
            per = split.sum(0).cpu()
            if (per > recv_cap).any():
                r = int(per.argmax())
                out.append(f"BUFFER_OVERFLOW: rank {r} receives {int(per[r])} {kind.upper()} rows, "
                           f"receive capacity {recv_cap}: raise SolverConfig.max_{kind}_recv_rows")
            if (sent > send_cap).any():
                r = int(sent.argmax())
                out.append(f"BUFFER_OVERFLOW: rank {r} sends {int(sent[r])} {kind.upper()} rows, send capacity "
                           f"{send_cap}: raise SolverConfig.max_{kind}_send_rows")
        if len(out) == before:
            out.append("BUFFER_OVERFLOW: a slice piece lies past its receive buffer: raise "
                       "SolverConfig.max_qo_recv_rows / max_kv_recv_rows")
    if status & INVALID_MASK:
        out.append("INVALID_MASK: a slice range is reversed or outside [0, S), or a type code is not 0..3; "
                   "mask.validate() names the row")
    if status & NEED_MISMATCH:
        out.append("NEED_MISMATCH: a slice piece lies outside its block's q_need/k_need (or in a block of "
                   "area 0): build the BlockAreas from the same mask")
    return out
