"""CalcMeta: cut every slice at the block borders and deal the pieces to ranks.

Shape legend: G head groups (Gm = G for a grouped mask, 1 otherwise), R
slices, P ranks, c tokens per chunk, n sub-chunk tiles per chunk, U = n * P
units of c / n tokens (blocks are unit pairs), cap slice rows per rank and stage.

Decomposition of one slice inside one block. With rows ``[Q0, Q1)`` = the
slice's q range ∩ the block's rows and cols ``[L, E)`` = its k range ∩ the
block's cols, let ``a = ks - qs`` for INV_CAUSAL / BI_CAUSAL (else -inf) and
``b = ke - qe + 1`` for CAUSAL / BI_CAUSAL (else +inf; both finite sentinels
here). Row q's valid cols are ``[max(L, q + a), min(E, q + b))``. Rows with no
valid col are trimmed first (keep ``L - b < q < E - a``); the rest is cut
where the lower bound switches from L to q + a (first row ``L - a + 1``) and
where the upper bound switches from q + b to E (first row ``E - b``). Each of
the (at most three) row segments ``[s, e)`` becomes one slice:

    lo = L,     hi = E      FULL        k [L, E)
    lo = L,     hi = q + b  CAUSAL      k [L, e + b - 1)
    lo = q + a, hi = E      INV_CAUSAL  k [s + a, E)
    lo = q + a, hi = q + b  BI_CAUSAL   k [s + a, e + b - 1)

The type code is ``(hi follows q) + 2 * (lo follows q)``, which is exactly
FULL=0, CAUSAL=1, INV_CAUSAL=2, BI_CAUSAL=3.
"""
from __future__ import annotations

import torch

from gpusolver.masks.slices import AttnSlices
from gpusolver.masks.types import BI_CAUSAL, CAUSAL, INV_CAUSAL
from gpusolver.plan.meta import CalcMeta, CommMeta
from gpusolver.problem import BlockAreas

_BIG = 1 << 40  # finite stand-in for +-inf diagonal offsets (int64 math)
PIECES = 3


def default_stage_capacity(num_slices: int, head_groups: int, cp_size: int, tiles: int = 1) -> int:
    """Default slice rows per rank and stage: ``3 * G * n * max(R, 2 * P)``.

    Without tiling stage 0 of a rank holds only block (r, r) of each group, at
    most 3 pieces per slice, so ``3 * G * R`` always suffices there. Stage 1
    may hold many blocks; ``2 * P`` blocks per group covers one long slice (a
    causal or full mask given as a single slice) dealt out with reasonable
    balance. With n tiles a slice is cut at n times as many borders per axis;
    ``n`` times the room covers the masks whose slices stay within a few tiles.
    """
    return PIECES * head_groups * tiles * max(num_slices, 2 * cp_size)


def slice_pieces(qs, qe, ks, ke, attn_type, i, j, chunk: int):
    """Pieces of slices inside blocks (global coordinates), broadcasting all inputs.

    qs, qe, ks, ke, attn_type: int64 tensors (slice ranges and types).
    i, j: int64 tensors, the query / key unit of the block (``chunk`` tokens per unit).
    Returns (q0, q1, k0, k1, ptype, valid), each of the broadcast shape with a
    trailing dim of 3 (pieces in row order), int64 / bool. ``valid`` is false for
    empty pieces, whose other fields are meaningless.
    """
    inv = (attn_type == INV_CAUSAL) | (attn_type == BI_CAUSAL)
    cau = (attn_type == CAUSAL) | (attn_type == BI_CAUSAL)
    a = torch.where(inv, ks - qs, -_BIG)
    b = torch.where(cau, ke - qe + 1, _BIG)
    Q0 = torch.maximum(qs, i * chunk)
    Q1 = torch.minimum(qe, (i + 1) * chunk)
    L = torch.maximum(ks, j * chunk)
    E = torch.minimum(ke, (j + 1) * chunk)
    r0 = torch.maximum(Q0, L - b + 1)      # first row with a valid col
    r1 = torch.minimum(Q1, E - a)          # past the last row with a valid col
    ok = (r0 < r1) & (L < E) & (a < b)
    x1 = L - a + 1                         # from here on lo = q + a
    x2 = E - b                             # from here on hi = E
    m1 = torch.minimum(x1, x2).maximum(r0).minimum(r1)
    m2 = torch.maximum(x1, x2).maximum(r0).minimum(r1)
    s = torch.stack(torch.broadcast_tensors(r0, m1, m2), dim=-1)
    e = torch.stack(torch.broadcast_tensors(m1, m2, r1), dim=-1)
    a, b, L, E = (x[..., None] for x in (a, b, L, E))
    x1, x2 = x1[..., None], x2[..., None]
    lo_q = s >= x1
    hi_q = s < x2
    k0 = torch.where(lo_q, s + a, L)
    k1 = torch.where(hi_q, e + b - 1, E)
    ptype = hi_q.long() + 2 * lo_q.long()
    valid = ok[..., None] & (s < e)
    return s, e, k0, k1, ptype, valid


def build_calc_meta(mask: AttnSlices, areas: BlockAreas, assignment: torch.Tensor, comm: CommMeta,
                    capacity: int, task_stage: torch.Tensor | None = None) -> tuple[CalcMeta, dict[str, torch.Tensor]]:
    """CalcMeta for all ranks, plus device flags.

    mask:       AttnSlices, ungrouped [R, 2] or grouped [G, R, 2].
    areas:      BlockAreas of the same mask (q_need / k_need [G, U, U, 2] int64, U = n * P).
    assignment: [G, U, U] integer, rank of task (g, i, j); -1 for empty tasks.
    comm:       the CommMeta of the same assignment (buffer offsets, ``num_stages`` S).
    capacity:   cap, slice rows per rank and stage (static).
    task_stage: [G, U, U] int32 stage of each task (``gpusolver.plan.stages``); None: 0 for
                tasks whose units are both on their rank, 1 for the rest (needs S = 1).

    Returns (CalcMeta, flags) with flags ``calc_overflow``, ``buffer_overflow``,
    ``unassigned``, ``mismatch``: [] bool tensors. A piece that cannot be placed
    (no rank, outside its needs, past a buffer, past ``cap``) is left out and its
    flag set; nothing is written out of bounds. Sync-free.
    """
    G, P, U, n = areas.head_groups, areas.cp_size, areas.num_units, areas.tiles
    c, cu = areas.rank_tokens, areas.chunk  # tokens per rank, per unit
    dev = assignment.device
    if mask.grouped:
        q, k, t = mask.per_group(G)
    else:
        q, k, t = mask.q_ranges.long()[None], mask.k_ranges.long()[None], mask.attn_type.long()[None]
    Gm, R = q.shape[0], q.shape[1]
    M = U * U * R * PIECES

    # 1. candidate pieces on [Gm, U(i), U(j), R, 3]: only the valid flags survive.
    au = torch.arange(U, device=dev)
    host = au // n
    sl = (slice(None), None, None, slice(None))  # [Gm, R] -> [Gm, 1, 1, R]
    *_, valid = slice_pieces(q[..., 0][sl], q[..., 1][sl], k[..., 0][sl], k[..., 1][sl], t[sl],
                             au.view(1, U, 1, 1), au.view(1, 1, U, 1), cu)
    task_pieces = valid.sum(dim=(3, 4))                        # [Gm, U, U]
    valid = valid.reshape(Gm, M)

    # 2. compact to a static capacity in (i, j, slice, piece) order.
    ns = comm.num_stages + 1  # the pieces fill at most (S + 1) * P buckets of cap rows
    ncap = min(M, -(-ns * P * capacity // G) if Gm == 1 else ns * P * capacity)
    count = valid.sum(dim=1)                                   # [Gm]
    pos = valid.long().cumsum(dim=1) - 1
    dst = torch.where(valid & (pos < ncap), pos, ncap)
    src = torch.arange(M, device=dev).expand(Gm, M)
    flat = torch.zeros(Gm, ncap + 1, dtype=torch.long, device=dev).scatter_(1, dst, src)[:, :ncap]
    filled = torch.arange(ncap, device=dev) < count[:, None]   # [Gm, ncap]
    i, j = flat // (U * R * PIECES), flat // (R * PIECES) % U
    rho, piece = flat // PIECES % R, flat % PIECES
    gm = torch.arange(Gm, device=dev)[:, None]
    fields = slice_pieces(q[gm, rho, 0], q[gm, rho, 1], k[gm, rho, 0], k[gm, rho, 1], t[gm, rho], i, j, cu)
    q0, q1, k0, k1, ptype, ok = (f.gather(-1, piece[..., None])[..., 0] for f in fields)
    item = filled & ok

    # 3. expand over groups with the assignment.
    q0, q1, k0, k1, ptype, item, i, j = (x.expand(G, ncap) for x in (q0, q1, k0, k1, ptype, item, i, j))
    g = torch.arange(G, device=dev)[:, None].expand(G, ncap)
    assign = assignment.long()
    r = assign[g, i, j]
    has_rank = (r >= 0) & (r < P)
    r = r.clamp(0, P - 1)
    q_local, k_local = host[i] == r, host[j] == r
    S = comm.num_stages
    if task_stage is None and S > 1:
        raise ValueError(f"a plan of {S} sub-stages needs the task_stage of its assignment")
    two = (~(q_local & k_local)).long()  # 0 local, 1 remote: the stage of a task with no sub-stage
    stage = two if task_stage is None else torch.where(task_stage[g, i, j] >= 0, task_stage[g, i, j].long(), two)
    qu, ku, qn, kn = q0 - i * cu, k0 - j * cu, q1 - q0, k1 - k0  # unit-local starts
    qn_lo, qn_hi = areas.q_need[g, i, j, 0], areas.q_need[g, i, j, 1]
    kn_lo, kn_hi = areas.k_need[g, i, j, 0], areas.k_need[g, i, j, 1]
    need_ok = ((qu >= qn_lo) & (qu + qn <= qn_hi) & (ku >= kn_lo) & (ku + kn <= kn_hi)
               & (areas.area[g, i, j] > 0))
    ql, kl = q0 - host[i] * c, k0 - host[j] * c  # chunk-local starts
    qo_lo, qo_hi = comm.qo_range[g, i, r, 0], comm.qo_range[g, i, r, 1]
    kv_lo, kv_hi = comm.kv_range[g, j, r, 0], comm.kv_range[g, j, r, 1]
    range_ok = ((q_local | ((ql >= qo_lo) & (ql + qn <= qo_hi)))
                & (k_local | ((kl >= kv_lo) & (kl + kn <= kv_hi))))
    cap_q, cap_k = comm.qo_recv_capacity, comm.kv_recv_capacity
    q_base = k_base = G * c  # one receive buffer per kind after the local rows, shared by the sub-stages
    q_end, k_end = q_base + cap_q, k_base + cap_k
    qrow = torch.where(q_local, g * c + ql, q_base + comm.qo_recv_offset[g, i, r] + ql - qo_lo)
    krow = torch.where(k_local, g * c + kl, k_base + comm.kv_recv_offset[g, j, r] + kl - kv_lo)
    buf_ok = (qrow + qn <= q_end) & (krow + kn <= k_end)
    placed = item & has_rank
    keep = placed & need_ok & range_ok & buf_ok

    # 4. deal to (rank, stage) buckets in (g, slice order), clip at capacity.
    nb = ns * P
    key = torch.where(keep, r * ns + stage, nb).reshape(-1)
    counts = torch.zeros(nb + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    starts = counts.cumsum(0) - counts
    skey, perm = torch.sort(key, stable=True)
    spos = torch.arange(key.numel(), device=dev) - starts[skey]
    out_at = torch.where((skey < nb) & (spos < capacity), skey * capacity + spos, nb * capacity)
    rows = torch.stack((qrow, qrow + qn, krow, krow + kn, ptype), dim=-1).reshape(-1, 5)[perm]
    out = torch.zeros(nb * capacity + 1, 5, dtype=torch.long, device=dev)
    out[out_at] = rows
    out = out[:-1].view(P, ns, capacity, 5).to(torch.int32)

    # 5. per-task counts (exact, independent of compaction) and flags.
    pieces_g = task_pieces.expand(G, U, U)
    task_has = (assign >= 0) & (assign < P)
    task_r = assign.clamp(0, P - 1)
    task_two = ((host.view(1, U, 1) != task_r) | (host.view(1, 1, U) != task_r)).long()
    task_st = task_two if task_stage is None else torch.where(task_stage >= 0, task_stage.long(), task_two)
    task_key = torch.where(task_has, task_r * ns + task_st, nb).reshape(-1)
    needed = torch.zeros(nb + 1, dtype=torch.long, device=dev).scatter_add_(0, task_key, pieces_g.reshape(-1))
    needed = needed[:nb].view(P, ns)
    nonempty = (areas.area > 0) | (pieces_g > 0)
    flags = {
        "calc_overflow": (needed > capacity).any() | (count > ncap).any(),
        "buffer_overflow": (placed & need_ok & range_ok & ~buf_ok).any(),
        "unassigned": (nonempty & ~task_has).any(),
        "mismatch": (item & ~need_ok).any() | (placed & ~range_ok).any(),
    }
    calc = CalcMeta(q_ranges=out[..., 0:2].contiguous(), k_ranges=out[..., 2:4].contiguous(),
                    attn_type=out[..., 4].contiguous(),
                    num_rows=counts[:nb].clamp(max=capacity).view(P, ns).to(torch.int32),
                    needed_rows=needed.to(torch.int32))
    return calc, flags
