"""The layer in S remote sub-stages: every cast up front, each sub-stage waits only for its own.

Shape legend: P ranks, c tokens per rank, G head groups, n = G * c local
group-major rows, cap = the plan's receive rows of a kind (QO for Q, O, dO,
dQ rows; KV for K, V, dK, dV rows), S sub-stages,
h heads per group, D head dim. ``[B, ...]`` is the leading rank dim of a
``LocalGroup`` (absent for one rank).

Operand rows of every sub-stage: ``X = concat(local rows, receive buffer)``, ``n + cap``
rows (CalcMeta's coordinates). The S casts of a kind share that one buffer: cast s writes
its rows in place from row ``CommMeta.stage_base[s - 1]`` of each rank's buffer on
(``group_cast(out=..., recv_offset=...)``), after casts 1..s-1's rows. A unit travels
once, in the cast of the first sub-stage that uses it, so sub-stage s reads only rows of
casts 1..s, and S sub-stages take the receive memory of one. ``cap`` is the plan's capacity on a
static-shape group; on ``TorchGroup`` it is this rank's fill, all S casts' rows, from the host
copy of the splits (``receive_rows``): X, the running out and the fp32 sums hold what this layer
moves here.

Both passes execute ``gpusolver.plan.schedule``'s ``forward_ops(S + 1)`` /
``backward_ops(S + 1)`` op by op (the lists the simulator prices):

Forward: casts 1..S of Q (``fwd.qo.s``) and of K, V (``fwd.kv.s``) are issued
up front; stage 0 (local tasks) runs; sub-stage s waits for cast s only, runs,
merges its partial (out, lse) into the rows of ``X`` it covers, and sends back
the rows whose last task was in s (reduce ``fwd.o.s``, in flight while s + 1
computes). Each reduce merges straight into the host rows of the running (out
fp32, lse) (``group_reduce(inplace=True)``): no host-sized result is made and
merged a second time. When it merges depends on the group, never on timing:
``LocalGroup`` and ``SymmMemGroup`` at the REDUCE op (issue), ``TorchGroup`` at
its WAIT; later sub-stages merge into the same host rows in program order, so
the result is deterministic for each group (the log-sum-exp merge is
associative: the groups agree up to rounding).

Backward: dO, lse and delta (and Q, K, V again without kept buffers) are cast
per sub-stage (``bwd.qo.s``, ``bwd.kv.s``; each kind kept or cast again on its own,
``keep_forward_buffers``; with ``kept_kv_rows`` only the first rows of the shared KV buffer are
kept and each ``bwd.kv.s`` moves its cast's rows past them, ``kept_rows``; with ``kept_q_rows``
likewise the QO buffer's, Q of the rest beside dO in ``bwd.qo.s``); after sub-stage s
the dQ rows (``bwd.dq.s``) and dK, dV rows (``bwd.dkv.s``) whose last task was in s are summed back to their hosts, and
the local stage runs last, while those reduces fly. Each reduce adds into the host rows of the
fp32 gradient sums in place, at issue or at its WAIT as in the forward (no bf16 sum of the
returned rows is made and added again).

Host reads: none with ``LocalGroup``; with ``TorchGroup`` the 4 S ``[P, P]``
split matrices, stacked and copied once without blocking (``host_splits``); each
cast's start row on this rank is summed from that copy (a ``RankFill`` of the casts before it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attn_kernels import flex_attn, flex_attn_backward, merge_out_lse, merge_out_lse_, row_delta
from gpusolver.nvtx import nvtx_range
from gpusolver.plan import Plan
from gpusolver.plan.schedule import ATTN, CAST, DELTA, MERGE, REDUCE, WAIT, Op, backward_ops, forward_ops
from gpusolver.runtime.kept_rows import tail_cast, unpack_room, whole_operands, with_tail
from gpusolver.runtime.layout import natural_copy, to_group_major
from gpusolver.runtime.operands import WINDOW_MIN_ELEMENTS, Operands, row_windows, rows
from gpusolver.runtime.per_rank import per_rank
from groupcomm import TorchGroup, group_cast, group_reduce, host_splits, packed_rows

_INTERNAL = dict(validate=False, flag_errors=False)
KINDS = ("qo", "kv")
WHICH = ("cast", "return")


def stage_phase(base: str, stage: int) -> str:
    """The byte-counter phase of ``base`` (``"fwd.qo"``, ...) in sub-stage ``stage`` (1..S)."""
    return f"{base}.{stage}"


def counter_phases(bases, num_stages: int) -> tuple[str, ...]:
    """Every byte-counter phase a layer of ``num_stages`` S counts ``bases`` under: the bases
    themselves with one remote stage, each base per sub-stage (``stage_phase``) with S > 1."""
    if num_stages == 1:
        return tuple(bases)
    return tuple(stage_phase(b, s) for b in bases for s in range(1, num_stages + 1))


class RouteTables:
    """The send lists and gathers of a layer's sub-stages, built from the plan's metas when first
    read and let go by ``drop`` once every collective that reads them has been issued.

    index(kind, which): S send lists, ``[send_cap]`` (``[P, send_cap]`` batched) int64.
    gather(kind):       S ``[cap]`` (``[P, cap]``) int64 rows of ``X``'s remote part that make each
                        reduce's buffer (-1 past the fill).

    Each is S times a send or receive capacity of int64 (the KV ones 17-25 MB per rank at 8K
    tokens per rank, 64:8, P = 16-64): each pass builds its own (``fresh``), the forward the casts'
    and the O reduces' only, and drops a table after its last collective is issued; the routing a
    layer keeps for its backward holds none. Building one is a handful of ops, no host read.
    """

    def __init__(self, comms: dict, ranks: tuple[int, ...], batched: bool, host: dict | None = None):
        self.comms, self.ranks, self.batched, self.host = comms, ranks, batched, host
        self._built: dict = {}

    def fresh(self, host: dict | None = None) -> "RouteTables":
        """The same tables, none built. host: ``StageRoutes.host`` once its copy has landed (a
        ``TorchGroup`` backward: its forward waited for it): each list is then built only as long
        as the most rows it holds in any sub-stage, not the capacity."""
        return RouteTables(self.comms, self.ranks, self.batched, host)

    def recv_capacity(self, kind: str) -> int:
        """The plan's receive rows of ``kind`` (what a reduce's partials' layout is sized by)."""
        return self.comms[kind].buffers.recv(kind)

    def _longest(self, kind: str, which: str, column: bool) -> int | None:
        """From the host copy: the most rows this rank sends (its split row) or receives (its
        column) in any one sub-stage of ``kind``'s ``which`` routing; None without it."""
        if self.host is None:
            return None
        r = self.ranks[0]
        return max((sum(row[r] for row in part.get()) if column else sum(part.get()[r]))
                   for part in self.host[kind, which])

    def index(self, kind: str, which: str) -> list[torch.Tensor]:
        key = (kind, which)
        if key not in self._built:
            ranks = self.ranks if self.batched else self.ranks[:1]
            lists = self.comms[kind].stage_send_index(kind, ranks, which, self._longest(kind, which, False))
            self._built[key] = list(lists.unbind(1) if self.batched else lists[0].unbind(0))
        return self._built[key]

    def gather(self, kind: str) -> list[torch.Tensor]:
        key = ("gather", kind)
        if key not in self._built:
            comm, ranks = self.comms[kind], self.ranks
            rows = (torch.stack([comm.return_gather(kind, r) for r in ranks]) if self.batched
                    else comm.return_gather(kind, ranks[0], self._longest(kind, "return", True)))
            self._built[key] = list(rows.unbind(1 if self.batched else 0))
        return self._built[key]

    def build(self, *keys) -> None:
        """Build the tables ``keys`` now (``(kind, which)``, ``("gather", kind)``): at a pass's start,
        before its buffers exist, so that a build's temporaries never sit beside them."""
        for a, b in keys:
            self.gather(b) if a == "gather" else self.index(a, b)

    def drop(self, *keys) -> None:
        """Let go of the tables ``keys`` (a collective issued with one holds what it still reads)."""
        for key in keys:
            self._built.pop(key, None)


@dataclass(frozen=True)
class StageRoutes:
    """The routing of each sub-stage's cast and reduce, for the ranks run here.

    tables:                the send lists and gathers (``RouteTables``): each pass builds its own
                           (``fresh``), so a layer keeps none of them from forward to backward.
    split[(kind, which)]:  S ``[P, P]`` int64 split matrices.
    host[(kind, which)]:   S host copies (``TorchGroup``), else S Nones.
    start[kind]:           S ``[P]`` int64: the row of each rank's shared receive buffer where
                           cast s's rows start (``CommMeta.stage_base``).
    host_start[kind]:      S ``RankFill`` of the casts before each (``TorchGroup``: this rank's start, from the host
                           copy of the splits), else S Nones.
    recv_rows[kind]:       ``TorchGroup``: a ``RankFill`` of the S casts, the rows
                           this rank receives in all S casts (its buffer's fill); else None (the
                           buffer is the plan's capacity, ``receive_rows``).

    Beside the tables, the plan's own tensors and small host copies.
    """

    num_stages: int
    tables: RouteTables
    split: dict
    host: dict
    start: dict
    host_start: dict
    recv_rows: dict


def received_rows(host, rank: int) -> int:
    """The rows ``rank`` receives in a routing, from the host copy of its split (``host_splits``'
    part): the sum of the rank's column."""
    return sum(row[rank] for row in host.get())


def at_fill(cap: int, fill) -> int:
    """A buffer's rows: ``cap`` where ``fill`` is None (a static-shape group), else the rows
    ``fill.get()`` counts from the host copy of the splits, at most ``cap``."""
    return cap if fill is None else min(cap, fill.get())


class RankFill:
    """The rows ``rank`` receives in the casts whose host splits are ``parts`` (``host_splits``'
    parts), summed when ``get()`` is first called: a ``TorchGroup`` buffer's fill (``at_fill``)."""

    def __init__(self, parts: list, rank: int):
        self.parts, self.rank = parts, rank

    def get(self) -> int:
        return sum(received_rows(part, self.rank) for part in self.parts)


def stage_routes(plan: Plan, group, ranks: tuple[int, ...], batched: bool, kv_comm=None) -> StageRoutes:
    """kv_comm: the KV route's CommMeta when it is not ``plan.comm`` (a sparse plan's key blocks,
    ``KVBlocks.staged``)."""
    comms = {"qo": plan.comm, "kv": plan.comm if kv_comm is None else kv_comm}
    S = plan.comm.num_stages
    split, host = {}, {}
    for kind in KINDS:
        for which in WHICH:
            split[kind, which] = list(comms[kind].stage_split(kind, which).unbind(0))
    if isinstance(group, TorchGroup):
        # the only host read: all 4 S matrices in one non-blocking copy, awaited by the first collective
        stacked = torch.cat([comms[kind].stage_split(kind, which) for kind in KINDS for which in WHICH])
        parts = host_splits(stacked).parts()
        for b, key in enumerate((kind, which) for kind in KINDS for which in WHICH):
            host[key] = parts[b * S:(b + 1) * S]
        host_start = {kind: [RankFill(host[kind, "cast"][:s - 1], ranks[0]) for s in range(1, S + 1)]
                      for kind in KINDS}
        recv_rows = {kind: RankFill(host[kind, "cast"], ranks[0]) for kind in KINDS}
    else:
        host = {key: [None] * S for key in split}
        host_start = {kind: [None] * S for kind in KINDS}
        recv_rows = {kind: None for kind in KINDS}
    start = {kind: list(comms[kind].stage_base(kind).unbind(0)) for kind in KINDS}
    return StageRoutes(num_stages=S, tables=RouteTables(comms, ranks, batched), split=split, host=host,
                       start=start, host_start=host_start, recv_rows=recv_rows)


def receive_rows(plan: Plan, sr: StageRoutes, kind: str) -> int:
    """Rows of ``kind``'s receive buffer here, the remote rows of its operands ``X`` and of every sum
    over them: the plan's capacity on a static-shape group; on ``TorchGroup`` the rows
    this rank receives in all S casts, read from the host copy of the splits that its first cast
    reads anyway (no other wait), at most the capacity (a plan past it is refused by the cast, as at
    the capacity). Every row a stage reads or a reduce gathers is one a cast brought, so the buffer
    holds what this layer moves here, not what the worst plan could."""
    return at_fill(plan.comm.buffers.recv(kind), sr.recv_rows[kind])


def op_range(op: Op, sub_stages: bool = False) -> str:
    """The NVTX range of one scheduled op (``comm/cast fwd.qo``, ``attn/fwd stage1``, ...); with
    ``sub_stages`` a collective's range names its sub-stage (``comm/cast fwd.qo.2``)."""
    if op.kind in (CAST, REDUCE, WAIT):
        return f"comm/{op.kind} {stage_phase(op.phase, op.stages[0]) if sub_stages else op.phase}"
    if op.kind == ATTN:
        return f"attn/{op.phase} stage{op.stages[0]}"
    return f"attn/{op.phase} {op.kind}"


def _merge(o_a, l_a, o_b, l_b, lead: int):
    """The log-sum-exp merge of two (out, lse) row sets; elementwise, so all ranks in one call. Out in
    o_a's dtype: the running fp32 accumulator merges a stage's (or a reduce's) out in the activation
    dtype, which the merge kernel, one dtype for both, gets as fp32 too."""
    o_b = o_b.to(o_a.dtype)
    if lead == 0:
        return merge_out_lse(o_a, l_a, o_b, l_b)
    B, T = l_a.shape[:2]
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    o, lse = merge_out_lse(flat(o_a), flat(l_a), flat(o_b), flat(l_b))
    return o.view(o_a.shape), lse.view(l_a.shape)


MERGE_PIECES = 8
_CPU_MERGE_WHOLE = 1 << 22  # elements of a CPU accumulator merged in one call (larger: in windows)


def row_elements(x: torch.Tensor, lead: int) -> int:
    """Elements of one row of ``x``'s row dim ``lead`` (0, or 1 under a batch of ranks), all ranks'."""
    return math.prod(x.shape[:lead]) * math.prod(x.shape[lead + 1:])


def _windows(total: int, row_elements: int):
    """``operands.row_windows`` at most ``MERGE_PIECES`` windows of at least ``WINDOW_MIN_ELEMENTS``
    (this module's names, read at each call)."""
    return row_windows(total, row_elements, MERGE_PIECES, WINDOW_MIN_ELEMENTS)


def _merge_into(acc: Operands, o_s, l_s, lead: int) -> None:
    """Merge one stage's (out, lse) into the accumulator's rows, in place (``merge_rows_into``)."""
    merge_rows_into(*acc.x, o_s, l_s, lead)


def merge_rows_into(a_o, a_l, o_s, l_s, lead: int) -> None:
    """Merge (out, lse) ``o_s, l_s`` into the running (out fp32, lse) ``a_o, a_l`` in place, through
    ``merge_out_lse_`` (on CUDA one kernel that allocates nothing; its torch twin makes fp32
    temporaries as large as its rows, so large CPU rows go a window at a time: the merge is
    elementwise, the same bits in any windows). Batched, rank by rank: one rank's rows are
    contiguous, a window of every rank's is not."""
    for x_o, x_l, y_o, y_l in [(a_o, a_l, o_s, l_s)] if lead == 0 else zip(a_o, a_l, o_s, l_s):
        big = x_o.device.type == "cpu" and x_o.numel() > _CPU_MERGE_WHOLE
        for start, width in _windows(x_o.shape[0], row_elements(x_o, 0)) if big else [(0, x_o.shape[0])]:
            merge_out_lse_(*(t.narrow(0, start, width) for t in (x_o, x_l, y_o, y_l)))


def merge_gradients(host, returned, lead: int, n: int):
    """dQ, dK, dV on their host: the host's own rows (``host``: its dQ, dK, dV operands) plus what
    came back, ``returned`` as (phase, results), summed in that order in place into the host's fp32
    rows (the relay's hops). The pipelined backward's reduces sum into those rows themselves
    (``group_reduce(inplace=True)``): it passes nothing and takes the host rows' views."""
    dq, dk, dv = (rows(t, lead, 0, n) for t in host)
    for phase, parts in returned:
        if phase == "bwd.dq":
            dq.add_(parts[0])
        else:
            dk.add_(parts[0])
            dv.add_(parts[1])
    return dq, dk, dv


def _slices(plan: Plan, rank: int, stage: int):
    c = plan.calc
    return c.q_ranges[rank, stage], c.k_ranges[rank, stage], c.attn_type[rank, stage]




def _gather_remote(x: torch.Tensor, gather: torch.Tensor, n: int, lead: int, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``gather`` of x's remote part as a reduce buffer in ``dtype`` (-1: row 0, past the fill:
    never sent). An overflowed plan run sync-free (``validate=False``, its status flagged) can name
    rows past the receive capacity, which its casts dropped: they read the last row, so the layer
    runs bounded instead of indexing out of range. ``out``: the buffer to write (a view of a packed
    one, ``groupcomm.packed_rows``); else one is made."""
    n_recv = x.shape[lead] - n
    if n_recv == 0:  # no receive rows at all: nothing was received, the buffer is zeros
        shape = (*gather.shape, *x.shape[lead + 1:]) if lead else (gather.shape[0], *x.shape[1:])
        return x.new_zeros(shape, dtype=dtype) if out is None else out.zero_()
    remote = x.narrow(lead, n, n_recv)
    idx = gather.clamp(min=0, max=n_recv - 1)
    shape = (*idx.shape, *x.shape[lead + 1:])
    out = x.new_empty(shape, dtype=dtype) if out is None else out
    # a window of rows at a time: the gathered rows in x's dtype (fp32 sums) exist for one window,
    # never for the whole buffer (twice the size of ``out`` in bf16)
    b = torch.arange(remote.shape[0], device=idx.device)[:, None] if lead else None
    for start, width in _windows(idx.shape[lead], row_elements(out, lead)):
        w = idx.narrow(lead, start, width)
        rows(out, lead, start, width).copy_(remote.index_select(0, w) if lead == 0 else remote[b, w])
    return out


def _returned_rows(sr: StageRoutes, kind: str, stage: int, rank: int, batched: bool) -> int | None:
    """The rows ``rank`` returns in reduce ``stage`` of ``kind`` (those it received in that routing),
    from the host copy of the splits, where the group sizes its moves from it (``TorchGroup``);
    else None (a static-shape group returns whole buffers)."""
    host = None if batched else sr.host[kind, "return"][stage - 1]
    return None if host is None else received_rows(host, rank)


def _reduce_partials(x_parts, sr: StageRoutes, tables: RouteTables, kind: str, stage: int, n: int, lead: int, dtypes, rank: int,
                     batched: bool):
    """Reduce ``stage``'s partials of ``kind`` out of the running rows ``x_parts`` and the receive
    capacity to pass (None: the partials' rows). On ``TorchGroup`` only the rows this rank returns
    are gathered (the first of the reduce's layout; the rest never leave): a reduce buffer of the
    stage's fill, not of the receive capacity."""
    gather = tables.gather(kind)[stage - 1]
    rows_ = _returned_rows(sr, kind, stage, rank, batched)
    if rows_ is not None:
        gather = gather.narrow(0, 0, min(rows_, gather.shape[0]))
    # on TorchGroup several partials (out and lse, dK and dV) are gathered into one packed buffer,
    # which the reduce sends as it is: their rows never exist twice (gathered, then packed)
    into = [None] * len(x_parts) if rows_ is None or len(x_parts) < 2 else \
        packed_rows(gather.shape[0], [t.shape[1:] for t in x_parts], list(dtypes), x_parts[0].device)
    parts = [_gather_remote(t, gather, n, lead, d, out=o) for t, d, o in zip(x_parts, dtypes, into)]
    return parts, (None if rows_ is None else tables.recv_capacity(kind))


class _LastIssue:
    """Drops a routing table once the last collective that reads it has been issued: ``issued(op)``
    after each cast and reduce (``per_stage`` calls of a kind per sub-stage: the forward's reduces
    run once per output branch)."""

    def __init__(self, tables: RouteTables, num_stages: int, per_stage: int = 1):
        self.tables, self.num_stages, self.per_stage, self.count = tables, num_stages, per_stage, {}

    def issued(self, op: Op) -> None:
        which = "return" if op.back else "cast"
        key = (op.route, which)
        self.count[key] = self.count.get(key, 0) + 1
        if self.count[key] == self.num_stages * (self.per_stage if op.back else 1):
            self.tables.drop(key, *((("gather", op.route),) if op.back else ()))


def _issue(op: Op, sr: StageRoutes, tables: RouteTables, group, caps: dict, tensors, acc=None, deterministic: bool = True,
           inplace: bool = False, recv_capacity: int | None = None):
    """Start collective ``op`` of sub-stage ``op.stages[0]``: its Work. ``caps[kind]``: receive rows.
    A cast writes into ``acc`` (the kind's shared receive buffers) at its own rows. A reduce takes
    its partials as a list and empties it (``group_reduce(consume=True)``): a caller that keeps no
    other reference has the partials freed once their rows have left, not when the next reduce
    replaces them. ``inplace``: the reduce writes into ``acc`` (the host rows of the running
    accumulators), which is left as given; else acc is emptied too and freed once read."""
    (s,) = op.stages
    which = "return" if op.back else "cast"
    key, i = (op.route, which), s - 1
    phase = stage_phase(op.phase, s)
    if op.kind == CAST:
        return group_cast(list(tensors), tables.index(*key)[i], sr.split[key][i], caps[op.route], group, phase=phase,
                          host_split=sr.host[key][i], async_op=True, flag_errors=False, out=list(acc),
                          recv_offset=sr.start[op.route][i], host_recv_offset=sr.host_start[op.route][i])
    return group_reduce(tensors, tables.index(*key)[i], sr.split[key][i], acc, group,
                        op="lse" if op.phase == "fwd.o" else "sum", phase=phase, host_split=sr.host[key][i],
                        deterministic=deterministic, async_op=True, flag_errors=False, consume=True,
                        inplace=inplace, recv_capacity=recv_capacity)


def _flex(plan: Plan, scale: float):
    """The slice kernel of a stage: ``attend(rank, stage, q, k, v) -> (out, lse)``."""
    return lambda r, s, q_, k_, v_: flex_attn(q_, k_, v_, *_slices(plan, r, s), scale, **_INTERNAL)


def _flex_backward(plan: Plan, scale: float):
    """``attend_bwd(rank, stage, dO, q, k, v, lse, delta) -> (dq, dk, dv)`` of the slice kernel."""
    return lambda r, s, *t: flex_attn_backward(*t, *_slices(plan, r, s), scale, **_INTERNAL)


def _flex_backward_into(plan: Plan, scale: float, ranks, batched: bool, s: int, into, *tensors) -> None:
    """The slice kernel's backward of stage ``s`` per rank, its (dq, dk, dv) added in fp32 straight
    into ``into`` (the fp32 sums' rows, in place): no per-stage gradient tensor is made, where
    ``per_rank`` would stack every rank's dq, dk, dv over the stage's rows. Batched, a rank's rows
    of a ``[P, rows, ...]`` sum are one contiguous block, as the kernel writes them."""
    for r in ranks if batched else ranks[:1]:
        pick = (lambda t: t[r]) if batched else (lambda t: t)
        flex_attn_backward(*(pick(t) for t in tensors), *_slices(plan, r, s), scale,
                           accumulate=tuple(pick(t) for t in into), **_INTERNAL)


def _flex_into(plan: Plan, scale: float, ranks, batched: bool, s: int, into, *tensors) -> None:
    """The slice kernel of stage ``s`` per rank, its (out, lse) merged in fp32 straight into ``into``
    (the running (out fp32, lse) rows, in place): no stage output is made, where ``per_rank`` would
    stack every rank's out over the stage's rows (as large as its operand) for a merge to read."""
    for r in ranks if batched else ranks[:1]:
        pick = (lambda t: t[r]) if batched else (lambda t: t)
        flex_attn(*(pick(t) for t in tensors), *_slices(plan, r, s), scale, accumulate=tuple(pick(t) for t in into),
                  **_INTERNAL)


def forward_stages(plan: Plan, group, ranks, batched: bool, sr: StageRoutes, ql, kl, vl, scale: float,
                   deterministic: bool, *, extra=(), attend=None, branches: int = 1, groups: int = 1,
                   out_groups: int = 0):
    """Run ``forward_ops(S + 1, branches)``: (outs, the operand tensors [Xq, *X extra, Xk, Xv] for the
    backward), group-major; ``outs`` is (out, lse) per output branch, flat: ``(o_0, lse_0, o_1, ...)``.
    groups: ql, kl, vl are group-major rows (1), or with G > 1 the shards in their natural layout
    ``[*, c, H, D]``, written group-major straight into the operands' local rows (``Operands``),
    which every later read sees: no group-major copy of them exists.
    extra: per-row tensors that travel with Q (a sparse layer's selection rows);
    attend(rank, stage, q, k, v, *extra) -> (out_0, lse_0, ...): the stage kernel, one (out, lse)
    per branch (default: the slice kernel, one branch). Each branch keeps its own running (out,
    lse) and is reduced and merged on its own (an NSA layer's selection and window branches).
    out_groups: 0 (default) returns each out group-major; G >= 1 returns it in the natural layout of
    G head groups (``layout.from_group_major``'s), written straight from the fp32 sums
    (``layout.natural_copy``): no group-major copy of it in its dtype is made."""
    lead = 1 if batched else 0
    S = sr.num_stages
    caps = {kind: receive_rows(plan, sr, kind) for kind in KINDS}
    # this pass's routing tables (built here, inside the pass: under torch.compile the layer's
    # routing is state from outside it, never written), before its buffers exist; on TorchGroup the
    # host copy of the splits has landed (the fills above read it), so each list only as long as
    # the most rows it holds in a sub-stage
    tables = sr.tables.fresh(host=None if batched or sr.host["qo", "cast"][0] is None else sr.host)
    tables.build(("qo", "cast"), ("kv", "cast"), ("qo", "return"), ("gather", "qo"))
    # the slice kernel merges each stage's result into the running (out fp32, lse) itself
    # (``_flex_into``); a custom kernel (a sparse layer's) returns its parts, merged here
    fused = attend is None
    attend = _flex(plan, scale) if attend is None else attend
    # the operands, allocated before the casts that fill their receive rows; the local rows are
    # read from them (the casts send them, stage 0 attends them)
    X = {"qo": Operands([ql, *extra], caps["qo"], lead, zero=True, groups=(groups,) + (1,) * len(extra)),
         "kv": Operands([kl, vl], caps["kv"], lead, zero=True, groups=groups)}
    ql, *extra = X["qo"].local()
    kl, vl = X["kv"].local()
    sent = {"qo": (ql, *extra), "kv": (kl, vl)}
    works = {}
    last = _LastIssue(tables, S, per_stage=branches)
    acc, dtypes, outs = [], [], []
    n = X["qo"].n
    for op in forward_ops(S + 1, branches):
        with nvtx_range(op_range(op, sub_stages=True)):
            if op.kind == CAST:
                works[op.name] = _issue(op, sr, tables, group, caps, sent[op.route], X[op.route].remote())
                last.issued(op)
            elif op.kind == WAIT and op.back:  # the reduce merges into the host's rows (in place): by now
                works.pop(op.deps[0]).wait()
            elif op.kind == WAIT:
                works.pop(op.deps[0]).wait()  # cast s's rows are in X now; its work (a view of X) let go
            elif op.kind == ATTN and op.stages == (0,) and fused:  # the running result of every row of X
                acc.append(Operands.zeros([ql], caps["qo"], lead, torch.float32))
                acc[0].x.append(ql.new_full(acc[0].x[0].shape[:lead + 2], float("-inf"), dtype=torch.float32))
                dtypes.append((ql.dtype, torch.float32))
                _flex_into(plan, scale, ranks, batched, 0, [rows(t, lead, 0, n) for t in acc[0].x], ql, kl, vl)
            elif op.kind == ATTN and fused:
                (s,) = op.stages
                _flex_into(plan, scale, ranks, batched, s, acc[0].x, X["qo"].x[0], *X["kv"].x)
            elif op.kind == ATTN and op.stages == (0,):
                parts = per_rank(ranks, batched, lambda r, *t: attend(r, 0, *t), ql, kl, vl, *extra)
                for b in range(branches):  # running (out fp32, lse) of every row of X, per branch
                    o0, l0 = parts[2 * b], parts[2 * b + 1]
                    dtypes.append((o0.dtype, l0.dtype))
                    acc.append(Operands([o0, l0], caps["qo"], lead, zero=True, dtype=torch.float32))
                    acc[-1].remote()[1].fill_(float("-inf"))
                del parts, o0, l0  # merged: a stage's out is as large as its rows, never kept past its merge
            elif op.kind == ATTN:
                (s,) = op.stages
                xq, *x_extra = X["qo"].x
                parts = per_rank(ranks, batched, lambda r, *t: attend(r, s, *t), xq, *X["kv"].x, *x_extra)
                for b in range(branches):
                    _merge_into(acc[b], parts[2 * b], parts[2 * b + 1], lead)
                del parts
            elif op.kind == REDUCE:
                (s,), b = op.stages, op.branch
                group.drop_landed_sends()  # the last reduce's send buffer, if it has landed, before these
                # the partials handed over (no name keeps them): freed once sent, not held through s + 1;
                # merged into the host rows of the running (out fp32, lse) themselves
                parts, cap = _reduce_partials(acc[b].x, sr, tables, "qo", s, n, lead, dtypes[b], ranks[0], batched)
                works[op.name] = _issue(op, sr, tables, group, caps, parts, [rows(t, lead, 0, n) for t in acc[b].x],
                                        deterministic, inplace=True, recv_capacity=cap)
                last.issued(op)
                del parts
            elif op.kind == MERGE:  # every return is merged in: the host's rows are the output
                for b in range(branches):
                    h_o, h_l = (rows(t, lead, 0, n) for t in acc[b].x)
                    # copies: the output never holds acc
                    h_o = (h_o.to(dtypes[b][0], copy=True) if out_groups == 0
                           else natural_copy(h_o, out_groups, lead, dtypes[b][0]))
                    outs += [h_o, h_l.clone()]
            else:
                raise AssertionError(f"dist_attn cannot run forward op {op}")
    return tuple(outs), X["qo"].x + X["kv"].x


def backward_stages(plan: Plan, group, ranks, batched: bool, sr: StageRoutes, ql, kl, vl, o, lse, kept_q,
                    kept_kv, d_o, d_l, scale: float, deterministic: bool, *, extra=(), kept_extra=(),
                    attend_bwd=None, more_branches=(), kept_kv_rows: int = -1, kept_q_rows: int = -1,
                    groups: int = 1, kept_room=None, o_natural: bool = False, out_groups: int = 0):
    """Run ``backward_ops(S + 1)``: (dq, dk, dv) group-major. ``kept_q``: the forward's Xq or None
    (Q is cast again with dO); ``kept_kv``: its [Xk, Xv] or None (K, V are cast again).
    kept_kv_rows >= 0: ``kept_kv`` holds the local rows and only the first this many rows of the
    shared KV buffer; each sub-stage's KV cast runs again restricted to its rows past them
    (``kept_rows.tail_cast``, phases ``bwd.kv.s``) into whole operands (``kept_rows.whole_operands``).
    kept_q_rows >= 0: likewise ``kept_q`` (and ``kept_extra``) hold only the first this many rows of
    the QO buffer; the rows past them travel again beside dO in each sub-stage's ``bwd.qo.s``.
    kept_room: ``(KeptRoom, room)`` with ``kept_per_rank`` (``kept_q``, ``kept_kv`` None): each rank's
    kept Q and K, V rows in the room (``kept_rows.pack_room``), the rest cast again as above with
    per-rank first rows.
    extra / kept_extra: the rows travelling with Q (``forward_stages``) and, with ``kept_q``, their
    kept X; attend_bwd(rank, stage, dO, q, k, v, lse, delta, *extra, *more) -> (dq, dk, dv), the
    gradients of every branch summed. more_branches: the other output branches' (o, lse, dO, dlse
    or None), as the first's (an NSA layer's window branch): each gets its own delta, its dO, lse
    and delta travel in the same ``bwd.qo`` casts after the first's, and ``more`` is their
    (dO, lse, delta) per branch, in that order. groups: ``d_o`` is group-major rows (1), or with
    G > 1 the upstream grad in its natural layout ``[*, c, Hq, D]``; either way it is written
    group-major straight into its operand, whose local rows are the dO every later step reads.
    o_natural: ``o``, ``d_o`` and ``d_l`` are in the natural layout of ``groups`` head groups (the
    layer's output as it returned and saved it: no group-major copy of O exists); the first branch's
    delta is computed there and made group-major (a ``[c, H]`` fp32 copy). out_groups: as
    ``forward_stages``' (the gradients in that natural layout, straight from the fp32 sums). The
    operands are freed before the gradients are made, and each kind's fp32 sums once its gradients
    are: the pass's peak is never its end."""
    lead = 1 if batched else 0
    S = sr.num_stages
    # the routing tables first, before any operand or sum: their builds' temporaries never sit
    # beside those (K, V are cast again unless kept whole)
    kv_cast = kept_kv is None or kept_kv_rows >= 0 or kept_room is not None
    # on TorchGroup the forward waited for the host copy of the splits: each list only as long as
    # the most rows it holds in a sub-stage, not the capacity
    tables = sr.tables.fresh(host=None if batched or sr.host["qo", "cast"][0] is None else sr.host)
    tables.build(("qo", "cast"), ("qo", "return"), ("kv", "return"), ("gather", "qo"), ("gather", "kv"),
                 *((("kv", "cast"),) if kv_cast else ()))
    caps = {kind: receive_rows(plan, sr, kind) for kind in KINDS}
    cap_q, cap_k = caps["qo"], caps["kv"]
    # the kept KV rows here: the plan's (which route the casts again), at most the buffer's
    n = ql.shape[lead]
    works = {}
    last = _LastIssue(tables, S)
    # the slice kernel sums each stage's share into the fp32 sums itself (``_flex_backward_into``);
    # a custom kernel (a sparse layer's) returns its gradients, added here
    fused = attend_bwd is None
    attend_bwd = _flex_backward(plan, scale) if attend_bwd is None else attend_bwd
    # the kept rows of a kind kept in part: an int (every rank's) or [P] (each rank's, kept_room)
    tail_q, tail_kv, host_q, host_kv = kept_q_rows, kept_kv_rows, None, None
    if kept_room is not None:  # each rank's kept rows out of the room, the rest cast again
        room, pool = kept_room
        Xq, Xkv = unpack_room(pool, ql, kl, vl, room, ranks, cap_q, cap_k, lead)
        del pool, kept_room
        tail_q, tail_kv, host_q, host_kv = room.kept_q, room.kept_kv, room.host_kept("qo"), room.host_kept("kv")
        part_q = part = True
        kept_q = Xq.x[0]
    else:
        part_q = kept_q is not None and kept_q_rows >= 0
        if part_q:  # the local and kept rows, the rest cast again beside dO
            Xq = whole_operands([kept_q, *kept_extra], cap_q, lead, n, min(kept_q_rows, cap_q))
        else:
            Xq = Operands([ql, *extra], cap_q, lead, zero=True) if kept_q is None else None
        part = kept_kv is not None and kept_kv_rows >= 0
        if part:  # the local and kept rows, the rest cast again
            Xkv = whole_operands(kept_kv, cap_k, lead, n, min(kept_kv_rows, cap_k))
        else:
            Xkv = Operands([kl, vl], cap_k, lead, zero=True) if kept_kv is None else None
    if part:
        kept_kv = None
    xq = [kept_q, *kept_extra] if kept_q is not None and not part_q else Xq.x
    xk, xv = kept_kv if kept_kv is not None else Xkv.x
    grads = Xg = None
    # fp32 sums over the rows of each kind's operands (the local stage may run last: start from zero)
    grads_q = Operands.zeros([ql], cap_q, lead, torch.float32)
    grads_kv = Operands.zeros([kl, vl], cap_k, lead, torch.float32)

    def run(s):
        return lambda r, *t: attend_bwd(r, s, *t)

    for op in backward_ops(S + 1, kept_kv is not None):
        with nvtx_range(op_range(op, sub_stages=True)):
            if op.kind == DELTA:  # the host computes delta from its final O: O itself never travels
                # dO goes into its operand first and delta is computed from its rows there: the
                # operands' local rows are the only dO, lse and delta the stages and casts read
                def deltas(do_b, o_b, dl_b):
                    return per_rank(ranks, batched, lambda r, a, b, *c_: (row_delta(a, b, c_[0] if c_ else None),),
                                    do_b, o_b, *(() if dl_b is None else (dl_b,)))[0]

                # o natural: the first branch's delta from the natural dO, before dO goes group-major
                delta = to_group_major(deltas(d_o, o, d_l), groups, lead).contiguous() if o_natural else None
                first = Operands([d_o], cap_q, lead, zero=True, groups=groups)
                d_o = None
                do_b = first.local()[0]
                if delta is None:
                    delta = deltas(do_b, o, d_l)
                trio = [do_b, lse, delta]  # (dO, lse, delta) of each branch
                for o_b, l_b, do_b, dl_b in more_branches:
                    delta = deltas(do_b, o_b, dl_b)
                    trio += [do_b, l_b, delta]
                Xg = first.join(Operands(trio[1:], cap_q, lead, zero=True))
                grads = Xg.local()
                del first, trio, delta, do_b
            elif op.kind == CAST:
                if op.route == "qo":
                    tensors = tuple(grads) + (() if kept_q is not None else (ql, *extra))
                    into = Xg.remote() + ([] if kept_q is not None else Xq.remote())
                    works[op.name] = _issue(op, sr, tables, group, caps, tensors, into)
                    if part_q:  # Q of sub-stage s's rows past the kept ones travels again beside dO
                        (s,) = op.stages
                        key = ("qo", "cast")
                        tail = tail_cast((ql, *extra), tables.index(*key)[s - 1], sr.split[key][s - 1], tail_q,
                                         Xq.remote(), group, phase=stage_phase(op.phase, s), ranks=ranks,
                                         batched=batched, base=sr.start["qo"][s - 1],
                                         host_base=sr.host_start["qo"][s - 1], host_kept=host_q)
                        works[op.name] = with_tail(works[op.name], tail)
                elif part:  # sub-stage s's rows past the kept ones, into the buffer rows past them
                    (s,) = op.stages
                    key = ("kv", "cast")
                    works[op.name] = tail_cast((kl, vl), tables.index(*key)[s - 1], sr.split[key][s - 1], tail_kv,
                                               Xkv.remote(), group, phase=stage_phase(op.phase, s), ranks=ranks,
                                               batched=batched, base=sr.start["kv"][s - 1],
                                               host_base=sr.host_start["kv"][s - 1], host_kept=host_kv)
                else:
                    works[op.name] = _issue(op, sr, tables, group, caps, (kl, vl), Xkv.remote())
                last.issued(op)
            elif op.kind == WAIT and op.back:  # the reduce sums into the host's rows (in place): by now
                works.pop(op.deps[0]).wait()
            elif op.kind == WAIT:
                # cast s's rows are in the operands now; its work let go: it holds views of them, which
                # would keep them past the pass's MERGE, where they are freed
                works.pop(op.deps[0]).wait()
            elif op.kind == ATTN and op.stages == (0,) and fused:  # local rows only: its grads never travel
                host = [rows(t, lead, 0, n) for t in grads_q.x + grads_kv.x]
                _flex_backward_into(plan, scale, ranks, batched, 0, host, grads[0], ql, kl, vl, grads[1], grads[2])
            elif op.kind == ATTN and op.stages == (0,):
                parts = per_rank(ranks, batched, run(0), grads[0], ql, kl, vl, grads[1], grads[2], *extra,
                                  *grads[3:])
                for acc_, part in zip(grads_q.x + grads_kv.x, parts):
                    rows(acc_, lead, 0, n).add_(part)
                del parts, part
            elif op.kind == ATTN:
                (s,) = op.stages
                g_do, g_lse, g_delta, *g_more = Xg.x
                if fused:
                    _flex_backward_into(plan, scale, ranks, batched, s, grads_q.x + grads_kv.x,
                                        g_do, xq[0], xk, xv, g_lse, g_delta)
                    continue
                parts = per_rank(ranks, batched, run(s), g_do, xq[0], xk, xv, g_lse, g_delta, *xq[1:], *g_more)
                for acc_, part in zip(grads_q.x + grads_kv.x, parts):
                    acc_.add_(part)
                del parts, part  # summed: a stage's gradients are as large as its rows
            elif op.kind == REDUCE:
                (s,) = op.stages
                kind = "qo" if op.phase == "bwd.dq" else "kv"
                pick = grads_q.x if kind == "qo" else grads_kv.x
                dtype = ql.dtype if kind == "qo" else kl.dtype
                group.drop_landed_sends()  # the last reduce's send buffer, if it has landed, before these
                # the partials handed over (no name keeps them): freed once sent, not held through s + 1;
                # summed into the host rows of the fp32 sums themselves
                parts, cap = _reduce_partials(pick, sr, tables, kind, s, n, lead, [dtype] * len(pick), ranks[0], batched)
                works[op.name] = _issue(op, sr, tables, group, caps, parts, [rows(t, lead, 0, n) for t in pick],
                                        deterministic, inplace=True, recv_capacity=cap)
                last.issued(op)
                del parts
            elif op.kind == MERGE:  # every reduce is summed in: the host's rows are the gradients
                # nothing reads the operands now: freed before the gradients are made
                Xq = Xkv = Xg = xq = xk = xv = kept_q = kept_kv = grads = tensors = into = None
                g_do = g_lse = g_delta = g_more = host = None
            else:
                raise AssertionError(f"dist_attn cannot run backward op {op}")
    # each kind's gradients straight from its fp32 sums' host rows, which are freed before the next
    # kind's are made: at most one kind's sums live beside the gradients
    out = []
    for sums, like in ((grads_q, (ql,)), (grads_kv, (kl, vl))):
        for t, x in zip(sums.x, like):
            host_rows = rows(t, lead, 0, n)
            out.append(natural_copy(host_rows, max(out_groups, 1), lead, x.dtype))  # a copy: the sums go
        sums.x.clear()
        del t, host_rows
    return tuple(out)
