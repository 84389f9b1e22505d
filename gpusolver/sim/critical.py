"""The critical path of a simulated pass: the chain of causes that ends at its makespan.

A run (``engine.run_ops``) records why each op ended when it did (``Run.cause``). Walking those
causes back from the op that ends last gives contiguous segments from 0 to the makespan, each one
of:

- ``compute``:  a rank's attention (or another priced op) running;
- ``transfer``: bytes on link sides, the time the chain waited for them (a transfer held back by an
  earlier one on a busy side hands the chain to that one, so a queue on one NIC reads as its
  transfers one after another);
- ``latency``:  a collective's latency after the later of its two ends posted.

Every time is the simulator's, not a measurement. ``summary`` adds them up per kind, and per
collective and link class for the transfers: where a pass's time went.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpusolver.sim.engine import Run, Transfer

__all__ = ["Segment", "critical_path", "summary", "describe"]


@dataclass(frozen=True)
class Segment:
    """One link of the critical path, ``start`` to ``end`` seconds.

    kind:   "compute", "transfer" or "latency".
    rank:   the rank it ran on (compute), the destination of the bytes (transfer; -1 for an
            all-to-all-v's busiest side) or the rank whose posting came last (latency).
    label:  the op's label (``SimOp.label``, e.g. "fwd stage 2", "fwd.o").
    link:   "ib" or "nvlink" for a transfer (the slowest class it crosses), else "".
    src:    a point-to-point transfer's source (-1 otherwise).
    nbytes: its bytes (0 otherwise).
    """

    kind: str
    rank: int
    label: str
    start: float
    end: float
    link: str = ""
    src: int = -1
    nbytes: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _link(t: Transfer) -> str:
    if not t.sides:
        return ""
    return "ib" if any(side.startswith("ib") for side, _ in t.sides) else "nvlink"


def critical_path(run: Run, ops) -> list[Segment]:
    """The segments, in time order, of the chain that ends at ``run``'s makespan (``ops``: the list
    the run placed). Contiguous: each starts where the one before it ends, the first at 0 (or at
    the first op's start), the last at the makespan; zero-length links are left out."""
    by_name = {op.name: op for op in ops}
    if not run.end:
        return []
    name, rank = max(((n, r) for n, ends in run.end.items() for r in range(run.cp_size)),
                     key=lambda k: run.end[k[0]][k[1]])
    out: list[Segment] = []
    until = run.end[name][rank]  # the chain must reach this time from the step before it
    state = ("end", name, rank)
    for _ in range(16 * (len(run.end) * run.cp_size + len(run.intervals) + 1)):  # a bound: each link once
        if state[0] == "end":
            _, name, rank = state
            op = by_name[name]
            before, landed = run.cause[name][rank]
            start = run.start[name][rank]
            if landed is not None and landed.end > start:
                state = ("transfer", landed)
                continue
            if op.duration is not None and run.end[name][rank] > start:
                out.append(Segment("compute", rank, op.label or name, start, min(until, run.end[name][rank])))
            until = start
        else:
            t: Transfer = state[1]
            out.append(Segment("transfer", t.dst, t.label, t.start, min(until, t.end), _link(t), t.src, t.nbytes))
            until = t.start
            if t.after is not None:
                state = ("transfer", t.after)
                continue
            if t.start > t.posted:
                out.append(Segment("latency", t.poster, t.label, t.posted, t.start))
            until = t.posted
            # the later poster's readiness for this collective: what its start waited for
            rank, before = t.poster, run.cause[t.op][t.poster][0]
        if before is None:  # started at 0
            break
        state = ("end", before, rank)
    out.reverse()
    return [s for s in out if s.end > s.start]


def summary(path: list[Segment]) -> dict:
    """Seconds of the path per kind (``"compute"``, ``"latency"``, ``"transfer"``) and per
    (collective label, link class) of its transfers: ``{"compute": s, "latency": s, "transfer": s,
    "transfers": {(label, link): s}}``."""
    out = {"compute": 0.0, "latency": 0.0, "transfer": 0.0, "transfers": {}}
    for s in path:
        out[s.kind] += s.seconds
        if s.kind == "transfer":
            key = (s.label, s.link)
            out["transfers"][key] = out["transfers"].get(key, 0.0) + s.seconds
    return out


def describe(path: list[Segment], top: int = 6) -> list[str]:
    """Lines for a person: the pass's time on the path by kind, then its ``top`` longest runs of
    segments (consecutive segments of one kind, label, rank and link merged) in time order, in ms,
    simulated."""
    total = sum(s.seconds for s in path)
    if total <= 0:
        return ["critical path: nothing ran"]
    parts = summary(path)
    lines = ["critical path (simulated): " + ", ".join(
        f"{k} {parts[k] * 1e3:.3f} ms ({100 * parts[k] / total:.0f} %)" for k in ("compute", "transfer", "latency"))]
    runs: list[list] = []
    for s in path:
        key = (s.kind, s.label, s.rank, s.link)
        if runs and runs[-1][0] == key:
            runs[-1][2] = s.end
            runs[-1][3] += s.nbytes
            runs[-1][4].add(s.src)
        else:
            runs.append([key, s.start, s.end, s.nbytes, {s.src}])
    largest = sorted(sorted(runs, key=lambda r: r[1] - r[2])[:top], key=lambda r: r[1])  # shown in time order
    for (kind, label, rank, link), start, end, nbytes, srcs in largest:
        where = f"rank {rank}" if rank >= 0 else "busiest side"
        what = (f"{label} {nbytes / 1e6:.1f} MB over {link} into {where}"
                + (f" from {len(srcs - {-1})} source(s)" if srcs - {-1} else "")) if kind == "transfer" else \
            f"{label} on {where}"
        lines.append(f"  {start * 1e3:8.3f} - {end * 1e3:8.3f} ms  {kind:<8} {what}")
    return lines
