"""Reduce returned partial rows into the host's accumulators (the local half of group_reduce).

After the move back, rank b holds ``ret [C, *f]``: row p is the partial for
the row it sent at send position p, destined to ``dest[p]`` (-1: nothing was
sent there). It is reduced into ``acc[send_index[p]]``. Everything carries a
leading batch dim B of ranks; rows are addressed in a flat ``[B * (N + 1)]``
space whose row N of each rank is a scratch row that absorbs every skipped
position, so shapes stay static and no mask is read on the host.

Deterministic mode sums destination by destination in ascending order (P
static steps). Within one step every real target is distinct (a rank sends a
row to one destination at most once), so a gather-add-scatter with no atomics
gives the same bits whatever the scheduling. The other mode is one
``index_add_`` (float atomics on GPU).

The lse merge (``op="lse"``): for partials k of one row, with the host's own
(out_0, lse_0) among them,

    m = max_k lse_k,  lse = m + log(sum_k exp(lse_k - m)),  out = sum_k exp(lse_k - lse) * out_k

No exponent is positive (no overflow). A row whose every lse is -inf has
m = -inf: m and lse are replaced by 0 inside the exponents, so the sum is 0,
lse = log(0) = -inf and every weight is exp(-inf) = 0, giving out = 0, never NaN.
The max is exact in any order; the two sums go through the ordered sum above.
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def _targets(send_index: torch.Tensor, dest: torch.Tensor, N: int) -> torch.Tensor:
    """Flat target row of every position, ``[B * C]``: the scratch row of its rank when skipped."""
    B = send_index.shape[0]
    ok = (dest >= 0) & (send_index >= 0) & (send_index < N)
    local = torch.where(ok, send_index, torch.full_like(send_index, N))
    base = torch.arange(B, device=send_index.device, dtype=torch.int64)[:, None] * (N + 1)
    return (base + local).reshape(-1)


def _with_scratch(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``[B, N, *f]`` -> ``[B * (N + 1), *f]`` with one scratch row per rank."""
    B, N = x.shape[:2]
    pad = x.new_full((B, 1, *x.shape[2:]), fill)
    return torch.cat([x, pad], dim=1).reshape(B * (N + 1), *x.shape[2:])


def _drop_scratch(flat: torch.Tensor, B: int, N: int) -> torch.Tensor:
    return flat.reshape(B, N + 1, *flat.shape[1:])[:, :N]


def scatter_sum(base: torch.Tensor, vals: torch.Tensor, send_index: torch.Tensor, dest: torch.Tensor,
                P: int, deterministic: bool) -> torch.Tensor:
    """``base [B, N, *f] + sum of vals [B, C, *f]`` at rows ``send_index``; new tensor, base's dtype."""
    B, N = base.shape[:2]
    flat = _with_scratch(base)
    rows = vals.reshape(-1, *vals.shape[2:]).to(base.dtype)
    if not deterministic:
        flat.index_add_(0, _targets(send_index, dest, N), rows)
        return _drop_scratch(flat, B, N)
    for k in range(P):
        t = _targets(send_index, torch.where(dest == k, dest, torch.full_like(dest, -1)), N)
        # real targets are distinct within one destination; duplicates only hit scratch rows
        flat.index_put_((t,), flat.index_select(0, t) + rows)
    return _drop_scratch(flat, B, N)


def _sum_dtype(acc: torch.dtype, part: torch.dtype) -> torch.dtype:
    dtype = torch.promote_types(acc, part)
    if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return torch.float32
    return dtype


def reduce_sum(acc: list[torch.Tensor], ret: list[torch.Tensor], send_index: torch.Tensor,
               dest: torch.Tensor, P: int, deterministic: bool) -> list[torch.Tensor]:
    """``acc[i] [B, N, *f]`` plus the returned rows ``ret[i] [B, C, *f]``, in acc's dtype (fp32 inside)."""
    out = []
    for a, r in zip(acc, ret):
        dtype = _sum_dtype(a.dtype, r.dtype)
        out.append(scatter_sum(a.to(dtype), r, send_index, dest, P, deterministic).to(a.dtype))
    return out


def reduce_lse(acc: list[torch.Tensor], ret: list[torch.Tensor], send_index: torch.Tensor,
               dest: torch.Tensor, P: int, deterministic: bool) -> list[torch.Tensor]:
    """Merge partial (out ``[B, C, h, D]``, lse ``[B, C, h]``) into acc (out ``[B, N, h, D]``, lse ``[B, N, h]``)."""
    out_acc, lse_acc = acc
    out_p, lse_p = ret
    B, N, h = lse_acc.shape
    t = _targets(send_index, dest, N)                                   # [B * C]
    la = lse_acc.float()                                                # [B, N, h]
    lp = lse_p.float().reshape(-1, h)                                   # [B * C, h]
    m = _with_scratch(la, _NEG_INF).scatter_reduce(0, t[:, None].expand(-1, h), lp, "amax")
    m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)              # [B * (N + 1), h]
    e_acc = torch.exp(la - _drop_scratch(m, B, N))
    e_p = torch.exp(lp - m.index_select(0, t)).reshape(B, -1, h)
    lse = _drop_scratch(m, B, N) + torch.log(scatter_sum(e_acc, e_p, send_index, dest, P, deterministic))
    lse_safe = torch.where(lse == _NEG_INF, torch.zeros_like(lse), lse)
    w_acc = torch.exp(la - lse_safe)                                    # [B, N, h]
    w_p = torch.exp(lp - _with_scratch(lse_safe).index_select(0, t))    # [B * C, h]
    o_p = (w_p[..., None] * out_p.float().reshape(-1, *out_p.shape[2:])).reshape(out_p.shape)
    out = scatter_sum(w_acc[..., None] * out_acc.float(), o_p, send_index, dest, P, deterministic)
    return [out.to(out_acc.dtype), lse.to(lse_acc.dtype)]


def reduce_rows(acc: list[torch.Tensor], ret: list[torch.Tensor], send_index: torch.Tensor,
                dest: torch.Tensor, op: str, P: int, deterministic: bool) -> list[torch.Tensor]:
    """Dispatch on ``op`` ("sum" or "lse"); all tensors carry the leading batch dim."""
    fn = reduce_sum if op == "sum" else reduce_lse
    return fn(acc, ret, send_index, dest, P, deterministic)
