"""The portfolio: strategies of the device solver and the variants they run as.

A ``Strategy`` is a batch of variants (one per threshold scale) that share a
search width, a task order and a start; ``default_strategies(P)`` is the
portfolio ``solve_device`` runs, chosen by measurement (the comment above
``DEFAULT_STRATEGIES``). Inside a solve each variant is a row of small
device tables (``variant_tables``, ``variant_scales``): the steps read a
variant's order, window width and unit count from them, so one batch runs
variants of different widths side by side.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# Rounds of moves: more rounds changed no plan of the benchmark masks at P <= 16 (CHANGELOG.md).
DEFAULT_ROUNDS = 24
# Below LARGE_P ranks the bottleneck phase also takes sideways moves, and every
# RESTART_EVERY rounds (8 and 16 of 24) each variant restarts from its best
# state with its bottleneck rank's moves undone: on the benchmark masks both
# lower the small-P medians and raise none, while from LARGE_P up balancing
# still runs past round 8 and a restart costs quality.
RESTART_EVERY = 8
# Below SINGLES_P ranks the balance phase may also ship a unit's first task alone (without it,
# only the prefix that covers the source's excess): in small CP groups that leaves fewer masks
# above the reference's bytes, from P = 8 up more (the sweep: CHANGELOG.md).
SINGLES_P = 8


@dataclass(frozen=True)
class Strategy:
    """One batch of variants run side by side.

    threshold_scales: balance-phase limits on every touched rank's volume, as
                      multiples of the start's forward bottleneck (one
                      variant each; inf = unbounded).
    units_per_rank:   QO units each source offers per round.
    bundle_dests:     destinations (by headroom) each unit is priced against.
    task_order:       the order a bundle takes a unit's tasks in: "area"
                      (largest first), "rows" (fewest needed query rows
                      first: off-diagonal tasks that need a few rows travel
                      without the unit's full chunk) or "small" (smallest
                      first: a source a little above the cap sheds one small
                      task, e.g. to the rank holding its keys, where "area"
                      could only ship its largest).
    start:            the assignment the variants start from: "owner"
                      (owner-computes), "transpose" (``start.ref.transpose_start``:
                      rows with many remote key columns go to their head
                      group's rank of an aligned block of G ranks, as in
                      Ulysses), "ulysses" (every row so, remote keys or
                      not) or "shed" (``start.shed``: each overloaded rank
                      ships whole units, a few head groups at a time) or
                      "nodes" (with a topology across nodes: a solve over
                      the nodes first, each node a rank holding its ranks'
                      chunks as tiles, then each task on a rank of its node,
                      ``device.node_start``; without one, owner-computes). A
                      solve given a start (the tiled refine) starts every
                      variant but "shed" there.
    """

    threshold_scales: tuple[float, ...] = (3.0, float("inf"))
    units_per_rank: int = 4
    bundle_dests: int = 8
    task_order: str = "area"
    start: str = "owner"

    def __post_init__(self):
        if self.task_order not in TASK_ORDERS:
            raise ValueError(f"task_order must be one of {TASK_ORDERS}, got {self.task_order!r}")
        if self.start not in STARTS:
            raise ValueError(f"start must be one of {STARTS}, got {self.start!r}")
        if not self.threshold_scales or self.units_per_rank < 1 or self.bundle_dests < 1:
            raise ValueError(f"a strategy needs threshold scales and positive widths, got {self}")


TASK_ORDERS = ("area", "rows", "small")
STARTS = ("owner", "transpose", "ulysses", "shed", "nodes")


# Batches that differ in how widely they search and in the order bundles take
# a unit's tasks. Picked greedily from a grid of single strategies within the
# torch path's time budget and checked on held-out seeds (the method and the
# figures: CHANGELOG.md, "Design notes"). Why each kind is there:
# - the fifth and sixth are for balance alone: a finite threshold or a narrow
#   rows-first window balances masks the first four leave above mu;
# - the transposed start: on documents that span many ranks owner-computes
#   gathers K/V from all of them, and no sequence of single moves leaves that
#   state cheaply;
# - below P = 32 a narrow window does as well on one long sequence as the
#   widest at a fraction of its cost; from P = 32 up the wide one wins;
# - smallest task first (last below P = 32): a rank just above the cap whose
#   unit's largest task fits no rank could otherwise only move that task. A
#   variant more never raises a mask; from P = 32 up this one lowers no median
#   and would cost time.
_INF = float("inf")
DEFAULT_STRATEGIES = (Strategy((_INF,), units_per_rank=16, bundle_dests=16),
                      Strategy((_INF,), units_per_rank=16, bundle_dests=8, task_order="rows"),
                      Strategy((_INF,), units_per_rank=1, bundle_dests=8),
                      Strategy((_INF,), units_per_rank=2, bundle_dests=16, task_order="rows"),
                      Strategy((3.0,), units_per_rank=4, bundle_dests=8),
                      Strategy((_INF,), units_per_rank=1, bundle_dests=4, task_order="rows"),
                      Strategy((_INF,), units_per_rank=4, bundle_dests=8, start="transpose"),
                      Strategy((_INF,), units_per_rank=16, bundle_dests=8, task_order="small"))
# From P = 32 up: wide destination windows win (full documents), and three
# strategies bound the torch path's time at P = 64.
LARGE_P = 32
LARGE_P_STRATEGIES = (Strategy((_INF,), units_per_rank=4, bundle_dests=32),
                      Strategy((_INF,), units_per_rank=1, bundle_dests=64, task_order="rows"),
                      Strategy((_INF,), units_per_rank=4, bundle_dests=32, start="transpose"))


# The last strategy of each portfolio starts from Ulysses ("ulysses": every row on its head
# group's rank of its block): on sparse indexer masks (NSA, DSA) the Ulysses start alone can
# be balanced and below USP's bytes where the moves from the other starts end above them. It
# comes last, so the variants before it keep their indices and a plan changes only where it
# ends strictly lower.
ULYSSES_STRATEGY = Strategy((_INF,), units_per_rank=4, bundle_dests=8, start="ulysses")
LARGE_P_ULYSSES_STRATEGY = Strategy((_INF,), units_per_rank=4, bundle_dests=32, start="ulysses")
# Below P = 32 the portfolio ends with a strategy from the "shed" start (``start.shed``): a rank
# far above the cap ships a few head groups' best units whole, so a helper pays for their keys
# once. From owner-computes or from the coarser plan single moves cannot get there: the first
# unit of a head group to leave pays its keys alone. Smallest first with 16 units on 8
# destinations ended lowest from this start; last, so every other variant keeps its index and
# a plan changes only where this one ends strictly lower.
SHED_STRATEGY = Strategy((_INF,), units_per_rank=16, bundle_dests=8, task_order="small", start="shed")


# A strategy from the two-level "nodes" start (balance the nodes, then the ranks inside each),
# for a topology-aware solve; the solve over the nodes runs NODE_LEVEL_STRATEGIES. Not in the
# default portfolio: appended to it, it won no benchmark mask (packed causal and full documents,
# P = 16 and 32, nodes of 8) and cost a solve over the nodes plus one strategy.
NODES_STRATEGY = Strategy((_INF,), units_per_rank=16, bundle_dests=8, start="nodes")
NODE_LEVEL_STRATEGIES = (Strategy((_INF,), units_per_rank=16, bundle_dests=8),
                         Strategy((_INF,), units_per_rank=4, bundle_dests=8, task_order="rows"))


# From P = 32 up, a solve priced for the relay transport (``SolverConfig.relays``) runs a narrow
# window over many units in place of the Ulysses start: on packed causal and full documents
# (nodes of 8) it ended below the large-P portfolio's InfiniBand bottleneck at P = 32 and on
# causal documents at P = 64, where the Ulysses start ended highest, and it costs less
# (benchmarks/results/relay_solve.md).
RELAY_STRATEGY = Strategy((_INF,), units_per_rank=16, bundle_dests=8)


def default_strategies(cp_size: int, relays: bool = False) -> tuple[Strategy, ...]:
    """The portfolio ``solve_device`` runs for a CP group of ``cp_size`` ranks (``relays``: priced
    for the relay transport, ``SolverConfig.relays``)."""
    if cp_size >= LARGE_P:
        return LARGE_P_STRATEGIES + ((RELAY_STRATEGY,) if relays else (LARGE_P_ULYSSES_STRATEGY,))
    return DEFAULT_STRATEGIES + (ULYSSES_STRATEGY, SHED_STRATEGY)


def default_local_search(cp_size: int) -> tuple[bool, int, bool]:
    """(sideways, restart_every, singles) ``solve_device`` uses for ``cp_size`` ranks (see
    RESTART_EVERY and SINGLES_P)."""
    small = cp_size < LARGE_P
    return small, (RESTART_EVERY if small else 0), cp_size < SINGLES_P



class Variant(NamedTuple):
    """One variant of a portfolio, on the host: a row of the device tables."""

    scale: float   # balance-phase threshold, a multiple of the start's forward bottleneck (inf = none)
    units: int     # QO units each source offers per round (at most K)
    window: int    # destinations each unit is priced against (at most D)
    order: int     # index into TASK_ORDERS
    start: int     # index into STARTS


def variants(strategies: tuple[Strategy, ...], G: int, P: int, tiles: int = 1):
    """The variants of a portfolio: ([Variant], K, D).

    K = unit slots per source and D = window width of the widest variant; each
    variant's own counts are clipped to them.
    """
    K = min(max(st.units_per_rank for st in strategies), G * P * tiles)
    D = min(max(st.bundle_dests for st in strategies), P)
    rows = [Variant(x, min(st.units_per_rank, K), min(st.bundle_dests, D), TASK_ORDERS.index(st.task_order),
                    STARTS.index(st.start)) for st in strategies for x in st.threshold_scales]
    return rows, K, D


def variant_tables(variants, dev) -> torch.Tensor:
    """[3, B] int64 per-variant task order, window width and units offered.

    Built from device fills: a tensor made from a host list is a host-to-device
    copy on a GPU, which a CUDA graph cannot capture.
    """
    fill = _fills(torch.int64, dev)
    return torch.cat([fill(getattr(v, name)) for name in ("order", "window", "units")
                      for v in variants]).view(3, len(variants))


def variant_scales(variants, dev) -> torch.Tensor:
    """[B] fp64 threshold scale of each variant (inf = unbounded)."""
    fill = _fills(torch.float64, dev)
    return torch.cat([fill(float(v.scale)) for v in variants])


def _fills(dtype, dev):
    """A function giving a 1-element ``dtype`` tensor of a value, one fill per distinct value
    (each fill is a launch on a GPU)."""
    made = {}

    def fill(v):
        if v not in made:
            made[v] = torch.full((1,), v, dtype=dtype, device=dev)
        return made[v]
    return fill
