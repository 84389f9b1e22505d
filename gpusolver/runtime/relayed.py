"""The executor of a relay plan (``Plan.relay``): every cast and reduce of ``dist_attn`` as its hops.

Shape legend: P ranks, G head groups, c tokens per rank, ``cap`` a kind's receive
rows, ``relay_cap`` / ``fan_cap`` its relay buffer / fan-out send rows
(``gpusolver.plan.relay``). Per-rank tensors carry a leading ``[P]`` on a
``LocalGroup`` (``batched``).

It runs ``schedule.forward_ops(..., relay=True, egress=...)`` / ``backward_ops`` op by op:

- a cast is, with an egress (``RelayMeta.egress``, the default), hop 3 first (host -> its egress over NVLink, into the
  egress buffer), then hop 1 (egress or host -> relay over InfiniBand, read from
  concat(local rows, egress buffer), into the relay buffer), hop 0
  (the direct rows) and hop 2 (relay -> consumers, read from the relay buffer);
  each consumer then gathers its receive buffer, in the plan's own layout, out of
  ``concat(direct, fan-out, relay buffer)``, straight into the receive rows of stage 1's
  operands ``[local rows | receive buffer]`` (``Operands``, allocated once; what the layer keeps
  of a kept kind): CalcMeta and the kernels are unchanged. The hops' buffers go once it is
  gathered, so they never live beside a reduce;
- a reduce is hop 2 back (consumers' partials into the relay buffer's layout,
  merged onto the relay's own partial), hop 0 back (the direct rows, merged on
  the host), hop 1 back (the relays' merged rows, merged on the host after the
  direct ones, or on an egress onto identity rows of its egress buffer) and
  hop 3 back (the egresses' rows, merged on the host last). Every merge has a
  fixed order, so the result is deterministic.

Each hop is one whole-group collective whose split is non-zero only on that
hop's pairs; its bytes are counted under ``schedule.hop_phase(phase, hop)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_kernels import flex_attn, flex_attn_backward, merge_out_lse, row_delta
from gpusolver.nvtx import nvtx_range
from gpusolver.plan.relay import assemble_index, hop_send_index, inverse_index
from gpusolver.plan.schedule import ATTN, CAST, DELTA, MERGE, REDUCE, WAIT, backward_ops, forward_ops
from gpusolver.runtime.operands import Operands
from gpusolver.runtime.per_rank import per_rank
from gpusolver.runtime.pipelined import RankFill, _windows, at_fill, op_range, row_elements
from groupcomm import TorchGroup, group_cast, group_reduce, host_splits

_INTERNAL = dict(validate=False, flag_errors=False)


@dataclass(frozen=True)
class KindRoutes:
    """One kind's hops for the ranks run here.

    index:    per hop, send lists (``[cap]`` or ``[P, cap]`` int64): hops 0 and 3 into local
              rows, hop 1 into concat(local rows, egress buffer), hop 2 into the relay buffer
              (no hop 3 without egress).
    split:    per hop, the ``[P, P]`` split; host: its ``HostSplits`` (``TorchGroup``) or None.
    assemble: ``[.., recv_cap]`` rows of ``concat(direct, fan-out, relay)`` that make the receive buffer.
    back:     (direct, fan-out, relay) ``[.., rows]`` rows of the receive buffer that each of those
              buffers holds (-1: none), the way back.
    fill:     ``TorchGroup``: "recv" and each hop -> this rank's ``pipelined.RankFill`` (the rows the
              plan's layout, or that hop's cast, brings it), else None (every buffer at its capacity).
    """

    index: tuple
    split: tuple
    host: tuple
    assemble: torch.Tensor
    back: tuple
    recv_cap: int
    relay_cap: int
    egress_cap: int = 0
    egress: bool = False
    fill: dict | None = None

    def capacity(self, which) -> int:
        """Rows of the receive buffer in the plan's layout ("recv") or of hop ``which``'s at capacity."""
        return {1: self.relay_cap, 3: self.egress_cap}.get(which, self.recv_cap)

    def rows(self, which) -> int:
        """Rows of that buffer here, and of every partial returned from it: its capacity on a
        static-shape group; on ``TorchGroup`` the rows its cast brings this rank, read from the
        host copy of the splits the casts read anyway (no other wait)."""
        return at_fill(self.capacity(which), None if self.fill is None else self.fill[which])


@dataclass(frozen=True)
class RelayRoutes:
    qo: KindRoutes
    kv: KindRoutes
    sub_stages: bool = False  # one remote stage (``relay_stages.StageRelayRoutes`` runs S > 1)
    host_parts: tuple | None = None  # the host copies of the splits (``TorchGroup``), for a rebuild

    def kind(self, route: str) -> KindRoutes:
        return self.qo if route == "qo" else self.kv


def relay_routes(plan, group, ranks: tuple[int, ...], batched: bool, host_parts: tuple | None = None) -> RelayRoutes:
    """The hops' send lists, splits and gathers of ``plan`` for the ranks run here (sync-free;
    on ``TorchGroup`` it starts the one non-blocking copy of the six split matrices, unless
    ``host_parts`` gives an earlier routing's: a backward builds its tables again, not the copy)."""
    comm, relay = plan.comm, plan.relay
    egress = bool(relay.egress)
    hops = (0, 1, 2, 3) if egress else (0, 1, 2)
    H = len(hops)
    if host_parts is not None:
        hosts = list(host_parts)
    elif isinstance(group, TorchGroup):
        # with the hops' splits, the plan's own layout ones: what each rank's receive buffer holds
        hosts = host_splits(torch.stack([relay.route(k).split(h) for k in ("qo", "kv") for h in hops]
                                        + [comm.qo_split, comm.kv_split])).parts()
    else:
        hosts = [None] * (2 * H + 2)

    def stack(fn):
        return torch.stack([fn(r) for r in ranks]) if batched else fn(ranks[0])

    def kind(k: str, hosts_k, layout) -> KindRoutes:
        route = relay.route(k)
        cap, rcap = comm.buffers.recv(k), route.relay_capacity
        index = tuple(stack(lambda r, h=h: hop_send_index(comm, route, k, h, r)) for h in hops)
        assemble = stack(lambda r: assemble_index(comm, route, k, r))

        def inverse(r):
            return inverse_index(assemble_index(comm, route, k, r), 2 * cap + rcap)

        inv = stack(inverse)
        back = (inv[..., :cap], inv[..., cap:2 * cap], inv[..., 2 * cap:])
        fill = None
        if layout is not None:
            fill = {"recv": RankFill([layout], ranks[0]), **{h: RankFill([hosts_k[i]], ranks[0])
                                                             for i, h in enumerate(hops)}}
        return KindRoutes(index=index, split=tuple(route.split(h) for h in hops), host=tuple(hosts_k),
                          assemble=assemble, back=back, recv_cap=cap, relay_cap=rcap,
                          egress_cap=route.egress_capacity, egress=egress, fill=fill)

    return RelayRoutes(qo=kind("qo", hosts[:H], hosts[2 * H]), kv=kind("kv", hosts[H:2 * H], hosts[2 * H + 1]),
                       host_parts=tuple(hosts))


def _take(x: torch.Tensor, idx: torch.Tensor, fill: float, batched: bool) -> torch.Tensor:
    """Rows ``idx`` of ``x`` (``[.., N, *f]``), ``fill`` where ``idx`` is -1 (all of them when x has no
    rows: a rank that returns nothing in a reduce, on ``TorchGroup``, gathers none)."""
    lead = 1 if batched else 0
    if x.shape[lead] == 0:
        return torch.full((*idx.shape, *x.shape[lead + 1:]), fill, dtype=x.dtype, device=x.device)
    safe = idx.clamp(min=0)
    if batched:
        out = x[torch.arange(x.shape[0], device=x.device)[:, None], safe]
    else:
        out = x.index_select(0, safe)
    keep = (idx >= 0).view(*idx.shape, *([1] * (x.dim() - idx.dim())))
    return torch.where(keep, out, torch.full((), fill, dtype=x.dtype, device=x.device))


def _assemble_into(x: torch.Tensor, parts, idx: torch.Tensor, lead: int, sizes=None) -> None:
    """``x[.., i] = concat(parts)[.., idx[.., i]]`` where ``idx >= 0`` (the rows a cast's hops brought,
    ``RelayStage.assemble``), in place: one part at a time, so no concatenation of the hop buffers
    is made, and x's rows in windows (``pipelined._windows``), so a part's rows gathered and merged
    with x take one window's size at a time, not x's. sizes: each part's rows in ``idx``'s
    coordinates (its capacity) where a part holds only its first rows (a buffer at the rank's
    fill); default the parts' own rows."""
    keep_dims = [1] * (x.dim() - idx.dim())
    batch = torch.arange(x.shape[0], device=x.device)[:, None] if lead else None
    start = 0
    for part, span in zip(parts, sizes or [p.shape[lead] for p in parts]):
        n = part.shape[lead]
        for a, w in _windows(x.shape[lead], row_elements(x, lead)) if n else ():
            i = idx[..., a:a + w]
            mine = (i >= start) & (i < start + n)
            src = (i - start).clamp(0, n - 1)
            got = part[batch, src] if lead else part.index_select(0, src)
            xw = x.narrow(lead, a, w)
            xw.copy_(torch.where(mine.view(*i.shape, *keep_dims), got, xw))
            del got
        start += span


def _cast(kr: KindRoutes, hop: int, group, tensors, phase: str):
    return group_cast(list(tensors), kr.index[hop], kr.split[hop], kr.rows(hop), group, phase=_label(phase, hop),
                      host_split=kr.host[hop], async_op=True, flag_errors=False)


def _reduce(kr: KindRoutes, hop: int, group, partials, acc, op: str, phase: str, deterministic: bool):
    """The way back of hop ``hop``'s cast: partials of the rows it brought (``kr.rows(hop)``) return
    into buffers laid out at its capacity."""
    return group_reduce(list(partials), kr.index[hop], kr.split[hop], list(acc), group, op=op,
                        phase=_label(phase, hop), host_split=kr.host[hop], deterministic=deterministic,
                        async_op=True, flag_errors=False, recv_capacity=kr.capacity(hop))


def _label(phase: str, hop: int) -> str:
    from gpusolver.plan.schedule import hop_phase

    return hop_phase(phase, hop)


class _Hops:
    """The state of one pass's relayed collectives: works, relay buffers, assembled receive buffers.
    ``into[route]``: the receive rows of stage 1's operands (``Operands.remote()``, zero) that a
    kind's hops are gathered into, set before its casts."""

    def __init__(self, routes: RelayRoutes, group, batched: bool, deterministic: bool):
        self.routes, self.group, self.batched, self.det = routes, group, batched, deterministic
        self.works, self.relay_buf, self.parts, self.merged, self.result = {}, {}, {}, {}, {}
        self.into = {}
        self.egress_res = {}
        self.cast_names = {}  # per kind, its casts' works: let go once its receive buffer is assembled
        self.lead = 1 if batched else 0

    def cast(self, op, tensors) -> None:
        kr = self.routes.kind(op.route)
        if op.hop == 1 and kr.egress:  # reads the local rows, then the egress buffer hop 3 brought
            brought = self.works[op.deps[0]].wait()
            tensors = [torch.cat((t, e), dim=self.lead) for t, e in zip(tensors, brought)]
        if op.hop == 2:  # reads the relay buffer hop 1 brought
            self.relay_buf[op.route] = self.works[op.deps[0]].wait()
            tensors = self.relay_buf[op.route]
        self.works[op.name] = _cast(kr, op.hop, self.group, tensors, op.phase)
        self.cast_names.setdefault(op.route, []).append(op.name)

    def wait_cast(self, op) -> None:
        self.parts[(op.route, op.hop)] = self.works[op.deps[0]].wait()
        if (op.route, 0) in self.parts and (op.route, 2) in self.parts:
            kr = self.routes.kind(op.route)
            direct, fan = self.parts.pop((op.route, 0)), self.parts.pop((op.route, 2))
            lead = 1 if self.batched else 0
            rows = kr.rows("recv")  # the layout's rows this rank receives; the hops' buffers at theirs
            recv = self.into.pop(op.route)
            for x, d, f, r in zip(recv, direct, fan, self.relay_buf.pop(op.route)):
                _assemble_into(x, (d, f, r), kr.assemble[..., :rows], lead,
                               sizes=(kr.recv_cap, kr.recv_cap, kr.relay_cap))
            # nothing reads the hops' buffers again: they go before stage 1 and the reduce run (with
            # one remote stage every cast lands first, so they never live beside a reduce's buffers)
            for name in self.cast_names.pop(op.route):
                del self.works[name]

    def reduce(self, op, full, acc, red: str, fills) -> None:
        """``full``: partials in the receive buffer's layout; ``acc``: the host's accumulators."""
        kr = self.routes.kind(op.route)
        held = (kr.rows(0), kr.rows(2), kr.rows(1))  # rows of the direct, fan-out and relay buffers here

        def take(which):  # each of those buffers' rows, from the partials in the layout's
            return [_take(p, kr.back[which][..., :held[which]], f, self.batched) for p, f in zip(full, fills)]

        if op.hop == 2:  # onto the relay's own partial of each relayed row, sources ascending
            self.works[op.name] = _reduce(kr, 2, self.group, take(1), take(2), red, op.phase, self.det)
        elif op.hop == 0:
            self.works[op.name] = _reduce(kr, 0, self.group, take(0), acc, red, op.phase, self.det)
        elif op.hop == 1:  # the host merges the relays' rows after its direct ones
            acc = self.works[op.name.replace(":hop1", "")].wait()
            if kr.egress:  # an egress merges its slots' rows onto identity rows, sources ascending
                acc = [torch.cat((a, _identity(a, kr.rows(3), f, self.lead)), dim=self.lead)
                       for a, f in zip(acc, fills)]
            self.works[op.name] = _reduce(kr, 1, self.group, self.merged[op.phase], acc, red, op.phase, self.det)
        else:  # hop 3: the host merges its egresses' rows last
            res, slots_here = self.egress_res[op.phase], kr.rows(3)
            rows = res[0].shape[self.lead] - slots_here
            local = [x.narrow(self.lead, 0, rows) for x in res]
            slots = [x.narrow(self.lead, rows, slots_here).contiguous() for x in res]
            self.works[op.name] = _reduce(kr, 3, self.group, slots, local, red, op.phase, self.det)

    def wait_reduce(self, op) -> None:
        res = self.works[op.deps[0]].wait()
        if op.hop == 2:
            self.merged[op.phase] = res
        elif op.hop == 1 and self.routes.kind(op.route).egress:
            self.egress_res[op.phase] = res
        elif op.hop in (1, 3):
            self.result[op.phase] = res


def _identity(like: torch.Tensor, rows: int, fill: float, lead: int) -> torch.Tensor:
    """``rows`` rows shaped like ``like``'s, all ``fill`` (a merge's identity: 0, or -inf for an lse)."""
    shape = list(like.shape)
    shape[lead] = rows
    return torch.full(shape, fill, dtype=like.dtype, device=like.device)


def _slices(plan, rank: int, stage: int):
    c = plan.calc
    return c.q_ranges[rank, stage], c.k_ranges[rank, stage], c.attn_type[rank, stage]


def relay_forward(plan, group, ranks, batched, routes: RelayRoutes, ql, kl, vl, scale: float, deterministic: bool):
    """(o, lse, (Xq, Xk, Xv)) in group-major rows: the forward of a relay plan; X = [local rows |
    receive buffer], stage 1's operands (a kept kind's are what the layer keeps, its local rows too)."""
    lead = 1 if batched else 0
    n, cap = ql.shape[lead], routes.qo.rows("recv")
    # stage 1's operands X = [local rows | receive buffer], allocated once: each kind's hops are gathered
    # straight into its receive rows, so no receive buffer lives beside them and nothing is concatenated
    X = {"qo": Operands([ql], cap, lead, zero=True), "kv": Operands([kl, vl], routes.kv.rows("recv"), lead, zero=True)}
    hops = _Hops(routes, group, batched, deterministic)
    hops.into = {"qo": X["qo"].remote(), "kv": X["kv"].remote()}
    sent = {"qo": (ql,), "kv": (kl, vl)}
    parts = {}
    o = lse = None
    operands = tuple(X["qo"].x + X["kv"].x)
    for op in forward_ops(plan.calc.q_ranges.shape[1], 1, relay=True, egress=plan.relay.egress):
        with nvtx_range(op_range(op)):
            if op.kind == CAST:
                hops.cast(op, sent[op.route])
            elif op.kind == WAIT and op.back:
                hops.wait_reduce(op)
            elif op.kind == WAIT:
                hops.wait_cast(op)
            elif op.kind == ATTN:
                (s,) = op.stages
                args = operands if s else (ql, kl, vl)

                def run(r, q_, k_, v_, s=s):
                    return flex_attn(q_, k_, v_, *_slices(plan, r, s), scale, **_INTERNAL)

                parts[s] = per_rank(ranks, batched, run, *args)
            elif op.kind == MERGE:
                o, lse = parts[0]
                o, lse = per_rank(ranks, batched, lambda r, a, b, c_, d: merge_out_lse(a, b, c_, d), o, lse,
                                   parts[1][0].narrow(lead, 0, n), parts[1][1].narrow(lead, 0, n))
            elif op.kind == REDUCE:
                full = [x.narrow(lead, n, cap).contiguous() for x in parts[1]]
                hops.reduce(op, full, (o, lse), "lse", (0.0, float("-inf")))
            else:
                raise AssertionError(f"relay forward cannot run op {op}")
    o, lse = hops.result["fwd.o"]
    return o, lse, operands


def relay_backward(plan, group, ranks, batched, routes: RelayRoutes, ql, kl, vl, o, lse, kept_q, kept_kv,
                   d_o, d_l, scale: float, deterministic: bool):
    """(dq, dk, dv) in group-major rows: the backward of a relay plan. ``kept_q`` / ``kept_kv``: the
    forward's Xq / [Xk, Xv] (``ql``, ``kl``, ``vl`` their local rows), or None (cast again)."""
    lead = 1 if batched else 0
    n = ql.shape[lead]
    qcap, kcap = routes.qo.rows("recv"), routes.kv.rows("recv")  # as the forward's buffers
    keep_q, keep_kv = kept_q is not None, kept_kv is not None
    hops = _Hops(routes, group, batched, deterministic)
    # stage 1's operands, built here for what is cast again (the hops gathered straight into their
    # receive rows); dO, lse and delta over X's QO rows once delta is made
    Xkv = None if keep_kv else Operands([kl, vl], kcap, lead, zero=True)
    if Xkv is not None:
        hops.into["kv"] = Xkv.remote()
    Xg = delta = None
    parts = {}
    for op in backward_ops(plan.calc.q_ranges.shape[1], keep_kv, relay=True, egress=plan.relay.egress):
        with nvtx_range(op_range(op)):
            if op.kind == DELTA:
                delta = per_rank(ranks, batched, lambda r, a, b, *c_: (row_delta(a, b, c_[0] if c_ else None),),
                                  d_o, o, *(() if d_l is None else (d_l,)))[0]
                Xg = Operands([d_o, lse, delta] + ([] if keep_q else [ql]), qcap, lead, zero=True)
                hops.into["qo"] = Xg.remote()
            elif op.kind == CAST:
                hops.cast(op, Xg.local() if op.route == "qo" else (kl, vl))
            elif op.kind == WAIT and op.back:
                hops.wait_reduce(op)
            elif op.kind == WAIT:
                hops.wait_cast(op)
            elif op.kind == ATTN:
                (s,) = op.stages
                args = (d_o, ql, kl, vl, lse, delta)
                if s:  # [local rows | receive buffer]: the kept operands, or those built here
                    x_q = kept_q if keep_q else Xg.x[3]
                    x_k, x_v = kept_kv if keep_kv else Xkv.x
                    args = (Xg.x[0], x_q, x_k, x_v, Xg.x[1], Xg.x[2])
                    Xg = Xkv = None  # the operands go with args, once stage 1 has run

                def run(r, *t, s=s):
                    return flex_attn_backward(*t, *_slices(plan, r, s), scale, **_INTERNAL)

                parts[s] = per_rank(ranks, batched, run, *args)
                del args  # stage 1's operands built here go before the reduces
            elif op.kind == REDUCE:
                pick = (0,) if op.phase == "bwd.dq" else (1, 2)  # dQ to the QO host, dK and dV to the KV host
                cap = qcap if op.phase == "bwd.dq" else kcap
                acc = [parts[0][i] + parts[1][i].narrow(lead, 0, n) for i in pick]
                full = [parts[1][i].narrow(lead, n, cap).contiguous() for i in pick]
                hops.reduce(op, full, acc, "sum", (0.0,) * len(pick))
            else:
                raise AssertionError(f"relay backward cannot run op {op}")
    (dq,), (dk, dv) = hops.result["bwd.dq"], hops.result["bwd.dkv"]
    return dq, dk, dv
