"""Torch twin of the bundle step: each offered QO unit's best bundle move, priced exactly.

``bundle_proposals(tasks, st, ...)`` is the reference the Triton
``bundle_proposals_triton`` (kernel.py) equals entry for entry (integers
exactly, float64 scores bit for bit).
"""
from __future__ import annotations

import torch

from gpusolver.solver.bundle.relay import relay_key_prices, relay_row_prices
from gpusolver.solver.core import _BIG, _TOKEN_LIMIT, Proposals, State, Tasks
from gpusolver.solver.offers.ref import offers


def _union_growth(cur_lo, cur_hi, lo, hi):
    """Tokens a hull [cur_lo, cur_hi) grows by when [lo, hi) joins it (lo < hi).

    An empty hull is (``_BIG``, 0) (``_scatter_hull``; (``_TOKEN_LIMIT``, 0) in int32), so the
    hull formula needs no branch for it: max(0, hi) - min(_BIG, lo) = hi - lo. The kernels'
    twin branches on it instead.
    """
    out = torch.maximum(cur_hi, hi)
    out -= torch.minimum(cur_lo, lo)
    return out.sub_((cur_hi - cur_lo).clamp_(min=0))



def _plus(base, *terms):
    """``base`` plus each ``x * c`` of ``terms`` ((x, c) pairs, c a host int), skipping those with
    c == 0 or x None: the same integers with fewer passes (a zero byte price is common: the
    backward's second K/V send is 0 with kept buffers)."""
    for x, c in terms:
        if c and x is not None:
            base = torch.add(base, x, alpha=c)  # one pass for the product and the sum
    return base


def _busiest_key_host(send, delta, inc, elsewhere):
    """The largest send of a key host other than the touched ranks after a move, 0 if none.

    send: [B, P]; delta: [B, ..., U] bytes each key unit's task changes its host's send by,
    in key order (key unit j on host j // n, n = U // P); inc: [B, ..., U] the bundle's
    tasks; elsewhere: [B, ..., P] the key hosts of its tasks other than the touched ranks.
    With one tile per rank each task's key unit has its own host; with n tiles up to n of a
    bundle's tasks share one, and their deltas add up.
    """
    B, P = send.shape
    per_host = (delta * inc).unflatten(-1, (P, -1)).sum(-1)
    lead = (B,) + (1,) * (elsewhere.dim() - 2)
    return ((send.view(*lead, P) + per_host) * elsewhere).amax(-1)  # as torch.where(elsewhere, .., 0)


def _node_peer(tasks: Tasks, headroom: torch.Tensor) -> torch.Tensor:
    """[B, P] int64: for each source, the other rank of its node with the most headroom (first
    on ties), the source itself when its node has no other rank (``Tasks.links``)."""
    P = tasks.P
    ranks = torch.arange(P, device=headroom.device)
    node = ranks // tasks.links[0]
    peer = (node[:, None] == node[None, :]) & (ranks[:, None] != ranks[None, :])  # [P(s), P(r)]
    room = torch.where(peer, headroom[:, None, :], -_BIG)  # [B, P(s), P(r)]
    return torch.where(peer.any(1), room.argmax(2), ranks)


def _cut_reads(cut: torch.Tensor, U: int):
    """Where ``_at_cut`` reads a running value for each cut [..., C] in 0..U: (prefix, suffix),
    each (the position inside the range, clamped; the cuts whose range is empty). Shared by
    every read at the same cuts."""
    return ((cut - 1).clamp(min=0), cut == 0), (cut.clamp(max=U - 1), cut == U)


def _at_cut(running: torch.Tensor, read, empty: int) -> torch.Tensor:
    """Read ``running`` [..., U] (prefix values along a unit's order, or suffix values) at the
    cuts of ``read`` (``_cut_reads``: its prefix or suffix part): the value over positions
    [0, cut) (or [cut, U)), ``empty`` where that range is empty. A 4-D ``running`` [B, P, K, U]
    is shared by every destination of 5-D cuts [B, P, K, D, C]."""
    # the last position inside the range (the first for a suffix), blanked where the range is
    # empty: no padded copy of ``running``
    at, empty_range = read
    if running.dim() == at.dim():
        value = running.gather(-1, at)
    else:
        value = running.gather(-1, at.flatten(-2)).view(at.shape)
    return value.masked_fill_(empty_range, empty)


def bundle_proposals(tasks: Tasks, st: State, cap, excess, balance, threshold,
                     units_per_rank, n_dests, dests_per_variant=None, order_per_variant=None,
                     sideways: bool = False, singles: bool = False, caps: torch.Tensor | None = None) -> Proposals:
    """Ship a prefix of one QO unit's tasks (by area) from each source to one destination.

    Balance phase (``balance`` [B] True): overloaded sources, the prefix stops
    once the source's excess is covered, every touched rank stays under the
    threshold, scored by added bytes per area. Bottleneck phase: any source,
    the prefix is one task or all that fit the destination, the bottleneck
    rank must go down and no touched rank may reach the bottleneck; scored by
    the touched ranks' new maximum. With ``sideways`` (host bool) a move that
    leaves the bottleneck as it is, keeps every touched rank below it and
    lowers the total bytes is also allowed, ranked after every move that
    lowers the bottleneck (score + 1); the total falls strictly, so no cycles.
    With ``singles`` (host bool) the balance phase also offers the one-task bundle.

    Both sizes take the source's tasks among the first ``cut`` positions of the
    unit's order, so every sum over a bundle is a running sum read at its cut,
    and the tasks of one key host sit at known positions (``Tasks.unit_pos``).
    """
    G, P, U, T, n = tasks.G, tasks.P, tasks.U, tasks.T, tasks.tiles
    B, dev = st.rank.shape[0], st.rank.device
    K, D = min(units_per_rank, G * U), min(n_dests, P)
    ranks = torch.arange(P, device=dev)
    upos = torch.arange(U, device=dev)
    unit, headroom, dests = offers(tasks, st, cap, units_per_rank, n_dests, dests_per_variant)
    u_host = tasks.unit_host[unit]  # [B, P, K] query host of each offered unit

    # the unit's tasks in the variant's order: [B, P(s), K, U(position)]; mine = on the source
    order_b = torch.zeros((B,), dtype=torch.int64, device=dev) if order_per_variant is None else order_per_variant
    tid = tasks.unit_tasks[order_b.view(B, 1, 1), unit]
    s4 = ranks.view(1, P, 1, 1)
    mine = st.rank.gather(1, tid.view(B, -1)).view(B, P, K, U) == s4
    t_area = tasks.area[tid] * mine
    after = torch.cumsum(t_area, 3)
    before = after - t_area
    first = (torch.cumsum(mine, 3) == 0).sum(3)  # [B, P, K] position of the first task here, U if none
    first_at = first.clamp(max=U - 1)[..., None]
    j_t = tasks.k_host[tid]  # key host of each task
    # each unit also considers: the key host of its heaviest task here (no K/V to ship for it),
    # the unit's own host (moving home frees the transfer) and the other rank holding most of
    # the unit's rows (merging two helpers of one unit saves one transfer)
    key_host = j_t.gather(3, first_at) * (first < U)[..., None]  # [B, P, K, 1]
    home = u_host[..., None]
    held = st.qlen.gather(1, unit.view(B, -1, 1).expand(-1, -1, P).reshape(B, -1, P)).view(B, P, K, P)
    held = torch.where(ranks.view(1, P, 1, 1) == ranks, -1, held)  # not the source itself
    holder = held.argmax(3, keepdim=True)
    extra = (key_host, home, holder)
    if tasks.links is not None:  # and the rank of the source's node with most headroom (NVLink only)
        extra += (_node_peer(tasks, headroom).view(B, P, 1, 1).expand(B, P, K, 1),)
    dests = torch.cat((dests[:, :, None, :].expand(B, P, K, D),) + extra, 3)  # [B, P, K, D1]
    D1 = dests.shape[3]
    # each size ships the source's tasks before a cut of the order, [B, P, K, D1, 2(size)]:
    # size 0 = the first task here if it fits the destination (bottleneck phase, or ``singles``);
    # size 1 = while the running area fits (and, balancing, until the excess is covered)
    room = headroom.gather(1, dests.view(B, -1)).view(B, P, K, D1)
    fits = torch.searchsorted(after, room, right=True)  # positions whose running area fits
    over = torch.where(balance.view(B, 1, 1), (before < excess.view(B, P, 1, 1)).sum(3), U)
    cut1 = torch.minimum(fits, over[..., None])
    single_ok = ~balance.view(B, 1, 1, 1) | singles
    cut0 = (first[..., None] + 1) * (single_ok & (fits > first[..., None]))
    cut = torch.stack((cut0, cut1), 4)
    pre, suf = _cut_reads(cut, U)
    area = _at_cut(after, pre, 0)  # [B, P, K, D1, 2]
    shape = area.shape

    i_of = u_host[..., None, None]  # [B, P, K, 1, 1] query host
    d_of = dests.view(B, P, K, D1, 1)
    s_of = ranks.view(1, P, 1, 1, 1)
    # a [B, ...] table read at [B, ...] indices; indices with size-1 dims read once and broadcast
    gather_at = lambda table, idx: table.reshape(B, -1).gather(1, idx.reshape(B, -1)).view(idx.shape)  # noqa: E731

    # query rows: growth of the destination's hull, and what the source frees when it is not the host
    lo_here = torch.where(mine, tasks.qlo[tid], _BIG)
    hi_here = tasks.qhi[tid] * mine
    b_lo = _at_cut(lo_here.cummin(3).values, pre, _BIG)
    b_hi = _at_cut(hi_here.cummax(3).values, pre, 0)
    at_d = (unit * P)[..., None, None] + d_of
    q_grow = _union_growth(gather_at(st.q_lo, at_d), gather_at(st.q_hi, at_d), b_lo, b_hi)
    # integers times a mask: torch.where(mask, x, 0) exactly, at a fraction of its CPU cost
    q_grow = q_grow * ((area > 0) & (d_of != i_of))
    # the unit's tasks that stay on the source: those at or after the cut
    r_lo = _at_cut(lo_here.flip(3).cummin(3).values.flip(3), suf, _BIG)
    r_hi = _at_cut(hi_here.flip(3).cummax(3).values.flip(3), suf, 0)
    q_cur = gather_at(st.qlen, (unit * P)[..., None, None] + s_of).expand(shape)
    q_free = (q_cur - (r_hi - r_lo).clamp(min=0)) * ((area > 0) & (s_of != i_of))
    # with a topology the bytes price each token by its link (``Tasks.links``): the rows the
    # destination gains come from the query host over link (i, d), those freed at the source over
    # (i, s); each task's key columns over (j, d) and (j, s). The b* names are the priced tokens
    # (the plain ones without a topology); the rows stay plain for the buffers.
    topo = tasks.links is not None
    if tasks.relays:  # the relay transport's hops (``bundle.relay``)
        bq_grow, bq_free = relay_row_prices(tasks, st, unit, i_of, s_of, d_of, b_lo, b_hi, q_grow, q_free, area,
                                            gather_at)
    elif topo:
        bq_grow, bq_free = q_grow * tasks.link_weight(i_of, d_of), q_free * tasks.link_weight(i_of, s_of)
    else:
        bq_grow, bq_free = q_grow, q_free

    # key columns of each task here: growth at the destination (none when the destination is
    # the key host), freed at the source
    kv_u = tasks.kv_unit[tid]  # [B, P, K, U]
    kd = (kv_u * P)[:, :, :, None, :] + d_of  # [B, P, K, D1, U]
    k_lo32, k_hi32 = st.k_lo.clamp(max=_TOKEN_LIMIT).int(), st.k_hi.int()  # int32, empty = (_TOKEN_LIMIT, 0)
    not_d = j_t[:, :, :, None, :] != d_of  # [B, P, K, D1, U] the destination is not the key host
    kg_t = _union_growth(gather_at(k_lo32, kd), gather_at(k_hi32, kd),
                         tasks.klo[tid].int()[:, :, :, None, :], tasks.khi[tid].int()[:, :, :, None, :])
    kg_t *= mine[:, :, :, None, :] & not_d  # [B, P, K, D1, U]
    # a KV unit's columns leave the source only with its last task there (a lower bound of
    # what is freed: a unit shared with tasks that stay is counted as not shrinking)
    k_cur = gather_at(st.klen, kv_u * P + s4)
    sole = gather_at(st.kcount, kv_u * P + s4) == 1
    kf_t = k_cur * (mine & sole)  # [B, P, K, U]
    if tasks.relays:
        bkg_t, bkf_t = relay_key_prices(tasks, st, kv_u, j_t, mine, d_of, s4, tasks.klo[tid], tasks.khi[tid], kg_t,
                                        kf_t, gather_at)
    elif topo:
        bkg_t = kg_t.long() * tasks.link_weight(j_t[:, :, :, None, :], d_of)
        bkf_t = kf_t * tasks.link_weight(j_t, s4)
    else:
        bkg_t, bkf_t = kg_t, kf_t

    # each key host's part of a bundle, per (destination, size): whether the bundle has tasks
    # there and their token change. Size 0 moves one task, the first here: its key host alone.
    # Size 1 moves the tasks before its cut: [B, P, K, D1, P(host)], the unit's tasks read in key
    # order (key unit j at its position ``Tasks.unit_pos`` in the unit's order), so host h's n
    # tasks are the n slots h*n.. and the sums are a view and a reduction, not a scatter
    kpos = tasks.unit_pos[order_b.view(B, 1, 1), unit]  # [B, P, K, U] position of key unit j's task
    kpos5 = kpos[:, :, :, None, :].expand(B, P, K, D1, U)
    inc1 = mine.gather(3, kpos)[:, :, :, None, :] & (kpos[:, :, :, None, :] < cut1[..., None])  # [B, P, K, D1, U]
    inc1_h = inc1.view(B, P, K, D1, P, n)
    at_first = first_at[:, :, :, None, :].expand(B, P, K, D1, 1)
    one = cut0[..., None] > 0  # [B, P, K, D1, 1] size 0 moves its task
    f_host = key_host[..., None]  # [B, P, K, 1, 1] that task's key host

    def by_key(kg, kf):  # [B, P, K, D1, U] token change of each task, in key order
        return kg.gather(4, kpos5) - kf.gather(3, kpos)[:, :, :, None, :]

    def sizes(kg, kf, kf32):  # (size 0 [B, P, K, D1, 1], size 1 [B, P, K, D1, P]) int64 token changes
        moved = by_key(kg, kf32) * inc1
        return ((kg.gather(4, at_first) - kf.gather(3, first_at)[..., None]).long() * one,
                moved.long() if n == 1 else moved.view(B, P, K, D1, P, n).sum(-1))

    # plain token changes in int32 (each within a unit's tokens: half the memory traffic), the
    # link-priced ones in int64
    tok0, tok1 = sizes(kg_t, kf_t, kf_t.int())
    btok0, btok1 = sizes(bkg_t, bkf_t, bkf_t) if topo else (tok0, tok1)
    hit1 = inc1_h[..., 0]
    for t in range(1, n):  # slices, not a reduction over the short last dimension
        hit1 = hit1 | inc1_h[..., t]
    # the key hosts other than the touched ranks (source, query host, destination)
    untouched = lambda h: (h != s_of) & (h != i_of) & (h != d_of)  # noqa: E731
    else0, else1 = one & untouched(f_host), hit1 & untouched(ranks)
    # each size's candidate hosts: the table of a per-rank value [B, P] at them
    at0 = lambda t: gather_at(t, f_host)  # noqa: E731
    at1 = lambda t: t.view(B, 1, 1, 1, P)  # noqa: E731
    both = lambda x0, x1: torch.stack((x0, x1), 4)  # noqa: E731  [B, P, K, D1] each -> [B, P, K, D1, 2]
    # the same at the source, the query host, the bottleneck rank and the destination (and the
    # backward's bottleneck rank, training): [B, P, K, D1, 2] each
    bn = st.vol.argmax(1).view(B, 1, 1, 1)
    per_unit = torch.cat((ranks.view(1, P, 1, 1).expand(B, P, K, 1), u_host[..., None], bn.expand(B, P, K, 1)), 3)
    hosts = (per_unit[:, :, :, None, :].expand(B, P, K, D1, 3), dests[..., None])
    if tasks.training:
        b_bn = st.bvol.argmax(1).view(B, 1, 1, 1)
        hosts += (b_bn.expand(B, P, K, D1)[..., None],)
    hosts = torch.cat(hosts, 4)  # [B, P, K, D1, H]
    is_f = hosts == f_host
    on = lambda x0, x1: both(x0 * is_f, x1.gather(4, hosts)).unbind(5)  # noqa: E731
    tok_on, any_on = on(tok0, tok1), on(one, hit1)
    btok_on = on(btok0, btok1) if topo else tok_on
    kv_to_src = btok_on[0] * tasks.kv
    kv_to_host = btok_on[1] * tasks.kv * (i_of != s_of)
    # the destination as key host: it no longer sends the K/V it ships to the source alone
    kv_to_dest = btok_on[3] * tasks.kv
    k_grow = _at_cut(kg_t.cumsum(4, dtype=torch.int32), pre, 0).long()  # [B, P, K, D1, 2] bundle tokens
    k_free = _at_cut(kf_t.cumsum(3), pre, 0)
    if topo:
        bk_grow, bk_free = _at_cut(bkg_t.cumsum(4), pre, 0), _at_cut(bkf_t.cumsum(3), pre, 0)
    else:
        bk_grow, bk_free = k_grow, k_free

    # byte deltas of the three touched ranks (the query host may be the source or the destination)
    dq = q_grow - q_free
    bdq = bq_grow - bq_free if topo else dq
    h_ds, h_dr = bdq * tasks.q, bdq * tasks.o
    s_ds, s_dr = -bq_free * tasks.o, -bq_free * tasks.q - bk_free * tasks.kv
    dest_send = bq_grow * tasks.o
    dest_recv = bq_grow * tasks.q + bk_grow * tasks.kv
    s_is_h, d_is_h = s_of == i_of, d_of == i_of
    at = gather_at
    host_send = (at(st.send, i_of) + h_ds + torch.where(s_is_h, s_ds + kv_to_src, kv_to_host)
                 + dest_send * d_is_h)
    host_recv = at(st.recv, i_of) + h_dr + s_dr * s_is_h + dest_recv * d_is_h
    src_send = st.send.view(B, P, 1, 1, 1) + s_ds + kv_to_src + h_ds * s_is_h
    src_recv = st.recv.view(B, P, 1, 1, 1) + s_dr + h_dr * s_is_h
    d_send = at(st.send, d_of) + dest_send + h_ds * d_is_h + kv_to_dest
    d_recv = at(st.recv, d_of) + dest_recv + h_dr * d_is_h
    host_f, src_f, dest_f = (torch.maximum(host_send, host_recv), torch.maximum(src_send, src_recv),
                             torch.maximum(d_send, d_recv))

    if tasks.training:
        peaks = (_key_host_peaks(tasks, st, at0, else0, btok0), _key_host_peaks(tasks, st, at1, else1, btok1))
        ok, score = _training_scores(
            tasks, st, [both(a, b) for a, b in zip(*peaks)], btok_on, any_on, i_of, s_of, d_of, bdq, bq_grow,
            bq_free, bk_grow, bk_free, area, excess, balance, threshold, sideways, gather_at, host_f, src_f, dest_f)
    else:
        # the busiest key host other than the touched ranks after the move
        if n == 1:
            # one task per key host: its send plus its own change, for the tasks whose key host is
            # neither the source, the query host nor the destination; a prefix maximum per cut
            base = st.send.gather(1, j_t.view(B, -1)).view(B, P, K, U) - bkf_t * tasks.kv
            other = mine & (j_t != s4) & (j_t != u_host[..., None])
            val = torch.add(base[:, :, :, None, :], bkg_t, alpha=tasks.kv)  # [B, P, K, D1, U] int64
            not_there = other[:, :, :, None, :] & not_d
            at_first = first_at[:, :, :, None, :].expand(B, P, K, D1, 1)
            kvh0 = (val.gather(4, at_first) * not_there.gather(4, at_first)).squeeze(4) * (cut0 > 0)
            kvh1 = val.mul_(not_there & (upos < cut1[..., None])).amax(-1)
            kvh_max = torch.stack((kvh0, kvh1), 4)
        else:
            # up to n tasks per key host: their changes add up (``_busiest_key_host``)
            kvh_max = both(((at0(st.send) + btok0 * tasks.kv) * else0).amax(-1),
                           _busiest_key_host(st.send, by_key(bkg_t, bkf_t) * tasks.kv, inc1, else1))
        new_max = torch.maximum(torch.maximum(host_f, src_f), torch.maximum(dest_f, kvh_max))
        added = bdq * (tasks.q + tasks.o) + (bk_grow - bk_free) * tasks.kv

        bal = balance.view(B, 1, 1, 1, 1)
        bnv = st.bottleneck.view(B, 1, 1, 1, 1)
        bn = bn.view(B, 1, 1, 1, 1)
        # the bottleneck rank as a key host of moved tasks (not otherwise touched)
        to_bn, any_bn = btok_on[2], any_on[2]
        bn_is_j = any_bn & (bn != s_of) & (bn != i_of) & (bn != d_of)
        bn_as_j = torch.maximum(at(st.send, bn) + to_bn * tasks.kv, at(st.recv, bn))
        bn_new = torch.where(s_of == bn, src_f,
                             torch.where(i_of == bn, host_f,
                                         torch.where(d_of == bn, dest_f, torch.where(bn_is_j, bn_as_j, bnv))))
        ok_bal = (excess.view(B, P, 1, 1, 1) > 0) & (new_max.double() <= threshold.view(B, 1, 1, 1, 1))
        ok_bn = (bn_new < bnv) & (new_max < bnv)
        side = ~ok_bn & (bn_new <= bnv) & (new_max < bnv) & (added < 0) & sideways
        ok_bn = ok_bn | side
        ok = (area > 0) & (d_of != s_of) & torch.where(bal, ok_bal, ok_bn)
        score = torch.where(bal, added.double() / area.clamp(min=1).double(),
                            new_max.double() / bnv.clamp(min=1).double()
                            + 1e-12 * (added.double() / bnv.clamp(min=1).double()) + side.double())
        score = torch.where(ok, score, float("inf"))

    # the destination's backward change (its own part: as dest_send, not the host's when it is the host)
    dest_bsend = bq_grow * tasks.dqb + btok_on[3] * tasks.kvb + bk_grow * tasks.dkv
    dest_brecv = bq_grow * tasks.qb + bk_grow * tasks.kvb + btok_on[3] * tasks.dkv
    if caps is not None:
        S = caps[3].view(B, 1, 1, 1, 1)  # the KV send rows of the key hosts elsewhere
        over = both(_past_kv_send(at0, S, st, else0, tok0), _past_kv_send(at1, S, st, else1, tok1))
        ok = ok & _fits_buffers(st, caps, over, tok_on, i_of, s_of, d_of, dq, q_grow, k_grow, gather_at)
        score = torch.where(ok, score, float("inf"))

    # each offered unit proposes its best (destination, size): proposals [B, P*K]
    n_opts = D1 * 2
    best = score.view(B, P, K, n_opts).argmin(-1, keepdim=True)  # first on ties
    pick = lambda x: x.expand(shape).reshape(B, P, K, n_opts).gather(3, best).reshape(B, P * K)  # noqa: E731
    moved = mine & (upos < cut.reshape(B, P, K, n_opts).gather(3, best))
    d_best = dests.gather(3, best // 2)  # [B, P, K, 1]
    return Proposals(ok=pick(ok), score=pick(score), dest=d_best.reshape(B, P * K),
                     source=ranks.view(P, 1).expand(P, K).reshape(1, -1).expand(B, -1),
                     area=pick(area), dest_send=pick(dest_send + kv_to_dest), dest_recv=pick(dest_recv),
                     tasks=torch.where(moved, tid, T).view(B, P * K, U), dest_bsend=pick(dest_bsend),
                     dest_brecv=pick(dest_brecv), dest_qin=pick(q_grow), dest_kin=pick(k_grow))



def _key_host_peaks(tasks: Tasks, st: State, at, elsewhere, tok):
    """The largest forward and backward volume among the key hosts of moved tasks other than the
    touched ranks, after the move (0 if none): their K/V out grows by the tasks' token changes
    (summed per host), which adds K/V to their forward send and dK/dV to their backward receive.

    at: a per-rank value [B, P] at each candidate host (broadcastable to [B, ..., M]);
    elsewhere, tok: [B, ..., M] per candidate, whether it is such a host and its tasks' token
    change (int64). Returns (fwd, bwd), [B, ...] int64 each.
    """
    fwd = torch.maximum(_plus(at(st.send), (tok, tasks.kv)), at(st.recv))
    bwd = torch.maximum(_plus(at(st.bsend), (tok, tasks.kvb)), _plus(at(st.brecv), (tok, tasks.dkv)))
    # times the mask: the integers of torch.where(elsewhere, .., 0), at a fraction of its CPU cost
    return (fwd * elsewhere).amax(-1), (bwd * elsewhere).amax(-1)


def _past_kv_send(at, S, st: State, elsewhere, tok):
    """[B, ...] bool: a key host of moved tasks other than the touched ranks grows its KV send
    rows past ``S`` ([B, 1, ..] rows). at, elsewhere, tok: as ``_key_host_peaks``."""
    # now + tok > S and tok > 0, as tok > max(S - now, 0)
    return (elsewhere & (tok > (S - at(st.k_out)).clamp(min=0))).any(-1)


def _training_scores(tasks: Tasks, st: State, peaks, tok_on, any_on, i_of, s_of, d_of, dq,
                     q_grow, q_free, k_grow, k_free, area, excess, balance, threshold, sideways, gather_at,
                     host_f, src_f, dest_f):
    """(ok, score) [B, P, K, D1, 2] of the bundle moves under the training objective
    ``J = max_r fwd_r + max_r bwd_r``.

    Every touched rank's new forward and backward volume follows from its token changes (QO
    tokens out and in, KV tokens out and in); a rank not touched keeps its volumes, so the new
    maximum of a phase is at most the larger of the touched ranks' and, of the others', the
    phase's bottleneck (its second largest when the bottleneck rank is touched): J' is that
    bound. Bottleneck phase: J' < J, or J' = J with every touched rank strictly below both
    bottlenecks and one of the bottleneck ranks among them (ties make progress); the
    destination stays below both (acceptance holds it there); sideways moves as in the
    forward rule. Scored by J' / J. Balance phase: every touched rank's fwd + bwd under the
    threshold, scored by the bytes of both phases added per unit of area.
    """
    B, P = st.send.shape
    s_is_h, d_is_h = s_of == i_of, d_of == i_of
    at = gather_at

    def bwd(bs, br, qo, qi, ko, ki):  # a rank's new backward volume from its token changes (None: no change)
        return torch.maximum(_plus(bs, (qo, tasks.qb), (qi, tasks.dqb), (ko, tasks.kvb), (ki, tasks.dkv)),
                             _plus(br, (qi, tasks.qb), (qo, tasks.dqb), (ki, tasks.kvb), (ko, tasks.dkv)))

    host_b = bwd(at(st.bsend, i_of), at(st.brecv, i_of), dq, None, torch.where(s_is_h, tok_on[0], tok_on[1]),
                 k_grow * d_is_h - k_free * s_is_h)
    src_b = bwd(st.bsend.view(B, P, 1, 1, 1), st.brecv.view(B, P, 1, 1, 1), dq * s_is_h, -q_free,
                tok_on[0], -k_free)
    dest_b = bwd(at(st.bsend, d_of), at(st.brecv, d_of), dq * d_is_h, q_grow, tok_on[3], k_grow)
    # key hosts other than the touched ranks
    kh_f, kh_b = peaks  # the key hosts other than the touched ranks (``_key_host_peaks``)
    new_f = torch.maximum(torch.maximum(host_f, src_f), torch.maximum(dest_f, kh_f))
    new_b = torch.maximum(torch.maximum(host_b, src_b), torch.maximum(dest_b, kh_b))

    # the phases' bottleneck ranks (first on ties) and, for each, the largest volume of the others
    f_bn, b_bn = st.vol.argmax(1), st.bvol.argmax(1)
    f_2nd = st.vol.scatter(1, f_bn[:, None], -1).amax(1)
    b_2nd = st.bvol.scatter(1, b_bn[:, None], -1).amax(1)
    v = lambda t: t.view(B, 1, 1, 1, 1)  # noqa: E731
    F, Bw = v(st.bottleneck), v(st.bwd_bottleneck)
    f_hit = (s_of == v(f_bn)) | (i_of == v(f_bn)) | (d_of == v(f_bn)) | any_on[2]
    b_hit = (s_of == v(b_bn)) | (i_of == v(b_bn)) | (d_of == v(b_bn)) | any_on[4]
    J = F + Bw
    J_new = (torch.maximum(new_f, torch.where(f_hit, v(f_2nd), F))
             + torch.maximum(new_b, torch.where(b_hit, v(b_2nd), Bw)))
    added = dq * (tasks.q + tasks.o + tasks.qb + tasks.dqb) + (k_grow - k_free) * (tasks.kv + tasks.kvb + tasks.dkv)

    below = (new_f < F) & (new_b < Bw)
    ok_bn = ((J_new < J) | (below & (f_hit | b_hit))) & (dest_f < F) & (dest_b < Bw)
    side = ~ok_bn & below & (added < 0) & sideways
    ok_bn = ok_bn | side
    ok_bal = (excess.view(B, P, 1, 1, 1) > 0) & ((new_f + new_b).double() <= threshold.view(B, 1, 1, 1, 1))
    bal = balance.view(B, 1, 1, 1, 1)
    ok = (area > 0) & (d_of != s_of) & torch.where(bal, ok_bal, ok_bn)
    j64 = J.clamp(min=1).double()
    score = torch.where(bal, added.double() / area.clamp(min=1).double(),
                        J_new.double() / j64 + 1e-12 * (added.double() / j64) + side.double())
    return ok, torch.where(ok, score, float("inf"))


def _fits_buffers(st: State, caps, over, tok_on, i_of, s_of, d_of, dq, q_grow, k_grow, gather_at):
    """[B, P, K, D1, 2] bool: the move keeps every rank's rows within the plan's buffers.

    caps: [4, B] int64, each variant's QO and KV receive and QO and KV send rows per rank. A
    rank's rows of each kind received and sent stay within those, or do not grow. Rows that
    grow: the query host's QO sends (the destination's new rows), the destination's QO and KV
    receives, and the KV sends of the moved tasks' key hosts (the source, the query host and
    the others: ``over`` [B, P, K, D1, 2], one of those past its buffer, ``_past_kv_send``;
    the destination's only shrink).
    """
    B, P = st.send.shape
    at = gather_at
    fits = lambda now, delta, cap: (now + delta <= cap) | (delta <= 0)  # noqa: E731
    QR, KR, QS, S = (c.view(B, 1, 1, 1, 1) for c in caps)
    ok = fits(at(st.q_out, i_of), dq, QS) & fits(at(st.q_in, d_of), q_grow, QR) & fits(at(st.k_in, d_of), k_grow, KR)
    ok &= fits(st.k_out.view(B, P, 1, 1, 1), tok_on[0], S)  # the source as a key host
    ok &= (s_of == i_of) | fits(at(st.k_out, i_of), tok_on[1], S)  # the query host as one
    return ok & ~over
