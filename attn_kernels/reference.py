"""The test oracle: slice attention from a dense boolean mask and plain torch math.

Independent of the kernels and of ``flex_attn/ref.py``: the dense mask is
rebuilt row by row on the host straight from the slice definition, and the
attention is differentiable torch code, so gradients come from autograd.

    mask = slices_to_dense(q_ranges, k_ranges, attn_type, Tq, Tk)   # [Tq, Tk] bool
    out, lse = dense_attn(q, k, v, mask)                            # [Tq, Hq, D], [Tq, Hq]
"""
from __future__ import annotations

import torch


def slices_to_dense(q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
                    seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """[Tq, Tk] bool mask of a slice list (host loops; small masks only).

    q_ranges/k_ranges: [R, 2] int half-open; attn_type: [R] int (0 FULL,
    1 CAUSAL bottom-right, 2 INV_CAUSAL top-left, 3 BI_CAUSAL).
    """
    dense = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    for (qs, qe), (ks, ke), t in zip(q_ranges.tolist(), k_ranges.tolist(), attn_type.tolist()):
        for q in range(qs, qe):
            lo = max(ks, q + ks - qs) if t in (2, 3) else ks
            hi = min(ke, q + ke - qe + 1) if t in (1, 3) else ke
            if hi > lo:
                dense[q, lo:hi] = True
    return dense.to(q_ranges.device)


def dense_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               softmax_scale: float | None = None, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention in fp64, differentiable, NaN-free for empty rows.

    q: [Tq, Hq, D], k/v: [Tk, Hkv, D], mask: [Tq, Tk] bool.
    Returns out [Tq, Hq, D] (q's dtype) and lse [Tq, Hq] fp32; a row with no
    valid key gives out 0 and lse -inf.
    """
    Tq, HQ, D = q.shape
    HKV = k.shape[1]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    kk = k.double().repeat_interleave(HQ // HKV, dim=1)
    vv = v.double().repeat_interleave(HQ // HKV, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    has_key = mask.any(-1)  # [Tq]
    # Empty rows get a harmless all-zero score row, then are zeroed at the end,
    # so no -inf - -inf reaches autograd.
    keep = mask | ~has_key[:, None]
    s = torch.where(keep, s, torch.full_like(s, float("-inf")))
    s = torch.where(has_key[:, None], s, torch.zeros_like(s))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Tq]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vv)
    out = torch.where(has_key[:, None, None], out, torch.zeros_like(out))
    lse = torch.where(has_key[None, :], lse, torch.full_like(lse, float("-inf")))
    return out.to(q.dtype).contiguous(), lse.t().float().contiguous()


def flex_attn_reference(q, k, v, q_ranges, k_ranges, attn_type, softmax_scale=None, softcap=0.0):
    """``flex_attn``'s contract through the dense oracle: same arguments, same (out, lse)."""
    mask = slices_to_dense(q_ranges, k_ranges, attn_type, q.shape[0], k.shape[0])
    return dense_attn(q, k, v, mask.to(q.device), softmax_scale, softcap)
