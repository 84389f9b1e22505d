"""Solver configuration: the static facts that size every output."""
from __future__ import annotations

import reprlib
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch

from gpusolver.limits import CONFIG_LIMITS, MAX_IMBALANCE_TOL, MAX_LINK_WEIGHT, check_seqlen_limit
from gpusolver.problem import CommCost, check_kept_per_rank, kept_kinds
from gpusolver.support import DTYPES
from gpusolver.topology import Topology


# what the device solver minimises: a training step's forward plus backward bottleneck, or the
# forward's alone (inference)
OBJECTIVES = ("training", "forward")
# chunk_tiles="auto" splits each chunk pair's work into at least this many pieces: G head groups
# times n tiles per chunk, n a power of two (G = 1: 4 tiles, G = 2: 2, G >= 4: whole chunks).
# With one KV head, whole chunks left 5 of 9 flex-attention test masks at P = 4 above mu
# (1.19-1.33) and 2-4 tiles balanced them (1.06-1.10); head-group flattening already gives
# G >= 4 enough pieces on the quality masks.
AUTO_TILE_PIECES = 4
# num_stages="auto" (the default) gives slice (dense) masks this many remote sub-stages: the lowest median
# simulated training step over the benchmark masks at every P measured (h200_hgx; P = 16-64: 0.75x
# the two-stage all-to-all-v step over point-to-point, 0.90x over all-to-all-v,
# benchmarks/results/stages_bench.md; P = 2-8: 0.97x, stages_bench_small.md). Sparse selections take
# them inside one node only (``SolverConfig.for_sparse``): over p2p, S = 4 gave 0.77-0.99x of S = 1 at
# P = 8 and 0.92-1.10x across nodes at P = 16-64 (benchmarks/results/sparse_stages.md).
AUTO_STAGES = 4
# local_tail's default: half of each rank's local work runs after its remote sub-stages (direct
# transport, S > 1). Over p2p on the benchmark masks across nodes (h200_hgx, P = 16-64, seeds 0-2,
# S = 4) a half took the median simulated step over the ideal bound from 1.084 to 1.071 and the worst
# from 1.334 to 1.302; 0.6-0.75 measured the same, 0.25-0.4 less; all-to-all-v did not move
# (benchmarks/results/local_tail_bench.md). Inside one node (P = 4-8) the forward reached its bound.
LOCAL_TAIL = 0.5
# Without a topology, a sparse group of at most this many ranks counts as inside one node (an HGX
# node of 8 GPUs, the preset ``h200_hgx``) for its sub-stages.
SPARSE_NODE_RANKS = 8
# imbalance_tol="auto" (the default): mu for a group inside one node (or without a topology), and for a
# slice-mask group that spans nodes. On the benchmark masks across nodes (h200_hgx, packed causal and
# full documents, P = 16-64, seeds 0-1, S = 4 over p2p, benchmarks/results/relay_balance.md) mu = 1.05
# gave 0.969x mu = 1.10's simulated step at the median (0.937-1.011, faster in 11 of 12 cells) at the
# same CPU solve time; with one remote stage and relay, 1.04-1.06 gave 0.978x at the median (seeds
# 0-2, balance_sweep_seeds.md). Inside one node the plans stay those of mu = 1.10 (pinned digests).
DEFAULT_IMBALANCE_TOL = 1.10
CLUSTER_IMBALANCE_TOL = 1.05


# short names configs carry besides torch's own (accelerate's mixed_precision="bf16"); a name torch itself
# has ("bfloat16", "half", "float") needs no entry
_DTYPE_ALIASES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(value, name: str = "dtype") -> torch.dtype:
    """``value`` as one of the activation dtypes the layer runs (``support.DTYPES``).

    Takes a ``torch.dtype`` or a string naming one ("bfloat16", "torch.bfloat16", "bf16"): Hugging
    Face configs carry ``torch_dtype="bfloat16"``. Anything else raises, naming ``name`` and the
    value, here rather than as a TypeError from ``torch.empty`` deep in a solve's byte counts."""
    names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
    dtype = value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        dtype = _DTYPE_ALIASES.get(key, getattr(torch, key, None))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}={value!r} does not name a torch dtype; use one of "
                             f"{names} (or a torch.dtype)")
    elif not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype or a string naming one, got {type(value).__name__} {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"{name}={value!r} is not an activation dtype the attention kernels run: use one of "
                         f"{names} (gpusolver.support.DTYPES)")
    return dtype


def check_config(config, name: str = "config") -> None:
    """Raise TypeError unless ``config`` is a ``SolverConfig`` (an entry point's first read of it
    would otherwise be an AttributeError)."""
    if not isinstance(config, SolverConfig):
        raise TypeError(f"{name} must be a gpusolver.SolverConfig, got {type(config).__name__} {reprlib.repr(config)}")


def auto_tile_cap(head_groups: int) -> int:
    """The most tiles per chunk ``chunk_tiles="auto"`` may use with ``head_groups`` groups."""
    n = 1
    while 2 * n * head_groups <= AUTO_TILE_PIECES:
        n *= 2
    return n


# local_tail is applied in sixteenths of a rank's local work (rounded): integer comparisons, the same on
# every rank and device (a rank's local work is at most G * c^2 <= 2^55 within ``limits``, so work times
# the scale stays below 2^59)
TAIL_SCALE = 16


def check_local_tail(local_tail) -> None:
    """``local_tail`` must be a number in [0, 1] (a share of each rank's local work)."""
    if isinstance(local_tail, bool) or not isinstance(local_tail, (int, float)) or not 0 <= local_tail <= 1:
        raise ValueError(f"local_tail must be a number in [0, 1] (the share of each rank's local work computed "
                         f"after its remote sub-stages), got {local_tail!r}")


def tail_parts(local_tail: float) -> int:
    """``local_tail`` in sixteenths (``TAIL_SCALE``), rounded: the share of local work the tail takes."""
    check_local_tail(local_tail)
    return round(local_tail * TAIL_SCALE)


def sub_stages(num_stages: int, local_tail: float = 0.0) -> int:
    """The sub-stages a plan with ``num_stages`` S remote ones runs: S + 1 with a local tail (S > 1 and
    ``local_tail`` at least half a sixteenth; ``gpusolver.plan.stages``), else S."""
    return num_stages + 1 if num_stages > 1 and tail_parts(local_tail) > 0 else num_stages


@dataclass(frozen=True)
class SolverConfig:
    """What a solve needs to know besides the mask.

    cp_size:            P, ranks in the context-parallel group.
    num_heads_q/kv:     Hq, Hkv (Hq a multiple of Hkv).
    head_dim:           D.
    dtype:              activation dtype, for byte counts: float32, float16 or bfloat16
                        (``support.DTYPES``, what the kernels run), as a torch.dtype or a
                        string naming one ("bfloat16", "torch.bfloat16", "bf16"); the
                        field reads the torch.dtype.
    imbalance_tol:      mu; a plan is balanced when max load <= mu * mean load. "auto"
                        (default): 1.10 (``DEFAULT_IMBALANCE_TOL``), or 1.05
                        (``CLUSTER_IMBALANCE_TOL``) for a slice-mask config whose group
                        spans nodes of its ``topology`` (the step measured faster there);
                        a float from construction on (``auto_mu`` remembers the choice;
                        ``replaced`` keeps it "auto" when the topology or P changes).
    head_group_flatten: split work per KV head group (G = Hkv) instead of G = 1.
    chunk_tiles:        n, sub-chunk tiles per rank's chunk. With n > 1 a task is a
                        (query tile, key tile) pair of c / n tokens each, so the
                        solver can split one chunk pair's work over several
                        ranks and ship only the tiles a helper needs; S must be
                        divisible by n * P. "auto" (default): ``solve`` picks the
                        fewest tiles that reach mu, coarse to fine, up to
                        ``tiles_for(S).chunk_tiles``: ``auto_tile_cap(G)`` (4
                        with one head group, 2 with two, 1 from four up), halved
                        until it divides c. That cap sets every static shape
                        (the plan is [G, n P, n P] at the cap, a coarser solution
                        refined to it). The field reads 1 until ``tiles_for``
                        resolves it, so areas and plans built without ``solve``
                        stay whole chunks.
    auto_tiles:         set by chunk_tiles="auto": the device solver returns the
                        coarsest level (whole chunks, 2, 4 ... up to
                        chunk_tiles) whose plan reaches mu and fits the buffers.
    max_stage_slices:   static capacity of each CalcMeta stage (slice rows per
                        rank per stage); None picks a default from P and the
                        mask's slice count.
    max_recv_rows:      rows of every collective buffer at once (QO and KV receive
                        buffers and send lists), in group-major rows; the per-kind
                        fields below take precedence. None (default): each buffer
                        its own default (``gpusolver.capacity.DEFAULT_CHUNKS``):
                        ``min(G * c * (P - 1), k * G * c)`` with k = 2 (QO recv),
                        13 (KV recv), 3 (QO send), 16 (KV send), at least 1.5x the
                        largest fill of the benchmark masks' plans; across nodes of a
                        topology (slice masks, direct transport) smaller ones,
                        ``capacity.CLUSTER_CHUNKS``: 1.5, 8, 2, 8 at 16 <= P <= 32 and
                        1.5, 10, 2, 12 at 33 <= P <= 64 (a 36-37 % / 26 % lower buffer
                        peak at a simulated step within 1.01x, median 1.00x). The solve keeps
                        every plan within the buffers (a hard constraint; work is
                        never dropped): a plan that cannot fit reports
                        BUFFER_OVERFLOW; set larger values, up to the worst case,
                        for it. ``16 * G * c`` gives the single shared capacity of
                        earlier versions back.
    max_qo_recv_rows, max_kv_recv_rows, max_qo_send_rows, max_kv_send_rows:
                        rows of one buffer (None: ``max_recv_rows``, else its default).
    keep_forward_buffers: in the backward, helpers reuse the Q, K and V they
                        received in the forward (default), so only dO, lse,
                        delta go out and dQ, dK, dV come back. False re-sends
                        Q and K, V in the backward: less activation memory,
                        more bytes (see ``CommCost``). "qo" keeps only Q, "kv"
                        only K and V (the other kind is sent again).
    memory_budget:      what a layer keeps for its backward, at most this multiple of
                        what plain attention of the rank's shard keeps (q, k, v,
                        out, lse). 1.5 (default): at 8K tokens per rank and 64:8
                        a room of 1.13 G·c Q rows' bytes, which each rank splits
                        by its own fills (its Q rows, then its K, V rows:
                        ``kept_per_rank``); simulated on h200_hgx at the default
                        S = 4, the step is 1.000x that of keeping everything on
                        all 42 benchmark masks, P = 8-64, solved on the cluster
                        or not (benchmarks/results/budget_split_cluster.md,
                        budget_split.md). Keeping everything holds 2.7-3.3x. Slice-mask plans only: sparse solves keep
                        what ``keep_forward_buffers`` says. None: helpers keep
                        what ``keep_forward_buffers`` says. Set: of the kinds it allows,
                        they keep the largest set of receive buffers that fits
                        (``capacity.keep_for_budget``, a function of the config
                        and c alone), then, at row granularity, the room left in
                        the buffers that do not fit whole (``kept_q_rows``,
                        ``kept_kv_rows``; with both kinds kept, one room that each
                        rank splits by its own fills, ``kept_per_rank``); what is
                        not kept is sent again in the backward. The solve prices a kind kept in part
                        as kept; ``plan.pair_bytes`` and the simulator count the
                        rows sent again.
    kept_kv_rows:       with K and V kept, keep only the first this many rows of the
                        KV receive buffer; the rows past them are cast again in the
                        backward (``groupcomm.tail_routing``). None (default): all of
                        them. With S sub-stages the rows are those of the one buffer the
                        S casts share; each sub-stage's cast again moves its rows past
                        them (``gpusolver.runtime.kept_rows``).
    kept_q_rows:        with Q kept, keep only the first this many rows of the QO
                        receive buffer; the rows past them are cast again beside dO in
                        the backward, as ``kept_kv_rows`` does for K and V. None
                        (default): all of them.
    kept_per_rank:      False (default): ``kept_q_rows`` and ``kept_kv_rows`` are
                        the same first rows on every rank. True: they size one room
                        (their bytes together) that each rank splits by its own
                        fills, Q first: it keeps every Q row it received up to the
                        room, then its K, V rows in what is left, so only a rank whose
                        fills pass the room receives anything again. Needs
                        ``keep_forward_buffers=True`` and both rows set;
                        ``memory_budget`` chooses it when it keeps both kinds in part
                        (direct transport).
    num_stages:         S, remote sub-stages of the layer (static). Stage 0 computes
                        the tasks whose units are all local; the remote tasks of
                        each rank are cut into S sub-stages by when their bytes
                        land (``gpusolver.plan.stages``), each with its own cast
                        and reduce, so later casts overlap earlier sub-stages and
                        each sub-stage's partials return while the next computes.
                        The casts share the one QO and the one KV receive buffer
                        (each at its own rows): S costs no receive memory, but
                        S times the collectives and S + 1 attention launches per
                        pass. "auto" (default): ``AUTO_STAGES`` (4) for slice masks,
                        the measured best (simulated), ``kept_kv_rows`` or not; for
                        sparse selections the same inside one node and 1 across
                        nodes (``for_sparse``). 1 is the two-stage layer
                        (one cast, one remote stage, one reduce; the pinned digests).
    local_tail:         with S > 1 and direct transport, the share of each rank's
                        local work (in sixteenths) computed in a local-only
                        sub-stage after the S remote ones instead of in stage 0,
                        so each reduce is posted sooner and the last partials land
                        while the rank attends its own rows (``plan.stages``). Its
                        casts and reduces are empty: point-to-point posts nothing
                        for them, all-to-all-v runs them as empty collectives. A
                        plan then has S + 1 sub-stages (``plan.num_stages``).
                        Default ``LOCAL_TAIL`` (0.5, measured); 0: none. The
                        split is by whole tasks, so a rank with one local task
                        (G = 1, whole chunks) keeps it in stage 0. Sparse
                        plans and relay transport take no tail.
    auto_stages:        set by num_stages="auto" (the field then reads the resolved S);
                        not an argument: ``dataclasses.replace`` of a config makes its
                        num_stages explicit, ``replaced`` keeps "auto".
    auto_mu:            set by imbalance_tol="auto", as ``auto_stages``.
    objective:          what the device solver minimises among balanced plans.
                        "training" (default): the bytes of a training step,
                        ``max_r fwd_r + max_r bwd_r`` (each phase a rank's
                        larger of send and receive; backward under
                        ``keep_forward_buffers``). "forward": the forward
                        bottleneck alone, for inference (the plans of the
                        forward-only solver, bit for bit).
    topology:           the cluster (``gpusolver.topology.Topology``). When the group
                        spans nodes the solve prices each byte by its link (an
                        InfiniBand byte weighs ``link_weights``); None, or a group
                        inside one node, gives the plans of an untopologised solve.
    ib_relay:           inter-node transport, the one the solve prices and the plan runs
                        (``relays``). None (default): relay wherever the group spans
                        nodes and the plan has one remote stage; direct with sub-stages
                        (the default S = 4 of slice masks) and for sparse plans; False: every
                        rank pulls its own copy across nodes; True: relay at every S (an
                        error without nodes, and for sparse plans).
    imbalance_auto:     a time-aware mu (opt-in; needs ``topology``). False (default):
                        mu = ``imbalance_tol``. True: ``imbalance_tol`` is the upper
                        bound; the device solve runs once per candidate bound
                        (``solver.balance.candidate_tols``: 1 + f (mu - 1), f in 1, 0.6,
                        0.4, 0.2) and keeps, on the device, the plan of the lowest
                        modelled step: the busiest rank's attention FLOPs over the
                        topology's rate plus its link-weighted bytes over NVLink, in
                        integer weights (``step_model.time_weights``). It costs one
                        solve per candidate. On the benchmark masks (seeds 0-2, P = 16-64)
                        the simulated step was 0.928-1.042x mu = 1.10's, median 0.97
                        (benchmarks/results/balance_sweep_seeds.md).
    """

    cp_size: int
    num_heads_q: int = 64
    num_heads_kv: int = 8
    head_dim: int = 128
    dtype: torch.dtype | str = torch.bfloat16
    imbalance_tol: float | str = "auto"
    head_group_flatten: bool = True
    chunk_tiles: int | str = "auto"
    max_stage_slices: int | None = None
    max_recv_rows: int | None = None
    max_qo_recv_rows: int | None = None
    max_kv_recv_rows: int | None = None
    max_qo_send_rows: int | None = None
    max_kv_send_rows: int | None = None
    keep_forward_buffers: bool | str = True
    memory_budget: float | None = 1.5
    kept_kv_rows: int | None = None
    kept_q_rows: int | None = None
    kept_per_rank: bool = False
    objective: str = "training"
    num_stages: int | str = "auto"
    local_tail: float = LOCAL_TAIL
    auto_tiles: bool = False
    topology: Topology | None = None
    ib_relay: bool | None = None
    imbalance_auto: bool = False
    auto_stages: bool = field(default=False, init=False)
    auto_mu: bool = field(default=False, init=False)
    # a slice-mask group across nodes at 16 <= P <= 64 gets the smaller default buffers measured
    # there (``capacity.default_chunks``); not a field: it names a kind of plan, not a setting
    cluster_buffers: ClassVar[bool] = True

    def __post_init__(self):
        if self.chunk_tiles == "auto":  # an int from here on: whole chunks until solve resolves the cap
            object.__setattr__(self, "chunk_tiles", 1)
            object.__setattr__(self, "auto_tiles", True)
        if self.num_stages == "auto":  # an int from here on, as chunk_tiles
            object.__setattr__(self, "num_stages", AUTO_STAGES)
            object.__setattr__(self, "auto_stages", True)
        for name in ("cp_size", "num_heads_q", "num_heads_kv", "head_dim", "chunk_tiles", "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_heads_q % self.num_heads_kv:
            raise ValueError(
                f"num_heads_q={self.num_heads_q} must be a multiple of num_heads_kv={self.num_heads_kv}")
        for name in ("auto_tiles", "auto_stages"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        # a truthy string or None would pick G silently (None: G = 1), as imbalance_auto's check says
        if not isinstance(self.head_group_flatten, bool):
            raise TypeError(f"head_group_flatten must be a bool, got {type(self.head_group_flatten).__name__} "
                            f"{self.head_group_flatten!r}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        kept_kinds(self.keep_forward_buffers)  # True, False, "qo" or "kv", else ValueError
        # checked here, not first in build_plan (where True passed as 1 and ended in CALC_OVERFLOW)
        if self.max_stage_slices is not None and (isinstance(self.max_stage_slices, bool)
                                                  or not isinstance(self.max_stage_slices, int)
                                                  or self.max_stage_slices < 1):
            raise ValueError(f"max_stage_slices must be a positive int or None, got {self.max_stage_slices!r}")
        for name in ("max_recv_rows", "max_qo_recv_rows", "max_kv_recv_rows", "max_qo_send_rows",
                     "max_kv_send_rows", "kept_kv_rows", "kept_q_rows"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be None or a non-negative int, got {v!r}")
        check_local_tail(self.local_tail)
        check_kept_per_rank(self.kept_per_rank, self.keep_forward_buffers, self.kept_q_rows, self.kept_kv_rows)
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool)
                                               or not isinstance(self.memory_budget, (int, float))
                                               or not self.memory_budget >= 1.0):
            raise ValueError(f"memory_budget must be None or a number >= 1.0 (a multiple of plain attention's "
                             f"saved bytes), got {self.memory_budget!r}")
        if self.topology is not None:
            if not isinstance(self.topology, Topology):
                raise TypeError(f"topology must be a gpusolver.topology.Topology or None, got "
                                f"{type(self.topology).__name__} {self.topology!r}")
            self.topology.check_group(self.cp_size)
        if self.ib_relay is not None and not isinstance(self.ib_relay, bool):
            raise TypeError(f"ib_relay must be None or a bool, got {type(self.ib_relay).__name__} "
                            f"{self.ib_relay!r}")
        if self.ib_relay and self.link_weights is None:
            raise ValueError("ib_relay=True needs a topology whose nodes are smaller than the group "
                             f"(cp_size = {self.cp_size}, topology = {self.topology!r}): there is no "
                             "InfiniBand hop to relay")
        if not isinstance(self.imbalance_auto, bool):
            raise TypeError(f"imbalance_auto must be a bool, got {type(self.imbalance_auto).__name__} "
                            f"{self.imbalance_auto!r}")
        if self.imbalance_auto and self.topology is None:
            raise ValueError("imbalance_auto=True needs a topology (SolverConfig(topology=...)): its attention "
                             "rate and link bandwidths price the step the bound is chosen by")
        if self.imbalance_tol == "auto":  # a float from here on, as num_stages
            object.__setattr__(self, "imbalance_tol", self._auto_imbalance_tol())
            object.__setattr__(self, "auto_mu", True)
        if isinstance(self.imbalance_tol, bool) or not isinstance(self.imbalance_tol, (int, float)):
            raise ValueError(f"imbalance_tol must be a number >= 1.0 or 'auto', got {self.imbalance_tol!r}")
        if not self.imbalance_tol >= 1.0:
            raise ValueError(f"imbalance_tol must be >= 1.0, got {self.imbalance_tol}")
        for name, (limit_name, limit) in CONFIG_LIMITS.items():
            if getattr(self, name) > limit:
                raise ValueError(f"{name}={getattr(self, name)} is past the supported {limit_name} = {limit} "
                                 "(see gpusolver.limits)")
        if self.imbalance_tol > MAX_IMBALANCE_TOL:
            raise ValueError(f"imbalance_tol={self.imbalance_tol} is past the supported MAX_IMBALANCE_TOL = "
                             f"{MAX_IMBALANCE_TOL} (see gpusolver.limits)")

    def tiles_for(self, total_seqlen: int) -> "SolverConfig":
        """This config for a sequence of ``total_seqlen`` tokens: with ``auto_tiles``, chunk_tiles
        set to ``auto_tile_cap(G)`` halved until it divides the chunk (the cap of the solve's
        coarse-to-fine choice); otherwise itself."""
        if not self.auto_tiles:
            return self
        n = auto_tile_cap(self.head_groups)
        while n > 1 and total_seqlen % (n * self.cp_size):
            n //= 2
        return self if n == self.chunk_tiles else self.replaced(chunk_tiles=n)

    def replaced(self, **changes) -> "SolverConfig":
        """``dataclasses.replace`` that keeps ``num_stages="auto"`` and ``imbalance_tol="auto"`` unless
        ``changes`` name them."""
        if self.auto_stages and "num_stages" not in changes:
            changes["num_stages"] = "auto"
        if self.auto_mu and "imbalance_tol" not in changes:
            changes["imbalance_tol"] = "auto"
        return replace(self, **changes)

    def _auto_imbalance_tol(self) -> float:
        """mu of ``imbalance_tol="auto"``: ``CLUSTER_IMBALANCE_TOL`` where the group spans nodes (and
        the bound is not searched, ``imbalance_auto``), else ``DEFAULT_IMBALANCE_TOL``."""
        if self.link_weights is not None and not self.imbalance_auto:
            return CLUSTER_IMBALANCE_TOL
        return DEFAULT_IMBALANCE_TOL

    def for_sparse(self) -> "SolverConfig":
        """This config for a sparse selection's plan: with ``auto_stages``, one remote stage where
        the group spans nodes (``topology.ranks_per_node < cp_size``; without a topology, more than
        ``SPARSE_NODE_RANKS`` ranks), where sub-stages measured 0.92-1.10x of S = 1, and
        ``AUTO_STAGES`` inside one node (0.77-0.99x); with ``auto_mu``, mu
        ``DEFAULT_IMBALANCE_TOL`` (the tighter bound across nodes was measured on slice masks
        only); otherwise itself."""
        changes = {}
        per_node = SPARSE_NODE_RANKS if self.topology is None else self.topology.ranks_per_node
        if self.auto_stages and self.num_stages != 1 and self.cp_size > per_node:
            changes["num_stages"] = 1
        if self.auto_mu and self.imbalance_tol != DEFAULT_IMBALANCE_TOL:
            changes["imbalance_tol"] = DEFAULT_IMBALANCE_TOL
        return replace(self, **changes) if changes else self

    @property
    def link_weights(self) -> tuple[int, int, int] | None:
        """(ranks per node, NVLink weight, InfiniBand weight) the solver prices bytes by, or None
        when every byte costs the same (no topology, or the group inside one node).

        Integer weights keep the solve's arithmetic exact and bit-identical on every path: an
        NVLink byte costs 1 and an InfiniBand byte the ratio of a GPU's NVLink bandwidth to its
        share of the node's NICs, rounded (450 / 50 GB/s: 9), at most ``MAX_LINK_WEIGHT`` (past
        it InfiniBand decides alone; the cap keeps weighted bytes within the keys' range)."""
        topo = self.topology
        if topo is None or topo.ranks_per_node >= self.cp_size:
            return None
        ib_per_gpu = topo.ib_gbps * topo.nics_per_node / topo.ranks_per_node
        return topo.ranks_per_node, 1, min(MAX_LINK_WEIGHT, max(1, round(topo.nvlink_gbps / ib_per_gpu)))

    @property
    def tail(self) -> float:
        """The local tail a slice-mask plan of this config takes: ``local_tail`` with direct
        transport, 0 with relay transport (its hops' legs are placed by sub-stage, measured
        without one)."""
        return 0.0 if self.relays else self.local_tail

    @property
    def plan_stages(self) -> int:
        """The sub-stages a slice-mask plan of this config runs (``plan.num_stages``): S, plus one
        local-only sub-stage with a local tail (``sub_stages``)."""
        return sub_stages(self.num_stages, self.tail)

    @property
    def relays(self) -> bool:
        """Whether this config's slice-mask plans route inter-node rows by relay: each (unit, remote
        node) crosses InfiniBand once, host to ``Topology.relay_rank(host, node)``, and fans out over
        NVLink from there; partial results merge on the relay before they cross back.

        The one answer the solver prices (``solver.core.Tasks.relays``, its strategies) and the plan
        builder builds (``plan.build.relay_transport``), so the objective is what runs. Only where the
        group spans nodes (``link_weights`` is not None). ``ib_relay=None`` (default): relay with one
        remote stage (``num_stages=1``), direct with sub-stages (the default ``"auto"`` resolves to S = 4
        for slice masks; relayed sub-stages are simulated at 0.94-1.02x direct's step there at the
        default mu 1.05 across nodes, median 1.00x, for a median 0.96x USP's forward IB bytes instead
        of 1.50x and about 1.4x the CPU solve, ``benchmarks/results/relay_balance.md``); ``ib_relay=True``:
        relay at every S;
        ``ib_relay=False``: direct. Sparse plans always travel direct (``SparseSolverConfig.relays``)."""
        if self.link_weights is None or self.ib_relay is False:
            return False
        return self.ib_relay is True or self.num_stages == 1

    @property
    def head_groups(self) -> int:
        """G: the number of head groups a task is split by."""
        return self.num_heads_kv if self.head_group_flatten else 1

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def cost(self) -> CommCost:
        return CommCost(self.num_heads_q, self.num_heads_kv, self.head_dim,
                        self.dtype_bytes, self.head_groups, self.keep_forward_buffers, self.kept_kv_rows,
                        self.kept_q_rows, self.kept_per_rank)

    @property
    def num_units(self) -> int:
        """U = chunk_tiles * P, units per head group."""
        return self.chunk_tiles * self.cp_size

    def check_seqlen(self, total_seqlen: int) -> int:
        """Chunk size c = S / P; raises when S is not divisible by P (times chunk_tiles)."""
        U = self.num_units
        check_seqlen_limit("total_seqlen", total_seqlen)
        if total_seqlen % U:
            what = f"cp_size={self.cp_size}" if self.chunk_tiles == 1 else \
                f"cp_size * chunk_tiles={self.cp_size} * {self.chunk_tiles}"
            raise ValueError(f"total_seqlen={total_seqlen} must be divisible by {what} "
                             f"(pad the sequence to a multiple of {U})")
        return total_seqlen // self.cp_size


# the names SolverConfig's constructor takes (not ``auto_stages``), read once: a config copied field by
# field (a saved plan's, ``SparseSolverConfig``'s) passes these, also inside a torch.compile trace
CONFIG_ARGS = tuple(f.name for f in fields(SolverConfig) if f.init)
