"""A plan's layer time on a cluster (simulated): the runtime's own schedule, priced and placed.

``simulate(plan, topology)`` takes the op lists ``dist_attn`` executes
(``gpusolver.plan.schedule``), prices each op (attention FLOPs per rank and
stage from the plan's areas, bytes per (source, destination) from its splits
and ``CommCost``) and places them with the event engine (``sim.engine``). The
forward and the backward are placed separately, each from time 0: in a model
other layers run between them. The log-sum-exp merge and the row delta are
memory-bound and small next to attention: they are priced at zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from gpusolver.plan.schedule import ATTN, WAIT, op_pair_bytes, plan_ops, stage_area
from gpusolver.sim.critical import critical_path, summary
from gpusolver.sim.engine import COMM_MODES, Interval, Run, SimOp, run_ops
from gpusolver.topology import Topology

__all__ = ["LayerTime", "PassTime", "simulate", "ideal_seconds", "pass_time"]


@dataclass(frozen=True)
class PassTime:
    """One pass (forward or backward), simulated. Times in ms.

    ms:         when the last rank finishes.
    ideal_ms:   max(busiest rank's compute, per link class max over GPUs and NICs of bytes / bandwidth).
    compute_ms: the busiest rank's compute.
    comm_ms:    the longest time any rank's communication streams are busy.
    pair_bytes: [P][P] bytes moved from source to destination (host ints).
    timeline:   the bars of every rank's streams and link sides (seconds, ``engine.Interval``).
    critical:   the chain of compute, transfers and latencies that ends at ``ms``
                (``sim.critical.critical_path``: seconds, ``critical.Segment``).
    """

    ms: float
    ideal_ms: float
    compute_ms: float
    comm_ms: float
    pair_bytes: list
    timeline: list = field(repr=False, default_factory=list)
    critical: list = field(repr=False, default_factory=list)

    @property
    def exposed_comm_ms(self) -> float:
        return max(0.0, self.ms - self.compute_ms)


@dataclass(frozen=True)
class LayerTime:
    """A layer's forward, backward and training step (forward + backward), simulated, in ms.

    fwd_ms, bwd_ms, step_ms:  the passes and their sum.
    ideal_ms:                 the step's ideal bound (the passes' ideal bounds summed).
    compute_ms:               the busiest rank's compute, forward plus backward.
    exposed_comm_ms:          step time beyond that compute: communication nothing hid.
    hidden_share:             1 - exposed / (the passes' comm_ms), in [0, 1]: the share of
                              communication time that ran under compute.
    fwd, bwd:                 the passes' PassTime (timelines, bytes).
    """

    fwd: PassTime
    bwd: PassTime
    name: str = ""

    @property
    def fwd_ms(self) -> float:
        return self.fwd.ms

    @property
    def bwd_ms(self) -> float:
        return self.bwd.ms

    @property
    def step_ms(self) -> float:
        return self.fwd.ms + self.bwd.ms

    @property
    def ideal_ms(self) -> float:
        return self.fwd.ideal_ms + self.bwd.ideal_ms

    @property
    def compute_ms(self) -> float:
        return self.fwd.compute_ms + self.bwd.compute_ms

    @property
    def exposed_comm_ms(self) -> float:
        return self.fwd.exposed_comm_ms + self.bwd.exposed_comm_ms

    @property
    def hidden_share(self) -> float:
        comm = self.fwd.comm_ms + self.bwd.comm_ms
        return 1.0 if comm <= 0 else min(1.0, max(0.0, 1.0 - self.exposed_comm_ms / comm))

    @property
    def timeline(self) -> dict[str, list[Interval]]:
        return {"fwd": self.fwd.timeline, "bwd": self.bwd.timeline}

    def to_dict(self) -> dict:
        """The figures above as floats (ms), with each pass's critical path summed per kind
        (``critical_fwd_compute_ms``, ``..._transfer_ms``, ``..._latency_ms``; the same for bwd)."""
        keys = ("fwd_ms", "bwd_ms", "step_ms", "ideal_ms", "compute_ms", "exposed_comm_ms", "hidden_share")
        out = {k: getattr(self, k) for k in keys}
        out.update(ideal_fwd_ms=self.fwd.ideal_ms, ideal_bwd_ms=self.bwd.ideal_ms,
                   compute_fwd_ms=self.fwd.compute_ms, compute_bwd_ms=self.bwd.compute_ms)
        for name, pt in (("fwd", self.fwd), ("bwd", self.bwd)):  # the critical path's parts, ms
            parts = summary(pt.critical)
            out.update({f"critical_{name}_{k}_ms": parts[k] * 1e3 for k in ("compute", "transfer", "latency")})
        return out


def ideal_seconds(compute: list[float], transfers, topo: Topology, P: int) -> float:
    """max(busiest compute, per link class max over GPUs / NICs of bytes / bandwidth), seconds."""
    load: dict[tuple[str, int], int] = {}
    for s, d, b in transfers:
        if s == d or b <= 0:
            continue
        for side, index, _ in topo.link_sides(s, d):
            load[side, index] = load.get((side, index), 0) + b
    links = [topo.link_seconds(b, inter_node=side[0].startswith("ib")) for side, b in load.items()]
    return max([max(compute, default=0.0)] + links)


def pass_time(ops: list[SimOp], P: int, topo: Topology) -> PassTime:
    """Place one pass's priced ops and read its figures off the run."""
    run: Run = run_ops(ops, P, topo)
    compute = [sum(op.duration[r] for op in ops if op.duration is not None) for r in range(P)]
    moves = [t for op in ops if op.collective for t in op.transfers]
    pair = [[0] * P for _ in range(P)]
    for s, d, b in moves:
        if s != d:
            pair[s][d] += b
    comm_streams = {op.stream for op in ops if op.collective}
    comm = max((sum(run.end[op.name][r] - run.start[op.name][r] for op in ops if op.collective)
                for r in range(P)), default=0.0) if comm_streams else 0.0
    return PassTime(ms=run.makespan * 1e3, ideal_ms=ideal_seconds(compute, moves, topo, P) * 1e3,
                    compute_ms=max(compute, default=0.0) * 1e3, comm_ms=comm * 1e3, pair_bytes=pair,
                    timeline=run.intervals, critical=critical_path(run, ops))


def _priced(plan, phase: str, topo: Topology, cost, keep: bool, mode: str) -> list[SimOp]:
    ops = plan_ops(plan, phase, keep, getattr(cost, "kept_kv_rows", None))  # a partly kept KV buffer: its tail
    num_stages = max((op.stages[0] for op in ops if op.kind == ATTN), default=0) + 1
    area = stage_area(plan, num_stages).tolist()  # [P][stages] entries per head group
    P = plan.comm.cp_size
    out = []
    for op in ops:
        if op.collective:
            pb = op_pair_bytes(plan, op, cost)
            nz = torch.nonzero(pb).tolist()
            vals = pb.tolist()
            out.append(SimOp(op.name, op.stream, op.deps, transfers=tuple((s, d, vals[s][d]) for s, d in nz),
                             mode=mode, label=op.phase))
        elif op.kind == ATTN:
            (s,) = op.stages
            dur = tuple(topo.attn_seconds(area[r][s], cost.hq, cost.head_dim, phase) for r in range(P))
            out.append(SimOp(op.name, op.stream, op.deps, duration=dur, label=f"{phase} stage {s}"))
        elif op.kind == WAIT:
            out.append(SimOp(op.name, op.stream, op.deps, label=op.name))
        else:  # merge, delta: memory-bound, priced at zero
            out.append(SimOp(op.name, op.stream, op.deps, duration=(0.0,) * P, label=op.name))
    return out


def simulate(plan, topology: Topology, *, cost=None, keep_forward_buffers: bool | str | None = None,
             comm: str = "a2a", reduce_stream: bool = False, name: str = "ours") -> LayerTime:
    """The simulated time of one layer executing ``plan`` on ``topology``.

    plan:     a ``Plan`` or ``SparsePlan`` (read on the host).
    topology: the cluster; the plan's P must fit it (``Topology.check_group``).
    cost:     the ``CommCost`` pricing rows and FLOPs (default the plan's own).
    keep_forward_buffers: the backward's protocol (default the cost's).
    comm:     "a2a" (``TorchGroup``: every collective an all-to-all-v that completes as one)
              or "p2p" (``TorchGroup(transport="p2p")`` with a handle per send and receive, as
              gloo gives: each (source, destination) transfer on its own, and a rank's wait ends
              when its own incoming rows have landed), or "p2p-batch" (the same transfers, but a
              rank's wait also covers its sends: NCCL's coalesced batch, one handle for both).
    reduce_stream: the reduces on a stream of their own (not queued behind the casts; a
              what-if: the runtime issues them on the casts' stream).
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    if comm not in COMM_MODES:
        raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
    cost = plan.cost if cost is None else cost
    if cost is None:
        raise ValueError("simulate needs the plan's CommCost: the plan has none, pass cost=")
    P = plan.comm.cp_size
    topology.check_group(P)
    keep = cost.keep_forward_buffers if keep_forward_buffers is None else keep_forward_buffers
    keep = keep if isinstance(keep, str) else bool(keep)  # True, False, or the one kind kept ("qo" / "kv")
    passes = {}
    for phase in ("fwd", "bwd"):
        ops = _priced(plan, phase, topology, cost, keep, comm)
        if reduce_stream:  # the reduces, and the relays' merges between their hops (comm-stream waits)
            ops = [replace(op, stream="reduce") if op.stream == "comm" and op.name.split(".")[1] in ("reduce", "wait")
                   else op for op in ops]
        passes[phase] = pass_time(ops, P, topology)
    return LayerTime(fwd=passes["fwd"], bwd=passes["bwd"], name=name)
