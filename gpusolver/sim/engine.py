"""The discrete-event core: per-rank streams, serialised links, collectives that move bytes.

A run takes one list of ``SimOp`` that every rank executes in order (the
runtime's own schedule, priced, or a baseline's) and a ``Topology``, and
places every op in time:

- each rank has streams (``"compute"``, ``"comm"``, ...); an op starts when
  the ops before it on its stream have finished and its deps have finished
  on that rank;
- a compute op lasts its per-rank ``duration``; a wait lasts nothing (it
  blocks its stream until its deps are done);
- a collective moves ``transfers`` (source, destination, bytes). A transfer
  goes through the link sides ``Topology.link_sides`` names: inside a node the
  source GPU's NVLink send side and the destination GPU's NVLink receive side;
  across nodes a NIC's send side (the source's own, or with ``rail_routing``
  the one on the destination's rail, reached over NVLink) and the destination
  NIC's receive side. Each side moves its
  bytes one collective after another at its full bandwidth (serialised), so no
  link ever carries more than its bandwidth allows;
- ``mode="a2a"`` (an all-to-all-v): it starts when every rank has reached it;
  each link side then moves all of the collective's bytes through it back to
  back (as a pipelined exchange does), and the collective completes on every
  rank at once, when the busiest side is done; ``mode="p2p"``: each transfer
  starts when both its ends have reached the op and all its sides are free
  (the one that can start first goes first), holds them for its own bytes, and a rank is done
  when its incoming transfers are (``TorchGroup(transport="p2p")``: its wait is on its receives,
  its sends stay in flight); ``mode="p2p-batch"``: the same transfers, but a rank is done when
  its own sends have landed too (a batch that completes as one handle: NCCL's coalesced
  ``batch_isend_irecv``, a ring's hop).
  Each collective (a2a) or transfer (p2p) pays the topology's latency once,
  the inter-node one when it crosses nodes.

Times are seconds from the start of the run. A run also records why each op ended when it did
(``Run.cause``: the op its start waited for, the transfer it waited for, and for each transfer the
posting or the earlier transfer on a busy link side that held it back), so the chain of causes that
ends at the makespan, the critical path, can be read back (``sim.critical``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gpusolver.topology import Topology

__all__ = ["SimOp", "Interval", "Transfer", "Run", "run_ops", "COMM_MODES"]

P2P_MODES = ("p2p", "p2p-batch")
COMM_MODES = ("a2a",) + P2P_MODES


@dataclass(frozen=True)
class SimOp:
    """One op of a priced schedule.

    name:      unique in the list.
    stream:    the rank's stream it runs on.
    deps:      names of earlier ops it waits for (on the same rank).
    duration:  compute: seconds per rank ([P] floats); None for collectives and waits.
    transfers: collective: ((src, dst, bytes), ...); None otherwise.
    mode:      "a2a", "p2p" or "p2p-batch" for a collective.
    label:     what the timeline shows (default the name).
    """

    name: str
    stream: str
    deps: tuple[str, ...] = ()
    duration: tuple[float, ...] | None = None
    transfers: tuple[tuple[int, int, int], ...] | None = None
    mode: str = "a2a"
    label: str = ""

    @property
    def collective(self) -> bool:
        return self.transfers is not None


@dataclass(frozen=True)
class Interval:
    """One bar of the timeline: ``rank``'s ``lane`` busy with ``label`` from ``start`` to ``end`` (seconds).

    lane: a stream name, or a link side: "nvlink send", "nvlink recv", "ib send", "ib recv"
    (a NIC's bars are drawn on each GPU that moves bytes through it).
    """

    rank: int
    lane: str
    label: str
    start: float
    end: float


@dataclass(frozen=True, eq=False)
class Transfer:
    """Bytes placed on link sides: one (source, destination) transfer of a point-to-point collective,
    or all of an all-to-all-v's bytes through its busiest side (``src`` = ``dst`` = -1).

    op, label:  the collective it belongs to.
    sides:      the (side, index) pairs it holds.
    start, end: seconds; ``end`` is when its slowest side is done.
    posted:     the time both ends had posted (the later readiness, before the latency), and
    poster:     the rank whose readiness that was; the transfer started ``latency`` after it, unless
    after:      the earlier transfer whose hold on one of its sides ended at ``start`` (None: the
                posting and the latency set ``start``).
    """

    op: str
    label: str
    src: int
    dst: int
    nbytes: int
    sides: tuple
    start: float
    end: float
    posted: float
    poster: int
    after: "Transfer | None" = None


@dataclass
class Run:
    """What a run placed: per-rank end of every op, the timeline, busy time per stream.

    cause[name][rank]: why that op ended when it did on that rank: ``(before, transfer)``, ``before``
    the op whose end its start waited for (the one before it on its stream, or a dep; None when it
    started at 0) and ``transfer`` the ``Transfer`` its end waited for (a collective's last landing,
    None when nothing arrived after its start).
    """

    cp_size: int
    end: dict[str, list[float]] = field(default_factory=dict)
    start: dict[str, list[float]] = field(default_factory=dict)
    intervals: list[Interval] = field(default_factory=list)
    cause: dict[str, list[tuple]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max((max(v) for v in self.end.values()), default=0.0)

    def busy(self, rank: int, lane: str) -> float:
        return sum(i.end - i.start for i in self.intervals if i.rank == rank and i.lane == lane)


class _Links:
    """Free time of every link side, and the placement of transfers on them."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.free: dict[tuple[str, int], float] = {}
        self.holder: dict[tuple[str, int], Transfer] = {}  # the transfer whose hold ends at ``free``

    def _seconds(self, side: str, nbytes: int) -> float:
        return self.topo.link_seconds(nbytes, inter_node=side.startswith("ib"))

    def place_all(self, moves, earliest: float, label: str, out: list, op: str = "", posted: float = 0.0,
                  poster: int = -1) -> tuple[float, Transfer | None]:
        """Every side moves its share of ``moves`` back to back from ``earliest``: (when the last is
        done, the busiest side's ``Transfer``, None without bytes)."""
        load: dict[tuple[str, int], int] = {}
        ranks: dict[tuple[str, int], set] = {}
        for s, d, b in moves:
            for side, index, rank in self.topo.link_sides(s, d):
                load[side, index] = load.get((side, index), 0) + b
                ranks.setdefault((side, index), set()).add(rank)
        last, slowest = earliest, None
        for key, b in load.items():
            free = self.free.get(key, 0.0)
            start = max(earliest, free)
            end = start + self._seconds(key[0], b)
            held = Transfer(op, label, -1, -1, b, (key,), start, end, posted, poster,
                            self.holder.get(key) if free > earliest else None)
            self.free[key], self.holder[key] = end, held
            if slowest is None or end > last:
                last, slowest = max(last, end), held
            out.extend(Interval(r, key[0], label, start, end) for r in sorted(ranks[key]))
        return last, slowest

    def earliest(self, src: int, dst: int, nbytes: int, earliest: float) -> float:
        """When a transfer could start: every side it goes through free, not before ``earliest``."""
        return max([earliest] + [self.free.get((side, i), 0.0) for side, i, _ in self.topo.link_sides(src, dst)])

    def place(self, src: int, dst: int, nbytes: int, earliest: float, label: str, out: list, op: str = "",
              posted: float = 0.0, poster: int = -1) -> Transfer:
        """Start the transfer once every side is free; each side is busy for its own bytes' time
        (an NVLink hop before InfiniBand, ``Topology.rail_routing``, is pipelined with it); done when
        the slowest side is."""
        sides = self.topo.link_sides(src, dst)
        start = self.earliest(src, dst, nbytes, earliest)
        # what held the start back: the side freed last, if it was freed after ``earliest``
        busy = max(((side, i) for side, i, _ in sides), key=lambda k: self.free.get(k, 0.0))
        after = self.holder.get(busy) if self.free.get(busy, 0.0) > earliest else None
        done = start
        for side, i, rank in sides:
            end = start + self._seconds(side, nbytes)
            done = max(done, end)
            out.append(Interval(rank, side, label, start, end))
        moved = Transfer(op, label, src, dst, nbytes, tuple((side, i) for side, i, _ in sides), start, done, posted,
                         poster, after)
        for side, i, _ in sides:
            self.free[side, i] = start + self._seconds(side, nbytes)
            self.holder[side, i] = moved
        return moved


def run_ops(ops, cp_size: int, topo: Topology) -> Run:
    """Place ``ops`` (every rank runs the same list) on ``cp_size`` ranks of ``topo``."""
    P = cp_size
    run = Run(P)
    links = _Links(topo)
    stream_free: dict[str, list[float]] = {}
    stream_last: dict[str, str] = {}  # the op last placed on each stream
    for op in ops:
        if op.name in run.end:
            raise ValueError(f"op name {op.name!r} appears twice")
        missing = [d for d in op.deps if d not in run.end]
        if missing:
            raise ValueError(f"op {op.name!r} depends on {missing}, which come later or not at all")
        free = stream_free.setdefault(op.stream, [0.0] * P)
        before = [stream_last.get(op.stream)] + list(op.deps)
        ready, waited = [], []
        for r in range(P):
            times = [free[r]] + [run.end[d][r] for d in op.deps]
            k = max(range(len(times)), key=times.__getitem__)  # the first of the latest: the stream on ties
            ready.append(times[k])
            waited.append(before[k] if times[k] > 0 else None)
        label = op.label or op.name
        landed = [None] * P
        if op.collective:
            end, landed = _collective(op, ready, links, label, run.intervals, P)
        elif op.duration is not None:
            if len(op.duration) != P:
                raise ValueError(f"op {op.name!r} has {len(op.duration)} durations for {P} ranks")
            end = [ready[r] + op.duration[r] for r in range(P)]
            run.intervals.extend(Interval(r, op.stream, label, ready[r], end[r])
                                 for r in range(P) if op.duration[r] > 0)
        else:  # a wait
            end = ready
        run.start[op.name] = ready
        run.end[op.name] = end
        run.cause[op.name] = list(zip(waited, landed))
        stream_free[op.stream] = end
        stream_last[op.stream] = op.name
    return run


def _latency(topo: Topology, transfers) -> float:
    inter = any(not topo.same_node(s, d) for s, d, _ in transfers)
    return topo.latency_seconds(inter_node=inter)


def _collective(op: SimOp, ready: list[float], links: _Links, label: str, out: list,
                P: int) -> tuple[list[float], list[Transfer | None]]:
    """(per-rank end, per-rank the transfer that end waited for, None where nothing did)."""
    moves = [(s, d, b) for s, d, b in op.transfers if b > 0 and s != d]
    for s, d, _ in moves:
        if not (0 <= s < P and 0 <= d < P):
            raise ValueError(f"op {op.name!r} moves bytes between ranks {s} and {d} outside [0, {P})")
    topo = links.topo
    if op.mode == "a2a":
        last = max(range(P), key=ready.__getitem__)
        start = ready[last] + _latency(topo, moves)
        done, busiest = links.place_all(moves, start, label, out, op.name, ready[last], last)
        if busiest is None:  # nothing moved: every rank ends once the last has posted and the latency passed
            busiest = Transfer(op.name, label, -1, -1, 0, (), start, start, ready[last], last)
        return [done] * P, [busiest] * P
    if op.mode not in P2P_MODES:
        raise ValueError(f"op {op.name!r}: mode must be 'a2a', 'p2p' or 'p2p-batch', got {op.mode!r}")
    senders_wait = op.mode == "p2p-batch"
    end = list(ready)
    landed: list[Transfer | None] = [None] * P
    left = [(s, d, b, max(ready[s], ready[d]) + _latency(topo, [(s, d, b)])) for s, d, b in moves]
    while left:  # the transfer that can start first goes first (ties: source, then destination)
        k = min(range(len(left)), key=lambda i: (links.earliest(*left[i]), left[i][0], left[i][1]))
        s, d, b, earliest = left.pop(k)
        poster = s if ready[s] > ready[d] else d
        t = links.place(s, d, b, earliest, label, out, op.name, ready[poster], poster)
        for r in ((s, d) if senders_wait else (d,)):
            if t.end > end[r]:
                end[r], landed[r] = t.end, t
    return end, landed
