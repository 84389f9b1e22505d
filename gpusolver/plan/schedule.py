"""The runtime's schedule as data: the operations one layer executes, in order, per rank.

``dist_attn`` and ``sparse_dist_attn`` run these lists op by op, and the
simulator (``gpusolver.sim``) prices the same lists, so the model of a
layer's time cannot drift from the code that runs it.

Every rank executes the same list. An ``Op`` runs on one of two streams of
its rank: ``"compute"`` (attention kernels, merges, and the waits that block
it) or ``"comm"`` (the collectives, issued asynchronously in list order; the
backend runs them one after another; and a relay's merge of a hop's partials
before it forwards them, which the runtime runs on a side stream on CUDA,
``runtime.relay_stages``). An op starts when the ops before it on
its stream have finished and its ``deps`` have finished. A collective moves
rows of one route (``"qo"``: the plan's ``qo_split``, ``"kv"``: ``kv_split``)
from source to destination (``back=False``) or the way back (a reduce,
``back=True``); its bytes per (source, destination) are the split times
``row_bytes(op, cost)``.

Stages: stage 0 holds a rank's tasks whose two units are local, stages 1..S
the remote work (``CalcMeta`` has S + 1 stages; ``SolverConfig.num_stages``
= S). With one remote stage every collective moves the plan's whole split.
With S > 1 sub-stages (``gpusolver.plan.stages``) every collective belongs to
one sub-stage (``Op.stages = (s,)``) and moves that sub-stage's split
(``CommMeta.stage_split``): all casts are issued up front, sub-stage s waits
only for cast s, and reduce s returns the partials whose last task was in s
right after s ends, while s + 1 computes. The forward runs the local stage
first (it hides the casts), the backward last (it hides the returns).

Shape legend: G head groups, U units (P without tiling), P ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpusolver.problem import kept_kinds, room_size, split_kept_room
from groupcomm import tail_split

__all__ = ["Op", "CAST", "REDUCE", "WAIT", "ATTN", "MERGE", "DELTA", "forward_ops", "backward_ops",
           "row_bytes", "pair_bytes", "task_stage", "stage_area", "PHASES", "hop_phase"]

CAST, REDUCE, WAIT, ATTN, MERGE, DELTA = "cast", "reduce", "wait", "attn", "merge", "delta"
COMPUTE, COMM = "compute", "comm"

# every collective phase, with the route it moves and its direction (False: host -> helper)
PHASES = {"fwd.qo": ("qo", False), "fwd.kv": ("kv", False), "fwd.o": ("qo", True),
          "bwd.qo": ("qo", False), "bwd.kv": ("kv", False), "bwd.dq": ("qo", True), "bwd.dkv": ("kv", True)}


@dataclass(frozen=True)
class Op:
    """One operation of a layer, as every rank runs it.

    name:   unique within its list (``"fwd.cast.qo"``, ``"fwd.attn.1"``, ...).
    kind:   CAST, REDUCE (collectives), WAIT (its stream blocks on a collective: the compute stream,
            or, for a relay's merge before it forwards (relay sub-stages), the comm stream),
            ATTN (one stage's attention kernel), MERGE (log-sum-exp merge of the stages'
            local partials), DELTA (the backward's row delta on the host).
    stream: "compute" or "comm".
    deps:   names of ops (earlier in the list) that must finish before this one starts.
    phase:  the groupcomm phase of a collective or wait (``"fwd.qo"``); "fwd" / "bwd" otherwise.
    route:  "qo" or "kv" for a collective or wait, else None.
    back:   a collective's rows go from helper to host (reduces).
    stages: ATTN: the stage it computes; MERGE: the stages merged; REDUCE: the stages whose
            remote partials it returns; with S > 1 sub-stages a CAST, REDUCE or WAIT names the
            one sub-stage whose split it moves.
    branch: the output branch a fwd.o reduce returns (NSA layers have two), else 0.
    hop:    relay transport (``gpusolver.plan.relay``): 0 the direct rows, 1 the InfiniBand leg
            (the egress <-> the node's relay), 2 the NVLink leg (relay <-> its node's consumers),
            3 the NVLink pre-hop (host <-> its egress, ``RelayMeta.egress``); always 0 in a plan
            without relay.
    """

    name: str
    kind: str
    stream: str
    deps: tuple[str, ...] = ()
    phase: str = ""
    route: str | None = None
    back: bool = False
    stages: tuple[int, ...] = ()
    branch: int = 0
    hop: int = 0

    @property
    def collective(self) -> bool:
        return self.kind in (CAST, REDUCE)

    @property
    def counter(self) -> str:
        """The groupcomm phase its bytes are counted under (``hop_phase``)."""
        return hop_phase(self.phase, self.hop)


def hop_phase(phase: str, hop: int) -> str:
    """The byte-counter label of one hop of a collective phase: ``phase`` itself for hop 0
    (direct), ``"<phase>:hop1"`` / ``"<phase>:hop2"`` / ``"<phase>:hop3"`` for the relay legs."""
    return phase if hop == 0 else f"{phase}:hop{hop}"


def _collective(kind: str, phase: str, deps=(), stages=(), branch: int = 0, tag: str = "", hop: int = 0) -> Op:
    route, back = PHASES[phase]
    tag = tag + (f":hop{hop}" if hop else "")
    return Op(name=f"{phase.split('.')[0]}.{kind}.{phase.split('.')[1]}{tag}", kind=kind, stream=COMM,
              deps=tuple(deps), phase=phase, route=route, back=back, stages=tuple(stages), branch=branch, hop=hop)


def _wait(op: Op, stream: str = COMPUTE) -> Op:
    """The wait for collective ``op``: on the compute stream (what reads its result computes), or on the
    comm stream (a relay's merge before it forwards: only the collectives after it wait)."""
    return Op(name=op.name.replace(f".{op.kind}.", ".wait.", 1), kind=WAIT, stream=stream, deps=(op.name,),
              phase=op.phase, route=op.route, back=op.back, stages=op.stages, branch=op.branch, hop=op.hop)


# built once per shape and kept; under torch.compile the lists are constants, and a list first
# asked for inside a trace is built without being stored (a store there is a side effect that
# dynamo refuses inside an autograd.Function's backward or a checkpointed region)
_LISTS: dict[tuple, tuple[Op, ...]] = {}


def _kept(key: tuple, build) -> tuple[Op, ...]:
    ops = _LISTS.get(key)
    if ops is None:
        ops = build()
        if not torch.compiler.is_compiling():
            _LISTS[key] = ops
    return ops


def forward_ops(num_stages: int = 2, branches: int = 1, relay: bool = False, egress: bool = False) -> tuple[Op, ...]:
    """The forward: both casts up front, stage 0 while they fly, the remote stages, merge, reduce O.

    num_stages: CalcMeta stages (2: local + one remote; S + 1 with S sub-stages).
    branches: outputs per query row (2 for an NSA layer's selection and window branches): one
        ``fwd.o`` reduce per branch (per sub-stage with S > 1), each moving its branch's O and lse.
    relay: the plan's transport relays inter-node rows (``Plan.relay``): every cast and
        reduce becomes its hops (``_forward_relay_ops``); one remote stage, one branch.
    egress: with relay, the hops include the pre-hop to the egress (``RelayMeta.egress``).
    """
    if relay:
        egress = bool(egress)
        return _kept(("fwd-relay", num_stages, branches, egress),
                     lambda: _forward_relay_ops(num_stages, branches, egress) if num_stages <= 2
                     else _forward_relay_sub_stages(num_stages - 1, branches, egress))

    def build():
        _check(num_stages, branches)
        return (_forward_ops(num_stages, branches) if num_stages <= 2
                else _forward_sub_stages(num_stages - 1, branches))

    return _kept(("fwd", num_stages, branches), build)


def _forward_sub_stages(S: int, branches: int = 1) -> tuple[Op, ...]:
    """S sub-stages: casts 1..S up front; sub-stage s after its own casts; reduce s right after it
    (one per output branch, ``Op.branch``: each branch's partials merge on their own); the host
    merges its rows with reduces 1..S in that order, per branch (``fwd.merge``). Each
    ``fwd.attn.s`` runs every branch and merges its partials into the rows it covers."""
    casts = [(_collective(CAST, "fwd.qo", stages=(s,), tag=f".{s}"), _collective(CAST, "fwd.kv", stages=(s,),
                                                                                 tag=f".{s}")) for s in range(1, S + 1)]
    ops = [c for pair in casts for c in pair] + [Op("fwd.attn.0", ATTN, COMPUTE, phase="fwd", stages=(0,))]
    reduces = []
    for s, (cq, ckv) in enumerate(casts, start=1):
        waits = (_wait(cq), _wait(ckv))
        attn = Op(f"fwd.attn.{s}", ATTN, COMPUTE, deps=tuple(w.name for w in waits), phase="fwd", stages=(s,))
        mine = [_collective(REDUCE, "fwd.o", deps=(attn.name,), stages=(s,), branch=b,
                            tag=f".{s}" if branches == 1 else f".{s}.{b}") for b in range(branches)]
        reduces += mine
        ops += [*waits, attn, *mine]
    back = [_wait(r) for r in reduces]
    ops += back
    ops.append(Op("fwd.merge", MERGE, COMPUTE, deps=tuple(w.name for w in back), phase="fwd",
                  stages=tuple(range(S + 1))))
    return tuple(ops)


def _forward_ops(num_stages: int, branches: int) -> tuple[Op, ...]:
    cast_q, cast_kv = _collective(CAST, "fwd.qo"), _collective(CAST, "fwd.kv")
    waits = (_wait(cast_q), _wait(cast_kv))
    ops = [cast_q, cast_kv, Op("fwd.attn.0", ATTN, COMPUTE, phase="fwd", stages=(0,))]
    ops += waits
    remote = tuple(range(1, num_stages))
    for s in remote:
        ops.append(Op(f"fwd.attn.{s}", ATTN, COMPUTE, deps=tuple(w.name for w in waits), phase="fwd", stages=(s,)))
    attn = tuple(f"fwd.attn.{s}" for s in range(num_stages))
    ops.append(Op("fwd.merge", MERGE, COMPUTE, deps=attn, phase="fwd", stages=tuple(range(num_stages))))
    reduces = [_collective(REDUCE, "fwd.o", deps=("fwd.merge",) + attn, stages=remote, branch=b,
                           tag="" if branches == 1 else f".{b}") for b in range(branches)]
    # the runtime reduces one branch and waits for it before the next (group_reduce is blocking there)
    for r in reduces:
        ops += [r, _wait(r)]
    return tuple(ops)


def backward_ops(num_stages: int = 2, keep_forward_buffers: bool = True, relay: bool = False,
                 egress: bool = False) -> tuple[Op, ...]:
    """The backward: delta on the host, the dO cast (awaited before stage 0), the stages, dQ and dK/dV back.

    Without kept forward buffers Q travels with dO and K, V are cast again (``bwd.kv``).
    relay: every cast and reduce becomes its relay hops (``_backward_relay_ops``); egress as forward.
    """
    keep = bool(keep_forward_buffers)
    if relay:
        egress = bool(egress)
        return _kept(("bwd-relay", num_stages, keep, egress),
                     lambda: _backward_relay_ops(num_stages, keep, egress) if num_stages <= 2
                     else _backward_relay_sub_stages(num_stages - 1, keep, egress))

    def build():
        _check(num_stages, 1)
        return _backward_ops(num_stages, keep) if num_stages <= 2 else _backward_sub_stages(num_stages - 1, keep)

    return _kept(("bwd", num_stages, keep), build)


def _backward_sub_stages(S: int, keep_forward_buffers: bool) -> tuple[Op, ...]:
    """S sub-stages: delta, then casts 1..S of dO, lse, delta (and Q, K, V again without kept buffers)
    up front; sub-stage s after its own casts, reduces of dQ and dK / dV s right after it; the local
    stage 0 last, while the reduces fly; the host sums its rows with reduces 1..S in that order
    (``bwd.merge``).

    The local stage runs last here (first in the forward) because the backward's returns are its
    large transfers: dQ, dK and dV go back to every remote host while dO, lse and delta travel
    one way only (K and V are kept), so the remote sub-stages' partials must leave early, and the
    local work, which returns nothing, is what hides them."""
    ops = [Op("bwd.delta", DELTA, COMPUTE, phase="bwd")]
    casts = []
    for s in range(1, S + 1):
        mine = [_collective(CAST, "bwd.qo", deps=("bwd.delta",), stages=(s,), tag=f".{s}")]
        if not keep_forward_buffers:
            mine.append(_collective(CAST, "bwd.kv", stages=(s,), tag=f".{s}"))
        casts.append(mine)
        ops += mine
    reduces = []
    for s, mine in enumerate(casts, start=1):
        waits = [_wait(c) for c in mine]
        attn = Op(f"bwd.attn.{s}", ATTN, COMPUTE, deps=tuple(w.name for w in waits), phase="bwd", stages=(s,))
        pair = [_collective(REDUCE, ph, deps=(attn.name,), stages=(s,), tag=f".{s}") for ph in ("bwd.dq", "bwd.dkv")]
        reduces += pair
        ops += [*waits, attn, *pair]
    ops.append(Op("bwd.attn.0", ATTN, COMPUTE, phase="bwd", stages=(0,)))
    back = [_wait(r) for r in reduces]
    ops += back
    ops.append(Op("bwd.merge", MERGE, COMPUTE, deps=tuple(w.name for w in back), phase="bwd",
                  stages=tuple(range(S + 1))))
    return tuple(ops)


def _backward_ops(num_stages: int, keep_forward_buffers: bool) -> tuple[Op, ...]:
    ops = [Op("bwd.delta", DELTA, COMPUTE, phase="bwd")]
    casts = [_collective(CAST, "bwd.qo", deps=("bwd.delta",))]
    if not keep_forward_buffers:
        casts.append(_collective(CAST, "bwd.kv"))
    waits = []
    for c in casts:  # the runtime casts synchronously: each is awaited before the next starts
        waits.append(_wait(c))
        ops += [c, waits[-1]]
    attn = []
    for s in range(num_stages):
        deps = () if s == 0 else tuple(w.name for w in waits)
        ops.append(Op(f"bwd.attn.{s}", ATTN, COMPUTE, deps=deps, phase="bwd", stages=(s,)))
        attn.append(ops[-1].name)
    remote = tuple(range(1, num_stages))
    for phase in ("bwd.dq", "bwd.dkv"):
        r = _collective(REDUCE, phase, deps=tuple(attn), stages=remote)
        ops += [r, _wait(r)]
    return tuple(ops)


def _relay_check(num_stages: int, branches: int) -> None:
    _check(num_stages, branches)
    if num_stages < 2 or branches != 1:
        raise ValueError(f"relay transport runs remote stages and one output branch, got "
                         f"num_stages={num_stages} (CalcMeta stages), branches={branches}")


def _relay_cast(phase: str, deps=(), egress: bool = False, stage: int = 0) -> list[Op]:
    """A cast as its hops: with egress the pre-hop to the egresses first (hop 1 reads what it
    brings), InfiniBand to the relays (the fan-out reads what it brings), then the direct rows,
    then the fan-out over NVLink once hop 1 has landed. ``stage``: the sub-stage it belongs to
    (0: a plan with one remote stage)."""
    kw = dict(stages=(stage,), tag=f".{stage}") if stage else {}
    pre = [_collective(CAST, phase, deps=deps, hop=3, **kw)] if egress else []
    hop1 = _collective(CAST, phase, deps=tuple(p.name for p in pre) or deps, hop=1, **kw)
    direct = _collective(CAST, phase, deps=deps, **kw)
    hop2 = _collective(CAST, phase, deps=(hop1.name,), hop=2, **kw)
    return pre + [hop1, direct, hop2]


def _relay_reduce_legs(phase: str, stage: int, deps, egress: bool) -> tuple[list[Op], list[Op], list[Op]]:
    """Sub-stage ``stage``'s reduce as three legs, each placed one compute slot after the one before
    (``_place_legs``): A, partials to the relays (hop 2) and the direct rows home (hop 0, into a
    neutral accumulator) when the sub-stage ends; B, the relays' merged rows over InfiniBand (hop 1)
    once hop 2 has landed; C (egress only), the egresses' merged rows home over NVLink (hop 3) once
    hop 1 has.

    The relay's and the egress's merges wait on the comm stream, not the compute stream: a wait on
    the compute stream held every forwarding hop until the relay's attention then running had
    ended, and the egresses' until theirs had, so each hop of the chain added a compute slot of
    some rank to it (simulated, S = 4 over p2p: causal P = 32 step 1.35x direct's, 34.9 %
    exposed). On the comm stream only the collectives queued after the merge wait for it."""
    kw = dict(stages=(stage,), tag=f".{stage}")
    hop2 = _collective(REDUCE, phase, deps=deps, hop=2, **kw)
    direct = _collective(REDUCE, phase, deps=deps, **kw)
    merged = _wait(hop2, COMM)
    hop1 = _collective(REDUCE, phase, deps=(merged.name,), hop=1, **kw)
    legs = ([hop2, direct], [merged, hop1], [])
    if egress:
        at_egress = _wait(hop1, COMM)
        legs[2].extend((at_egress, _collective(REDUCE, phase, deps=(at_egress.name,), hop=3, **kw)))
    return legs


def _place_legs(slots: list[list[Op]], legs: dict[int, tuple], early_last: bool = False) -> list[Op]:
    """Interleave reduce legs with the compute slots: leg k of sub-stage s goes after slot
    ``min(s + k, len(slots))`` (slot j is ``slots[j - 1]``: its cast waits, then its attention),
    legs of one slot by (s + k, s). ``early_last``: the later legs (k > 0) due at the last slot go
    before its attention instead, so that the last attention hides their hops (the forward: see
    ``_forward_relay_sub_stages``)."""
    last = len(slots)
    before: dict[int, list] = {}
    after: dict[int, list] = {}
    for s, three in legs.items():
        for k, leg in enumerate(three):
            if leg:
                at = before if early_last and k > 0 and s + k == last else after
                at.setdefault(min(s + k, last), []).append((s + k, s, leg))
    ops = []
    for j, slot in enumerate(slots, start=1):
        ops += slot[:-1]
        for _, _, leg in sorted(before.get(j, []), key=lambda t: t[:2]):
            ops += leg
        ops.append(slot[-1])
        for _, _, leg in sorted(after.get(j, []), key=lambda t: t[:2]):
            ops += leg
    return ops


def _home_waits(reduces: list[Op], egress: bool) -> list[Op]:
    """The waits for what reaches the host: the direct rows, and hop 1 (no egress) or hop 3."""
    last = 3 if egress else 1
    return [_wait(r) for r in reduces if r.hop in (0, last)]


def _forward_relay_sub_stages(S: int, branches: int, egress: bool) -> tuple[Op, ...]:
    """Relay transport with S sub-stages: every sub-stage's casts as their hops, all up front;
    sub-stage s after its own direct and fan-out rows; its reduce in legs (``_relay_reduce_legs``)
    overlapping the later sub-stages; the host merges its rows, then per sub-stage the direct
    rows and the relayed rows, s = 1..S (``fwd.merge``)."""
    _relay_check(S + 1, branches)
    casts = {s: _relay_cast("fwd.qo", egress=egress, stage=s) + _relay_cast("fwd.kv", egress=egress, stage=s)
             for s in range(1, S + 1)}
    ops = [c for s in casts for c in casts[s]] + [Op("fwd.attn.0", ATTN, COMPUTE, phase="fwd", stages=(0,))]
    slots, legs = [], {}
    for s in range(1, S + 1):
        waits = [_wait(c) for c in casts[s] if c.hop in (0, 2)]
        attn = Op(f"fwd.attn.{s}", ATTN, COMPUTE, deps=tuple(w.name for w in waits), phase="fwd", stages=(s,))
        slots.append(waits + [attn])
        legs[s] = _relay_reduce_legs("fwd.o", s, (attn.name,), egress)
    # the last attention hides the InfiniBand legs of the sub-stages before it (measured in the
    # simulator: the forward gains; the backward, whose last slot is the local stage, loses, so it
    # keeps every leg after its slot)
    ops += _place_legs(slots, legs, early_last=True)
    back = _home_waits([op for three in legs.values() for leg in three for op in leg if op.kind == REDUCE], egress)
    ops += back
    ops.append(Op("fwd.merge", MERGE, COMPUTE, deps=tuple(w.name for w in back), phase="fwd",
                  stages=tuple(range(S + 1))))
    return tuple(ops)


def _backward_relay_sub_stages(S: int, keep_forward_buffers: bool, egress: bool) -> tuple[Op, ...]:
    """The backward of ``_forward_relay_sub_stages``: dO, lse, delta (and Q, K, V again without kept
    buffers) cast per sub-stage as their hops, up front; after sub-stage s its dQ and dK / dV
    reduces in legs; the local stage 0 is the last compute slot (it hides the last legs)."""
    _relay_check(S + 1, 1)
    ops = [Op("bwd.delta", DELTA, COMPUTE, phase="bwd")]
    casts = {}
    for s in range(1, S + 1):
        casts[s] = _relay_cast("bwd.qo", deps=("bwd.delta",), egress=egress, stage=s)
        if not keep_forward_buffers:
            casts[s] += _relay_cast("bwd.kv", egress=egress, stage=s)
        ops += casts[s]
    slots, legs = [], {}
    for s in range(1, S + 1):
        waits = [_wait(c) for c in casts[s] if c.hop in (0, 2)]
        attn = Op(f"bwd.attn.{s}", ATTN, COMPUTE, deps=tuple(w.name for w in waits), phase="bwd", stages=(s,))
        slots.append(waits + [attn])
        dq, dkv = (_relay_reduce_legs(ph, s, (attn.name,), egress) for ph in ("bwd.dq", "bwd.dkv"))
        legs[s] = tuple(a + b for a, b in zip(dq, dkv))
    slots.append([Op("bwd.attn.0", ATTN, COMPUTE, phase="bwd", stages=(0,))])
    ops += _place_legs(slots, legs)
    back = _home_waits([op for three in legs.values() for leg in three for op in leg if op.kind == REDUCE], egress)
    ops += back
    ops.append(Op("bwd.merge", MERGE, COMPUTE, deps=tuple(w.name for w in back), phase="bwd",
                  stages=tuple(range(S + 1))))
    return tuple(ops)


def _relay_reduce(phase: str, deps, egress: bool = False) -> list[Op]:
    """A reduce as its hops: partials to the relays (hop 2, merged there), the direct rows back,
    then the relays' merged rows over InfiniBand (hop 1) and, with egress, from the egresses to
    the hosts (hop 3); the host merges direct, then its own NIC's rows, then its egresses'."""
    hop2 = _collective(REDUCE, phase, deps=deps, hop=2)
    merged = _wait(hop2)
    direct = _collective(REDUCE, phase, deps=deps)
    hop1 = _collective(REDUCE, phase, deps=(merged.name,), hop=1)
    ops = [hop2, merged, direct, hop1, _wait(direct), _wait(hop1)]
    if egress:
        pre = _collective(REDUCE, phase, deps=(ops[-1].name,), hop=3)
        ops += [pre, _wait(pre)]
    return ops


def _forward_relay_ops(num_stages: int, branches: int, egress: bool = False) -> tuple[Op, ...]:
    _relay_check(num_stages, branches)
    casts = _relay_cast("fwd.qo", egress=egress) + _relay_cast("fwd.kv", egress=egress)
    waits = [_wait(c) for c in casts if c.hop in (0, 2)]  # hops 3 and 1 are awaited by the next hop
    ops = casts + [Op("fwd.attn.0", ATTN, COMPUTE, phase="fwd", stages=(0,))] + waits
    ops.append(Op("fwd.attn.1", ATTN, COMPUTE, deps=tuple(w.name for w in waits), phase="fwd", stages=(1,)))
    ops.append(Op("fwd.merge", MERGE, COMPUTE, deps=("fwd.attn.0", "fwd.attn.1"), phase="fwd", stages=(0, 1)))
    ops += _relay_reduce("fwd.o", ("fwd.merge", "fwd.attn.0", "fwd.attn.1"), egress)
    return tuple(ops)


def _backward_relay_ops(num_stages: int, keep_forward_buffers: bool, egress: bool = False) -> tuple[Op, ...]:
    _relay_check(num_stages, 1)
    ops = [Op("bwd.delta", DELTA, COMPUTE, phase="bwd")]
    casts = _relay_cast("bwd.qo", deps=("bwd.delta",), egress=egress)
    if not keep_forward_buffers:
        casts += _relay_cast("bwd.kv", egress=egress)
    waits = [_wait(c) for c in casts if c.hop in (0, 2)]
    ops += casts + [Op("bwd.attn.0", ATTN, COMPUTE, phase="bwd", stages=(0,))] + waits
    ops.append(Op("bwd.attn.1", ATTN, COMPUTE, deps=tuple(w.name for w in waits), phase="bwd", stages=(1,)))
    for phase in ("bwd.dq", "bwd.dkv"):
        ops += _relay_reduce(phase, ("bwd.attn.0", "bwd.attn.1"), egress)
    return tuple(ops)


def _check(num_stages: int, branches: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
        raise ValueError(f"branches must be an int >= 1, got {branches!r}")


def row_bytes(op: Op, cost) -> int:
    """Bytes of one row of ``op``'s collective, priced by ``cost`` (a ``CommCost``)."""
    branches = getattr(cost, "branches", 1)
    table = {"fwd.qo": cost.q_fwd, "fwd.kv": cost.kv_fwd, "fwd.o": cost.o_fwd // branches,
             "bwd.qo": cost.q_bwd, "bwd.kv": cost.kv_fwd, "bwd.dq": cost.dq_bwd, "bwd.dkv": cost.dkv_bwd}
    if op.phase not in table:
        raise ValueError(f"op {op.name!r} is not a collective (phase {op.phase!r})")
    return int(table[op.phase])


def kv_split_of(plan) -> torch.Tensor:
    """The KV split matrix that really moves: the key blocks' when a sparse plan has them."""
    kb = getattr(plan, "kv_blocks", None)
    return plan.comm.kv_split if kb is None else kb.kv_split


def op_split(plan, op: Op) -> torch.Tensor:
    """[P(src), P(dst)] int64 rows the collective ``op`` moves host -> helper (before ``back``)."""
    comm = plan.comm
    relay = getattr(plan, "relay", None)
    if relay is not None:  # one hop of relay transport (of one sub-stage's cast or reduce)
        stage = op.stages[0] if getattr(relay, "num_stages", 1) > 1 else 1
        return relay.stage(op.route, stage, "return" if op.back else "cast").split(op.hop)
    if op.hop:
        raise ValueError(f"op {op.name!r} is hop {op.hop} of relay transport but the plan has no relay")
    if getattr(comm, "num_stages", 1) > 1:  # one sub-stage's split
        (s,) = op.stages
        kb = getattr(plan, "kv_blocks", None)
        if op.route == "kv" and kb is not None:  # a sparse plan's key blocks, routed per sub-stage
            comm = kb.staged
        return comm.stage_split(op.route, "return" if op.back else "cast")[s - 1]
    return comm.qo_split if op.route == "qo" else kv_split_of(plan)


def tail_first_row(plan, op: Op, kept_rows) -> int | torch.Tensor:
    """The first row of ``op``'s own cast (a ``bwd.kv`` or ``bwd.qo`` cast of a partly kept
    buffer of its route) that lies past the ``kept_rows`` kept rows of the receive buffer (an int,
    or ``[P]`` per destination): ``kept_rows`` with one remote stage; with S sub-stages ``[P]``
    per destination, ``max(kept_rows - stage_base(route)[s], 0)``, as cast s's rows start at that
    row of the buffer the casts share (``runtime.kept_rows``)."""
    comm = plan.comm
    if getattr(plan, "relay", None) is not None or getattr(comm, "num_stages", 1) == 1:
        return kept_rows
    kb = getattr(plan, "kv_blocks", None)
    if op.route == "kv" and kb is not None:  # a sparse plan's key blocks, routed per sub-stage
        comm = kb.staged
    (s,) = op.stages
    return (kept_rows - comm.stage_base(op.route)[s - 1]).clamp(min=0)


def kept_rows_of(cost, route: str, plan=None) -> int | torch.Tensor | None:
    """The rows of ``route``'s receive buffer a ``cost`` keeps when it keeps that kind in part
    (``kept_q_rows`` / ``kept_kv_rows``), else None (kept whole, or not at all). With
    ``cost.kept_per_rank`` each rank's own (``[P]``, from ``plan``'s fills, ``split_kept_room``)."""
    if route not in kept_kinds(cost.keep_forward_buffers):
        return None
    if getattr(cost, "kept_per_rank", False):
        if plan is None:
            raise ValueError("kept_rows_of: a cost with kept_per_rank=True needs the plan (its fills)")
        comm = plan.comm
        room = room_size(cost.kept_q_rows, cost.kept_kv_rows, cost.q_fwd, cost.kv_fwd, comm.qo_recv_capacity,
                         comm.kv_recv_capacity)
        kept_q, kept_kv = split_kept_room(comm.qo_recv_rows.long(), comm.kv_recv_rows.long(), room, cost.q_fwd,
                                          cost.kv_fwd)
        return kept_q if route == "qo" else kept_kv
    return getattr(cost, "kept_q_rows" if route == "qo" else "kept_kv_rows", None)


def op_pair_bytes(plan, op: Op, cost) -> torch.Tensor:
    """[P(src), P(dst)] int64 bytes ``op`` moves from each source to each destination. A ``bwd.kv``
    cast of a partly kept KV buffer moves only the rows past ``cost.kept_kv_rows``; a ``bwd.qo``
    cast with a partly kept QO buffer moves dO, lse and delta of every row and Q of the rows past
    ``cost.kept_q_rows``; per sub-stage the rows of its cast past them (``tail_first_row``)."""
    split = op_split(plan, op)
    kept_rows = kept_rows_of(cost, op.route, plan) if op.phase in ("bwd.kv", "bwd.qo") else None
    tail = None if kept_rows is None else tail_split(split, tail_first_row(plan, op, kept_rows))
    if op.phase == "bwd.qo" and tail is not None:  # Q of the tail rows travels again beside dO
        return split.to(torch.int64) * row_bytes(op, cost) + tail.to(torch.int64) * int(cost.q_fwd)
    split = split if tail is None else tail
    split = split.t() if op.back else split
    return split.to(torch.int64) * row_bytes(op, cost)


def plan_ops(plan, phase: str, keep_forward_buffers, kept_kv_rows: int | None = None) -> tuple[Op, ...]:
    """The forward or backward op list a plan runs (its stage count and branches).

    keep_forward_buffers: True, False, "qo" or "kv"; K and V are cast again (``bwd.kv``) unless
    "kv" is kept whole (Q travels again inside ``bwd.qo``, priced by ``CommCost.q_bwd``);
    kept_kv_rows: only that many KV rows kept, the rest cast again (``bwd.kv`` moves the tail)."""
    calc = getattr(plan, "calc", None)  # a sparse plan's is its window branch's, or None
    num_stages = calc.q_ranges.shape[1] if calc is not None else getattr(plan.comm, "num_stages", 1) + 1
    meta = getattr(plan, "relay", None)
    relay, egress = meta is not None, bool(getattr(meta, "egress", False))
    if phase == "fwd":
        branches = 2 if getattr(getattr(plan, "spec", None), "window_size", 0) else 1
        return forward_ops(num_stages, branches, relay, egress)
    return backward_ops(num_stages, "kv" in kept_kinds(keep_forward_buffers) and kept_kv_rows is None, relay,
                        egress)


def pair_bytes(plan, phase: str, cost, stage: int | None = None, hop: int | None = None) -> torch.Tensor:
    """[P(src), P(dst)] int64 bytes a layer moves from source to destination.

    phase: "fwd" or "bwd" (every collective of that pass), or one collective's phase
    (``"fwd.qo"``, ``"fwd.kv"``, ``"fwd.o"``, ``"bwd.qo"``, ``"bwd.kv"``, ``"bwd.dq"``, ``"bwd.dkv"``).
    cost: the ``CommCost`` pricing a row (its ``keep_forward_buffers`` decides ``bwd.kv``).
    stage: None for every sub-stage; s in 1..S for the collectives of sub-stage s alone
        (with one remote stage, s = 1 is all of them).
    hop: None for every hop; 0, 1, 2 or 3 for one hop of relay transport (``Op.hop``).
    """
    if cost is None:
        raise ValueError("pair_bytes needs the plan's CommCost (the plan was built without one: pass cost=)")
    if phase not in ("fwd", "bwd") and phase not in PHASES:
        raise ValueError(f"phase must be 'fwd', 'bwd' or one of {sorted(PHASES)}, got {phase!r}")
    P = plan.comm.cp_size
    total = torch.zeros(P, P, dtype=torch.int64, device=plan.comm.qo_split.device)
    S = getattr(plan.comm, "num_stages", 1)
    if stage is not None and not (isinstance(stage, int) and 1 <= stage <= S):
        raise ValueError(f"stage must be None or an int in [1, {S}], got {stage!r}")
    if hop is not None and (isinstance(hop, bool) or hop not in (0, 1, 2, 3)):
        raise ValueError(f"hop must be None, 0 (direct), 1 (InfiniBand), 2 (NVLink fan-out) or 3 (NVLink "
                         f"pre-hop to the egress), got {hop!r}")
    for op in plan_ops(plan, phase.split(".")[0], cost.keep_forward_buffers, kept_rows_of(cost, "kv", plan)):
        if stage is not None and S > 1 and op.stages != (stage,):
            continue
        if hop is not None and op.hop != hop:
            continue
        if op.collective and (op.phase == phase or op.phase.startswith(phase + ".")):
            total = total + op_pair_bytes(plan, op, cost)
    return total


def task_stage(plan) -> torch.Tensor:
    """[G, U, U] int32: -1 for an empty task, 0 when both its units are on its rank, else its
    remote sub-stage 1..S (1 for every remote task of a plan without sub-stages)."""
    own = getattr(plan, "stage_of_task", None)
    if own is not None:
        return own
    a = plan.assignment.long()
    G, U, _ = a.shape
    P = plan.comm.cp_size
    host = plan.comm.unit_host()
    r = a.clamp(0, P - 1)
    remote = (host.view(1, U, 1) != r) | (host.view(1, 1, U) != r)
    empty = (a < 0) | (a >= P) | (plan.area <= 0)
    return torch.where(empty, -1, remote.to(torch.int32)).to(torch.int32)


def stage_area(plan, num_stages: int = 2) -> torch.Tensor:
    """[P, num_stages] int64: valid (q, k) entries per head group each rank computes in each stage."""
    P = plan.comm.cp_size
    st = task_stage(plan).long()
    a = plan.assignment.long().clamp(0, P - 1)
    key = torch.where(st >= 0, a * num_stages + st.clamp(max=num_stages - 1), P * num_stages).reshape(-1)
    area = torch.where(st >= 0, plan.area.long(), 0).reshape(-1)
    out = torch.zeros(P * num_stages + 1, dtype=torch.int64, device=area.device).scatter_add_(0, key, area)
    return out[:-1].view(P, num_stages)


for _branches in (1, 2):
    forward_ops(2, _branches)
for _egress in (False, True):
    forward_ops(2, 1, relay=True, egress=_egress)
for _keep in (True, False):
    backward_ops(2, _keep)
    for _egress in (False, True):
        backward_ops(2, _keep, relay=True, egress=_egress)
