"""``flex_attn``: the slice-attention custom ops and their public entry point.

Two ops, ``attn_kernels::flex_attn_fwd`` and ``attn_kernels::flex_attn_bwd``,
each with ``register_fake``; the forward has ``register_autograd`` (its
backward calls the backward op), so a layer traces whole under
``torch.compile(fullgraph=True)`` and runs on meta tensors.

Backend choice (the ``backend`` argument, resolved on the host from the
tensors' device, never from their values):

- ``"auto"`` (default): the Triton kernels for CUDA tensors, the torch twin
  (``ref.py``) for any other device. CPU callers (tests of the whole runtime,
  simulation) thus get exact dense math at torch speed.
- ``"triton"``: always the Triton kernels. On CPU this needs the Triton
  interpreter (``TRITON_INTERPRET=1`` set before triton is imported); this is
  how the tests run the kernels without a GPU.
- ``"torch"``: always the torch twin.
"""
from __future__ import annotations

import torch

from attn_kernels.flex_attn import kernel, ref

_BACKENDS = ("auto", "triton", "torch")
_HEAD_DIMS = (32, 64, 128)


def _impls(backend: str):
    return (kernel.flex_attn_fwd, kernel.flex_attn_bwd) if backend == "triton" else \
        (ref.flex_attn_fwd_ref, ref.flex_attn_bwd_ref)


@torch.library.custom_op("attn_kernels::flex_attn_fwd", mutates_args=())
def flex_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [Tq, Hq, D], k/v: [Tk, Hkv, D], ranges [R, 2] int32, attn_type [R] int32
    -> out [Tq, Hq, D] (q's dtype), lse [Tq, Hq] fp32. ``backend`` is "triton" or "torch"."""
    fwd, _ = _impls(backend)
    return fwd(q, k, v, q_ranges, k_ranges, attn_type, softmax_scale, softcap)


@flex_attn_fwd_op.register_fake
def flex_attn_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("attn_kernels::flex_attn_bwd", mutates_args=())
def flex_attn_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout/out: [Tq, Hq, D], lse/dlse: [Tq, Hq] fp32 -> dq [Tq, Hq, D], dk/dv [Tk, Hkv, D]."""
    _, bwd = _impls(backend)
    return bwd(dout, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type, softmax_scale, softcap)


@flex_attn_bwd_op.register_fake
def flex_attn_bwd_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_ranges, k_ranges, attn_type, softmax_scale, softcap, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, q_ranges, k_ranges, attn_type, out, lse)
    ctx.softmax_scale, ctx.softcap, ctx.backend = softmax_scale, softcap, backend


def _backward(ctx, dout, dlse):
    q, k, v, q_ranges, k_ranges, attn_type, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
    dq, dk, dv = flex_attn_bwd_op(dout, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type,
                                  ctx.softmax_scale, ctx.softcap, ctx.backend)
    return dq, dk, dv, None, None, None, None, None, None


flex_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check(q, k, v, q_ranges, k_ranges, attn_type, softcap, backend) -> None:
    """Shape / dtype / device checks (host metadata only)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
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
    if q_ranges.dim() != 2 or q_ranges.shape[1] != 2:
        raise ValueError(f"q_ranges must be [R, 2], got {tuple(q_ranges.shape)}")
    if k_ranges.shape != q_ranges.shape:
        raise ValueError(f"k_ranges shape {tuple(k_ranges.shape)} must equal q_ranges shape {tuple(q_ranges.shape)}")
    if tuple(attn_type.shape) != (q_ranges.shape[0],):
        raise ValueError(f"attn_type must be [R] = [{q_ranges.shape[0]}], got {tuple(attn_type.shape)}")
    for name, t in (("q_ranges", q_ranges), ("k_ranges", k_ranges), ("attn_type", attn_type)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 (or int64), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")


def validate_slice_values(q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
                          seqlen_q: int, seqlen_k: int) -> None:
    """Host-side value checks with row-precise messages (reads the tensors: not for the hot path).

    q_ranges/k_ranges: [R, 2] int, attn_type: [R] int. Raises ValueError naming
    the argument, the row and the value. Overlap between slices is not checked.
    """
    for name, rng, limit in (("q_ranges", q_ranges, seqlen_q), ("k_ranges", k_ranges, seqlen_k)):
        for row, (s, e) in enumerate(rng.tolist()):
            if not 0 <= s <= e <= limit:
                raise ValueError(f"{name}[{row}] = [{s}, {e}) must satisfy 0 <= start <= end <= {limit}")
    for row, t in enumerate(attn_type.tolist()):
        if t not in (0, 1, 2, 3):
            raise ValueError(f"attn_type[{row}] = {t} must be 0 FULL, 1 CAUSAL, 2 INV_CAUSAL or 3 BI_CAUSAL")


def _resolve_backend(q: torch.Tensor, backend: str) -> str:
    if backend == "auto":
        return "triton" if q.is_cuda else "torch"
    if backend == "triton" and not q.is_cuda:
        if not kernel._interpreting():
            raise ValueError(f"backend='triton' on {q.device} needs TRITON_INTERPRET=1 "
                             "(set before importing triton); use backend='auto' or 'torch' instead")
        if q.dtype == torch.bfloat16:
            raise ValueError("backend='triton' on CPU cannot run bf16 (the interpreter computes it wrongly); "
                             "use fp32 or fp16")
    return backend


def flex_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float | None = None, softcap: float = 0.0, *, backend: str = "auto",
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a slice mask; returns (out, lse). Differentiable in q, k, v.

    Args:
        q: [Tq, Hq, D] fp16/bf16 (GPU) or fp32/fp16 (CPU), D in {32, 64, 128}.
        k, v: [Tk, Hkv, D], same dtype and device; Hq a multiple of Hkv (GQA).
        q_ranges, k_ranges: [R, 2] int32 half-open ranges; a row with
            start == end in either is padding and changes nothing.
        attn_type: [R] int32: 0 FULL, 1 CAUSAL (bottom-right), 2 INV_CAUSAL
            (top-left), 3 BI_CAUSAL. Slices may share query rows but not entries.
        softmax_scale: defaults to D ** -0.5.
        softcap: > 0 caps scores as softcap * tanh(s / softcap); 0 disables.
        backend: "auto", "triton" or "torch" (see the module docstring).
        validate: also check range and type values on the host, with
            row-precise errors (reads the tensors; off on the hot path).

    Returns:
        out: [Tq, Hq, D] in q's dtype (0 for rows with no valid key).
        lse: [Tq, Hq] fp32 natural-log log-sum-exp of the scaled scores
            (-inf for rows with no valid key).
    """
    _check(q, k, v, q_ranges, k_ranges, attn_type, softcap, backend)
    if validate:
        validate_slice_values(q_ranges, k_ranges, attn_type, q.shape[0], k.shape[0])
    backend = _resolve_backend(q, backend)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return flex_attn_fwd_op(
        q.contiguous(), k.contiguous(), v.contiguous(),
        q_ranges.to(torch.int32).contiguous(), k_ranges.to(torch.int32).contiguous(),
        attn_type.to(torch.int32).contiguous(), scale, float(softcap), backend)
