"""The device solver's shared types and constants: tasks, the state of an assignment, proposals.

Every step of a round (``state``, ``offers``, ``bundle``, ``accept``, ``track``,
``start``) imports these and nothing above it; the round driver
(``device.py``) and the persistent kernel (``rounds.py``) import the steps.

Shape legend: B variants, G head groups, P ranks, n sub-chunk tiles per rank,
U = n * P units per group (unit u on rank u // n), T = G * U * U tasks in
(g, i, j) order, N proposals per variant, M task slots per proposal (M = U).
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from gpusolver.capacity import buffer_rows
from gpusolver.config import SolverConfig
from gpusolver.limits import check_problem_limits
from gpusolver.problem import BlockAreas

# mu is compared in integer arithmetic with this many parts per unit.
_MU_SCALE = 1 << 20
_BIG = 1 << 60
# Unit-local token positions stay below this, so the torch proposals price the [.., D, U]
# key hulls in int32 (half the memory traffic of int64), with it as the empty-hull bound.
_TOKEN_LIMIT = 1 << 30
# A bundle's key-hull growth is at most one unit per task, so the whole sequence (U units)
# bounds its running sum: below this, that sum is int32 too.
_SEQUENCE_LIMIT = 1 << 31
# Keys of states past a buffer start here: above every unbalanced state's (``_BIG // 2`` + max
# load <= 2^59 + 2^57: an unbalanced plan runs, slowly; one past a buffer cannot run). Balanced
# ones next (+ objective < 2^52), then unbalanced ones (+ 2^58 + max load), all below ``_BIG``.
OVER_CAPACITY = _BIG // 2 + _BIG // 8 + 1


@dataclass(frozen=True)
class DeviceSolveResult:
    """The chosen plan, all 0-dim tensors on the solve's device except the assignment.

    assignment:     [G, U, U] int32, rank of each task (-1 empty task; U = P untiled).
    balanced:       bool, max load <= mu * mean load.
    fits:           bool, every rank's rows within the plan's receive and send buffers
                    (``plan_capacities``). A solve whose starts all fit returns a plan that fits.
    fwd_bottleneck: int64 bytes, ``max_r max(send_r, recv_r)`` of the forward (-1 when
                    not balanced). With a topology across nodes every figure here is
                    link-weighted bytes (``SolverConfig.link_weights``), the solver's
                    own measure; the plan's metrics count plain bytes.
    bwd_bottleneck: int64 bytes, the same for the backward (-1 when not balanced).
    objective:      int64 bytes, what was minimised: their sum with ``objective="training"``,
                    the forward's alone with "forward" (-1 when not balanced).
    variant:        int64, index of the winning variant (of its tile level's solve).
    tiles:          int64, the tiles per chunk of the chosen plan: ``config.chunk_tiles``, or
                    with ``chunk_tiles="auto"`` the fewest (coarse to fine) that reach mu.
    imbalance_tol:  float64, with ``SolverConfig.imbalance_auto`` the bound the chosen plan was
                    solved at (``solver.balance``); None otherwise. ``balanced`` is against it.
    """

    assignment: torch.Tensor
    balanced: torch.Tensor
    fwd_bottleneck: torch.Tensor
    variant: torch.Tensor
    bwd_bottleneck: torch.Tensor | None = None
    objective: torch.Tensor | None = None
    fits: torch.Tensor | None = None
    tiles: torch.Tensor | None = None
    imbalance_tol: torch.Tensor | None = None


class Tasks:
    """Flat task arrays [T], T = G * U * U, in (g, i, j) order, plus static tables.

    U = n * P units per group (n sub-chunk tiles per rank); unit u lives on rank u // n.
    """

    def __init__(self, areas: BlockAreas, config: SolverConfig):
        G, P, U, n = areas.head_groups, areas.cp_size, areas.num_units, areas.tiles
        check_problem_limits(areas.chunk * U, P, G, n)
        # within MAX_SEQLEN every token position stays below _TOKEN_LIMIT and every bundle sum
        # below _SEQUENCE_LIMIT, so the int32 fast paths hold
        dev = areas.area.device
        self.G, self.P, self.U, self.T = G, P, U, G * U * U
        idx = torch.arange(self.T, device=dev)
        self.g = idx // (U * U)
        self.i = (idx // U) % U
        self.j = idx % U
        self.area = areas.area.reshape(-1)
        self.valid = self.area > 0
        self.qlo, self.qhi = areas.q_need.reshape(-1, 2).unbind(-1)
        self.klo, self.khi = areas.k_need.reshape(-1, 2).unbind(-1)
        self.qo_unit = self.g * U + self.i  # [T] index of QO unit (g, i)
        self.kv_unit = self.g * U + self.j  # [T] index of KV unit (g, j)
        # rank holding each task's query unit and its key unit [T] (untiled: the unit index itself)
        self.q_host, self.k_host = (self.i, self.j) if n == 1 else (self.i // n, self.j // n)
        self.tiles = n
        self.chunk = areas.chunk  # tokens per unit
        cost = config.cost()
        # bytes per token: forward Q there, O back, K/V there; backward dO there, dQ back, K/V
        # there again (0 with kept buffers), dK/dV back
        self.q, self.o, self.kv = cost.q_fwd, cost.o_fwd, cost.kv_fwd
        self.qb, self.dqb, self.kvb, self.dkv = cost.q_bwd, cost.dq_bwd, cost.kv_bwd, cost.dkv_bwd
        # the objective: forward plus backward bottleneck (a training step), or the forward's alone
        self.training = config.objective == "training"
        # (ranks per node, NVLink weight, InfiniBand weight): every byte priced by the link it
        # crosses; None when all links are alike (the plain-byte solve, untouched)
        self.links = config.link_weights
        # inter-node rows travel by relay (``SolverConfig.relays``, the answer the plan builder's
        # ``relay_transport`` gives too, so the solve prices the transport that runs): each (unit,
        # remote node) crosses InfiniBand once, host to ``Topology.relay_rank``, then NVLink to the
        # node's other consumers
        self.relays = config.relays
        self.problem = (areas, config)  # what the "nodes" start solves over the nodes
        # the plan's receive and send buffers, in group-major rows per rank: (QO recv, KV recv, QO
        # send, KV send), hard limits of every move (``capacity.buffer_rows``, the sizes the
        # runtime allocates)
        self.buffer_rows = buffer_rows(config, areas.rank_tokens).as_tuple()
        # no rank can pass G * c * (P - 1) rows (every other rank's whole chunk): capacities at or
        # above it never bind, and the steps skip their checks
        worst = G * areas.rank_tokens * (P - 1)
        self.caps = min(self.buffer_rows) < worst
        # the tasks of each QO unit in the orders a bundle may take them (TASK_ORDERS):
        # [3, G*U, U] task ids; "area": largest first; "rows": fewest needed query rows first
        # (then largest), so the rows a bundle ships grow as slowly as possible; "small":
        # smallest first, so a small excess is covered by the smallest task that covers it
        area = areas.area.reshape(G * U, U)
        q_len = (areas.q_need[..., 1] - areas.q_need[..., 0]).reshape(G * U, U)
        by_area = torch.sort(-area, dim=1, stable=True).indices
        # two stable sorts, not one product key: q_len * max area passes 2^63 on long sequences
        by_rows = by_area.gather(1, torch.sort(q_len.gather(1, by_area), dim=1, stable=True).indices)
        by_small = torch.sort(torch.where(area > 0, area, _BIG), dim=1, stable=True).indices  # empty last
        self.unit_tasks = torch.arange(G * U, device=dev)[:, None] * U + torch.stack((by_area, by_rows, by_small))

    def with_rule(self, training: bool) -> "Tasks":
        """The same tasks with moves priced (and states ranked) by the training or the forward rule."""
        other = copy.copy(self)
        other.training = training
        return other

    @functools.cached_property
    def unit_pos(self) -> torch.Tensor:
        """[2, G*U, U] position of key unit j in each QO unit's task order (``unit_tasks``
        inverted); built on first use (the torch proposals read it, the kernels do not)."""
        pos = torch.empty_like(self.unit_tasks)
        return pos.scatter_(2, self.unit_tasks % self.U, torch.arange(self.U, device=pos.device).expand_as(pos))

    def link_weight(self, a, b):
        """The price of one byte between ranks ``a`` and ``b`` (tensors or ints, broadcast):
        the NVLink weight inside a node, the InfiniBand weight across nodes (``links``)."""
        per_node, w_nv, w_ib = self.links
        return torch.where(a // per_node == b // per_node, w_nv, w_ib)

    @functools.cached_property
    def unit_dest_weight(self) -> torch.Tensor:
        """[G*U, P] int64, the price of a byte from each unit's host to each rank (``links``)."""
        return self.link_weight(self.unit_host[:, None], torch.arange(self.P, device=self.area.device))

    @functools.cached_property
    def unit_host(self) -> torch.Tensor:
        """[G*U] rank holding each QO / KV unit index g*U + u; built on first use (the kernels
        compute it in place, so their paths launch nothing for it)."""
        host = torch.arange(self.G * self.U, device=self.area.device) % self.U
        return host if self.tiles == 1 else host // self.tiles


@dataclass
class State:
    """Per-variant quantities of one assignment A [B, T+1] (column T is a dummy)."""

    rank: torch.Tensor  # [B, T], P for empty tasks
    q_lo: torch.Tensor  # [B, G*U, P] hull of each QO unit's rows at each rank
    q_hi: torch.Tensor
    k_lo: torch.Tensor  # [B, G*U, P] hull of each KV unit's columns at each rank
    k_hi: torch.Tensor
    qlen: torch.Tensor  # [B, G*U, P] tokens that travel (0 at the host)
    klen: torch.Tensor
    kcount: torch.Tensor  # [B, G*U, P] tasks of each KV unit on each rank
    send: torch.Tensor  # [B, P] forward bytes (link-weighted with ``Tasks.links``)
    recv: torch.Tensor
    vol: torch.Tensor  # [B, P] max(send, recv)
    bottleneck: torch.Tensor  # [B] max over ranks of vol
    load: torch.Tensor  # [B, P]
    bsend: torch.Tensor  # [B, P] backward bytes
    brecv: torch.Tensor
    bvol: torch.Tensor  # [B, P] max(bsend, brecv)
    bwd_bottleneck: torch.Tensor  # [B] max over ranks of bvol
    q_out: torch.Tensor  # [B, P] group-major rows of the rank's QO units that travel (its QO sends)
    q_in: torch.Tensor  # [B, P] QO rows it receives
    k_out: torch.Tensor  # [B, P] KV rows it sends
    k_in: torch.Tensor  # [B, P] KV rows it receives
    # relay transport only (``Tasks.relays``), else None: [6, B, G*U, N] int64 over the N nodes,
    # each unit's hull at each node (over the node's ranks but its host) and its consumers there:
    # QO lo, QO hi, KV lo, KV hi, QO consumers, KV consumers (``state.relay``)
    nodes: torch.Tensor | None = None


def objective(st: State, training: bool) -> torch.Tensor:
    """[B] int64, what the solver minimises: forward plus backward bottleneck (``training``),
    or the forward's alone."""
    return st.bottleneck + st.bwd_bottleneck if training else st.bottleneck


def state_key(balanced, goal, max_load, over=None):
    """[B] int64 best-state key, lower is better: within the buffers and balanced (the
    objective ``goal``), within and unbalanced (``_BIG // 2`` + max load), past a buffer and
    balanced (``OVER_CAPACITY`` + goal), past and unbalanced (``OVER_CAPACITY + 2^58`` + max
    load). ``over`` [B] bool, None when the buffers hold every plan."""
    key = torch.where(balanced, goal, _BIG // 2 + max_load)
    if over is None:
        return key
    return torch.where(over, torch.where(balanced, OVER_CAPACITY + goal, OVER_CAPACITY + (1 << 58) + max_load), key)


def over_buffers(st: State, caps) -> torch.Tensor:
    """[B] bool: some rank receives or sends more rows of a kind than its buffer holds. ``caps``:
    (QO recv, KV recv, QO send, KV send) rows, host ints or [B] tensors (a [4, B] tensor)."""
    col = lambda c: c.view(-1, 1) if isinstance(c, torch.Tensor) else c  # noqa: E731  (no host-to-device copy)
    qr, kr, qs, ks = (col(c) for c in caps)
    return ((st.q_in > qr) | (st.k_in > kr) | (st.q_out > qs) | (st.k_out > ks)).any(1)


def step_vol(st: State, training: bool) -> torch.Tensor:
    """[B, P] int64, each rank's part of the objective: fwd + bwd bytes, or fwd alone; its
    argmax is the rank a restart relieves."""
    return st.vol + st.bvol if training else st.vol


@dataclass
class Proposals:
    """Proposed moves: [B, N] each, tasks [B, N, M] (M task slots, T = unused)."""

    ok: torch.Tensor  # bool
    score: torch.Tensor  # float64, lower is better
    dest: torch.Tensor  # int64
    source: torch.Tensor  # int64
    area: torch.Tensor  # int64 area moved
    dest_send: torch.Tensor  # int64 change of the destination's send (< 0 when it stops shipping K/V)
    dest_recv: torch.Tensor
    tasks: torch.Tensor  # [B, P, M] task ids to move, T (dummy) where unused
    dest_bsend: torch.Tensor  # int64 change of the destination's backward send and receive
    dest_brecv: torch.Tensor
    dest_qin: torch.Tensor  # int64 QO and KV rows the destination receives more
    dest_kin: torch.Tensor

