"""``sparse_attn``: the sparse-attention custom ops and their public entry points.

Two ops, each with ``register_fake``, so a layer traces whole under
``torch.compile(fullgraph=True)`` and runs on meta tensors:

- ``attn_kernels::sparse_attn_fwd`` (with ``register_autograd``);
- ``attn_kernels::sparse_attn_bwd_delta``: the backward of a part of each
  row's keys from the row's final lse and delta (the distributed runtime's
  protocol: the row's host computes delta and sends dO, lse and delta).

Backend choice, from the tensors' device (never their values): ``"auto"`` is
Triton on CUDA and the torch twin elsewhere; ``"triton"`` on CPU needs the
interpreter (``TRITON_INTERPRET=1``); ``"torch"`` is always the twin.
"""
from __future__ import annotations

import numpy as np
import torch

from attn_kernels.sparse_attn import kernel, ref

_BACKENDS = ("auto", "triton", "torch")
_HEAD_DIMS = (16, 32, 64, 128)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _impls(backend: str):
    return (kernel.sparse_attn_fwd, kernel.sparse_attn_bwd_from_delta) if backend == "triton" else \
        (ref.sparse_attn_fwd_ref, ref.sparse_attn_bwd_from_delta_ref)


@torch.library.custom_op("attn_kernels::sparse_attn_fwd", mutates_args=())
def sparse_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
    block_size: int, window: int, softmax_scale: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [Tq, Hq, D], k/v: [Tk, Hkv, D], sel [Tq, Hs, n] int32, q_pos / q_class [Tq] int32,
    kv_windows [C, W, 3] int32 -> out [Tq, Hq, D] (q's dtype), lse [Tq, Hq] fp32."""
    fwd, _ = _impls(backend)
    return fwd(q, k, v, sel, q_pos, q_class, kv_windows, block_size, window, softmax_scale)


@sparse_attn_fwd_op.register_fake
def sparse_attn_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
    block_size: int, window: int, softmax_scale: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("attn_kernels::sparse_attn_bwd_delta", mutates_args=())
def sparse_attn_bwd_delta_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
    block_size: int, window: int, softmax_scale: float, deterministic: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout: [Tq, Hq, D], lse / delta: [Tq, Hq] fp32 -> dq [Tq, Hq, D], dk / dv [Tk, Hkv, D]."""
    _, bwd = _impls(backend)
    return bwd(dout, q, k, v, lse, delta, sel, q_pos, q_class, kv_windows, block_size, window, softmax_scale,
               deterministic)


@sparse_attn_bwd_delta_op.register_fake
def sparse_attn_bwd_delta_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    sel: torch.Tensor, q_pos: torch.Tensor, q_class: torch.Tensor, kv_windows: torch.Tensor,
    block_size: int, window: int, softmax_scale: float, deterministic: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, sel, q_pos, q_class, kv_windows, block_size, window, softmax_scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sel, q_pos, q_class, kv_windows, out, lse)
    ctx.block_size, ctx.window, ctx.softmax_scale, ctx.backend = block_size, window, softmax_scale, backend


def _backward(ctx, dout, dlse):
    q, k, v, sel, q_pos, q_class, kv_windows, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    delta = ref.row_delta_ref(dout, out, dlse)
    dq, dk, dv = sparse_attn_bwd_delta_op(dout, q, k, v, lse, delta, sel, q_pos, q_class, kv_windows,
                                          ctx.block_size, ctx.window, ctx.softmax_scale, True, ctx.backend)
    return dq, dk, dv, None, None, None, None, None, None, None, None


sparse_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# -- argument checks -----------------------------------------------------------------------------

def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be fp16, bf16 or fp32, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; q is {q.dtype} on {q.device}: they must match")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[2] != k.shape[2] or q.shape[2] not in _HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {_HEAD_DIMS} and equal for q, k: got q D={q.shape[2]}, "
                         f"k D={k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]} (GQA)")


def _index(name: str, t, shape: tuple | None, device, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {layout} = {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t.to(torch.int32).contiguous()


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _prepare(q, k, v, sel, block_size, q_pos, q_class, kv_windows, window, backend):
    """Checked, contiguous int32 index tensors with their defaults (host metadata only)."""
    _check_qkv(q, k, v)
    Tq, Tk, HKV = q.shape[0], k.shape[0], k.shape[1]
    if not isinstance(sel, torch.Tensor):
        raise TypeError(f"sel must be a torch.Tensor, got {type(sel).__name__}")
    if sel.dim() == 2:
        sel = sel[:, None, :]
    if sel.dim() != 3 or sel.shape[0] != Tq or sel.shape[1] not in (1, HKV):
        raise ValueError(f"sel must be [Tq, n] or [Tq, Hs, n] with Tq = {Tq} and Hs in (1, Hkv = {HKV}), "
                         f"got {list(sel.shape)}")
    sel = _index("sel", sel, None, q.device, "[Tq, Hs, n]")
    _positive("block_size", block_size)
    q_pos = torch.arange(Tq, dtype=torch.int32, device=q.device) if q_pos is None else \
        _index("q_pos", q_pos, (Tq,), q.device, "[Tq]")
    q_class = torch.zeros(Tq, dtype=torch.int32, device=q.device) if q_class is None else \
        _index("q_class", q_class, (Tq,), q.device, "[Tq]")
    if kv_windows is None:
        kv_windows = torch.tensor([[[0, Tk, 0]]], dtype=torch.int32, device=q.device)
        window = max(Tk, 1) if window is None else window
    elif kv_windows.dim() != 3 or kv_windows.shape[2] != 3:
        raise ValueError(f"kv_windows must be [C, W, 3] (lo, hi, offset), got {list(kv_windows.shape)}")
    kv_windows = _index("kv_windows", kv_windows, None, q.device, "[C, W, 3]")
    if window is None:
        raise ValueError("window (keys per kv_windows column) is required with kv_windows")
    _positive("window", window)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    return sel, q_pos, q_class, kv_windows, window


def validate_selection(sel: torch.Tensor, name: str = "sel") -> None:
    """Host-side value checks with row-precise messages (reads the tensor: not for the hot path).

    sel: [T, n] or [T, Hs, n] int. Every entry must be >= -1 and no row may
    select the same value twice (-1 may repeat).
    """
    a = sel.detach().to("cpu", torch.int64).numpy()
    a3 = a[:, None, :] if a.ndim == 2 else a
    bad = np.argwhere(a3 < -1)
    if bad.size:
        t, h, i = bad[0].tolist()
        where = f"{name}[{t}, {i}]" if a.ndim == 2 else f"{name}[{t}, {h}, {i}]"
        raise ValueError(f"{where} = {int(a3[t, h, i])} is negative; -1 is the only allowed padding value")
    srt = np.sort(a3, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if dup.any():
        t, h, _ = np.argwhere(dup)[0].tolist()
        value = int(srt[t, h, 1:][dup[t, h]][0])
        i = int(np.flatnonzero(a3[t, h] == value)[1])
        row = f"row {t}" if a.ndim == 2 else f"row (t={t}, h={h})"
        where = f"{name}[{t}, {i}]" if a.ndim == 2 else f"{name}[{t}, {h}, {i}]"
        raise ValueError(f"{where} = {value} repeats a selection in {row}: each key (block) once per row")


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    try:  # a string or a list would fail in float() with a message that names no argument
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    except (TypeError, ValueError, RuntimeError):
        scale = float("nan")
    if not scale > 0:
        raise ValueError(f"softmax_scale must be > 0 (or None: D^-0.5), got {softmax_scale!r}")
    return scale


def _resolve_backend(q: torch.Tensor, backend: str) -> str:
    if backend == "auto":
        return "triton" if q.is_cuda else "torch"
    if backend == "triton" and not q.is_cuda:
        if not kernel.interpreting():
            raise ValueError(f"backend='triton' on {q.device} needs TRITON_INTERPRET=1 "
                             "(set before importing triton); use backend='auto' or 'torch' instead")
        if q.dtype == torch.bfloat16:
            raise ValueError("backend='triton' on CPU cannot run bf16 (the interpreter computes it wrongly); "
                             "use fp32 or fp16")
    return backend


# -- public entry points -------------------------------------------------------------------------

def sparse_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: torch.Tensor, block_size: int = 1,
    softmax_scale: float | None = None, *, q_pos: torch.Tensor | None = None,
    q_class: torch.Tensor | None = None, kv_windows: torch.Tensor | None = None, window: int | None = None,
    backend: str = "auto", validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query row over the keys it selected (differentiable in q, k, v).

    Args:
        q: [Tq, Hq, D] fp16 / bf16 / fp32 (fp32 / fp16 under the interpreter).
        k, v: [Tk, Hkv, D], Hq a multiple of Hkv; the hg = Hq / Hkv query heads of
            a KV head share its selection.
        sel: [Tq, n] or [Tq, Hs, n] int32 / int64, Hs = 1 (shared by every KV head:
            DSA's token top-k) or Hkv (per KV head: NSA's blocks). Slot value b
            selects global keys [b * l, b * l + l); -1 = unused. A row must not
            select a key twice.
        block_size: l (1 for token top-k).
        softmax_scale: default D ** -0.5.
        q_pos: [Tq] int, each row's global position; keys after it are dropped
            (causal), and a row at -1 is padding (no keys). Default: arange(Tq).
        q_class, kv_windows, window: which keys this buffer holds and where. Global
            keys are cut in windows of ``window`` keys; for row class c = q_class[t]
            and window w, ``kv_windows[c, w] = (lo, hi, offset)`` keeps the selected
            keys in [lo, hi) (lo >= hi: none), found at k row ``key + offset``.
            Default: one class, one window [0, Tk) at offset 0 (k holds keys 0..Tk-1).
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".
        validate: host-side checks of sel's values (reads it; row-precise errors).

    Returns:
        out [Tq, Hq, D] in q's dtype and lse [Tq, Hq] fp32 (natural log); a row
        with no kept key gives out 0 and lse -inf.
    """
    given = sel
    sel, q_pos, q_class, kv_windows, window = _prepare(q, k, v, sel, block_size, q_pos, q_class, kv_windows,
                                                        window, backend)
    if validate:
        validate_selection(given)
    backend = _resolve_backend(q, backend)
    return sparse_attn_fwd_op(q.contiguous(), k.contiguous(), v.contiguous(), sel, q_pos, q_class, kv_windows,
                              block_size, window, _scale(q, softmax_scale), backend)


def _check_row_stat(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    want = tuple(q.shape[:2])
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != torch.float32 \
            or t.device != q.device:
        got = f"{list(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be [Tq, Hq] = {list(want)} fp32 on {q.device}, got {got}")


def sparse_attn_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor, sel: torch.Tensor, block_size: int = 1,
    softmax_scale: float | None = None, *, q_pos: torch.Tensor | None = None,
    q_class: torch.Tensor | None = None, kv_windows: torch.Tensor | None = None, window: int | None = None,
    backend: str = "auto", deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``sparse_attn`` over this call's keys, from each row's final lse and delta.

    Args:
        dout: [Tq, Hq, D] gradient of the row's final output, in q's dtype.
        lse: [Tq, Hq] fp32 final lse of each row (over all its keys, wherever computed).
        delta: [Tq, Hq] fp32 ``rowsum(dout * out) - dlse`` of the final out.
        the rest: as in ``sparse_attn`` (the same tensors this call's forward used).
        deterministic: dK, dV summed per key in a fixed order (bit-identical runs; the
            default, as autograd through ``sparse_attn`` does), or with fp32 atomics.

    Returns:
        dq [Tq, Hq, D] (this call's share), dk / dv [Tk, Hkv, D] (summed over each
        KV head's query heads and over the rows that selected each key).
    """
    sel, q_pos, q_class, kv_windows, window = _prepare(q, k, v, sel, block_size, q_pos, q_class, kv_windows,
                                                        window, backend)
    if tuple(dout.shape) != tuple(q.shape) or dout.dtype != q.dtype or dout.device != q.device:
        raise ValueError(f"dout must match q: got {tuple(dout.shape)} {dout.dtype} on {dout.device}, "
                         f"q is {tuple(q.shape)} {q.dtype} on {q.device}")
    _check_row_stat("lse", lse, q)
    _check_row_stat("delta", delta, q)
    backend = _resolve_backend(q, backend)
    return sparse_attn_bwd_delta_op(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                    lse.contiguous(), delta.contiguous(), sel, q_pos, q_class, kv_windows,
                                    block_size, window, _scale(q, softmax_scale), bool(deterministic), backend)


def selection_dense_mask(sel: torch.Tensor, block_size: int, seqlen_k: int, head: int = 0,
                         q_pos: torch.Tensor | None = None) -> torch.Tensor:
    """The dense [Tq, Tk] bool mask of one KV head's selection (causal, host-side; tests).

    sel: [Tq, n] or [Tq, Hs, n] int; query t at position q_pos[t] (default t)
    attends key x when some slot b >= 0 has b * l <= x < b * l + l and x <= q_pos[t].
    """
    a = sel.detach().to("cpu", torch.int64)
    a = a[:, None, :] if a.dim() == 2 else a
    a = a[:, head if a.shape[1] > 1 else 0]  # [Tq, n]
    Tq = a.shape[0]
    pos = torch.arange(Tq) if q_pos is None else q_pos.detach().to("cpu", torch.int64)
    keys = torch.arange(seqlen_k)
    blk = torch.div(keys, block_size, rounding_mode="floor")  # [Tk]
    hit = ((a[:, :, None] == blk[None, None, :]) & (a[:, :, None] >= 0)).any(1)
    return hit & (keys[None, :] <= pos[:, None])
