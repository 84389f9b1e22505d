"""The static rows of a plan's four collective buffers: QO and KV receive, QO and KV send.

Each rank receives the QO rows (Q) and the KV rows (K with V) of the units it
helps with into one receive buffer per kind, and sends its own units' rows
from one send list per kind; the partial O and lse (forward) and dK, dV / dQ
(backward) come back into buffers of the send lists' rows. A row is one token
of one head group (group-major), so with Hq:Hkv = 64:8 a Q row is four times a
K plus V row: the kinds are sized apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gpusolver.config import SolverConfig
from gpusolver.problem import kept_kinds

KINDS = ("qo", "kv")

# Default rows of each buffer in multiples of G * c, capped at the worst case G * c * (P - 1).
# The largest fills of the device solver's plans on the benchmark masks (packed documents, 8K
# tokens per rank, 64:8, P = 8..64, seeds 0-19, whole chunks; ``benchmarks/layer_bench.py``,
# ``benchmarks/results/layer_bench.md``) are QO recv 1.12, KV recv 8.63, QO send 1.88 and KV
# send 10.57; the defaults hold at least 1.5x each (QO recv 1.8x). One causal sequence needs
# more KV at P = 64 (14.75 received): the solve keeps its plan within these, moving other tasks,
# or reports BUFFER_OVERFLOW when no start fits.
DEFAULT_CHUNKS = {"qo_recv": 2, "kv_recv": 13, "qo_send": 3, "kv_send": 16}
# Smaller defaults where they were measured to cost nothing: a slice-mask group that spans nodes of
# a topology with direct transport (the default S = 4; the solve does not read S), per range of P.
# Measured (``benchmarks/capacity_sweep.py``, ``benchmarks/results/capacity_sweep.md``: h200_hgx,
# the default config, packed causal / full documents seeds 0-2 and one causal and one bidirectional
# sequence, 8K tokens per rank, 64:8) against plans at DEFAULT_CHUNKS, SIMULATED steps:
#   1.5 / 8 / 2 / 8 at P = 16, 24, 32: median 1.000x, max 1.000x, 1.007x, 1.006x, none overflowing,
#     ``plan.memory()`` peak 36-37 % lower (4.0x the layer's own q, k, v, out instead of 6.3x);
#     at P = 48 1.000x too, but at P = 64 up to 2.57x (full documents seed 2: the solve no
#     longer reached mu).
#   1.5 / 10 / 2 / 12 at P = 48, 64: median 1.000x, max 1.000x, none overflowing, peak 26 % lower
#     (4.7x own).
# Everywhere else DEFAULT_CHUNKS stays: inside one node (P <= 8: the pinned plans), without a
# topology, with relay transport, for sparse selections (``SparseSolverConfig.cluster_buffers``) and
# past P = 64, none of them measured at the smaller sizes. (lowest P, highest P, chunks):
CLUSTER_CHUNKS = ((16, 32, {"qo_recv": 1.5, "kv_recv": 8, "qo_send": 2, "kv_send": 8}),
                  (33, 64, {"qo_recv": 1.5, "kv_recv": 10, "qo_send": 2, "kv_send": 12}))
# The one shared default before the kinds were sized apart (``max_recv_rows`` set to
# ``LEGACY_CHUNKS * G * c`` gives those plans back).
LEGACY_CHUNKS = 16


_BUFFER_FIELDS = ("max_recv_rows", "max_qo_recv_rows", "max_kv_recv_rows", "max_qo_send_rows", "max_kv_send_rows")


def buffer_fields(*values: int) -> dict:
    """The config's buffer fields from the custom ops' ints (in ``_BUFFER_FIELDS`` order; -1 is None)."""
    return {name: None if v < 0 else v for name, v in zip(_BUFFER_FIELDS, values)}


def buffer_ints(config: SolverConfig) -> tuple[int, ...]:
    """The config's buffer fields as the ops take them (``_BUFFER_FIELDS`` order; None is -1)."""
    return tuple(-1 if getattr(config, n) is None else getattr(config, n) for n in _BUFFER_FIELDS)


@dataclass(frozen=True)
class BufferRows:
    """Rows of each rank's buffers per kind (host ints, static): receive and send."""

    qo_recv: int
    kv_recv: int
    qo_send: int
    kv_send: int

    def recv(self, kind: str) -> int:
        return self.qo_recv if kind == "qo" else self.kv_recv

    def send(self, kind: str) -> int:
        return self.qo_send if kind == "qo" else self.kv_send

    def as_tuple(self) -> tuple[int, int, int, int]:
        """(QO recv, KV recv, QO send, KV send): the order the solver's kernels read."""
        return self.qo_recv, self.kv_recv, self.qo_send, self.kv_send

    @property
    def largest_recv(self) -> int:
        return max(self.qo_recv, self.kv_recv)


def default_chunks(config: SolverConfig) -> dict:
    """Each buffer's default rows in multiples of G * c for ``config``: the ``CLUSTER_CHUNKS`` row of
    its P for a slice-mask group across nodes (``link_weights``) with direct transport, where they
    were measured; ``DEFAULT_CHUNKS`` everywhere else. Host values of the config only, so the solve
    (op or not) and the plan builder size the same buffers."""
    if config.cluster_buffers and config.link_weights is not None and not config.relays:
        for lo, hi, chunks in CLUSTER_CHUNKS:
            if lo <= config.cp_size <= hi:
                return chunks
    return DEFAULT_CHUNKS


def buffer_rows(config: SolverConfig, chunk: int) -> BufferRows:
    """The buffers of a plan of ``config`` with ``chunk`` = c tokens per rank.

    Per buffer: its ``SolverConfig.max_<kind>_<dir>_rows`` when set, else ``max_recv_rows``
    when set (one value for all four), else ``min(G * c * (P - 1), ceil(k * G * c))`` with k
    from ``default_chunks(config)`` (``DEFAULT_CHUNKS``, or ``CLUSTER_CHUNKS`` across nodes).
    """
    G, P = config.head_groups, config.cp_size
    worst = G * chunk * (P - 1)
    rows = {}
    for name, chunks in default_chunks(config).items():
        v = getattr(config, f"max_{name}_rows")
        if v is None:
            v = config.max_recv_rows
        if v is None:
            v = min(worst, math.ceil(chunks * G * chunk))  # 1.5 chunks: a whole row more at an odd G * c
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"max_{name}_rows must be a non-negative int, got {v!r}")
        rows[name] = v
    return BufferRows(**rows)


def plain_kept_bytes(config: SolverConfig, chunk: int) -> int:
    """Bytes plain single-device attention of one rank's shard keeps for its backward: q, k, v,
    out (the activation dtype) and the fp32 lse."""
    b, D, Hq, Hkv = config.dtype_bytes, config.head_dim, config.num_heads_q, config.num_heads_kv
    return chunk * ((2 * Hq + 2 * Hkv) * D * b + 4 * Hq)


def kept_bytes(config: SolverConfig, chunk: int, keep, kept_kv_rows: int | None = None,
               kept_q_rows: int | None = None) -> int:
    """Bytes per rank a layer keeps in its receive buffers with ``keep`` (True, False, "qo", "kv"):
    one buffer of each kept kind, whatever ``num_stages`` (the sub-stages share it); of the KV
    (QO) buffer only its first ``kept_kv_rows`` (``kept_q_rows``) rows when given."""
    rows = buffer_rows(config, chunk)
    cost = config.cost()
    kv_rows = rows.kv_recv if kept_kv_rows is None else min(rows.kv_recv, kept_kv_rows)
    q_rows = rows.qo_recv if kept_q_rows is None else min(rows.qo_recv, kept_q_rows)
    per_kind = {"qo": q_rows * cost.q_fwd, "kv": kv_rows * cost.kv_fwd}
    return sum(per_kind[k] for k in kept_kinds(keep))


# the sets of kinds a budget may choose, most kept first within each size (K, V before Q: a KV row
# is sent again by every rank that needs it, a query row by one host)
_KEEP_ORDER = (True, "kv", "qo", False)
# the order in which the room the whole kinds leave is written as rows: Q rows first, then K, V rows
# in the remainder. With both kinds kept the rows size one room that each rank splits by its own
# fills (``kept_per_rank``), so the order only names the room's bytes; measured (simulated,
# ``benchmarks/budget_split.py``, docs/design/layers.md), the per-rank split costs 1.000x keeping
# everything on all 42 benchmark masks, where the same room kept as every rank's first Q rows cost
# up to 1.17x and as its first K, V rows up to 1.15x.
PREFIX_ORDER = ("qo", "kv")


def _with(keep, kind: str) -> bool | str:
    """``keep`` plus ``kind``."""
    kinds = set(kept_kinds(keep)) | {kind}
    return True if kinds == {"qo", "kv"} else kind


def keep_for_budget(config: SolverConfig, chunk: int) -> SolverConfig:
    """``config`` with ``keep_forward_buffers`` (and ``kept_q_rows`` / ``kept_kv_rows``) the most
    kept within ``memory_budget``.

    The layer keeps its own activations (as plain attention does, ``plain_kept_bytes``) plus
    the receive buffers of the kinds kept (``kept_bytes``). First the whole kinds: the allowed
    set (a subset of what ``keep_forward_buffers`` keeps) with the most kept bytes within
    ``memory_budget * plain_kept_bytes``; then, for each allowed kind whose whole buffer does not
    fit, in ``PREFIX_ORDER``, the first rows of it that fit in the room left (``kept_q_rows``,
    ``kept_kv_rows``; the rest is cast again in the backward, per sub-stage with S > 1: the S
    casts share the buffer, so the kept bytes and the stages do not depend on each other; relay
    transport, whose backward has no such tail cast, keeps whole kinds only). When both kinds are
    kept and one in part, the two row counts (a whole kind at its buffer's rows) size one room that
    each rank splits by its own fills, Q first (``kept_per_rank``): the same bytes, but a rank whose
    fills fit the room casts nothing again. Without a budget,
    ``config`` itself; with ``kept_q_rows`` or ``kept_kv_rows`` set, the caller's choice (the
    budget dropped). Host ints only: every rank resolves the same choice.
    """
    if config.memory_budget is None:
        return config
    if config.kept_kv_rows is not None or config.kept_q_rows is not None:  # the caller's rows, not the budget's
        return config.replaced(memory_budget=None)
    allowed = set(kept_kinds(config.keep_forward_buffers))
    room = config.memory_budget * plain_kept_bytes(config, chunk) - plain_kept_bytes(config, chunk)
    # a plain loop, not max(key=...): a module's solve runs under torch.compile(fullgraph=True),
    # where dynamo traces this host arithmetic and has no max with a key
    best, best_bytes = False, 0  # False always fits
    for k in _KEEP_ORDER:
        b = kept_bytes(config, chunk, k)
        if set(kept_kinds(k)) <= allowed and b <= room and b > best_bytes:  # first on ties
            best, best_bytes = k, b
    part = {}
    room -= best_bytes
    # relay transport keeps whole kinds only: its backward has no tail cast of a part-kept buffer
    for kind in PREFIX_ORDER if not config.relays else ():
        if kind not in allowed or kind in kept_kinds(best):
            continue
        row = config.cost().q_fwd if kind == "qo" else config.cost().kv_fwd
        rows = max(int(room // row), 0)  # fewer than the whole buffer: it did not fit
        # none at all too, once something is kept: a kind kept in part is priced as kept by the solve
        # (``CommCost``), which steers it to faster plans than pricing every row as cast again
        # (``benchmarks/results/layer_memory_budget_cluster.md``); with nothing kept, what is
        # asked for is the fewest bytes held, and the solve prices every row cast again
        if rows > 0 or best is not False:
            best, part[kind] = _with(best, kind), rows
            room -= rows * row
    if part and kept_kinds(best) == ("qo", "kv"):  # both kept, one of them in part: one room, split per rank
        rows_ = buffer_rows(config, chunk)
        return config.replaced(keep_forward_buffers=True, kept_q_rows=part.get("qo", rows_.qo_recv),
                               kept_kv_rows=part.get("kv", rows_.kv_recv), kept_per_rank=True, memory_budget=None)
    return config.replaced(keep_forward_buffers=best, kept_kv_rows=part.get("kv"), kept_q_rows=part.get("qo"),
                           memory_budget=None)


# Relay transport (``gpusolver.plan.relay``): rows of each relay's buffer (what it receives over
# InfiniBand for its node) and of its fan-out send list (what it forwards over NVLink), per kind,
# in multiples of G * c, capped at the worst case, and of each egress buffer (what a rank's NIC
# sends for its node's other hosts, brought to it over NVLink). Candidates past them go direct (past
# an egress buffer: from the host's own NIC), so these bound memory, never correctness. Sized from
# what relay plans fill (``benchmarks/relay_fill.py``, ``benchmarks/results/relay_fill.md``: packed
# causal and full documents, seeds 0-2, and one causal or full sequence, P = 16-64, nodes of 8, the
# relay-priced solve): the largest QO fills are 0.62 (relay), 0.68 (fan) and 0.88 (egress) G * c,
# so 1, 2 and 2 hold at least 1.6x; KV fan-out fills up to 7.38 (one causal sequence at P = 64),
# so 12; one sequence fills the KV relay buffer to its worst case (N - 1 chunks), so KV relay and
# egress stay at 8. With 64:8 heads a Q row is 4x a K plus V row, so the QO buffers are the ones
# that cost memory (the egress's also in the fp32 sums of its reduce).
RELAY_CHUNKS = {"qo_relay": 1, "kv_relay": 8, "qo_fan": 2, "kv_fan": 12, "qo_egress": 2, "kv_egress": 8}


@dataclass(frozen=True)
class RelayRows:
    """Rows of each rank's relay buffers per kind (host ints, static)."""

    qo_relay: int
    kv_relay: int
    qo_fan: int
    kv_fan: int
    qo_egress: int = 0
    kv_egress: int = 0

    def relay(self, kind: str) -> int:
        return self.qo_relay if kind == "qo" else self.kv_relay

    def fan(self, kind: str) -> int:
        return self.qo_fan if kind == "qo" else self.kv_fan

    def egress(self, kind: str) -> int:
        return self.qo_egress if kind == "qo" else self.kv_egress


def relay_rows(config: SolverConfig, chunk: int, ranks_per_node: int, **override: int) -> RelayRows:
    """The relay buffers of a plan of ``config`` on nodes of ``ranks_per_node``, c = ``chunk``.

    Per buffer: ``override[name]`` when given (``qo_relay=...``), else
    ``min(worst, RELAY_CHUNKS[name] * G * c)``; worst: a relay buffer holds at most every
    other node's same-rail host's chunk, ``G * c * (N - 1)``, a fan-out list every other rank
    of the node taking all of it, ``(L - 1)`` times that, an egress buffer a slot per unit of every
    other rank of its node, ``G * c * (L - 1)``, and none on one node.
    """
    G, P, L = config.head_groups, config.cp_size, ranks_per_node
    bad = set(override) - set(RELAY_CHUNKS)
    if bad:
        raise ValueError(f"relay_rows: unknown buffers {sorted(bad)}, expected {sorted(RELAY_CHUNKS)}")
    worst_relay = G * chunk * max(P // L - 1, 0)
    rows = {}
    for name, chunks in RELAY_CHUNKS.items():
        v = override.get(name)
        if v is None:
            if name.endswith("egress"):
                worst = G * chunk * (L - 1) if P // L >= 2 else 0
            else:
                worst = worst_relay if name.endswith("relay") else worst_relay * (L - 1)
            v = min(worst, chunks * G * chunk)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"relay_rows: {name} must be a non-negative int, got {v!r}")
        rows[name] = v
    return RelayRows(**rows)
