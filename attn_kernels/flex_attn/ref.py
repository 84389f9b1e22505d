"""Torch twins of the slice-attention launchers: same signatures, same outputs.

Dense math on a ``[Tq, Tk]`` mask built from the slice table with scatters and
running sums (``slices_mask``), so it runs on any device, including ``meta``,
with no host read, and padding rows of the table cost next to nothing. It is
the CPU path of the op and the kernels' test twin; memory grows as Tq·Tk per
head, so it is meant for small problems. Scores and softmax are computed in fp32.
"""
from __future__ import annotations

import torch

from attn_kernels.flex_attn import worklist
from attn_kernels.merge import _weights


def slices_mask(q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
                seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Dense mask of a slice list, built on device with no host read.

    q_ranges/k_ranges: [R, 2] int, attn_type: [R] int. Returns [Tq, Tk] bool.

    Cost O(R + Tq·Tk), so padding rows cost next to nothing. Each slice
    (clipped by ``worklist.slice_rect``) covers, in each of its rows q in
    [qa, qb), the keys [lo(q), hi(q)) with lo = max(ka, q + di) and
    hi = min(kb, q + dc + 1). Marking +1 at lo and -1 at hi and summing along
    the row counts the slices covering each entry; the mask is count > 0.
    The marks of a slice lie on two column segments and two diagonal
    segments, so they are written as four end-point pairs per slice into
    difference arrays: one summed down columns, one summed down diagonals
    (sheared so that a diagonal is a column).
    """
    dev = q_ranges.device
    Tq, Tk = seqlen_q, seqlen_k
    r = worklist.slice_rect(q_ranges, k_ranges, attn_type, Tq, Tk).long()
    qa, qb, ka, kb, dc, di = (r[:, i] for i in range(6))
    # rows where lo leaves the column ka for the diagonal q + di, and where
    # hi leaves the diagonal q + dc + 1 for the column kb (empty slices: all 0)
    qm = torch.minimum(torch.maximum(ka - di, qa), qb)
    qn = torch.minimum(torch.maximum(kb - dc - 1, qa), qb)
    one = torch.ones_like(qa)
    # column segments [qa, qm) at ka (+1) and [qn, qb) at kb (-1); width Tk + 1 holds hi = Tk
    col = torch.zeros((Tq + 1) * (Tk + 1), dtype=torch.int32, device=dev)
    col.index_add_(0, torch.cat([qa * (Tk + 1) + ka, qm * (Tk + 1) + ka, qn * (Tk + 1) + kb, qb * (Tk + 1) + kb]),
                   torch.cat([one, -one, -one, one]).to(torch.int32))
    col = col.view(Tq + 1, Tk + 1).cumsum(0, dtype=torch.int32)
    # diagonal segments [qm, qb) at k = q + di (+1) and [qa, qn) at k = q + dc + 1 (-1),
    # stored at column k - q + Tq + 1 (di, dc + 1 are clamped into [-Tq, Tk + 1])
    W = Tq + Tk + 3
    d0, d1 = di + Tq + 1, dc + Tq + 2
    diag = torch.zeros((Tq + 1) * W, dtype=torch.int32, device=dev)
    diag.index_add_(0, torch.cat([qm * W + d0, qb * W + d0, qa * W + d1, qn * W + d1]),
                    torch.cat([one, -one, -one, one]).to(torch.int32))
    diag = diag.view(Tq + 1, W).cumsum(0, dtype=torch.int32)
    o_q = torch.arange(Tq, device=dev)[:, None]
    o_k = torch.arange(Tk + 1, device=dev)[None, :]
    marks = col[:Tq] + torch.gather(diag[:Tq], 1, o_k - o_q + Tq + 1)
    return marks.cumsum(1, dtype=torch.int32)[:, :Tk] > 0


def _count(counts, at, q_ranges, k_ranges, attn_type, Tq, Tk, HQ, axis, block_q, block_k):
    """Add the kernel loops' cost (per head, times Hq heads) to counts[at:at + 2]."""
    if block_q is None or block_k is None:
        raise ValueError("counts needs block_q and block_k")
    rect = worklist.slice_rect(q_ranges, k_ranges, attn_type, Tq, Tk)
    n, block, inner = (Tq, block_q, block_k) if axis == 0 else (Tk, block_k, block_q)
    c = worklist.inner_iterations(rect, axis, n, block, inner)
    counts[at] += c["visits"] * HQ
    counts[at + 1] += c["iterations"] * HQ


def _scores(q, k, mask, softmax_scale, softcap):
    """Masked scores s [Hkv, G, Tq, Tk] fp32 (-inf outside the mask), tanh of the capped scores (or None)."""
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    G = HQ // HKV
    qg = q.float().reshape(Tq, HKV, G, D)
    s = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * softmax_scale
    th = None
    if softcap > 0:
        th = torch.tanh(s / softcap)
        s = softcap * th
    return s.masked_fill(~mask, float("-inf")), th


def _probs_from_lse(s, mask, lse):
    """p [Hkv, G, Tq, Tk] fp32 = exp(s - lse) inside the mask; lse [Hkv, G, Tq], -inf for empty rows."""
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - lse_safe[..., None]).masked_fill(~mask, 0.0)


def flex_attn_fwd_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float,
    *, block_q: int | None = None, block_k: int | None = None, counts: torch.Tensor | None = None,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``kernel.flex_attn_fwd`` (block sizes only matter for ``counts``).

    counts: optional [2] int64, incremented by what the kernel's loops would
    cost at these block sizes (``worklist.inner_iterations``: slice visits,
    inner iterations, summed over programs); needs block_q and block_k.

    q: [Tq, Hq, D], k/v: [Tk, Hkv, D]; ranges [R, 2] int; attn_type [R] int.
    Returns out [Tq, Hq, D] in q's dtype and lse [Tq, Hq] fp32; with ``accumulate`` (fp32
    out_acc, lse_acc), the fp32 result merged into them in place (``merge_into``), returned.
    """
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    if counts is not None:
        _count(counts, 0, q_ranges, k_ranges, attn_type, Tq, Tk, HQ, 0, block_q, block_k)
    mask = slices_mask(q_ranges, k_ranges, attn_type, Tq, Tk)
    s, _ = _scores(q, k, mask, softmax_scale, softcap)
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, G, Tq], -inf for empty rows
    p = _probs_from_lse(s, mask, lse)
    out = torch.einsum("hgqk,khd->qhgd", p, v.float()).reshape(Tq, HQ, D)
    if accumulate is not None:
        merge_into(accumulate, out, lse.reshape(HQ, Tq).t())
        return accumulate
    return out.to(q.dtype), lse.reshape(HQ, Tq).t().contiguous()


def merge_into(accumulate: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, lse: torch.Tensor) -> None:
    """The forward kernel's ``ACCUMULATE`` epilogue: the part (out fp32 [Tq, Hq, D], lse [Tq, Hq])
    merged into ``accumulate`` = (out_acc, lse_acc), fp32, in place, with the log-sum-exp merge's
    weights (``merge._weights``); rows the part saw no key of are left as they are, bit for bit."""
    out_acc, lse_acc = accumulate
    seen = lse > float("-inf")
    new, w_acc, w_part = _weights(lse_acc, lse)
    merged = w_acc[..., None] * out_acc + w_part[..., None] * out
    out_acc.copy_(torch.where(seen[..., None], merged, out_acc))
    lse_acc.copy_(torch.where(seen, new, lse_acc))


def row_delta_ref(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of ``kernel.row_delta``: rowsum(dout * out) - dlse, [Tq, Hq] fp32."""
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    return delta.contiguous()


def flex_attn_bwd_ref(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float,
    *, block_q: int | None = None, block_k: int | None = None, counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of ``kernel.flex_attn_bwd``: returns dq [Tq, Hq, D], dk/dv [Tk, Hkv, D].

    dlse [Tq, Hq] fp32 is the gradient reaching lse; ``row_delta_ref`` then
    ``flex_attn_bwd_from_delta_ref``.
    """
    delta = row_delta_ref(dout, out, dlse)
    return flex_attn_bwd_from_delta_ref(dout, q, k, v, lse, delta, q_ranges, k_ranges, attn_type,
                                        softmax_scale, softcap, block_q=block_q, block_k=block_k, counts=counts)


def flex_attn_bwd_from_delta_ref(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float,
    *, block_q: int | None = None, block_k: int | None = None, counts: torch.Tensor | None = None,
    accumulate: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of ``kernel.flex_attn_bwd_from_delta``: returns dq [Tq, Hq, D], dk/dv [Tk, Hkv, D].

    accumulate: (dq_acc, dk_acc, dv_acc) fp32, shaped as q, k, v: the fp32 gradients (never
    rounded to q's dtype) are added into them in place and they are returned.

    counts: optional [4] int64 (dQ visits, iterations, dK/dV visits, iterations), as in the forward twin.

    p = exp(s - lse) uses the GIVEN lse [Tq, Hq] fp32 (the row's final lse,
    which may cover keys outside this call), delta [Tq, Hq] fp32 as given.
    """
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    G = HQ // HKV
    if counts is not None:
        _count(counts, 0, q_ranges, k_ranges, attn_type, Tq, Tk, HQ, 0, block_q, block_k)
        _count(counts, 2, q_ranges, k_ranges, attn_type, Tq, Tk, HQ, 1, block_q, block_k)
    mask = slices_mask(q_ranges, k_ranges, attn_type, Tq, Tk)
    s, th = _scores(q, k, mask, softmax_scale, softcap)
    p = _probs_from_lse(s, mask, lse.float().t().reshape(HKV, G, Tq))
    do = dout.float().reshape(Tq, HKV, G, D)
    delta = delta.float().t().reshape(HKV, G, Tq)
    dv = torch.einsum("hgqk,qhgd->khd", p, do)
    dp = torch.einsum("qhgd,khd->hgqk", do, v.float())
    ds = p * (dp - delta[..., None])
    if th is not None:
        ds = ds * (1.0 - th * th)
    dq = torch.einsum("hgqk,khd->qhgd", ds, k.float()).reshape(Tq, HQ, D) * softmax_scale
    dk = torch.einsum("hgqk,qhgd->khd", ds, q.float().reshape(Tq, HKV, G, D)) * softmax_scale
    if accumulate is not None:
        for acc, g in zip(accumulate, (dq, dk, dv)):
            acc.add_(g)
        return accumulate
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
