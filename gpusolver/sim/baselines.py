"""The classic schemes' layer time in the same simulator, on the same sequential shards (simulated).

- ``"usp"``: Ulysses of degree ``u = ulysses_degree(Hkv, P)`` (``min(8, Hkv)`` in the usual
  case, at most the ranks of a node) inside a node, times a ring over the ``R = P / u`` Ulysses groups.
  Forward: an all-to-all of Q, K, V inside each group (a rank then holds Hq/u
  query heads and Hkv/u KV heads of the group's u chunks), R ring steps whose
  K, V hop to the next group asynchronously while the block in hand is
  computed, and an all-to-all of O back. Backward (Q, K, V, O, lse kept
  head-sharded): an all-to-all of dO, R ring steps with K, V hopping as in
  the forward and the dK, dV accumulator of each block moving on after every
  remote step (it starts at the first remote group, and its last hop takes
  it home), then an all-to-all of dQ, dK, dV back. The bytes are
  ``gpusolver.baselines.usp``'s, per (source, destination). K, V hops and dK, dV
  hops run on two communication streams (two communicators), sharing links.
- ``"usp_balanced"``: the same schedule with every ring step's compute at the
  mean of all steps: the bound any permutation of the tokens can reach.
- ``"ring"``: ring attention over all P ranks (USP of degree 1; ``baselines.ring_attention``'s bytes).
- ``"owner"``: owner-computes (every task on its query host), run by the
  runtime's own schedule (``simulate``).

Compute per ring step is the exact area of the blocks it holds (empty blocks
cost nothing: causal skipping is free), at Hq/u query heads.
"""
from __future__ import annotations

from gpusolver.areas import block_areas
from gpusolver.baselines import ulysses_degree
from gpusolver.config import SolverConfig
from gpusolver.metrics import owner_computes_assignment
from gpusolver.plan.build import build_plan
from gpusolver.sim.engine import SimOp
from gpusolver.sim.layer import LayerTime, pass_time, simulate
from gpusolver.topology import Topology

__all__ = ["simulate_baseline", "BASELINES"]

BASELINES = ("usp", "usp_balanced", "ring", "owner")


def simulate_baseline(kind: str, mask, config: SolverConfig, topology: Topology, *, areas=None) -> LayerTime:
    """One baseline's simulated layer time on ``mask`` (an ``AttnSlices``) with ``config``'s P, heads, dims.

    areas: the mask's ``block_areas(mask, P, 1)`` when the caller has them (saves recomputing).
    """
    if kind not in BASELINES:
        raise ValueError(f"kind must be one of {BASELINES}, got {kind!r}")
    if not isinstance(config, SolverConfig):
        raise TypeError(f"config must be a SolverConfig, got {type(config).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    P = config.cp_size
    topology.check_group(P)
    if kind == "owner":
        owner_areas = block_areas(mask, P, config.head_groups, impl="torch")
        plan = build_plan(mask, owner_areas, owner_computes_assignment(owner_areas), config)
        return simulate(plan, topology, name="owner")
    if areas is None:
        areas = block_areas(mask, P, 1, impl="torch")
    if areas.head_groups != 1 or areas.cp_size != P or areas.tiles != 1:
        raise ValueError("areas must be block_areas(mask, P, 1): one head group, whole chunks")
    # Ulysses stays inside a node: its all-to-alls would cross InfiniBand otherwise
    u = 1 if kind == "ring" else ulysses_degree(config.num_heads_kv, P, max_degree=min(8, topology.ranks_per_node))
    area = areas.area[0].tolist()  # [P][P] valid entries of each (query chunk, key chunk)
    fwd, bwd = _usp_passes(config, area, areas.rank_tokens, u, topology, balanced=kind == "usp_balanced")
    return LayerTime(fwd=fwd, bwd=bwd, name=kind)


def _usp_passes(config: SolverConfig, area, c: int, u: int, topo: Topology, *, balanced: bool):
    """(forward, backward) PassTime of USP of degree u; area [P][P] entries per chunk pair, c tokens per rank."""
    P = config.cp_size
    R = P // u
    hq, hkv, D, b = config.num_heads_q // u, config.num_heads_kv // u, config.head_dim, config.dtype_bytes
    if config.num_heads_kv % u or config.num_heads_q % u:
        raise ValueError(f"Ulysses degree {u} must divide num_heads_q and num_heads_kv")
    q_row, kv_row = hq * D * b, 2 * hkv * D * b  # one token of a rank's head share
    group = [p // u for p in range(P)]

    def step_area(i: int, j: int) -> int:  # Ulysses group i's queries against group j's keys
        return sum(area[qi][kj] for qi in range(i * u, (i + 1) * u) for kj in range(j * u, (j + 1) * u))

    steps = [[step_area(group[p], (group[p] - t) % R) for t in range(R)] for p in range(P)]
    if balanced:
        mean = sum(steps[p][t] for p in range(0, P, u) for t in range(R)) / (R * R)
        steps = [[mean] * R for _ in range(P)]

    def a2a(name: str, row: int) -> SimOp:
        moves = tuple((s, d, c * row) for s in range(P) for d in range(P) if s != d and group[s] == group[d])
        return SimOp(name, "comm", transfers=moves, mode="a2a", label=name)

    def hop(name: str, nbytes: int, deps: tuple, stream: str) -> SimOp:
        moves = tuple((p, ((group[p] + 1) % R) * u + p % u, nbytes) for p in range(P))
        return SimOp(name, stream, deps, transfers=moves, mode="p2p-batch", label=name)

    def compute(name: str, t: int, phase: str, deps=()) -> SimOp:
        dur = tuple(topo.attn_seconds(steps[p][t], hq, D, phase) for p in range(P))
        return SimOp(name, "compute", deps, duration=dur, label=f"{phase} ring step {t}")

    def wait(name: str, dep: str) -> SimOp:
        return SimOp(name, "compute", (dep,), label=name)

    block = c * u * kv_row  # one ring block: u chunks of the rank's KV head share
    fwd = [a2a("fwd.a2a.qkv", q_row + kv_row), wait("fwd.wait.qkv", "fwd.a2a.qkv")]
    held = "fwd.wait.qkv"
    for t in range(R):
        if t < R - 1:  # send the block in hand on while computing it
            fwd.append(hop(f"fwd.hop.kv.{t}", block, (held,), "comm"))
        fwd.append(compute(f"fwd.step.{t}", t, "fwd"))
        if t < R - 1:
            held = f"fwd.wait.kv.{t}"
            fwd.append(wait(held, f"fwd.hop.kv.{t}"))
    fwd += [a2a("fwd.a2a.o", q_row), wait("fwd.wait.o", "fwd.a2a.o")]

    bwd = [a2a("bwd.a2a.do", q_row), wait("bwd.wait.do", "bwd.a2a.do")]
    held, acc = "bwd.wait.do", None
    for t in range(R):
        if t < R - 1:
            bwd.append(hop(f"bwd.hop.kv.{t}", block, (held,), "comm"))
        bwd.append(compute(f"bwd.step.{t}", t, "bwd"))
        if t < R - 1:
            held = f"bwd.wait.kv.{t}"
            bwd.append(wait(held, f"bwd.hop.kv.{t}"))
        if t >= 1:  # this step's dK, dV join the accumulator that came in, and it moves on
            if acc is not None:
                bwd.append(wait(f"bwd.wait.dkv.{t - 1}", acc))
            deps = (f"bwd.step.{t}",) + (() if acc is None else (f"bwd.wait.dkv.{t - 1}",))
            acc = f"bwd.hop.dkv.{t}"
            bwd.append(hop(acc, block, deps, "comm.dkv"))
    if acc is not None:  # the last hop takes each accumulator home
        bwd.append(wait(f"bwd.wait.dkv.{R - 1}", acc))
    bwd += [a2a("bwd.a2a.dqkv", q_row + kv_row), wait("bwd.wait.dqkv", "bwd.a2a.dqkv")]
    return pass_time(fwd, P, topo), pass_time(bwd, P, topo)
