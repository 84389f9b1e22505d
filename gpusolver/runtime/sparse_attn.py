"""``sparse_dist_attn``: one sparse attention layer (NSA blocks, DSA top-k) over a CP group.

Shape legend: P ranks, c tokens per rank, G head groups, Hq / Hkv heads (hq,
hkv per group), D head dim, cap receive rows, hs selection heads per
group-major row, w selection width.

The layer runs as ``dist_attn`` does (docs/design/layers.md, "Data flow of one layer")
with the sparse kernel in its stages:

1. local shards become group-major rows; the selection rows too
   (``[G * c, hs, w]`` int32: a token top-k row is repeated for each group);
2. remote Q travels with its selection rows in one cast (``fwd.qo``), K with V
   in another (``fwd.kv``); stage 0 runs while they are in flight;
3. stage 1 runs on ``concat(local rows, receive buffer)``; each stage's row
   and key-window tables come from the plan (``SparsePlan.stage``);
4. partial (out, lse) of received rows go back and merge on their host (``fwd.o``).

With S > 1 remote sub-stages (``SolverConfig.num_stages``) the layer runs through
``dist_attn``'s own sub-stage executor (``runtime.pipelined.forward_stages`` /
``backward_stages``) with the sparse kernel as its stage kernel and the selection rows
travelling with Q: every cast issued up front, each sub-stage waiting only for its own,
each sub-stage's partials reduced as it ends; the backward likewise. An NSA layer mask's two
branches run in every sub-stage, each with its own running (out, lse) and its own ``fwd.o``
reduce; the backward casts both branches' dO, lse and delta and sums their gradients.

The backward is the delta protocol (``bwd.qo``: dO, lse, delta; ``bwd.dq``,
``bwd.dkv`` back), with the received Q, selection, K and V kept from the
forward unless ``keep_forward_buffers`` is off. An NSA layer mask
(``NSALayerMask``) has two branches, the selection and the sliding window
(slice kernel over the plan's ``window_calc``), each with its own out and lse.

The sharded indexer flow (``gather_sparse_areas``): each rank computes the
block areas of its own query rows and an all-gather over the CP group (a
stack for ``LocalGroup``) gives every rank the whole problem; every rank then
solves it (``solve_sparse_sharded``). Host reads: none with ``LocalGroup``
(the layer runs on ``device="meta"``); ``TorchGroup`` copies the split
matrices as ``dist_attn`` does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from attn_kernels import flex_attn, flex_attn_backward, merge_out_lse, row_delta, sparse_attn, sparse_attn_backward
from gpusolver import errors
from gpusolver.areas.sparse import AreaRows, areas_from_rows, sparse_area_rows, used_block_rows
from gpusolver.config import SolverConfig, check_config
from gpusolver.masks.sparse import BlockSparseMask, NSALayerMask, TokenTopKMask
from gpusolver.nvtx import nvtx_range
from gpusolver.plan.meta import IMBALANCED
from gpusolver.plan.sparse import (SelectionSpec, SparsePlan, build_sparse_plan,
                                   default_kv_block, no_worse_than_owner, sparse_config)
from gpusolver.plan.schedule import ATTN, CAST, DELTA, MERGE, REDUCE, WAIT, backward_ops, forward_ops
from gpusolver.sparse_solve import sparse_assignment
from gpusolver.support import check_tensors, softmax_scale_of
from gpusolver.runtime.dist_attn import LayerRoutes, issue, layer_routes
from gpusolver.runtime.layout import from_group_major, to_group_major
from gpusolver.runtime.operands import Operands
from gpusolver.runtime.per_rank import per_rank
from gpusolver.runtime.pipelined import RankFill, backward_stages, forward_stages, op_range, stage_routes
from groupcomm import TorchGroup, as_group, host_splits, retain

SPARSE_MASKS = (BlockSparseMask, TokenTopKMask, NSALayerMask)
# The stages run the plan's own tables, checked once per layer through the plan's status
# (validation: plan.validate(); sync-free: one device flag), so the calls skip their own checks
# (and record nothing from inside the autograd function, which torch.compile traces as a subgraph).
_INTERNAL = dict(validate=False, flag_errors=False)


# -- the sharded indexer flow ------------------------------------------------------------------------

def _shards(mask, group):
    """The masks of the ranks run here: every rank's rows for a ``LocalGroup`` (mask of the whole
    sequence), else this rank's (a mask of c rows at query_offset rank * c)."""
    S, P = mask.total_seqlen_k, group.size
    if S % P:
        raise ValueError(f"total_seqlen_k={S} must be divisible by the group size P={P}")
    c = S // P
    rows = _selection(mask).shape[0]
    if getattr(group, "batched", False):
        if rows != S or mask.query_offset != 0:
            raise ValueError(f"with a LocalGroup the mask holds every rank's rows: T = S = {S} from query_offset 0, "
                             f"got T = {rows} from {mask.query_offset}")
        return [mask.rows(r * c, (r + 1) * c) for r in range(P)]
    if rows != c or mask.query_offset != group.rank * c:
        raise ValueError(f"rank {group.rank} must hold its own c = {c} rows at query_offset = {group.rank * c}, "
                         f"got T = {rows} at query_offset = {mask.query_offset}")
    return [mask]


def _selection(mask) -> torch.Tensor:
    if isinstance(mask, TokenTopKMask):
        return mask.topk_indices
    return (mask.selection if isinstance(mask, NSALayerMask) else mask).block_indices


def gather_sparse_areas(mask, config: SolverConfig, group, kv_block: int | None = None):
    """Every rank's row of block areas, all-gathered: (BlockAreas [G, U, U], mask error [] bool,
    used blocks [G, U, S / kv_block] bool or None).

    Each rank computes ``sparse_area_rows`` of its own rows (``LocalGroup``: every simulated
    rank, stacked) and, with ``kv_block``, which key blocks its rows attend
    (``used_block_rows``); ``TorchGroup`` / ``SymmMemGroup`` all-gather them over the process
    group in one collective (int64: ``m * G * U * 6`` area words, the last channel the ranks'
    mask-error flags, then ``m * G * NB`` block flags), so every rank holds the same problem.
    Sync-free on the device.
    """
    U, G = config.num_units, config.head_groups
    parts, used = [], []
    for shard in _shards(mask, group):
        rows: AreaRows = sparse_area_rows(shard, U, G)
        flag = shard.value_error().to(torch.int64).expand(rows.area.shape[1], G, U, 1)
        parts.append(torch.cat((rows.pack(), flag), dim=-1))
        if kv_block is not None:
            used.append(used_block_rows(shard, U, G, kv_block).transpose(0, 1))  # [m, G, NB]
        chunk = rows.chunk
    if getattr(group, "batched", False):
        packed = torch.cat(parts)
        used = torch.cat(used) if used else None
    else:
        local = parts[0]
        words = [local.reshape(-1)] + ([used[0].reshape(-1).to(torch.int64)] if used else [])
        flat = torch.cat(words)
        gathered = [torch.empty_like(flat) for _ in range(group.size)]
        dist.all_gather(gathered, flat, group=getattr(group, "process_group", None))
        retain(flat, *gathered)  # freed by Python, never by a gloo worker thread (groupcomm._retain)
        n = local.numel()
        packed = torch.cat([x[:n].view(local.shape) for x in gathered])
        used = torch.cat([x[n:].view(used[0].shape).bool() for x in gathered]) if used else None
    areas = areas_from_rows(packed[..., :5], chunk, config.chunk_tiles)
    return areas, packed[..., 5].amax() > 0, (None if used is None else used.transpose(0, 1).contiguous())


def solve_sparse_sharded(mask, config: SolverConfig, group, *, solver: str = "device", impl: str = "auto",
                         validate: bool | None = None, kv_block: int | None | str = "auto") -> SparsePlan:
    """The sharded flow of one layer: local area rows, all-gather, the same solve on every rank, metas.

    mask: the rows this process holds (see ``_shards``: every rank's rows for a ``LocalGroup``,
    else this rank's c rows at ``query_offset = rank * c``). validate: host checks of the local
    rows and of the plan (default: on for CPU tensors outside ``torch.compile``). kv_block: K and
    V travel as blocks of this many keys, or as hulls (None); "auto": ``default_kv_block``.
    """
    if not isinstance(mask, SPARSE_MASKS):
        raise TypeError(f"mask must be a BlockSparseMask, TokenTopKMask or NSALayerMask, got {type(mask).__name__}")
    check_config(config)
    group = as_group(group)
    if config.cp_size != group.size:
        raise ValueError(f"config.cp_size={config.cp_size} but the group has {group.size} ranks")
    config = config.for_sparse()
    spec = SelectionSpec.of(mask, config.head_groups)
    if validate is None:
        validate = mask.device.type == "cpu" and not torch.compiler.is_compiling()
    if validate:
        mask.validate()
    if kv_block == "auto":
        kv_block = default_kv_block(mask, config)
    with nvtx_range("solve/areas"):
        areas, error, used = gather_sparse_areas(mask, config, group, kv_block)
    with nvtx_range("solve/assign"):
        assignment = sparse_assignment(areas, sparse_config(config, spec), solver=solver, impl=impl)
        assignment = no_worse_than_owner(areas, assignment, config, spec, used, kv_block)
    with nvtx_range("solve/metas"):
        plan = build_sparse_plan(areas, assignment, config, spec, mask.total_seqlen_k, mask_error=error,
                                 used_blocks=used, kv_block=kv_block)
    if validate:
        plan.validate(ignore=IMBALANCED)
    return plan


# -- the layer -----------------------------------------------------------------------------------------

def sparse_routes(plan: SparsePlan, group) -> LayerRoutes:
    """``layer_routes`` of the plan, with the KV routing of its key blocks when it has them."""
    from dataclasses import replace

    kb = plan.kv_blocks
    if plan.comm.num_stages > 1:  # sub-stages: the pipelined executor's routing, K and V by block if so
        batched = bool(getattr(group, "batched", False))
        ranks = tuple(range(plan.comm.cp_size)) if batched else (group.rank,)
        if group.size != plan.comm.cp_size:
            raise ValueError(f"the plan is for P = {plan.comm.cp_size} ranks but the group has {group.size}")
        return LayerRoutes(plan=plan, ranks=ranks, batched=batched, qo_index=None, kv_index=None, qo_split=None,
                           kv_split=None, qo_host=None, kv_host=None,
                           stages=stage_routes(plan, group, ranks, batched, None if kb is None else kb.staged))
    routes = layer_routes(plan, group)  # its K, V send list is by key block already (``send_lists``)
    if kb is None:
        return routes
    kv_host, fill = None, None
    if isinstance(group, TorchGroup):
        kv_host = host_splits(kb.kv_split)
        fill = {"qo": routes.fill["qo"], "kv": RankFill([kv_host], routes.ranks[0])}
    return replace(routes, kv_split=kb.kv_split, kv_host=kv_host, fill=fill)


def _per_rank(routes: LayerRoutes, fn, *tensors):
    return per_rank(routes.ranks, routes.batched, fn, *tensors)


def _selection_rows(sel: torch.Tensor, G: int, lead: int) -> torch.Tensor:
    """Local selection ``[*, c, w]`` (token top-k) or ``[*, c, Hkv, w]`` (blocks) -> group-major
    ``[*, G * c, hs, w]`` int32."""
    sel = sel.to(torch.int32)
    if sel.dim() == lead + 2:
        shape = list(sel.shape)
        sel = sel.unsqueeze(lead + 1).expand(*shape[:lead + 1], G, shape[-1])
    return to_group_major(sel, G, lead).contiguous()


def stage_tables(plan: SparsePlan, ranks) -> dict:
    """rank -> each stage's kernel tables (``SparsePlan.stage``), built from the plan for a pass: the
    forward builds them, and the backward again (a layer keeps none of them between the two)."""
    return {r: tuple(plan.stage(r, s) for s in range(plan.comm.num_stages + 1)) for r in ranks}


def _sparse_kernels(plan: SparsePlan, stages, scale: float, backend: str, deterministic: bool):
    """The kernels of each stage as the pipelined executor calls them: ``attend(rank, stage, q, k, v,
    sel) -> (out, lse[, out_win, lse_win])`` and ``attend_bwd(rank, stage, dO, q, k, v, lse, delta,
    sel[, dO_win, lse_win, delta_win]) -> (dq, dk, dv)`` over the stage's tables: the sparse kernel,
    and for an NSA layer mask the slice kernel over the window branch's ``window_calc`` too (its
    gradients summed with the selection's)."""
    block, wc = plan.spec.block_size, plan.window_calc if plan.spec.window_size else None

    # a stage's row tables span X at the plan's capacity; X may hold fewer rows (on TorchGroup, the
    # rank's fill: ``pipelined.receive_rows``), every row past them unused
    def attend(r, s, q_, k_, v_, s_):
        st = stages[r][s]
        T = q_.shape[0]
        out = sparse_attn(q_, k_, v_, s_, block, scale, q_pos=st.q_pos[:T], q_class=st.q_class[:T],
                          kv_windows=st.kv_windows, window=st.window, backend=backend)
        if wc is not None:
            out = tuple(out) + tuple(flex_attn(q_, k_, v_, wc.q_ranges[r, s], wc.k_ranges[r, s],
                                               wc.attn_type[r, s], scale, **_INTERNAL))
        return out

    def attend_bwd(r, s, d_o, q_, k_, v_, lse, delta, s_, *win):
        st = stages[r][s]
        T = q_.shape[0]
        dq, dk, dv = sparse_attn_backward(d_o, q_, k_, v_, lse, delta, s_, block, scale, q_pos=st.q_pos[:T],
                                          q_class=st.q_class[:T], kv_windows=st.kv_windows, window=st.window,
                                          backend=backend, deterministic=deterministic)
        if wc is not None:
            d_w, lse_w, delta_w = win
            g = flex_attn_backward(d_w, q_, k_, v_, lse_w, delta_w, wc.q_ranges[r, s], wc.k_ranges[r, s],
                                   wc.attn_type[r, s], scale, **_INTERNAL)
            dq, dk, dv = dq + g[0], dk + g[1], dv + g[2]
        return dq, dk, dv

    return attend, attend_bwd


def _forward_sub_stages(ctx, ql, kl, vl, sl, sel, routes: LayerRoutes, stages, group, scale, keep, deterministic,
                        backend):
    """S > 1 remote sub-stages: ``pipelined.forward_stages`` with the sparse kernel (and the window
    branch's slice kernel: one (out, lse) per branch), the selection rows travelling with Q. Saves
    for the backward what it reads: the local rows, every branch's (out, lse) and, kept, the operands;
    cast again, the selection as given (``sel``: one row per token, its group rows ``sl`` made again)."""
    attend, _ = _sparse_kernels(routes.plan, stages, scale, backend, deterministic)
    lead = 1 if routes.batched else 0
    nb = 2 if routes.plan.spec.window_size else 1
    outs, (xq, xs, xk, xv) = forward_stages(routes.plan, group, routes.ranks, routes.batched, routes.stages,
                                            ql, kl, vl, scale, deterministic, extra=(sl,), attend=attend,
                                            branches=nb)
    if keep:  # the local rows are the operands' first rows: kept once, as views
        n = ql.shape[lead]
        ql, sl, kl, vl = (x.narrow(lead, 0, n) for x in (xq, xs, xk, xv))
    ctx.save_for_backward(ql, kl, vl, sl if keep else sel, *outs, *((xq, xs, xk, xv) if keep else ()))
    ctx.routes, ctx.group, ctx.scale = routes.for_backward(), group, scale
    ctx.keep, ctx.deterministic, ctx.backend, ctx.branches = keep, deterministic, backend, nb
    group.wait_sends()  # p2p sends may outlive their wait(): none past the pass
    G = routes.groups
    return tuple(from_group_major(x, G, lead) for x in outs)


def _backward_sub_stages(ctx, *grads):
    """grads: (dout, dlse) per branch, as ``_forward_sub_stages`` returned (out, lse)."""
    routes, group = ctx.routes.restored(), ctx.group
    lead = 1 if routes.batched else 0
    G, nb = routes.groups, ctx.branches
    saved = ctx.saved_tensors
    ql, kl, vl, sl = saved[:4]
    if not ctx.keep:  # saved as given: its rows per head group, as the forward made them
        sl = _selection_rows(sl, G, lead)
    outs, kept = saved[4:4 + 2 * nb], saved[4 + 2 * nb:]
    stages = stage_tables(routes.plan, routes.ranks)
    _, attend_bwd = _sparse_kernels(routes.plan, stages, ctx.scale, ctx.backend, ctx.deterministic)
    branches = []  # (o, lse, dO, dlse or None) per branch
    for b in range(nb):
        o, lse = outs[2 * b], outs[2 * b + 1]
        d_out, d_lse = grads[2 * b], grads[2 * b + 1]
        d_o = torch.zeros_like(o) if d_out is None else to_group_major(d_out, G, lead).contiguous()
        d_l = None if d_lse is None else to_group_major(d_lse, G, lead).contiguous()
        branches.append((o, lse, d_o, d_l))
    (o, lse, d_o, d_l), more = branches[0], tuple(branches[1:])
    xq, xs, xk, xv = kept if ctx.keep else (None,) * 4
    dq, dk, dv = backward_stages(routes.plan, group, routes.ranks, routes.batched, routes.stages, ql, kl, vl, o,
                                 lse, xq, None if xk is None else [xk, xv], d_o, d_l, ctx.scale,
                                 ctx.deterministic, extra=(sl,), kept_extra=() if xs is None else (xs,),
                                 attend_bwd=attend_bwd, more_branches=more)
    group.wait_sends()
    return (from_group_major(dq, G, lead), from_group_major(dk, G, lead), from_group_major(dv, G, lead),
            None, None, None, None, None, None, None, None)


class _SparseDistAttn(torch.autograd.Function):
    """Runs ``forward_ops`` / ``backward_ops`` (``gpusolver.plan.schedule``) op by op, as ``dist_attn``;
    with S > 1 remote sub-stages through ``dist_attn``'s pipelined executor (``runtime.pipelined``)."""

    @staticmethod
    def forward(ctx, q, k, v, sel, routes: LayerRoutes, stages, group, scale: float, keep: bool,
                deterministic: bool, backend: str):
        plan: SparsePlan = routes.plan
        spec = plan.spec
        lead = 1 if routes.batched else 0
        G = routes.groups
        sl = _selection_rows(sel, G, lead)
        if routes.stages is not None:
            ql, kl, vl = (to_group_major(x, G, lead).contiguous() for x in (q, k, v))
            return _forward_sub_stages(ctx, ql, kl, vl, sl, sel, routes, stages, group, scale, keep, deterministic,
                                       backend)
        attend, _ = _sparse_kernels(plan, stages, scale, backend, deterministic)
        cap, kcap = routes.recv_rows("qo"), routes.recv_rows("kv")  # as the casts bring them (QO: partial O too)
        n = sl.shape[lead]  # G * c local group-major rows
        local = lambda x: x.narrow(lead, 0, n)  # noqa: E731
        remote = lambda x: x.narrow(lead, n, cap)  # noqa: E731
        # stage 1's operands X = [local rows | receive buffer], allocated once, the shards written
        # group-major straight into their local rows: the casts write their rows into them, so neither
        # the local rows nor the buffers exist a second time (as dist_attn's)
        X = {"qo": Operands([q, sl], cap, lead, zero=True, groups=(G, 1)),
             "kv": Operands([k, v], kcap, lead, zero=True, groups=G)}
        del sl  # its rows are X's first n
        sent = {"qo": X["qo"].local(), "kv": X["kv"].local()}
        nb = 2 if spec.window_size else 1  # one (out, lse) per branch
        works, parts, merged, results = {}, {}, [], [None] * nb
        for op in forward_ops(2, nb):
            with nvtx_range(op_range(op)):
                if op.kind == CAST:
                    works[op.name] = issue(op, routes, group, sent[op.route], X[op.route].remote())
                elif op.kind == WAIT and op.back:
                    results[op.branch] = works.pop(op.deps[0]).wait()
                elif op.kind == WAIT:
                    works.pop(op.deps[0]).wait()  # its rows are in X now
                elif op.kind == ATTN:
                    (s,) = op.stages
                    (xq, xs), (xk, xv) = (sent["qo"], sent["kv"]) if s == 0 else (X["qo"].x, X["kv"].x)
                    parts[s] = _per_rank(routes, lambda r, *t, s=s: attend(r, s, *t), xq, xk, xv, xs)
                elif op.kind == MERGE:
                    for b in range(nb):
                        o, lse = parts[0][2 * b], parts[0][2 * b + 1]
                        for s in op.stages[1:]:
                            o, lse = _per_rank(routes, lambda r, a, b_, c_, d: merge_out_lse(a, b_, c_, d), o, lse,
                                               local(parts[s][2 * b]), local(parts[s][2 * b + 1]))
                        merged.append((o, lse))
                elif op.kind == REDUCE:
                    (s,), b = op.stages, op.branch
                    works[op.name] = issue(op, routes, group, (remote(parts[s][2 * b]), remote(parts[s][2 * b + 1])),
                                           merged[b], deterministic)
                else:
                    raise AssertionError(f"sparse_dist_attn cannot run forward op {op}")
        results = [x for pair in results for x in pair]
        # what the backward reads: the whole X when kept (its local rows are views of it), else copies of
        # the local rows, so X goes now; the selection then as given (one row per token, not one per head
        # group: G times less with a selection shared by every head, DSA's), its group rows made again
        if keep:
            kept = tuple(X["qo"].x + X["kv"].x)
            xq, xs, xk, xv = kept
            local_sel = local(xs)
        else:
            kept = ()
            (xq, _), (xk, xv) = sent["qo"], sent["kv"]
            xq, xk, xv = xq.clone(), xk.clone(), xv.clone()
            local_sel = sel
        del X, sent, parts, merged
        ctx.save_for_backward(local(xq), local(xk), local(xv), local_sel, *results, *kept)
        ctx.routes, ctx.group, ctx.scale = routes.for_backward(), group, scale
        ctx.keep, ctx.deterministic, ctx.backend, ctx.branches = keep, deterministic, backend, len(results) // 2
        group.wait_sends()  # p2p sends may outlive their wait(): none past the pass
        return tuple(from_group_major(x, G, lead) for x in results)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.routes.stages is not None:
            return _backward_sub_stages(ctx, *grads)
        routes, group, scale = ctx.routes.restored(), ctx.group, ctx.scale
        stages = stage_tables(routes.plan, routes.ranks)
        plan: SparsePlan = routes.plan
        lead = 1 if routes.batched else 0
        G, nb = routes.groups, ctx.branches
        qcap, kcap = routes.recv_rows("qo"), routes.recv_rows("kv")  # as the forward's buffers
        saved = ctx.saved_tensors
        ql, kl, vl, sl = saved[:4]
        if not ctx.keep:  # saved as given: its rows per head group, as the forward made them
            sl = _selection_rows(sl, G, lead)
        outs = saved[4:4 + 2 * nb]
        n = ql.shape[lead]
        local = lambda x: x.narrow(lead, 0, n)  # noqa: E731
        remote = lambda x, cap: x.narrow(lead, n, cap)  # noqa: E731
        _, attend_bwd = _sparse_kernels(plan, stages, scale, ctx.backend, ctx.deterministic)
        # stage 1's operands: the forward's X when kept, else built here for the casts to write into
        if ctx.keep:
            xq, xs, xk, xv = saved[4 + 2 * nb:]
            Xq = Xkv = None
        else:
            Xq, Xkv = Operands([ql, sl], qcap, lead, zero=True), Operands([kl, vl], kcap, lead, zero=True)
            (xq, xs), (xk, xv) = Xq.x, Xkv.x
        ql, kl, vl, sl = local(xq), local(xk), local(xv), local(xs)
        works, parts, out = {}, {}, {}
        Xg = None  # dO, lse, delta of every branch over X's QO rows
        for op in backward_ops(2, ctx.keep):
            with nvtx_range(op_range(op)):
                if op.kind == DELTA:  # each branch's host computes its delta from its final O
                    per_branch = []
                    for b in range(nb):
                        o, lse = outs[2 * b], outs[2 * b + 1]
                        d_out, d_lse = grads[2 * b], grads[2 * b + 1]
                        d_o = torch.zeros_like(o) if d_out is None else to_group_major(d_out, G, lead).contiguous()
                        d_l = None if d_lse is None else to_group_major(d_lse, G, lead).contiguous()
                        delta = _per_rank(routes, lambda r, a, b_, *c_: (row_delta(a, b_, c_[0] if c_ else None),),
                                          d_o, o, *(() if d_l is None else (d_l,)))[0]
                        per_branch += [d_o, lse, delta]
                    Xg = Operands(per_branch, qcap, lead, zero=True)
                    del per_branch, d_o, delta
                elif op.kind == CAST:  # into the receive rows of stage 1's operands
                    if op.route == "qo":
                        tensors = Xg.local() + ([] if ctx.keep else Xq.local())
                        into = Xg.remote() + ([] if ctx.keep else Xq.remote())
                    else:
                        tensors, into = Xkv.local(), Xkv.remote()
                    works[op.name] = issue(op, routes, group, tensors, into)
                    del tensors, into
                elif op.kind == WAIT and op.back:
                    out[op.phase] = works.pop(op.deps[0]).wait()
                elif op.kind == WAIT:
                    works.pop(op.deps[0]).wait()  # its rows are in the operands now
                elif op.kind == ATTN:
                    (s,) = op.stages
                    args = (xq, xk, xv, xs, *Xg.x) if s else (ql, kl, vl, sl, *Xg.local())

                    def run(r, q_, k_, v_, s_, d_o, lse, delta, *win, s=s):
                        return attend_bwd(r, s, d_o, q_, k_, v_, lse, delta, s_, *win)

                    parts[s] = list(_per_rank(routes, run, *args))
                    del args
                    if s == 1:  # the stages are done: the operands go before the reduces
                        Xg = Xq = Xkv = xq = xk = xv = xs = ql = kl = vl = sl = None
                elif op.kind == REDUCE:
                    (s,) = op.stages
                    pick = (0,) if op.phase == "bwd.dq" else (1, 2)  # dQ to the QO host, dK and dV to the KV host
                    acc = [parts[0][i] + local(parts[s][i]) for i in pick]
                    cap = qcap if op.phase == "bwd.dq" else kcap
                    works[op.name] = issue(op, routes, group, tuple(remote(parts[s][i], cap) for i in pick), acc,
                                           ctx.deterministic)
                else:
                    raise AssertionError(f"sparse_dist_attn cannot run backward op {op}")
        (dq,), (dk, dv) = out["bwd.dq"], out["bwd.dkv"]
        group.wait_sends()  # p2p sends may outlive their wait(): none past the pass
        return (from_group_major(dq, G, lead), from_group_major(dk, G, lead), from_group_major(dv, G, lead),
                None, None, None, None, None, None, None, None)


def _check_inputs(q, k, v, sel, plan: SparsePlan, group) -> None:
    """Shapes against the plan (host metadata only)."""
    if not isinstance(plan, SparsePlan):
        raise TypeError(f"plan must be a SparsePlan (gpusolver.plan.sparse), got {type(plan).__name__}")
    check_tensors(q=q, k=k, v=v, sel=sel)
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
    spec = plan.spec
    pre = f"[P = {P}, " if batched else "["
    if spec.block_size == 1 and spec.heads == 1 and sel.dim() == lead + 2:
        shape = (P, c, spec.width) if batched else (c, spec.width)
    else:
        shape = (P, c, spec.heads * G, spec.width) if batched else (c, spec.heads * G, spec.width)
    if not isinstance(sel, torch.Tensor) or tuple(sel.shape) != shape or sel.dtype not in (torch.int32, torch.int64):
        got = f"{tuple(sel.shape)} {sel.dtype}" if isinstance(sel, torch.Tensor) else type(sel).__name__
        raise ValueError(f"sel must be int32/int64 {list(shape)} ({pre}c, k] token top-k or {pre}c, Hkv, n] blocks, "
                         f"this plan's width {spec.width}), got {got}")


def sparse_dist_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: torch.Tensor, plan: SparsePlan, group,
                     *, softmax_scale: float | None = None, deterministic: bool = True,
                     keep_forward_buffers: bool = True, validate: bool | None = None, backend: str = "auto"):
    """Sparse attention of this rank's query shard over the whole sequence, as ``plan`` assigns the work.

    Args:
        q: ``[c, Hq, D]`` this rank's query shard (``[P, c, Hq, D]`` with a ``LocalGroup``).
        k, v: ``[c, Hkv, D]`` (``[P, c, Hkv, D]``).
        sel: this rank's selection rows, global key indices: ``[c, k]`` token top-k or
            ``[c, Hkv, n]`` key blocks (``[P, ...]`` with a ``LocalGroup``), int32/int64, -1 unused.
        plan: ``SparsePlan`` of the layer's mask (``solve_sparse_sharded`` / ``solve_sparse``).
        group: ``LocalGroup``, ``TorchGroup`` or ``SymmMemGroup``.
        softmax_scale, deterministic, keep_forward_buffers, validate: as in ``dist_attn``.
        backend: the kernels' backend ("auto": Triton on CUDA, the torch twin elsewhere).

    Returns:
        out ``[c, Hq, D]`` and lse ``[c, Hq]`` fp32 (a leading ``[P]`` for ``LocalGroup``);
        for an NSA layer mask, ``((out_sel, lse_sel), (out_win, lse_win))``, one pair per
        branch. Differentiable in q, k and v.
    """
    group = as_group(group)
    _check_inputs(q, k, v, sel, plan, group)
    if validate is None:
        validate = q.device.type == "cpu" and not torch.compiler.is_compiling()
    if validate:
        plan.validate(ignore=IMBALANCED)
    else:
        errors.record_plan(plan, "sparse_dist_attn")
    scale = softmax_scale_of(softmax_scale, q.shape[-1])
    with nvtx_range("solve/routes"):
        routes = sparse_routes(plan, group)
        stages = stage_tables(plan, routes.ranks)
    if not isinstance(keep_forward_buffers, bool):
        raise ValueError(f"sparse_dist_attn: keep_forward_buffers must be True or False (one kept kind is for slice "
                         f"masks), got {keep_forward_buffers!r}")
    outs = _SparseDistAttn.apply(q, k, v, sel, routes, stages, group, scale, keep_forward_buffers,
                                 bool(deterministic), backend)
    if len(outs) == 2:
        return outs[0], outs[1]
    return (outs[0], outs[1]), (outs[2], outs[3])


def local_selection(mask, group) -> torch.Tensor:
    """The selection rows ``sparse_dist_attn`` takes, from the mask the rank holds (``[P, c, ...]``
    for a ``LocalGroup``, whose mask holds every rank's rows)."""
    sel = _selection(mask)
    if getattr(group, "batched", False):
        P = group.size
        return sel.reshape(P, sel.shape[0] // P, *sel.shape[1:])
    return sel


def mask_on_device(mask, device: torch.device):
    """The sparse mask with its index tensor on ``device`` (the solve runs where the attention runs)."""
    from dataclasses import replace

    if mask.device == device:
        return mask
    if isinstance(mask, NSALayerMask):
        return replace(mask, selection=mask_on_device(mask.selection, device))
    if isinstance(mask, TokenTopKMask):
        return replace(mask, topk_indices=mask.topk_indices.to(device))
    return replace(mask, block_indices=mask.block_indices.to(device))
