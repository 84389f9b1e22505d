"""Reduce returned partial rows into the host's accumulators (the local half of group_reduce).

After the move back, rank b holds ``ret [C, *f]``: row p is the partial for
the row it sent at send position p, destined to ``dest[p]`` (-1: nothing was
sent there). It is reduced into ``acc[send_index[p]]``. Everything carries a
leading batch dim B of ranks; rows are addressed in a flat ``[B * (N + 1)]``
space whose row N of each rank is a scratch row that absorbs every skipped
position, so shapes stay static and no mask is read on the host.

Deterministic mode sums destination by destination in ascending order (P
static steps). A rank's send positions for one destination are one contiguous
run (the send list is in destination order) of at most N rows (a row goes to
each destination at most once), so step k reads a window of ``min(N, C)``
positions from the run's start, never all C. Within one step every real target
is distinct, so an accumulating scatter adds each partial to its row once and
gives the same bits whatever the scheduling (only the scratch rows see several
adds). The other mode is one ``index_add_`` per window of positions (float
atomics on GPU).

Memory: the sums live in one ``[B * (N + 1), *f]`` tensor of the sum dtype
(fp32 for fp16 / bf16 rows); the returned rows are read window by window, so
no fp32 copy at the send capacity C is ever made, and each window in
``_PIECES`` pieces (a quarter of ``min(N, C)`` rows gathered and converted at a
time). The fused merge (``_merge``, by default on CUDA) makes neither.

In place (``group_reduce(inplace=True)``: acc already in the sum dtype) the sums are acc
itself, addressed by (rank, row) pairs: no ``[B * (N + 1), *f]`` copy is made. With no scratch
row to absorb the skipped positions, they add -0.0 to row 0 of their rank: ``x + (-0.0) == x``
for every x (-0.0, NaN and inf included), in any order, so each real row gets the same adds
as the out-of-place sums, in the same order, and the same bits.

The lse merge (``op="lse"``): for partials k of one row, with the host's own
(out_0, lse_0) among them,

    m = max_k lse_k,  lse = m + log(sum_k exp(lse_k - m)),  out = sum_k exp(lse_k - lse) * out_k

No exponent is positive (no overflow). A row whose every lse is -inf has
m = -inf: m and lse are replaced by 0 inside the exponents, so the sum is 0,
lse = log(0) = -inf and every weight is exp(-inf) = 0, giving out = 0, never NaN.
The max is exact in any order; the two sums go through the ordered sum above.
"""
from __future__ import annotations

import math

import torch

from ._merge import fused_reduce_rows, use_fused

_NEG_INF = float("-inf")
_PIECES = 4  # pieces of each window the returned rows are converted in (a bounded number of ops)
# a piece of fewer elements saves less memory than its ops cost (launches, graph nodes under compile)
PIECE_MIN_ELEMENTS = 1 << 18


def _piece_step(W: int, vals: torch.Tensor) -> int:
    """Columns per piece of a ``W``-column window of ``vals [B, C, *f]``'s rows: ``_PIECES`` pieces,
    fewer (down to one) where a piece would hold under ``PIECE_MIN_ELEMENTS`` elements."""
    per_column = vals.shape[0] * math.prod(vals.shape[2:])
    return max(1, -(-W // _PIECES), -(-PIECE_MIN_ELEMENTS // max(1, per_column)))


def _targets(send_index: torch.Tensor, dest: torch.Tensor, N: int) -> torch.Tensor:
    """Flat target row of every position, ``[B * C]``: the scratch row of its rank when skipped."""
    B = send_index.shape[0]
    ok = (dest >= 0) & (send_index >= 0) & (send_index < N)
    local = torch.where(ok, send_index, torch.full_like(send_index, N))
    base = torch.arange(B, device=send_index.device, dtype=torch.int64)[:, None] * (N + 1)
    return (base + local).reshape(-1)


def _sums(base: torch.Tensor, dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
    """``[B, N, *f]`` -> ``[B * (N + 1), *f]`` in ``dtype`` with one scratch row per rank (one allocation)."""
    B, N = base.shape[:2]
    flat = base.new_empty((B, N + 1, *base.shape[2:]), dtype=dtype)
    flat[:, :N].copy_(base)
    flat[:, N].fill_(fill)
    return flat.view(B * (N + 1), *base.shape[2:])


def _drop_scratch(flat: torch.Tensor, B: int, N: int) -> torch.Tensor:
    return flat.view(B, N + 1, *flat.shape[1:])[:, :N]


def _window_starts(dest: torch.Tensor, P: int) -> torch.Tensor:
    """``[B, P]`` first send position of each destination's run (C where it has none)."""
    B, C = dest.shape
    pos = torch.arange(C, device=dest.device, dtype=torch.int64).expand(B, C)
    starts = torch.full((B, P + 1), C, dtype=torch.int64, device=dest.device)
    # column 0 collects the skipped positions (dest -1)
    starts = starts.scatter_reduce(1, (dest + 1).clamp(0, P), pos, "amin")
    return starts[:, 1:]


def _add_rows(flat: torch.Tensor, vals: torch.Tensor, pos: torch.Tensor, targets: torch.Tensor,
              weight: torch.Tensor | None, accumulate: bool) -> None:
    """``flat[targets] += vals[b, pos[b]] (* weight[b, pos[b]])``; pos ``[B, W]`` in range, targets
    ``[B * W]`` distinct outside the scratch rows when ``accumulate`` (else ``index_add_``).

    The window goes in ``_PIECES`` pieces of columns, so its gathered rows and their copy in the
    sum dtype exist a piece at a time. The same bits: each real row is in one piece of one window."""
    B, W = pos.shape
    b = torch.arange(B, device=pos.device)[:, None]
    targets = targets.view(B, W)
    step = _piece_step(W, vals)
    for c0 in range(0, W, step):
        p, t = pos[:, c0:c0 + step], targets[:, c0:c0 + step].reshape(-1)
        rows = vals[b, p].reshape(-1, *vals.shape[2:]).to(flat.dtype)   # [B * step, *f]
        if weight is not None:
            w = weight[b, p].reshape(-1, *weight.shape[2:])
            rows.mul_(w.reshape(*w.shape, *([1] * (rows.dim() - w.dim()))))
        if accumulate:
            flat.index_put_((t,), rows, accumulate=True)
        else:
            flat.index_add_(0, t, rows)
        del rows


def _steps(send_index: torch.Tensor, dest: torch.Tensor, P: int, N: int, deterministic: bool):
    """The windows a reduce adds, in order: ``(pos [B, w], mine)`` per step. Deterministic: step k
    reads ``min(N, C)`` positions from destination k's run, ``mine [B, w]`` the ones that are its;
    else one step per ``min(N, C)`` consecutive positions, ``mine`` None (every position counts)."""
    B, C = send_index.shape
    W = min(N, C)
    if W == 0:
        return
    window = torch.arange(W, device=dest.device, dtype=torch.int64)
    if not deterministic:
        for c0 in range(0, C, W):
            yield (c0 + window[:min(W, C - c0)]).expand(B, -1), None
        return
    starts = _window_starts(dest, P)                                    # [B, P]
    for k in range(P):
        pos = starts[:, k:k + 1] + window                               # [B, W]
        inside = pos < C
        pos = pos.clamp(max=C - 1)
        yield pos, inside & (dest.gather(1, pos) == k)


def scatter_add_(flat: torch.Tensor, vals: torch.Tensor, send_index: torch.Tensor, dest: torch.Tensor,
                 P: int, deterministic: bool, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Add ``vals [B, C, *f]`` (times ``weight [B, C, *w]`` broadcast over the rest) into ``flat``
    (``_sums`` layout, N = rows per rank) at rows ``send_index``, window by window; returns flat."""
    N = flat.shape[0] // send_index.shape[0] - 1
    for pos, mine in _steps(send_index, dest, P, N, deterministic):
        d = dest.gather(1, pos)
        if mine is not None:
            d = torch.where(mine, d, torch.full_like(d, -1))
        t = _targets(send_index.gather(1, pos), d, N)
        _add_rows(flat, vals, pos, t, weight, accumulate=mine is not None)
    return flat


def _add_rows_into(acc: torch.Tensor, vals: torch.Tensor, pos: torch.Tensor, rows_n: torch.Tensor,
                   ok: torch.Tensor, weight: torch.Tensor | None) -> None:
    """``acc[b, rows_n[b, w]] += vals[b, pos[b, w]] (* weight[b, pos[b, w]])`` where ``ok``, in place;
    pos, rows_n, ok ``[B, W]``. A position not ``ok`` adds -0.0 to row 0 of its rank (nothing, see
    the module docstring). In ``_PIECES`` pieces of columns, as ``_add_rows``."""
    B, W = pos.shape
    b = torch.arange(B, device=pos.device)[:, None]
    step = _piece_step(W, vals)
    for c0 in range(0, W, step):
        p, m = pos[:, c0:c0 + step], ok[:, c0:c0 + step]
        n = torch.where(m, rows_n[:, c0:c0 + step], torch.zeros_like(p))
        rows = vals[b, p].to(acc.dtype)                                 # [B, step, *f]
        if weight is not None:
            w = weight[b, p]
            rows.mul_(w.reshape(*w.shape, *([1] * (rows.dim() - w.dim()))))
        rows.masked_fill_(~m.reshape(*m.shape, *([1] * (rows.dim() - 2))), -0.0)
        acc.index_put_((b.expand_as(n), n), rows, accumulate=True)
        del rows


def scatter_add_into_(acc: torch.Tensor, vals: torch.Tensor, send_index: torch.Tensor, dest: torch.Tensor,
                      P: int, deterministic: bool, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``scatter_add_`` straight into ``acc [B, N, *f]`` (any strides, its own memory per element):
    the same windows and the same order, so the same bits as ``scatter_add_`` into acc's copy;
    returns acc. The other mode adds each window with ``index_put_(accumulate=True)``."""
    N = acc.shape[1]
    for pos, mine in _steps(send_index, dest, P, N, deterministic):
        si = send_index.gather(1, pos)
        ok = (si >= 0) & (si < N) & ((dest.gather(1, pos) >= 0) if mine is None else mine)
        _add_rows_into(acc, vals, pos, si, ok, weight)
    return acc


def scatter_sum(base: torch.Tensor, vals: torch.Tensor, send_index: torch.Tensor, dest: torch.Tensor,
                P: int, deterministic: bool) -> torch.Tensor:
    """``base [B, N, *f] + sum of vals [B, C, *f]`` at rows ``send_index``; new tensor, base's dtype."""
    B, N = base.shape[:2]
    flat = scatter_add_(_sums(base, base.dtype), vals, send_index, dest, P, deterministic)
    return _drop_scratch(flat, B, N)


def sum_dtype(acc: torch.dtype, part: torch.dtype) -> torch.dtype:
    """The dtype a sum of ``acc`` and ``part`` rows runs in: their promotion, fp32 at least for floats."""
    dtype = torch.promote_types(acc, part)
    if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return torch.float32
    return dtype


def reduce_sum(acc: list, ret: list, send_index: torch.Tensor, dest: torch.Tensor, P: int,
               deterministic: bool, inplace: bool = False) -> list[torch.Tensor]:
    """``acc[i] [B, N, *f]`` plus the returned rows ``ret[i] [B, C, *f]``, in acc's dtype (fp32 inside);
    ``inplace``: added into acc itself (already its sum dtype), which is returned.

    Each entry of ``acc`` and ``ret`` is dropped from its list once read (``None``): a caller that
    hands its tensors over (``group_reduce(consume=True)``) has tensor i's rows freed before the
    sums of tensor i + 1 are made."""
    out = []
    for i in range(len(acc)):
        a, r = acc[i], ret[i]
        acc[i] = ret[i] = None
        if inplace:
            out.append(scatter_add_into_(a, r, send_index, dest, P, deterministic))
            del a, r
            continue
        B, N = a.shape[:2]
        dtype = a.dtype
        flat = _sums(a, sum_dtype(dtype, r.dtype))
        del a
        flat = scatter_add_(flat, r, send_index, dest, P, deterministic)
        del r
        out.append(_drop_scratch(flat, B, N).to(dtype))
        del flat
    return out


def reduce_lse(acc: list, ret: list, send_index: torch.Tensor, dest: torch.Tensor, P: int,
               deterministic: bool, inplace: bool = False) -> list[torch.Tensor]:
    """Merge partial (out ``[B, C, h, D]``, lse ``[B, C, h]``) into acc (out ``[B, N, h, D]``, lse ``[B, N, h]``).

    ``acc`` and ``ret`` are emptied (as in ``reduce_sum``): the host's out goes once its weighted
    fp32 copy is made, the returned rows once they are summed. ``inplace`` (out and lse fp32): the
    host's out is weighted and summed into where it is and the new lse copied over acc's, which are
    returned; only lse-sized temporaries are made."""
    out_acc, lse_acc = acc
    out_p, lse_p = ret
    acc.clear()
    ret.clear()
    out_dtype, lse_dtype = out_acc.dtype, lse_acc.dtype
    B, N, h = lse_acc.shape
    t = _targets(send_index, dest, N)                                   # [B * C]
    la = lse_acc.float()                                                # [B, N, h]
    lp = lse_p.float().reshape(-1, h)                                   # [B * C, h]
    m = _sums(la, torch.float32, _NEG_INF).scatter_reduce(0, t[:, None].expand(-1, h), lp, "amax")
    m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)              # [B * (N + 1), h]
    e_acc = torch.exp(la - _drop_scratch(m, B, N))
    e_p = torch.exp(lp - m.index_select(0, t)).reshape(B, -1, h)
    lse = _drop_scratch(m, B, N) + torch.log(scatter_sum(e_acc, e_p, send_index, dest, P, deterministic))
    lse_safe = torch.where(lse == _NEG_INF, torch.zeros_like(lse), lse)
    w_acc = torch.exp(la - lse_safe)                                    # [B, N, h]
    flat_lse = _sums(lse_safe, torch.float32)
    w_p = torch.exp(lp - flat_lse.index_select(0, t)).reshape(B, -1, h)  # [B, C, h]
    if inplace:  # the bits of the copy below: an fp32 copy is exact, then the same mul_ and adds
        out_acc.mul_(w_acc[..., None])
        scatter_add_into_(out_acc, out_p, send_index, dest, P, deterministic, weight=w_p)
        lse_acc.copy_(lse)
        return [out_acc, lse_acc]
    # the fp32 sums of the weighted outputs: the host's own rows first, then the partials window by window
    sums = out_acc.new_empty((B, N + 1, *out_acc.shape[2:]), dtype=torch.float32)
    sums[:, :N].copy_(out_acc).mul_(w_acc[..., None])
    sums[:, N].zero_()
    f = out_acc.shape[2:]
    del out_acc, lse_acc, la, w_acc, e_acc
    flat = scatter_add_(sums.view(B * (N + 1), *f), out_p, send_index, dest, P, deterministic, weight=w_p)
    del out_p, sums
    return [_drop_scratch(flat, B, N).to(out_dtype), lse.to(lse_dtype)]


def neutral_rows(like: torch.Tensor, value: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An accumulator of ``like``'s shape that holds ``value`` everywhere (0: a sum's identity, -inf:
    an lse's) as a broadcast view of one element: it takes no memory until ``reduce_rows`` makes the
    reduce's result, so a reduce in flight holds none for it (``group_reduce``'s ``acc``)."""
    return like.new_full((), value, dtype=like.dtype if dtype is None else dtype).expand(like.shape)


def reduce_rows(acc: list[torch.Tensor], ret: list[torch.Tensor], send_index: torch.Tensor,
                dest: torch.Tensor, op: str, P: int, deterministic: bool, inplace: bool = False) -> list[torch.Tensor]:
    """Dispatch on ``op`` ("sum" or "lse"); all tensors carry the leading batch dim.

    The fused merge (``_merge``: fp32 in registers, only the outputs written; deterministic in
    either mode, in the deterministic order) where ``fused_reduce`` allows it (by default on
    CUDA), else the torch path of this module. Both read an accumulator given as a broadcast
    view (``neutral_rows``) as it is: the torch path copies it into the fp32 sums it makes
    anyway, the fused kernels load its one value per row (``O_BCAST`` / ``A_BCAST``).
    ``inplace``: the result is written into acc (checked by ``group_reduce``: real tensors in
    their sum dtype), and the returned list holds acc's tensors."""
    if use_fused(acc, ret):
        return fused_reduce_rows(acc, ret, send_index, dest, op, P, inplace)
    fn = reduce_sum if op == "sum" else reduce_lse
    return fn(acc, ret, send_index, dest, P, deterministic, inplace)
