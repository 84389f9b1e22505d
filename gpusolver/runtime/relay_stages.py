"""The executor of a relay plan with S > 1 sub-stages (``Plan.relay.num_stages`` = S).

Shape legend: P ranks, n = G * c local group-major rows, ``cap`` a kind's receive rows,
``relay_cap`` / ``egress_cap`` its relay / egress buffer rows (``gpusolver.plan.relay``).
Per-rank tensors carry a leading ``[P]`` on a ``LocalGroup`` (``batched``).

It runs ``schedule.forward_ops(S + 1, relay=True)`` / ``backward_ops`` op by op: the sub-stages
of ``runtime.pipelined`` (operands ``X = [local rows | receive buffer]``, the casts' rows at
their own rows of it, every cast up front, each sub-stage waiting only for its own, a reduce per
sub-stage) with every cast and reduce as the hops of ``runtime.relayed``:

- cast s of a kind is its hops (3, 1, 0, 2) on sub-stage s's route (``RelayMeta.stage``). Each
  hop receives into one buffer per (pass, kind, hop) shared by the S casts, at the rows casts
  1..s-1 left (``recv_offset``): the direct, fan-out, relay and egress buffers cost what one
  cast's do. Once cast s's direct and fan-out rows are in, its rows are gathered into X at
  ``CommMeta.stage_base`` (the layout CalcMeta reads), out of ``concat(direct, fan-out, relay)``;
- reduce s takes sub-stage s's partials in reduce s's layout (``CommMeta.return_gather``) and
  returns them by the hops of reduce s's route in three legs (``schedule._relay_reduce_legs``):
  hop 2 to the relays (merged there onto the relay's own) and hop 0 home, then hop 1 (onto
  identity rows, the egresses' slots too), then hop 3 home. Each leg's result starts from a
  neutral accumulator, so no leg waits for another's on its way home; the host merges its own
  rows, then per sub-stage its direct rows and its relayed rows, s = 1..S: a fixed order, so the
  result is deterministic (the log-sum-exp merge and the sums are associative).
  The waits of the relays' and egresses' merges are on the schedule's comm stream
  (``schedule._relay_reduce_legs``): on CUDA they, and the hop each feeds, run on a side stream
  (``_CommSide``), so the compute stream never waits for a hop it does not read.

Host reads: none with ``LocalGroup``; with ``TorchGroup`` every hop's ``[P, P]`` split of every
sub-stage and the layout's cast splits, stacked and copied once without blocking (``host_splits``),
and each shared buffer's start row on this rank summed from that copy (``pipelined.RankFill`` of the casts before it).
There every buffer a cast lands in (each hop's, the egress rows) and X's receive rows, with the
running out and the fp32 sums over them, hold the rows this rank receives (its fill), not the
capacity (``StageRelayRoutes.rows``, ``hop_buffer_rows``), as ``pipelined.receive_rows`` does; and
each reduce's gathered partials, and each reduce hop's, the rows this rank returns in it
(``StageRelayRoutes.gather``, ``_StageHops._received``).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from attn_kernels import flex_attn, row_delta
from gpusolver.nvtx import nvtx_range
from gpusolver.plan.relay import assemble_index, hop_send_index, inverse_index, shifted
from gpusolver.plan.schedule import (ATTN, CAST, COMM, DELTA, MERGE, REDUCE, WAIT, backward_ops, forward_ops,
                                     hop_phase)
from gpusolver.runtime.operands import Operands, rows
from gpusolver.runtime.per_rank import per_rank
from gpusolver.runtime.pipelined import (KINDS, WHICH, RankFill, _flex_backward_into, _gather_remote,
                                         _merge_into, _slices, at_fill, merge_gradients, merge_rows_into, op_range,
                                         received_rows, stage_phase)
from gpusolver.runtime.relayed import _assemble_into, _identity, _take
from groupcomm import TorchGroup, group_cast, group_reduce, host_splits

_INTERNAL = dict(validate=False, flag_errors=False)


@dataclass(frozen=True)
class HopRoutes:
    """One kind's cast or reduce of one sub-stage, for the ranks run here.

    index / split / host: per hop (0, 1, 2[, 3]) the send list, the ``[P, P]`` split and its host
    copy (``TorchGroup``) or None. start / host_start (casts): per hop the ``[P]`` first row of the
    shared receiving buffer (and this rank's, as a ``RankFill`` of the casts before it). assemble (casts): ``[.., cap]``
    rows of ``concat(direct, fan-out, relay)`` that make X's receive rows of this cast (-1 elsewhere).
    back (reduces): (direct, fan-out, relay) ``[.., rows]`` rows of the reduce's buffer each holds.
    """

    index: tuple
    split: tuple
    host: tuple
    start: tuple = ()
    host_start: tuple = ()
    assemble: torch.Tensor | None = None
    back: tuple | None = None


@dataclass(frozen=True)
class StageRelayRoutes:
    """Every sub-stage's hops: ``routes[(kind, which)][s - 1]`` a ``HopRoutes``; ``gather_rows[kind][s - 1]``
    the rows of X's receive part that make reduce s's buffer (all; ``gather(kind, s)``: what this rank
    returns); ``caps[kind]`` = (receive, relay,
    egress) rows."""

    num_stages: int
    egress: bool
    routes: dict
    gather_rows: dict
    caps: dict
    recv_rows: dict = None  # kind -> this rank's rows of X's receive part (``TorchGroup``), else None
    hop_rows: dict = None   # (kind, hop) -> this rank's rows of a cast hop's buffer (``TorchGroup``), else None
    back_rows: dict = None  # kind -> S: the rows this rank returns in each reduce (``TorchGroup``), else None
    sub_stages: bool = True  # ``dist_attn``: X-shaped operands, as ``pipelined``
    host_parts: tuple | None = None  # the host copies of the splits (``TorchGroup``), for a rebuild

    def rows(self, kind: str) -> int:
        """Rows of ``kind``'s receive part of X here (``pipelined.receive_rows``): the plan's capacity,
        or on ``TorchGroup`` this rank's fill, at most the capacity."""
        return at_fill(self.caps[kind][0], self.recv_rows[kind] if self.recv_rows else None)

    def hop_buffer_rows(self, kind: str, hop: int) -> int:
        """Rows of the buffer cast hop ``hop`` of ``kind`` lands in here (hop 3: its egress rows):
        its capacity, or on ``TorchGroup`` the rows all S casts bring this rank, at most it."""
        cap, rcap, ecap = self.caps[kind]
        return at_fill({1: rcap, 3: ecap}.get(hop, cap), self.hop_rows.get((kind, hop)) if self.hop_rows else None)

    def gather(self, kind: str, stage: int) -> torch.Tensor:
        """The rows of X's receive part that make reduce ``stage``'s buffer (``CommMeta.return_gather``):
        on ``TorchGroup`` only those this rank returns in it (the first), else all, -1 past the fill."""
        g = self.gather_rows[kind][stage - 1]
        if not self.back_rows:
            return g
        return g.narrow(0, 0, min(self.back_rows[kind][stage - 1].get(), g.shape[0]))


def stage_relay_routes(plan, group, ranks: tuple[int, ...], batched: bool,
                       host_parts: tuple | None = None) -> StageRelayRoutes:
    """The hops of every sub-stage of ``plan`` for the ranks run here (sync-free; on ``TorchGroup``
    it starts the one non-blocking copy of all the split matrices, unless ``host_parts`` gives an
    earlier routing's: a backward builds its tables again, not the copy)."""
    comm, relay = plan.comm, plan.relay
    S, egress = relay.num_stages, bool(relay.egress)
    hops = (0, 1, 2, 3) if egress else (0, 1, 2)
    keys = [(k, w) for k in KINDS for w in WHICH]
    splits = {(k, w): [[relay.stage(k, s, w).split(h) for h in hops] for s in range(1, S + 1)] for k, w in keys}
    recv_rows = hop_rows = back_rows = parts = None
    if host_parts is not None:
        parts = list(host_parts)
    elif isinstance(group, TorchGroup):
        # one non-blocking copy: every hop's splits, then the layout's cast and return splits (the rows
        # of X's receive part per kind, and of each reduce's buffer)
        layout = [comm.stage_split(k, w)[s] for k in KINDS for w in WHICH for s in range(S)]
        parts = host_splits(torch.stack([m for key in keys for per in splits[key] for m in per] + layout)).parts()
    if parts is not None:
        H = len(hops)
        hosts = {key: [parts[(b * S + i) * H:(b * S + i + 1) * H] for i in range(S)] for b, key in enumerate(keys)}
        base = len(keys) * S * H
        lay = {key: parts[base + b * S:base + (b + 1) * S] for b, key in enumerate(keys)}
        recv_rows = {k: RankFill(lay[k, "cast"], ranks[0]) for k in KINDS}
        back_rows = {k: [RankFill(lay[k, "return"][s - 1:s], ranks[0]) for s in range(1, S + 1)] for k in KINDS}
        hop_rows = {(k, h): RankFill([hosts[k, "cast"][i][j] for i in range(S)], ranks[0])
                    for k in KINDS for j, h in enumerate(hops)}
    else:
        hosts = {key: [[None] * len(hops) for _ in range(S)] for key in keys}

    def stack(fn):
        return torch.stack([fn(r) for r in ranks]) if batched else fn(ranks[0])

    routes, caps, gather = {}, {}, {}
    for k, w in keys:
        cap = comm.buffers.recv(k)
        per = []
        for s in range(1, S + 1):
            route = relay.stage(k, s, w)
            caps[k] = (cap, route.relay_capacity, route.egress_capacity)
            index = tuple(stack(lambda r, h=h: hop_send_index(comm, route, k, h, r)) for h in hops)
            kw = {}
            if w == "cast":
                earlier = splits[k, w][:s - 1]
                kw["start"] = tuple(sum((e[i].sum(0) for e in earlier), torch.zeros_like(comm.qo_recv_rows))
                                    for i in range(len(hops)))
                kw["host_start"] = tuple(
                    RankFill([hosts[k, w][j][i] for j in range(s - 1)], ranks[0]) if hosts[k, w][0][i] is not None
                    else None for i in range(len(hops)))
                base = comm.stage_base(k)[s - 1]
                kw["assemble"] = stack(lambda r: shifted(assemble_index(comm, route, k, r), base[r]))
            else:
                inv = stack(lambda r: inverse_index(assemble_index(comm, route, k, r), 2 * cap + route.relay_capacity))
                kw["back"] = (inv[..., :cap], inv[..., cap:2 * cap], inv[..., 2 * cap:])
            per.append(HopRoutes(index=index, split=tuple(splits[k, w][s - 1]), host=tuple(hosts[k, w][s - 1]), **kw))
        routes[k, w] = per
    for k in KINDS:
        gather[k] = list(stack(lambda r: comm.return_gather(k, r)).unbind(1 if batched else 0))
    return StageRelayRoutes(num_stages=S, egress=egress, routes=routes, gather_rows=gather, caps=caps,
                            recv_rows=recv_rows, hop_rows=hop_rows, back_rows=back_rows,
                            host_parts=None if parts is None else tuple(parts))


_SIDE_STREAMS: dict = {}


class _CommSide:
    """Where a pass runs its comm-stream waits (a relay's or an egress's merge of a hop's partials)
    and the hop each feeds: on CUDA a side stream, so the compute stream goes on with the next
    sub-stage while the relay waits for its node's partials (the schedule's comm stream, which the
    simulator prices); off CUDA, under ``torch.compile`` or on meta, inline (nothing to overlap).

    Every tensor the side stream reads that the compute stream made, and every collective's work
    it waits on, is kept until ``join`` (before the pass's final merge), where the compute stream
    waits for the side stream: a block the caching allocator hands back is then never written by
    the compute stream while the side stream may still read it.
    """

    def __init__(self, like: torch.Tensor):
        self.stream = None
        if like.device.type == "cuda" and not torch.compiler.is_compiling():
            self.stream = _SIDE_STREAMS.get(like.device)
            if self.stream is None:
                self.stream = _SIDE_STREAMS[like.device] = torch.cuda.Stream(like.device)
        self.kept: list = []

    def on(self, side: bool):
        """A context that runs its block on the side stream when ``side`` (after what the compute
        stream has queued), else where it is."""
        if self.stream is None or not side:
            return nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return torch.cuda.stream(self.stream)

    def keep(self, *objs) -> None:
        if self.stream is not None:
            self.kept.extend(objs)

    def sync(self) -> None:
        """The compute stream waits for what the side stream has queued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def join(self) -> None:
        self.sync()
        self.kept.clear()


def _label(op) -> str:
    """The byte counter of one hop of one sub-stage's collective: ``"fwd.kv.2:hop1"``."""
    return hop_phase(stage_phase(op.phase, op.stages[0]), op.hop)


class _StageHops:
    """One pass's relayed collectives: works, the shared receiving buffers, reduce legs' results."""

    def __init__(self, sr: StageRelayRoutes, group, batched: bool, deterministic: bool, like: torch.Tensor,
                 ops):
        self.sr, self.group, self.batched, self.det = sr, group, batched, deterministic
        self.lead = 1 if batched else 0
        self.works, self.bufs, self.landed, self.merged, self.at_egress = {}, {}, {}, {}, {}
        self.in_place: set = set()  # the reduce hops issued into the host's rows (``home_in_place``)
        self.side = _CommSide(like)
        # the comm-stream waits, and the collectives whose inputs they merge: both on the side stream
        self.on_comm = {op.name for op in ops if op.kind == WAIT and op.stream == COMM}
        self.fed = {op.name for op in ops if op.kind == REDUCE and set(op.deps) & self.on_comm}
        self.merged_on_side = {op.deps[0] for op in ops if op.name in self.on_comm}

    def _buffers(self, op, tensors) -> dict:
        """The shared buffers of ``op``'s pass and kind (allocated at its first cast): per hop one
        buffer per tensor; hop 3's is ``[local rows | egress rows]`` (hop 1 reads both)."""
        key = op.phase
        if key not in self.bufs:
            rows_of = lambda hop: self.sr.hop_buffer_rows(op.route, hop)  # noqa: E731

            def empty(rows_):
                out = []
                for t in tensors:
                    shape = list(t.shape)
                    shape[self.lead] = rows_
                    out.append(t.new_zeros(shape))
                return out

            self.bufs[key] = {0: empty(rows_of(0)), 2: empty(rows_of(2)), 1: empty(rows_of(1))}
            if self.sr.egress:
                self.bufs[key][3] = Operands(list(tensors), rows_of(3), self.lead, zero=True)
        return self.bufs[key]

    def cast(self, op, tensors) -> None:
        """Issue one hop of a cast. A hop that forwards what an earlier hop brought (2, and 1 with
        egress) waits for it on the side stream: in the schedule that dependency is the comm
        stream's alone, and the compute stream goes on (stage 0 runs while the casts fly)."""
        bufs = self._buffers(op, tensors)
        forwards = op.hop == 2 or (op.hop == 1 and self.sr.egress)
        with self.side.on(forwards):
            if forwards:  # the hop it forwards: waited once, here (kept for the side stream until join)
                work = self.works.pop(op.deps[0])
                self.side.keep(work)
                work.wait()
                # hop 1 reads the local rows, then the egress rows hop 3 brought; hop 2 the relay buffer
                tensors = bufs[3].x if op.hop == 1 else bufs[1]
            self._cast(op, tensors, bufs)

    def _cast(self, op, tensors, bufs) -> None:
        (s,) = op.stages
        hr = self.sr.routes[op.route, "cast"][s - 1]
        i = op.hop
        out = bufs[3].remote() if op.hop == 3 else bufs[op.hop]
        self.works[op.name] = group_cast(list(tensors), hr.index[i], hr.split[i], out[0].shape[self.lead], self.group,
                                         phase=_label(op), host_split=hr.host[i], async_op=True, flag_errors=False,
                                         out=list(out), recv_offset=hr.start[i], host_recv_offset=hr.host_start[i])

    def wait_cast(self, op, into: list[torch.Tensor]) -> None:
        """Wait for a direct or fan-out hop; once both of cast s are in, gather its rows into X. The
        fan-out hop (2) was issued on the side stream: a group whose work is done when issued (no
        handle the compute stream can wait on, unlike ``TorchGroup``'s) has the compute stream wait
        for the side stream here, before it reads the fan-out rows."""
        self.works.pop(op.deps[0]).wait()  # waited once: its result (the hop buffers) is not held here
        if op.hop == 2 and not isinstance(self.group, TorchGroup):
            self.side.sync()
        (s,) = op.stages
        key = (op.phase, s)
        self.landed[key] = self.landed.get(key, 0) + 1
        if self.landed[key] < 2:
            return
        idx = self.sr.routes[op.route, "cast"][s - 1].assemble
        idx = idx.narrow(self.lead, 0, into[0].shape[self.lead])  # X's rows (past them: -1, the fill's end)
        bufs = self.bufs[op.phase]
        cap, rcap, _ = self.sr.caps[op.route]
        for x, d, f, r in zip(into, bufs[0], bufs[2], bufs[1]):
            _assemble_into(x, (d, f, r), idx, self.lead, sizes=(cap, cap, rcap))
        if s == self.sr.num_stages:  # every cast of the kind is in X now: its hop buffers go (the
            del self.bufs[op.phase]  # side stream's reads of them are behind this wait, see above)

    def home_in_place(self, op) -> bool:
        """Whether hop ``op`` reduces straight into the host's running rows (``group_reduce(inplace=
        True)``), so no returned result is held until the home waits at the end of the pass: the direct
        hop 0 always (issued on the compute stream, in its order), the relayed rows' hop 1 (no egress)
        where its merge also runs in the compute stream's order: with no side stream, or on a
        ``TorchGroup`` (which merges in ``wait()``, on the compute stream). Elsewhere hop 1 is issued
        on the side stream and a merge at issue would race the sub-stages merging into the same rows:
        it returns its rows, merged at their wait."""
        if op.hop == 0:
            return True
        return op.hop == 1 and not self.sr.egress and (self.side.stream is None or isinstance(self.group, TorchGroup))

    def reduce(self, op, full, neutral, red: str, fills, host) -> None:
        """``full``: sub-stage s's partials in reduce s's layout; ``neutral``: the host's identity rows;
        ``host``: the host's rows of the running accumulators (fp32), which a hop home reduces into in
        place where ``home_in_place``. A hop fed by a comm-stream merge (1, 3) is taken and issued on
        the side stream."""
        fed = op.name in self.fed
        if fed:  # read on the side stream: the identity rows it clones, or the host's rows it merges into
            self.side.keep(*(host if self.home_in_place(op) else neutral))
        with self.side.on(fed):
            self._reduce(op, full, neutral, red, fills, host)

    def _reduce(self, op, full, neutral, red: str, fills, host) -> None:
        (s,) = op.stages
        hr = self.sr.routes[op.route, "return"][s - 1]
        cap, rcap, ecap = self.sr.caps[op.route]

        def take(which: int, hop: int):  # rows of the hop's buffer layout; on TorchGroup those it returns
            back, got = hr.back[which], self._received(hr, hop)
            if got is not None:
                back = back.narrow(-1, 0, min(got, back.shape[-1]))
            return [_take(p, back, f, self.batched) for p, f in zip(full, fills)]

        key = (op.phase, s)
        inplace = self.home_in_place(op)
        if inplace:
            self.in_place.add(op.name)
        if op.hop == 2:  # onto the relay's own partial of each relayed row (those it fanned out), sources ascending
            partials, acc = take(1, 2), take(2, 1)
        elif op.hop == 0:
            partials, acc = take(0, 0), (list(host) if inplace else [t.clone() for t in neutral])
        elif op.hop == 1:  # the relays' merged rows onto the host's rows or identity rows (an egress's slots too)
            partials, acc = self.merged.pop(key), (list(host) if inplace else [t.clone() for t in neutral])
            if self.sr.egress:
                acc = [torch.cat((a, _identity(a, ecap, f, self.lead)), dim=self.lead) for a, f in zip(acc, fills)]
        else:  # hop 3: an egress's merged slots home, onto the host's rows from its own NIC
            res = self.at_egress.pop(key)
            n = res[0].shape[self.lead] - ecap
            got = self._received(hr, 3)
            acc = [x.narrow(self.lead, 0, n) for x in res]
            partials = [x.narrow(self.lead, n, ecap if got is None else min(got, ecap)).contiguous() for x in res]
        i = op.hop
        if op.name in self.merged_on_side:  # its accumulator is merged into on the side stream
            self.side.keep(*acc)
        # on TorchGroup the partials hold the rows this rank returns, below the hop's capacity
        hop_cap = {1: rcap, 3: ecap}.get(i, cap)
        extra = {} if partials[0].shape[self.lead] == hop_cap else {"recv_capacity": hop_cap}
        self.works[op.name] = group_reduce(list(partials), hr.index[i], hr.split[i], list(acc), self.group, op=red,
                                           phase=_label(op), host_split=hr.host[i], deterministic=self.det,
                                           async_op=True, flag_errors=False, inplace=inplace, **extra)

    def _received(self, hr: HopRoutes, hop: int) -> int | None:
        """The rows this rank received in cast hop ``hop`` of route ``hr``, what the reduce reversing it
        returns, from the host copy of the splits (``TorchGroup``); None elsewhere (whole buffers)."""
        host = hr.host[hop]
        return None if host is None else received_rows(host, self.group.rank)

    def wait_reduce(self, op):
        """Wait for one hop of a reduce: its result when the hop ends at the host (hop 0, or the last
        hop home) and was not reduced in place, which the caller merges into its running rows at once;
        else None (in place, or kept here for the next hop)."""
        work = self.works.pop(op.deps[0])
        side = op.name in self.on_comm
        if side:
            self.side.keep(work)
        with self.side.on(side):
            res = work.wait()
        key = (op.phase, op.stages[0])
        if op.hop == 2:
            self.merged[key] = res
        elif op.hop == 1 and self.sr.egress:
            self.at_egress[key] = res
        elif op.deps[0] not in self.in_place:  # hop 0, or the last hop home (1 without an egress, else 3)
            return res
        return None

    @staticmethod
    def partial_uses(ops) -> dict:
        """(phase, s) -> how many reduce hops read sub-stage s's gathered partials (hop 2 and the direct
        hop 0): the gathered rows are dropped once the last has taken its rows."""
        uses: dict = {}
        for op in ops:
            if op.kind == REDUCE and op.hop in (0, 2):
                key = (op.phase, op.stages[0])
                uses[key] = uses.get(key, 0) + 1
        return uses


def _drop_after_last_use(full: dict, uses: dict, key, op) -> None:
    """Count one read of the gathered partials ``full[key]`` (key: (phase, sub-stage)) by ``op``
    (hops 2 and 0 read them, each taking its own copy of its rows); after the last, drop them: a
    sub-stage's partials are not held through the later sub-stages."""
    if op.hop not in (0, 2):
        return
    uses[key] -= 1
    if uses[key] == 0:
        del full[key]


def relay_stages_forward(plan, group, ranks, batched: bool, sr: StageRelayRoutes, ql, kl, vl, scale: float,
                         deterministic: bool):
    """Run ``forward_ops(S + 1, relay=True)``: (o, lse, [Xq, Xk, Xv]) group-major, as ``pipelined``."""
    lead = 1 if batched else 0
    S = sr.num_stages
    cap_q, cap_k = sr.rows("qo"), sr.rows("kv")
    n = ql.shape[lead]
    sent = {"qo": (ql,), "kv": (kl, vl)}
    X = {"qo": Operands([ql], cap_q, lead, zero=True), "kv": Operands([kl, vl], cap_k, lead, zero=True)}
    ops = forward_ops(S + 1, relay=True, egress=sr.egress)
    hops = _StageHops(sr, group, batched, deterministic, ql, ops)
    uses = hops.partial_uses(ops)
    acc = dtypes = None
    full = {}
    for op in ops:
        with nvtx_range(op_range(op, sub_stages=True)):
            if op.kind == CAST:
                hops.cast(op, sent[op.route])
            elif op.kind == WAIT and op.back:
                home = hops.wait_reduce(op)
                if home is not None:  # merged into the host's running rows now, not held to the end
                    merge_rows_into(*(rows(t, lead, 0, n) for t in acc.x), *home, lead)
                    del home
            elif op.kind == WAIT:
                hops.wait_cast(op, X[op.route].remote())
            elif op.kind == ATTN and op.stages == (0,):
                o0, l0 = per_rank(ranks, batched, lambda r, q_, k_, v_: flex_attn(
                    q_, k_, v_, *_slices(plan, r, 0), scale, **_INTERNAL), ql, kl, vl)
                dtypes = (o0.dtype, l0.dtype)
                # running (out fp32, lse) of X's rows, converted as copied in: stage 0's out goes now
                acc = Operands([o0, l0], cap_q, lead, zero=True, dtype=torch.float32)
                acc.remote()[1].fill_(float("-inf"))
                del o0, l0
            elif op.kind == ATTN:
                (s,) = op.stages
                o_s, l_s = per_rank(ranks, batched, lambda r, q_, k_, v_: flex_attn(
                    q_, k_, v_, *_slices(plan, r, s), scale, **_INTERNAL), *X["qo"].x, *X["kv"].x)
                _merge_into(acc, o_s, l_s, lead)
                del o_s, l_s  # merged: a stage's out is as large as X, never held through the next
            elif op.kind == REDUCE:
                (s,) = op.stages
                key = (op.phase, s)
                if op.hop in (0, 2) and key not in full:  # sub-stage s's partials in reduce s's layout, once
                    full[key] = [_gather_remote(t, sr.gather("qo", s), n, lead, d)
                                 for t, d in zip(acc.x, dtypes)]
                h_o, h_l = (rows(t, lead, 0, n) for t in acc.x)
                neutral = (torch.zeros(h_o.shape, dtype=dtypes[0], device=h_o.device),
                           torch.full(h_l.shape, float("-inf"), dtype=dtypes[1], device=h_l.device))
                hops.reduce(op, full.get(key), neutral, "lse", (0.0, float("-inf")),
                            [rows(t, lead, 0, n) for t in acc.x])
                _drop_after_last_use(full, uses, key, op)
            elif op.kind == MERGE:  # every return is merged into the host's rows: they are the output
                hops.side.join()
                o, lse = (rows(t, lead, 0, n) for t in acc.x)
            else:
                raise AssertionError(f"relay sub-stages cannot run forward op {op}")
    return o.to(dtypes[0]).contiguous(), lse.contiguous(), X["qo"].x + X["kv"].x


def relay_stages_backward(plan, group, ranks, batched: bool, sr: StageRelayRoutes, ql, kl, vl, o, lse, kept_q,
                          kept_kv, d_o, d_l, scale: float, deterministic: bool):
    """Run ``backward_ops(S + 1, relay=True)``: (dq, dk, dv) group-major. ``kept_q`` / ``kept_kv``:
    the forward's Xq / [Xk, Xv], or None (cast again), as ``pipelined.backward_stages``."""
    lead = 1 if batched else 0
    S = sr.num_stages
    cap_q, cap_k = sr.rows("qo"), sr.rows("kv")
    n = ql.shape[lead]
    Xq = Operands([ql], cap_q, lead, zero=True) if kept_q is None else None
    Xkv = Operands([kl, vl], cap_k, lead, zero=True) if kept_kv is None else None
    xq = [kept_q] if kept_q is not None else Xq.x
    xk, xv = kept_kv if kept_kv is not None else Xkv.x
    # fp32 sums over X's rows; each stage's kernel adds its share into them itself (``_flex_backward_into``)
    grads_q = Operands.zeros([ql], cap_q, lead, torch.float32)
    grads_kv = Operands.zeros([kl, vl], cap_k, lead, torch.float32)
    ops = backward_ops(S + 1, kept_kv is not None, relay=True, egress=sr.egress)
    hops = _StageHops(sr, group, batched, deterministic, ql, ops)
    uses = hops.partial_uses(ops)
    delta = Xg = None
    full = {}

    for op in ops:
        with nvtx_range(op_range(op, sub_stages=True)):
            if op.kind == DELTA:
                delta = per_rank(ranks, batched, lambda r, a, b, *c_: (row_delta(a, b, c_[0] if c_ else None),),
                                  d_o, o, *(() if d_l is None else (d_l,)))[0]
                Xg = Operands([d_o, lse, delta], cap_q, lead, zero=True)
            elif op.kind == CAST:
                if op.route == "qo":
                    hops.cast(op, (d_o, lse, delta) + (() if kept_q is not None else (ql,)))
                else:
                    hops.cast(op, (kl, vl))
            elif op.kind == WAIT and op.back:
                home = hops.wait_reduce(op)
                if home is not None:  # summed into the host's fp32 rows now, not held to the end
                    merge_gradients(grads_q.x + grads_kv.x, [(op.phase, home)], lead, n)
                    del home
            elif op.kind == WAIT:
                into = (Xg.remote() + ([] if kept_q is not None else Xq.remote())) if op.route == "qo" \
                    else Xkv.remote()
                hops.wait_cast(op, into)
            elif op.kind == ATTN and op.stages == (0,):  # local rows only: its grads never travel
                host = [rows(t, lead, 0, n) for t in grads_q.x + grads_kv.x]
                _flex_backward_into(plan, scale, ranks, batched, 0, host, d_o, ql, kl, vl, lse, delta)
            elif op.kind == ATTN:  # no stage gradient tensor: the kernel adds into the fp32 sums
                (s,) = op.stages
                g_do, g_lse, g_delta = Xg.x
                _flex_backward_into(plan, scale, ranks, batched, s, grads_q.x + grads_kv.x,
                                    g_do, xq[0], xk, xv, g_lse, g_delta)
            elif op.kind == REDUCE:
                (s,) = op.stages
                kind = op.route
                local = (ql,) if kind == "qo" else (kl, vl)
                pick = grads_q.x if kind == "qo" else grads_kv.x
                if op.hop in (0, 2) and (op.phase, s) not in full:  # the hops that read them (see _drop_after_last_use)
                    full[op.phase, s] = [_gather_remote(t, sr.gather(kind, s), n, lead, x.dtype)
                                         for t, x in zip(pick, local)]
                host = [rows(t, lead, 0, n) for t in pick]
                hops.reduce(op, full.get((op.phase, s)), [torch.zeros_like(x) for x in local], "sum", (0.0,) * len(local),
                            host)
                _drop_after_last_use(full, uses, (op.phase, s), op)
            elif op.kind == MERGE:  # every return is summed into the host's rows: they are the result
                hops.side.join()
                dq, dk, dv = merge_gradients(grads_q.x + grads_kv.x, [], lead, n)
            else:
                raise AssertionError(f"relay sub-stages cannot run backward op {op}")
    return dq.to(ql.dtype), dk.to(kl.dtype), dv.to(vl.dtype)
