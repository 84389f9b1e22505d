"""``dist_attn``: one attention layer over a CP group, forward and backward, from a Plan.

Shape legend: P ranks, c tokens per rank, G head groups, Hq / Hkv query / KV
heads (hq = Hq / G, hkv = Hkv / G per group), D head dim, qcap / kcap = the
QO / KV receive buffers' group-major rows: the plan's capacities on a static-shape
group, this rank's fill on ``TorchGroup`` (``LayerRoutes.recv_rows``).

Forward, per rank (docs/design/layers.md, "Data flow of one layer"):

1. the local shards become group-major rows ``[G * c, h, D]``;
2. the cast of remote Q (phase ``fwd.qo``) and of K with V (``fwd.kv``)
   starts, and stage 0 (tasks whose units are both local) runs while it is
   in flight;
3. stage 1 runs on ``X = [local rows | receive buffer]``, one tensor per operand
   allocated once, each buffer copied into its slot when its cast is waited for (no
   concatenation: what the backward keeps of a kind is its X);
4. the partial (out, lse) of received query rows go back to their host and
   are merged there with the log-sum-exp correction (``fwd.o``).

The order, streams and waits are data: ``gpusolver.plan.schedule``'s
``forward_ops`` / ``backward_ops``, which ``_DistAttn`` executes op by op and
``gpusolver.sim`` prices.

Backward moves as little as it can: the host computes the row delta
``rowsum(dO * O) - dlse`` itself and casts dO, lse and delta (``bwd.qo``),
never O; the Q, K and V a helper received in the forward are kept
(``keep_forward_buffers``; otherwise cast again, ``bwd.q`` / ``bwd.kv``; with
``kept_kv_rows`` only the first rows of the KV buffer are kept and ``bwd.kv`` casts
the rest, ``runtime.kept_rows``, with S sub-stages each sub-stage's cast its rows past them;
with ``kept_q_rows`` likewise the QO buffer's, Q of the rest travelling beside dO in ``bwd.qo``);
partial dQ is summed back to the QO host (``bwd.dq``), dK and dV to the KV
host (``bwd.dkv``). These are the volumes ``PlanMetrics`` prices
(``CommCost``), and the groups' byte counters equal them.

Host reads: none with ``LocalGroup`` and ``SymmMemGroup`` (the layer runs on
``device="meta"``); with ``TorchGroup`` only the plan's two ``[P, P]`` split
matrices, copied once without blocking (``host_splits``) and awaited when
the first collective starts; backward reuses the copy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import zlib

import torch

from attn_kernels import flex_attn, flex_attn_backward, merge_out_lse, row_delta
from gpusolver import errors
from gpusolver.nvtx import nvtx_range
from gpusolver.plan import IMBALANCED, Plan
from gpusolver.plan.schedule import ATTN, CAST, DELTA, MERGE, REDUCE, WAIT, Op, backward_ops, forward_ops
from gpusolver.plan.sparse import SparsePlan
from gpusolver.problem import check_kept_per_rank, kept_kinds
from gpusolver.runtime.kept_rows import KeptRoom, keep_prefix, kept_room, pack_room, tail_cast, unpack_room, \
    whole_operands, with_tail
from gpusolver.runtime.layout import from_group_major, to_group_major
from gpusolver.runtime.operands import Operands, rows
from gpusolver.runtime.per_rank import per_rank
from gpusolver.runtime.pipelined import (RankFill, StageRoutes, at_fill, backward_stages, forward_stages, op_range,
                                         stage_routes)
from gpusolver.runtime.relay_stages import (StageRelayRoutes, relay_stages_backward, relay_stages_forward,
                                            stage_relay_routes)
from gpusolver.runtime.relayed import RelayRoutes, relay_backward, relay_forward, relay_routes
from gpusolver.support import check_supported, check_tensors, softmax_scale_of
from groupcomm import CollectiveError, TorchGroup, as_group, group_cast, group_reduce, host_splits, retain

# The stages run the plan's own tables, checked once per layer through the plan's status
# (validation: plan.validate(); sync-free: one device flag), so the calls skip their own checks.
_INTERNAL = dict(validate=False, flag_errors=False)


@dataclass(frozen=True)
class _RelayHosts:
    """What ``LayerRoutes.for_backward`` keeps of a relay routing: which executor, and the host
    copies of its splits (None off ``TorchGroup``)."""
    sub_stages: bool
    parts: tuple | None


@dataclass(frozen=True)
class LayerRoutes:
    """What one layer's collectives and stages read from the plan, for the ranks this process runs.

    ranks:        the ranks computed here (all P for a ``LocalGroup``, else this rank).
    batched:      true for a ``LocalGroup`` (every per-rank tensor has a leading [P] dim).
    qo_index, kv_index: send lists, ``[send_cap]`` (or ``[P, send_cap]`` batched) int64.
    qo_split, kv_split: ``[P, P]`` int64 split matrices.
    qo_host, kv_host:   their host copies (``TorchGroup`` only, else None).
    stages:       the sub-stages' routing when the plan has S > 1 (``pipelined.StageRoutes``;
                  the fields above are then None), else None.
    relay:        the hops of a relay plan (``Plan.relay``; ``relayed.RelayRoutes``; the fields
                  above are then None), else None.
    fill:         ``TorchGroup`` with one remote stage: route -> this rank's ``pipelined.RankFill``
                  (the rows its cast brings, from the host copy of the split), else None.
    """

    plan: Plan
    ranks: tuple[int, ...]
    batched: bool
    qo_index: torch.Tensor
    kv_index: torch.Tensor
    qo_split: torch.Tensor
    kv_split: torch.Tensor
    qo_host: object
    kv_host: object
    stages: StageRoutes | None = None
    relay: RelayRoutes | StageRelayRoutes | None = None
    fill: dict | None = None

    def for_backward(self) -> "LayerRoutes":
        """What a layer keeps of its routing from forward to backward: none of the tables built from
        the plan for this call (send lists, a relay plan's hops: up to hundreds of MB per layer at
        real shapes), only the host copies of the splits; ``restored`` builds the tables again.
        Sub-stages build theirs in each pass (``pipelined.RouteTables``)."""
        if self.stages is not None:
            return self
        if self.relay is not None:
            return replace(self, relay=_RelayHosts(self.relay.sub_stages, self.relay.host_parts))
        return replace(self, qo_index=None, kv_index=None)

    def restored(self) -> "LayerRoutes":
        """``for_backward``'s routing whole again, its tables built from the plan (no host read)."""
        if isinstance(self.relay, _RelayHosts):
            build = stage_relay_routes if self.relay.sub_stages else relay_routes
            return replace(self, relay=build(self.plan, None, self.ranks, self.batched, host_parts=self.relay.parts))
        if self.stages is not None or self.relay is not None or self.qo_index is not None:
            return self
        return replace(self, qo_index=send_lists(self.plan, "qo", self.ranks, self.batched),
                       kv_index=send_lists(self.plan, "kv", self.ranks, self.batched))

    @property
    def groups(self) -> int:
        return self.plan.comm.head_groups

    @property
    def chunk(self) -> int:
        return self.plan.comm.chunk

    @property
    def qo_capacity(self) -> int:
        """Rows of the QO receive buffer."""
        return self.plan.comm.qo_recv_capacity

    @property
    def kv_capacity(self) -> int:
        """Rows of the KV receive buffer."""
        return self.plan.comm.kv_recv_capacity

    def recv_rows(self, route: str) -> int:
        """Rows of ``route``'s receive buffer here, and of every operand and partial over it: the
        plan's capacity on a static-shape group; on ``TorchGroup`` the rows this rank's cast
        brings, read from the host copy of the split that the cast reads anyway (no other
        wait). Every row a stage reads or a reduce returns is one the cast brought."""
        cap = self.qo_capacity if route == "qo" else self.kv_capacity
        return at_fill(cap, None if self.fill is None else self.fill[route])


def send_lists(plan: Plan, kind: str, ranks: tuple[int, ...], batched: bool) -> torch.Tensor:
    """The one-remote-stage send list of ``kind`` for ``ranks``: ``[send_cap]`` (``[P, send_cap]``
    batched) int64; K, V by key block where the plan moves them so (a sparse plan's ``kv_blocks``)."""
    comm, kb = plan.comm, getattr(plan, "kv_blocks", None)
    if kind == "kv" and kb is not None:
        def one(r):
            return kb.send_index(r, comm.chunk, comm.kv_send_capacity)
    else:
        def one(r):
            return comm.send_index(kind, r)
    return torch.stack([one(r) for r in ranks]) if batched else one(ranks[0])


def layer_routes(plan: Plan, group) -> LayerRoutes:
    """The routing of ``plan`` for ``group``; on ``TorchGroup`` it starts the split copy (no wait)."""
    comm = plan.comm
    P = comm.cp_size
    if group.size != P:
        raise ValueError(f"the plan is for P = {P} ranks but the group has {group.size}")
    batched = bool(getattr(group, "batched", False))
    ranks = tuple(range(P)) if batched else (group.rank,)
    if getattr(plan, "relay", None) is not None:  # inter-node rows by relay: every collective as its hops
        if type(group).__name__ == "SymmMemGroup":
            raise ValueError("plan has relay transport (plan.relay: its group spans nodes) but the group is a "
                             "SymmMemGroup, which covers one node's NVLink: use TorchGroup, or build the plan "
                             "with SolverConfig(ib_relay=False)")
        build = stage_relay_routes if plan.relay.num_stages > 1 else relay_routes  # sub-stages: each relayed
        return LayerRoutes(plan=plan, ranks=ranks, batched=batched, qo_index=None, kv_index=None, qo_split=None,
                           kv_split=None, qo_host=None, kv_host=None, relay=build(plan, group, ranks, batched))
    if comm.num_stages > 1:
        return LayerRoutes(plan=plan, ranks=ranks, batched=batched, qo_index=None, kv_index=None, qo_split=None,
                           kv_split=None, qo_host=None, kv_host=None,
                           stages=stage_routes(plan, group, ranks, batched))

    qo_host = kv_host = fill = None
    if isinstance(group, TorchGroup):
        # the only host read of the layer: two [P, P] matrices, copied without blocking now
        # and awaited when the first collective starts (groupcomm.host_splits)
        qo_host, kv_host = host_splits(comm.qo_split), host_splits(comm.kv_split)
        fill = {"qo": RankFill([qo_host], ranks[0]), "kv": RankFill([kv_host], ranks[0])}
    return LayerRoutes(plan=plan, ranks=ranks, batched=batched, qo_index=send_lists(plan, "qo", ranks, batched),
                       kv_index=send_lists(plan, "kv", ranks, batched),
                       qo_split=comm.qo_split, kv_split=comm.kv_split, qo_host=qo_host, kv_host=kv_host, fill=fill)


def _stage_slices(plan: Plan, rank: int, stage: int):
    c = plan.calc
    return c.q_ranges[rank, stage], c.k_ranges[rank, stage], c.attn_type[rank, stage]


def _per_rank(routes: LayerRoutes, fn, *tensors: torch.Tensor):
    return per_rank(routes.ranks, routes.batched, fn, *tensors)




def issue(op: Op, routes: LayerRoutes, group, tensors, acc=None, deterministic: bool = True):
    """Start the collective ``op``: a cast of ``tensors`` (into the buffers ``acc`` when given: the
    receive rows of stage 1's operands, written in place; else into new ones), or a reduce of them
    into ``acc``. Its Work. A reduce given two lists empties them (``group_reduce(consume=True)``):
    a caller that keeps no other reference has its partials freed once sent and its accumulators
    once read; tuples are left as they are."""
    index = routes.qo_index if op.route == "qo" else routes.kv_index
    split = routes.qo_split if op.route == "qo" else routes.kv_split
    host = routes.qo_host if op.route == "qo" else routes.kv_host
    if op.kind == CAST:
        cap = routes.recv_rows(op.route)
        return group_cast(list(tensors), index, split, cap, group, phase=op.phase, host_split=host,
                          async_op=True, flag_errors=False, out=None if acc is None else list(acc))
    consume = isinstance(tensors, list) and isinstance(acc, list)
    # partials at this rank's fill (``LayerRoutes.recv_rows``) return into buffers laid out at the capacity
    cap = routes.qo_capacity if op.route == "qo" else routes.kv_capacity
    return group_reduce(tensors if consume else list(tensors), index, split, acc if consume else list(acc), group,
                        op="lse" if op.phase == "fwd.o" else "sum", phase=op.phase, host_split=host,
                        deterministic=deterministic, async_op=True, flag_errors=False, consume=consume,
                        recv_capacity=cap)


def issue_tail(op: Op, routes: LayerRoutes, group, tensors, first_row, out, host_kept=None):
    """Start the cast ``op`` (of its route, KV or QO) of the rows that land past ``first_row`` (an int,
    or ``[P]`` per rank with ``host_kept``, ``kept_rows.KeptRoom``) of each receive buffer
    (``kept_rows.tail_cast``) into ``out`` (stage 1's operands' receive rows): what a rank that kept
    the first rows needs again. Its Work."""
    index = routes.qo_index if op.route == "qo" else routes.kv_index
    split = routes.qo_split if op.route == "qo" else routes.kv_split
    return tail_cast(tensors, index, split, first_row, out, group, phase=op.phase, ranks=routes.ranks,
                     batched=routes.batched, host_kept=host_kept)


class _DistAttn(torch.autograd.Function):
    """Runs ``forward_ops`` / ``backward_ops`` (``gpusolver.plan.schedule``) op by op: the list the
    simulator prices is the list executed here."""

    @staticmethod
    def forward(ctx, q, k, v, routes: LayerRoutes, group, scale: float, keep: tuple, kv_rows: int,
                deterministic: bool, q_rows: int = -1, room: KeptRoom | None = None):
        lead = 1 if routes.batched else 0
        G = routes.groups
        n = G * q.shape[lead]  # G * c local group-major rows
        if routes.stages is not None or routes.relay is not None:  # their own executors of the same op lists
            ctx.routes, ctx.group, ctx.scale, ctx.keep = routes.for_backward(), group, scale, keep
            ctx.deterministic = deterministic
            if routes.relay is not None:
                ql, kl, vl = (to_group_major(x, G, lead).contiguous() for x in (q, k, v))
                run = relay_stages_forward if routes.relay.sub_stages else relay_forward
                o, lse, operands = run(routes.plan, group, routes.ranks, routes.batched, routes.relay,
                                       ql, kl, vl, scale, deterministic)
            else:  # q, k, v go group-major straight into the operands: their local rows exist once;
                # o comes in its natural layout, and is saved as it is returned: one tensor, the output
                (o, lse), operands = forward_stages(routes.plan, group, routes.ranks, routes.batched,
                                                    routes.stages, q, k, v, scale, deterministic, groups=G,
                                                    out_groups=G)
                # a kind cast again saves a copy of its local rows, made now (a kept kind's are views, below)
                ql, kl, vl = (None if kind in keep else x.narrow(lead, 0, n).clone()
                              for kind, x in zip(("qo", "kv", "kv"), operands))
            # sub-stages save O and lse as they return them (natural): the outputs are what the backward
            # reads, and no group-major copy of either stays alive beside them
            natural = routes.relay is None
            if natural:
                lse = from_group_major(lse, G, lead)
            outs = (lambda: (o, lse)) if natural else (
                lambda: (from_group_major(o, G, lead), from_group_major(lse, G, lead)))
            x_q, x_k, x_v = operands  # only the kept kinds' operands: the others are cast again
            ctx.room = room
            if room is not None:  # each rank's kept rows in the room; the local rows copied (X goes)
                pool = pack_room(x_q, x_k, x_v, room, routes.ranks, n, lead)
                ql, kl, vl = (x.narrow(lead, 0, n).clone() for x in (x_q, x_k, x_v))
                del operands, x_q, x_k, x_v
                ctx.kv_rows = ctx.q_rows = -1
                ctx.save_for_backward(ql, kl, vl, o, lse, pool)
                group.wait_sends()
                return outs()
            part = routes.relay is None and "kv" in keep and kv_rows >= 0
            if part:  # the local rows and the first kv_rows of the KV buffer (the rest is cast again),
                # of a buffer at this rank's fill (``pipelined.receive_rows``) at most its rows
                x_k, x_v = keep_prefix([x_k, x_v], lead, n, min(kv_rows, x_k.shape[lead] - n))
                operands = None  # the whole KV operands go with the forward
            ctx.kv_rows = kv_rows if part else -1
            part_q = routes.relay is None and "qo" in keep and q_rows >= 0
            if part_q:  # likewise the first q_rows of the QO buffer (the rest travels again with dO)
                (x_q,) = keep_prefix([x_q], lead, n, min(q_rows, x_q.shape[lead] - n))
                operands = None
            ctx.q_rows = q_rows if part_q else -1
            # every executor here returns X = [local rows | receive buffer], whose first n rows are the
            # local rows: a kept kind keeps them once, as views of it
            if "qo" in keep:
                ql = x_q.narrow(lead, 0, n)
            if "kv" in keep:
                kl, vl = x_k.narrow(lead, 0, n), x_v.narrow(lead, 0, n)
            ctx.save_for_backward(ql, kl, vl, o, lse, *((x_q,) if "qo" in keep else ()),
                                  *((x_k, x_v) if "kv" in keep else ()))
            group.wait_sends()  # p2p sends may outlive their wait(): none past the pass
            return outs()
        # a remote stage's rows are X = [local rows | receive buffer], the buffer at the plan's capacity
        # or (TorchGroup) at this rank's fill (``LayerRoutes.recv_rows``); remote rows here are QO rows
        cap, kcap = routes.recv_rows("qo"), routes.recv_rows("kv")
        local = lambda x: rows(x, lead, 0, n)  # noqa: E731
        remote = lambda x: rows(x, lead, n, cap)  # noqa: E731
        # the operands of stage 1, allocated once: each cast writes its rows into their slot (zero past
        # the fill, as a new buffer), so the local rows and buffers never exist a second time
        X = {"qo": Operands([q], cap, lead, zero=True, groups=G),
             "kv": Operands([k, v], kcap, lead, zero=True, groups=G)}
        # X holds the local rows, written group-major straight from q, k, v (no group-major copy):
        # ql, kl, vl are views of it, and a kind not kept saves a copy of its local rows at the end,
        # once the reduce's work is freed
        ql = local(X["qo"].x[0])
        kl, vl = (local(x) for x in X["kv"].x)
        sent = {"qo": (ql,), "kv": (kl, vl)}
        works, parts = {}, {}
        o = lse = None
        for op in forward_ops(routes.plan.calc.q_ranges.shape[1]):
            with nvtx_range(op_range(op)):
                if op.kind == CAST:
                    works[op.name] = issue(op, routes, group, sent[op.route], X[op.route].remote())
                elif op.kind == WAIT and op.back:
                    o, lse = works.pop(op.deps[0]).wait()
                elif op.kind == WAIT:
                    works.pop(op.deps[0]).wait()  # its rows are in X now
                elif op.kind == ATTN:
                    (s,) = op.stages
                    args = (ql, kl, vl) if s == 0 else X["qo"].x + X["kv"].x

                    def run(r, q_, k_, v_, s=s):
                        return flex_attn(q_, k_, v_, *_stage_slices(routes.plan, r, s), scale, **_INTERNAL)

                    parts[s] = _per_rank(routes, run, *args)  # stage 0: local work while the casts fly
                elif op.kind == MERGE:
                    o, lse = parts.pop(op.stages[0])
                    for s in op.stages[1:]:
                        o, lse = _per_rank(routes, lambda r, a, b, c_, d: merge_out_lse(a, b, c_, d), o, lse,
                                           local(parts[s][0]), local(parts[s][1]))
                elif op.kind == REDUCE:
                    # the remote rows of one stage go back to their hosts (views of the stage's output),
                    # handed over with the host's (o, lse): no reference is kept here, so the stage's
                    # output is freed once its rows have left and o once the reduce has read it
                    (s,) = op.stages
                    partials, acc = [remote(x) for x in parts.pop(s)], [o, lse]
                    o = lse = None
                    works[op.name] = issue(op, routes, group, partials, acc, deterministic)
                else:
                    raise AssertionError(f"dist_attn cannot run forward op {op}")
        # only what the backward reads: a kept kind's whole X (local rows and buffer), else its local rows
        if room is not None:  # the local rows and each rank's kept rows in the room
            saved = (ql.clone(), kl.clone(), vl.clone(), o, lse,
                     pack_room(X["qo"].x[0], *X["kv"].x, room, routes.ranks, n, lead))
            del X, sent, ql, kl, vl
            ctx.save_for_backward(*saved)
            ctx.routes, ctx.group, ctx.scale, ctx.keep = routes.for_backward(), group, scale, keep
            ctx.deterministic, ctx.kv_rows, ctx.q_rows, ctx.room = deterministic, -1, -1, room
            group.wait_sends()
            return from_group_major(o, G, lead), from_group_major(lse, G, lead)
        if "kv" not in keep:
            kv_saved = (kl.clone(), vl.clone())
        else:  # all of X, or its local rows and the first kv_rows of the buffer (the rest is cast again),
            # of a buffer at this rank's fill at most its rows
            kv_saved = tuple(X["kv"].x) if kv_rows < 0 else keep_prefix(X["kv"].x, lead, n, min(kv_rows, kcap))
        if "qo" not in keep:
            q_saved = ql.clone()
        else:  # likewise for Q
            q_saved = X["qo"].x[0] if q_rows < 0 else keep_prefix(X["qo"].x, lead, n, min(q_rows, cap))[0]
        saved = (q_saved,) + kv_saved
        del X, sent, ql, kl, vl, q_saved
        ctx.save_for_backward(*saved, o, lse)
        ctx.routes, ctx.group, ctx.scale, ctx.keep = routes.for_backward(), group, scale, keep
        ctx.deterministic = deterministic
        ctx.kv_rows, ctx.q_rows, ctx.room = kv_rows, q_rows, None
        group.wait_sends()  # p2p sends may outlive their wait(): none past the pass
        return from_group_major(o, G, lead), from_group_major(lse, G, lead)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        routes, group, scale = ctx.routes.restored(), ctx.group, ctx.scale
        lead = 1 if routes.batched else 0
        G = routes.groups
        # read once: non-reentrant checkpointing unpacks each saved tensor a single time
        saved = ctx.saved_tensors
        keep_q, keep_kv = "qo" in ctx.keep, "kv" in ctx.keep
        if routes.stages is not None or routes.relay is not None:  # sub-stages, or relay
            ql, kl, vl, o, lse = saved[:5]
            # sub-stages write dO group-major straight into its operand (groups=G): no copy of it here
            staged = routes.relay is None  # o, dO and dlse natural (``forward_stages(out_groups=G)``)
            if staged:  # the natural lse saved as returned; its rows group-major ([c, H] fp32)
                lse = to_group_major(lse, G, lead).contiguous()
            if d_out is None:
                d_o = torch.zeros_like(o)
            else:
                d_o = d_out if staged else to_group_major(d_out, G, lead).contiguous()
            d_l = d_lse if staged or d_lse is None else to_group_major(d_lse, G, lead).contiguous()
            kept = list(saved[5:])  # the kept kinds' operands, Xq then Xk, Xv (or the room)
            room = None if ctx.room is None else (ctx.room, kept.pop(0))
            kept_q = kept.pop(0) if keep_q and room is None else None
            kept_kv = kept if keep_kv and room is None else None
            run, how = (backward_stages, routes.stages) if routes.relay is None else (
                relay_stages_backward if routes.relay.sub_stages else relay_backward, routes.relay)
            more = {} if not staged else {"kept_kv_rows": ctx.kv_rows, "kept_q_rows": ctx.q_rows,
                                          "groups": G, "kept_room": room, "o_natural": True, "out_groups": G}
            del kept, saved, room
            dq, dk, dv = run(routes.plan, group, routes.ranks, routes.batched, how, ql, kl, vl, o, lse, kept_q,
                             kept_kv, d_o, d_l, scale, ctx.deterministic, **more)
            group.wait_sends()  # p2p sends may outlive their wait(): none past the pass
            if not staged:
                dq, dk, dv = (from_group_major(x, G, lead) for x in (dq, dk, dv))
            return dq, dk, dv, None, None, None, None, None, None, None, None
        o, lse = saved[3:5]
        qcap, kcap = routes.recv_rows("qo"), routes.recv_rows("kv")  # as the forward's buffers
        d_o = torch.zeros_like(o) if d_out is None else to_group_major(d_out, G, lead).contiguous()
        d_l = None if d_lse is None else to_group_major(d_lse, G, lead).contiguous()
        n = o.shape[lead]
        local = lambda x: rows(x, lead, 0, n)  # noqa: E731
        remote = lambda x, cap: rows(x, lead, n, cap)  # noqa: E731
        # stage 1's operands X = [local rows | buffer]: the forward's X of a kept kind, else built here
        xq, xk, xv = saved[:3]
        # the kept rows of a kind kept in part: an int (every rank's) or [P] (each rank's, the room)
        tail_q, tail_kv, host_q, host_kv = ctx.q_rows, ctx.kv_rows, None, None
        room = ctx.room
        if room is not None:  # each rank's kept rows out of the room, the rest cast again below
            Xq, Xkv = unpack_room(saved[5], xq, xk, xv, room, routes.ranks, qcap, kcap, lead)
            part = part_q = True
            tail_q, tail_kv, host_q, host_kv = room.kept_q, room.kept_kv, room.host_kept("qo"), room.host_kept("kv")
        else:
            part = keep_kv and ctx.kv_rows >= 0  # the first kv_rows of the KV buffer kept, the rest cast again
            part_q = keep_q and ctx.q_rows >= 0  # likewise the first q_rows of the QO buffer
            if part_q:  # of a buffer at this rank's fill, at most its rows
                Xq = whole_operands((xq,), qcap, lead, n, min(ctx.q_rows, qcap))
            else:
                Xq = None if keep_q else Operands([xq], qcap, lead, zero=True)
            if part:  # the local and kept rows copied into whole operands, the rest cast again below
                Xkv = whole_operands((xk, xv), kcap, lead, n, min(ctx.kv_rows, kcap))
            else:
                Xkv = None if keep_kv else Operands([local(xk), local(xv)], kcap, lead, zero=True)
        if Xq is not None:
            xq = Xq.x[0]
        if Xkv is not None:
            xk, xv = Xkv.x
        ql, kl, vl = local(xq), local(xk), local(xv)
        works, parts, out = {}, {}, {}
        Xg = None  # dO, lse, delta over X's QO rows
        last = routes.plan.calc.q_ranges.shape[1] - 1  # the last stage
        for op in backward_ops(routes.plan.calc.q_ranges.shape[1], keep_kv and not part):  # K, V again unless kept
            with nvtx_range(op_range(op)):
                if op.kind == DELTA:  # the host computes delta from its final O: O itself never travels
                    delta = _per_rank(routes, lambda r, a, b, *c_: (row_delta(a, b, c_[0] if c_ else None),),
                                      d_o, o, *(() if d_l is None else (d_l,)))[0]
                    Xg = Operands([d_o, lse, delta], qcap, lead, zero=True)
                    del d_o, delta
                elif op.kind == CAST:  # into the receive rows of stage 1's operands
                    if op.route == "qo":
                        sent = tuple(local(x) for x in Xg.x) + (() if keep_q else (ql,))
                        works[op.name] = issue(op, routes, group, sent, Xg.remote() + ([] if keep_q else Xq.remote()))
                        if part_q:  # Q of the rows past the kept ones travels again beside dO
                            tail = issue_tail(op, routes, group, (ql,), tail_q, Xq.remote(), host_q)
                            works[op.name] = with_tail(works[op.name], tail)
                    elif part:  # the rows past the kept ones
                        works[op.name] = issue_tail(op, routes, group, (kl, vl), tail_kv, Xkv.remote(), host_kv)
                    else:
                        works[op.name] = issue(op, routes, group, (kl, vl), Xkv.remote())
                    sent = None  # views of Xg: they must not keep it past the stages
                elif op.kind == WAIT and op.back:
                    out[op.phase] = works.pop(op.deps[0]).wait()
                elif op.kind == WAIT:
                    works.pop(op.deps[0]).wait()  # its rows are in the operands now
                elif op.kind == ATTN:
                    (s,) = op.stages
                    args = (Xg.x[0], xq, xk, xv, Xg.x[1], Xg.x[2])
                    if s == 0:
                        args = tuple(local(a) for a in args)

                    def run(r, *t, s=s):
                        return flex_attn_backward(*t, *_stage_slices(routes.plan, r, s), scale, **_INTERNAL)

                    parts[s] = list(_per_rank(routes, run, *args))
                    del args
                    if s == last:  # the stages are done: the operands built here go before the reduces
                        Xg = Xq = Xkv = xq = xk = xv = ql = kl = vl = None
                elif op.kind == REDUCE:
                    (s,) = op.stages
                    pick = (0,) if op.phase == "bwd.dq" else (1, 2)  # dQ to the QO host, dK and dV to the KV host
                    acc = []
                    for i in pick:  # the host's rows summed in place into stage 0's output (same bits as a + b)
                        a = parts[0][i]
                        for t in range(1, len(parts)):
                            a.add_(local(parts[t][i]))
                        acc.append(a)
                    cap = qcap if op.phase == "bwd.dq" else kcap
                    partials = [remote(parts[s][i], cap) for i in pick]
                    for t in parts:  # each gradient goes back once: its stage outputs are handed over
                        for i in pick:
                            parts[t][i] = None
                    del a
                    works[op.name] = issue(op, routes, group, partials, acc, ctx.deterministic)
                else:
                    raise AssertionError(f"dist_attn cannot run backward op {op}")
        (dq,), (dk, dv) = out["bwd.dq"], out["bwd.dkv"]
        group.wait_sends()  # p2p sends may outlive their wait(): none past the pass
        return (from_group_major(dq, G, lead), from_group_major(dk, G, lead), from_group_major(dv, G, lead),
                None, None, None, None, None, None, None, None)


def _check_inputs(q, k, v, plan: Plan, group) -> None:
    """Shapes against the plan (host metadata only)."""
    check_tensors(q=q, k=k, v=v)
    batched = bool(getattr(group, "batched", False))
    lead = 1 if batched else 0
    P, c, G = plan.comm.cp_size, plan.comm.chunk, plan.comm.head_groups
    want = "[P, c, H, D]" if batched else "[c, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 + lead or (batched and t.shape[0] != P):
            raise ValueError(f"{name} must be {want} with P = {P} (the {type(group).__name__}'s layout), "
                             f"got {tuple(t.shape)}")
        if t.shape[lead] != c:
            raise ValueError(f"{name} holds {t.shape[lead]} tokens per rank but the plan has c = S / P = {c}")
        if t.shape[lead + 1] % G:
            raise ValueError(f"{name} has {t.shape[lead + 1]} heads, not a multiple of the plan's G = {G} head groups")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")


_MOD = (1 << 31) - 1  # digests live in [0, 2^31): every product below stays under 2^62


def _weights(n: int, salt: int, device) -> torch.Tensor:
    """[n] int64 pseudo-random weights in [1, 2^31), a fixed function of (position, salt)."""
    w = (torch.arange(1, n + 1, dtype=torch.int64, device=device) * 2654435761 + salt * 40503) % _MOD
    return (w * w + 12345) % _MOD + 1


def plan_digest(plan: Plan) -> torch.Tensor:
    """0-dim int64 digest of a plan's tensors (assignment, areas, stage tables, splits, status).

    On the plan's device, no host read. Two ranks that solved different masks (or
    the same mask under different configs) get different digests, except with
    probability about 2^-31.
    """
    parts = (plan.assignment, plan.area, plan.calc.q_ranges, plan.calc.k_ranges, plan.calc.attn_type,
             plan.comm.qo_split, plan.comm.kv_split, plan.status)
    h = torch.zeros((), dtype=torch.int64, device=plan.assignment.device)
    for salt, t in enumerate(parts):
        x = t.reshape(-1).to(torch.int64) % _MOD
        h = (h * 1000003 + (x * _weights(x.numel(), salt, x.device) % _MOD).sum()) % _MOD
    return h


def config_digest(*values) -> int:
    """A host int digest of configuration values (their repr), stable across processes."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


def _digest_message(row: int, values: list[int]) -> str:
    rank, other, what = values[:3]
    kind, why = ("configuration", "another config") if what == 0 else ("plan", "another mask or solve")
    return (f"rank {other}'s {kind} digest differs from rank {rank}'s ({why}): every rank of the CP group "
            "must pass the same mask and config (debug_digest)")


errors.register("dist_attn", "plan digest", _digest_message)


def check_plan_digest(plan: Plan, group, config_key: int, *, validate: bool) -> None:
    """Debug mode: all-gather ``[config digest, plan digest]`` over the group and compare.

    Validation mode raises ``ValueError`` naming the ranks that differ (one host read);
    the sync-free mode records a device error flag instead (``gpusolver.check_errors()``).
    ``LocalGroup`` runs every rank from one plan: nothing to compare. A peer that never
    joins makes the all-gather fail within the group's timeout (``CollectiveError``).
    """
    if getattr(group, "batched", False):
        return
    import torch.distributed as dist

    digest = plan_digest(plan)
    mine = torch.stack([torch.full_like(digest, config_key), digest])
    parts = [torch.empty_like(mine) for _ in range(group.size)]
    pg = getattr(group, "process_group", None)
    try:
        work = dist.all_gather(parts, mine, group=pg, async_op=True)
        retain(mine, *parts)  # freed by Python, never by a gloo worker thread (groupcomm._retain)
        timeout = getattr(group, "timeout", None)
        work.wait() if timeout is None else work.wait(timeout)
    except Exception as e:  # a peer that failed or stalled
        raise CollectiveError(f"rank {group.rank}: plan digest all-gather over {group.size} ranks failed: {e}") \
            from e
    table = torch.stack(parts)                                        # [P, 2]
    differ = table != mine[None]                                      # [P, 2]
    if validate:
        bad = differ.any(1).nonzero()
        if bad.numel():
            other = int(bad[0, 0])
            what = 0 if bool(differ[other, 0]) else 1
            raise ValueError(_digest_message(-1, [group.rank, other, what, 0]))
        return
    other = torch.arange(group.size, device=table.device)
    what = differ[:, 0].logical_not().to(torch.int64)
    values = torch.stack([torch.full_like(other, group.rank), other, what, torch.zeros_like(other)], 1)
    errors.record("dist_attn", "plan digest", _digest_message, differ.any(1), values)


def dist_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group, *,
              softmax_scale: float | None = None, deterministic: bool = True,
              keep_forward_buffers: bool | str | None = None, validate: bool | None = None, debug_digest: bool = False,
              config_key: int | None = None, kept_kv_rows: int | None = None,
              kept_q_rows: int | None = None, kept_per_rank: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's query shard over the whole sequence, as ``plan`` assigns the work.

    Args:
        q: ``[c, Hq, D]`` this rank's query shard (tokens ``[rank * c, (rank + 1) * c)``,
            natural order); with a ``LocalGroup`` every rank's shard, ``[P, c, Hq, D]``.
        k, v: ``[c, Hkv, D]`` (``[P, c, Hkv, D]``), Hq a multiple of Hkv (GQA, or MHA).
        plan: the layer's ``Plan`` (``gpusolver.solve``), for the same P, G and c.
        group: ``LocalGroup``, ``TorchGroup`` or ``SymmMemGroup`` (``groupcomm``), or a
            ``torch.distributed`` process group (wrapped as ``groupcomm.default_group`` does).
        softmax_scale: default ``D ** -0.5``.
        deterministic: partial results are reduced rank by rank in a fixed order
            (no float atomics), so outputs are bit-identical across runs.
        keep_forward_buffers: keep the received Q, K, V for the backward (True), cast them
            again (False: less activation memory, more bytes), or keep one kind only ("qo": Q,
            "kv": K and V; the other is cast again). None (default): what the plan's solve
            priced (``plan.cost``: the kinds and the KV rows ``SolverConfig.memory_budget``
            keeps), True for a plan without a cost.
        validate: read ``plan.status`` on the host and raise on a capacity overflow or a
            mask the plan does not fit (default: on for CPU tensors; off on GPU, where
            reading it would sync, and under ``torch.compile``, where it would break the graph).
            Off, the same check is one device error flag that ``gpusolver.check_errors()`` reads.
        debug_digest: all-gather a digest of every rank's plan (and ``config_key``) before the
            layer and raise (validation) or flag (sync-free) when the ranks differ: they were
            given different masks or configs. One small collective per call: a debug mode.
        config_key: a host int digest of the caller's configuration (``config_digest``);
            default: one of the plan's shape (P, c, G, capacities, mu).
        kept_kv_rows: with K and V kept, keep only the first this many rows of the KV receive
            buffer (``SolverConfig.kept_kv_rows``, as ``capacity.keep_for_budget`` resolves a
            ``memory_budget``); the rows past them are cast again in the backward. None: all,
            or with ``keep_forward_buffers=None`` the plan's.
            With S sub-stages the rows are those of the one buffer the S casts share: each
            sub-stage's cast again moves its rows past them (``runtime.kept_rows``).
        kept_q_rows: with Q kept, keep only the first this many rows of the QO receive buffer
            (``SolverConfig.kept_q_rows``); the rows past them are cast again beside dO in the
            backward. None: all, or with ``keep_forward_buffers=None`` the plan's.
        kept_per_rank: True: ``kept_q_rows`` and ``kept_kv_rows`` size one room that each rank
            splits by its own fills, Q first (``SolverConfig.kept_per_rank``); only the rows past
            a rank's kept ones are cast again. None: False, or with ``keep_forward_buffers=None``
            and neither row count given, the plan's.

    Returns:
        out ``[c, Hq, D]`` in q's dtype and lse ``[c, Hq]`` fp32 (natural log; a row with
        no valid key gives out 0 and lse -inf), with a leading ``[P]`` for ``LocalGroup``.
        Differentiable in q, k and v.
    """
    group = as_group(group)
    if not isinstance(plan, Plan):
        hint = " (a sparse mask's plan: run it with sparse_dist_attn or DynamicCPAttention)" \
            if isinstance(plan, SparsePlan) else ""
        raise TypeError(f"plan must be a Plan (gpusolver.solve), got {type(plan).__name__}{hint}")
    _check_inputs(q, k, v, plan, group)
    check_supported(q, k, v, group)  # the support matrix (docs/support_matrix.md), host metadata only
    scale = softmax_scale_of(softmax_scale, q.shape[-1])
    if validate is None:
        validate = q.device.type == "cpu" and not torch.compiler.is_compiling()  # a host read breaks the graph
    if validate:
        plan.validate(ignore=IMBALANCED)  # an imbalanced plan is slow, not wrong
    else:
        errors.record_plan(plan, "dist_attn")
    if debug_digest:
        if config_key is None:
            m = plan.comm
            config_key = config_digest(m.cp_size, m.chunk, m.head_groups, m.tiles, m.buffers.as_tuple(),
                                       plan.calc.capacity, plan.imbalance_tol)
        check_plan_digest(plan, group, config_key, validate=validate)
    with nvtx_range("solve/routes"):
        routes = layer_routes(plan, group)
    if keep_forward_buffers is None:  # run what the solve priced
        cost = plan.cost
        keep_forward_buffers = True if cost is None else cost.keep_forward_buffers
        if kept_per_rank is None and cost is not None and kept_kv_rows is None and kept_q_rows is None:
            kept_per_rank = getattr(cost, "kept_per_rank", False)  # the plan's room, not the caller's rows
        if kept_kv_rows is None and cost is not None:
            kept_kv_rows = cost.kept_kv_rows
        if kept_q_rows is None and cost is not None:
            kept_q_rows = getattr(cost, "kept_q_rows", None)
    keep = kept_kinds(keep_forward_buffers)
    room = _kept_room(kept_per_rank, keep_forward_buffers, kept_q_rows, kept_kv_rows, plan, routes, group, q, k)
    if room is not None:
        kept_q_rows = kept_kv_rows = None  # the room says what each rank keeps
    kv_rows = _kept_rows("kept_kv_rows", kept_kv_rows, plan, plan.comm.kv_recv_capacity)
    q_rows = _kept_rows("kept_q_rows", kept_q_rows, plan, plan.comm.qo_recv_capacity)
    return _DistAttn.apply(q, k, v, routes, group, scale, keep, kv_rows, bool(deterministic), q_rows, room)


def _kept_room(per_rank, keep, q_rows, kv_rows, plan: Plan, routes: LayerRoutes, group, q, k) -> KeptRoom | None:
    """The ``KeptRoom`` of ``kept_per_rank=True`` (checked), else None."""
    if per_rank is None or per_rank is False:
        return None
    check_kept_per_rank(per_rank, keep, q_rows, kv_rows)
    for name, value in (("kept_q_rows", q_rows), ("kept_kv_rows", kv_rows)):
        _kept_rows(name, value, plan, 0)  # the type checks
    if plan.relay is not None:
        raise ValueError("kept_per_rank=True keeps each rank's rows in part, which relay transport does not run "
                         "(plan.relay is set): keep whole kinds (keep_forward_buffers) or solve with "
                         "SolverConfig(ib_relay=False)")
    host_fill = None
    if isinstance(group, TorchGroup):  # this rank's fills from the host splits its casts read (no sync)
        fills = routes.fill if routes.stages is None else routes.stages.recv_rows
        host_fill = (fills["qo"], fills["kv"])
    return kept_room(plan.comm, q_rows, kv_rows, q.shape[-2] // k.shape[-2], host_fill)


def _kept_rows(name: str, value, plan: Plan, capacity: int) -> int:
    """The rows of a receive buffer of ``capacity`` rows kept for the backward, checked: -1 for the
    whole buffer (None, or at least its rows)."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be None or a non-negative int, got {value!r}")
    if plan.relay is not None and value < capacity:
        kind = "QO" if name == "kept_q_rows" else "KV"
        raise ValueError(f"{name}={value} keeps part of the {kind} buffer, which relay transport does not run "
                         f"(plan.relay is set): keep whole kinds (keep_forward_buffers) or solve with "
                         f"SolverConfig(ib_relay=False)")
    return -1 if value >= capacity else value
