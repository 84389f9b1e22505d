"""Torch twins of the sparse-attention launchers: same signatures, same outputs.

Memory-lean: each query row gathers only the keys it selected (``[rows, Hkv,
n * l, D]`` per step of ``ROW_STEP`` rows), never a dense ``[Tq, Tk]`` mask.
Scores and softmax are fp32. The loop over row steps has a static trip count
(a function of Tq), so the twins run on any device, ``meta`` included. This is
the op's CPU path and the oracle of the Triton kernels' tests.

The selection semantics (see the package docstring) live in ``selected_rows``,
shared by the forward and the backward.
"""
from __future__ import annotations

import torch

# Gathered (row, head, key) triples per step: bounds the [rows, Hkv, N, D] working set.
_STEP_ELEMS = 1 << 16


def selected_rows(sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
                  block_size: int, window: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffer rows of every selected key, and whether it is kept.

    sel:        [T, Hs, n] int, selection slots (-1 unused); slot value b covers
                global keys [b * l, b * l + l).
    q_pos:      [T] int, global position of each query row (-1: padding row).
    q_class:    [T] int, each row's class (its row of kv_windows).
    kv_windows: [C, W, 3] int, (lo, hi, offset) per class and window of ``window`` keys.
    Returns (rows [T, Hs, n * l] int64, kept [T, Hs, n * l] bool); rows are 0
    where not kept, so a gather with them stays inside the buffer.
    """
    T, Hs, n = sel.shape
    C, W = kv_windows.shape[0], kv_windows.shape[1]
    l = block_size
    b = sel.long()
    key = (b[..., None] * l + torch.arange(l, device=sel.device)).reshape(T, Hs, n * l)
    pos = q_pos.long().view(T, 1, 1)
    j = torch.div(key, window, rounding_mode="floor")
    ok = (b >= 0).repeat_interleave(l, dim=-1, output_size=n * l) & (key <= pos) & (pos >= 0) & (j < W)
    cls = q_class.long().clamp(0, C - 1).view(T, 1, 1)
    win = kv_windows.long()[cls, j.clamp(0, W - 1)]  # [T, Hs, n * l, 3]
    ok = ok & (key >= win[..., 0]) & (key < win[..., 1])
    rows = key + win[..., 2]
    ok = ok & (rows >= 0) & (rows < num_keys)
    return torch.where(ok, rows, 0), ok


def _row_step(Tq: int, Hkv: int, width: int, D: int) -> int:
    return max(1, min(Tq, _STEP_ELEMS // max(1, Hkv * width * D // 16)))


def _gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [Tk, Hkv, D], rows [t, Hs, N] (Hs in {1, Hkv}) -> [t, Hkv, N, D] fp32 (head h reads rows[:, h or 0])."""
    Tk, Hkv, D = x.shape
    t, Hs, N = rows.shape
    heads = torch.arange(Hkv, device=x.device).view(1, Hkv, 1)
    flat = rows.expand(t, Hkv, N) * Hkv + heads  # rows of x viewed as [Tk * Hkv, D]
    return x.reshape(Tk * Hkv, D).float()[flat]


def sparse_attn_fwd_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
    block_size: int, window: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``kernel.sparse_attn_fwd``.

    q: [Tq, Hq, D], k/v: [Tk, Hkv, D]; sel [Tq, Hs, n] int; q_pos / q_class [Tq]
    int; kv_windows [C, W, 3] int. Returns out [Tq, Hq, D] in q's dtype and lse
    [Tq, Hq] fp32 (natural log; out 0 and lse -inf for a row with no kept key).
    """
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    G = HQ // HKV
    N = sel.shape[2] * block_size
    step = _row_step(Tq, HKV, N, D)
    outs, lses = [], []
    for t0 in range(0, Tq, step):  # static trip count
        t1 = min(Tq, t0 + step)
        rows, ok = selected_rows(sel[t0:t1], q_pos[t0:t1], q_class[t0:t1], kv_windows, block_size, window, Tk)
        kg, vg = _gather(k, rows), _gather(v, rows)  # [t, Hkv, N, D]
        qg = q[t0:t1].float().reshape(t1 - t0, HKV, G, D)
        s = torch.einsum("thgd,thnd->thgn", qg, kg) * softmax_scale
        keep = ok.expand(t1 - t0, HKV, N)[:, :, None, :]
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [t, Hkv, G], -inf for empty rows
        lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - lse_safe[..., None]).masked_fill(~keep, 0.0)
        outs.append(torch.einsum("thgn,thnd->thgd", p, vg).reshape(t1 - t0, HQ, D))
        lses.append(lse.reshape(t1 - t0, HQ))
    if not outs:
        return torch.zeros_like(q), q.new_full((Tq, HQ), float("-inf"), dtype=torch.float32)
    return torch.cat(outs).to(q.dtype), torch.cat(lses).contiguous()


def sparse_attn_bwd_from_delta_ref(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
    block_size: int, window: int, softmax_scale: float, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of ``kernel.sparse_attn_bwd_from_delta``: dq [Tq, Hq, D], dk / dv [Tk, Hkv, D].

    ``p = exp(s - lse)`` with the GIVEN lse [Tq, Hq] fp32 (the row's final lse,
    which may cover keys outside this call) and ``dS = p * (dP - delta)`` with
    delta [Tq, Hq] fp32 as given, so this call's gradients are its exact share.
    dK and dV are summed with ``index_add_`` (in row order on the CPU, deterministic whatever
    ``deterministic`` says; on a GPU index_add_ uses atomics).
    """
    Tq, HQ, D = q.shape
    Tk, HKV, _ = k.shape
    G = HQ // HKV
    N = sel.shape[2] * block_size
    step = _row_step(Tq, HKV, N, D)
    dk = torch.zeros(Tk * HKV, D, dtype=torch.float32, device=k.device)
    dv = torch.zeros(Tk * HKV, D, dtype=torch.float32, device=k.device)
    dqs = []
    heads = torch.arange(HKV, device=k.device).view(1, HKV, 1)
    for t0 in range(0, Tq, step):
        t1 = min(Tq, t0 + step)
        t = t1 - t0
        rows, ok = selected_rows(sel[t0:t1], q_pos[t0:t1], q_class[t0:t1], kv_windows, block_size, window, Tk)
        kg, vg = _gather(k, rows), _gather(v, rows)
        qg = q[t0:t1].float().reshape(t, HKV, G, D)
        dog = dout[t0:t1].float().reshape(t, HKV, G, D)
        keep = ok.expand(t, HKV, N)[:, :, None, :]
        s = torch.einsum("thgd,thnd->thgn", qg, kg) * softmax_scale
        l_ = lse[t0:t1].float().reshape(t, HKV, G)
        l_ = torch.where(torch.isinf(l_), torch.zeros_like(l_), l_)
        p = torch.exp(s - l_[..., None]).masked_fill(~keep, 0.0)
        dp = torch.einsum("thgd,thnd->thgn", dog, vg)
        ds = p * (dp - delta[t0:t1].float().reshape(t, HKV, G)[..., None])
        dqs.append((torch.einsum("thgn,thnd->thgd", ds, kg) * softmax_scale).reshape(t, HQ, D))
        flat = (rows.expand(t, HKV, N) * HKV + heads).reshape(-1)
        dk.index_add_(0, flat, (torch.einsum("thgn,thgd->thnd", ds, qg) * softmax_scale).reshape(-1, D))
        dv.index_add_(0, flat, torch.einsum("thgn,thgd->thnd", p, dog).reshape(-1, D))
    dq = torch.cat(dqs) if dqs else torch.zeros_like(q, dtype=torch.float32)
    return dq.to(q.dtype), dk.view(Tk, HKV, D).to(k.dtype), dv.view(Tk, HKV, D).to(v.dtype)


def row_delta_ref(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None = None) -> torch.Tensor:
    """rowsum(dout * out) - dlse, [Tq, Hq] fp32 (the delta of the final out)."""
    delta = (dout.float() * out.float()).sum(-1)
    return (delta if dlse is None else delta - dlse.float()).contiguous()
