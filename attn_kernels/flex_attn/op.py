"""``flex_attn``: the slice-attention custom ops and their public entry point.

Four ops, each with ``register_fake``, so a layer traces whole under
``torch.compile(fullgraph=True)`` and runs on meta tensors:

- ``attn_kernels::flex_attn_fwd`` (with ``register_autograd``: its backward
  calls ``attn_kernels::flex_attn_bwd``, which takes out and dlse);
- ``attn_kernels::row_delta`` and ``attn_kernels::flex_attn_bwd_delta``: the
  backward split the way the distributed runtime runs it. The rank hosting a
  query row computes ``delta = rowsum(dO * O) - dlse`` from the row's final
  O (``row_delta``) and sends dO, lse and delta, never O; a rank that
  computed part of the row's keys then gets its share of dQ and its dK, dV
  from them (``flex_attn_backward``).

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

import math

import torch

from attn_kernels.flex_attn import kernel, ref

_BACKENDS = ("auto", "triton", "torch")
_HEAD_DIMS = (16, 32, 64, 128)


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


@torch.library.custom_op("attn_kernels::flex_attn_fwd_acc", mutates_args=("out_acc", "lse_acc"))
def flex_attn_fwd_acc_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str, out_acc: torch.Tensor, lse_acc: torch.Tensor,
) -> None:
    """As ``flex_attn_fwd``, the result merged in fp32 into out_acc [Tq, Hq, D] and lse_acc [Tq, Hq]
    (fp32, contiguous) in place: no output is made."""
    fwd, _ = _impls(backend)
    fwd(q, k, v, q_ranges, k_ranges, attn_type, softmax_scale, softcap, accumulate=(out_acc, lse_acc))


@flex_attn_fwd_acc_op.register_fake
def flex_attn_fwd_acc_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str, out_acc: torch.Tensor, lse_acc: torch.Tensor,
) -> None:
    return None  # writes into its arguments: allocates nothing


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


@torch.library.custom_op("attn_kernels::flex_attn_bwd_delta", mutates_args=())
def flex_attn_bwd_delta_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout: [Tq, Hq, D], lse/delta: [Tq, Hq] fp32 -> dq [Tq, Hq, D], dk/dv [Tk, Hkv, D]."""
    bwd = kernel.flex_attn_bwd_from_delta if backend == "triton" else ref.flex_attn_bwd_from_delta_ref
    return bwd(dout, q, k, v, lse, delta, q_ranges, k_ranges, attn_type, softmax_scale, softcap)


@flex_attn_bwd_delta_op.register_fake
def flex_attn_bwd_delta_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("attn_kernels::flex_attn_bwd_delta_acc", mutates_args=("dq_acc", "dk_acc", "dv_acc"))
def flex_attn_bwd_delta_acc_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str,
    dq_acc: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor,
) -> None:
    """As ``flex_attn_bwd_delta``, the gradients added in fp32 into dq_acc [Tq, Hq, D] and
    dk_acc, dv_acc [Tk, Hkv, D] (fp32, contiguous) in place: no gradient tensor is made."""
    bwd = kernel.flex_attn_bwd_from_delta if backend == "triton" else ref.flex_attn_bwd_from_delta_ref
    bwd(dout, q, k, v, lse, delta, q_ranges, k_ranges, attn_type, softmax_scale, softcap,
        accumulate=(dq_acc, dk_acc, dv_acc))


@flex_attn_bwd_delta_acc_op.register_fake
def flex_attn_bwd_delta_acc_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str,
    dq_acc: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor,
) -> None:
    return None  # writes into its arguments: allocates nothing


@torch.library.custom_op("attn_kernels::row_delta", mutates_args=())
def row_delta_op(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None, backend: str) -> torch.Tensor:
    """dout/out: [Tq, Hq, D], dlse: [Tq, Hq] fp32 or None -> delta [Tq, Hq] fp32."""
    fn = kernel.row_delta if backend == "triton" else ref.row_delta_ref
    return fn(dout, out, dlse)


@row_delta_op.register_fake
def row_delta_fake(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None, backend: str) -> torch.Tensor:
    return dout.new_empty(dout.shape[:2], dtype=torch.float32)


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
    for name, t in (("q", q), ("k", k), ("v", v), ("q_ranges", q_ranges), ("k_ranges", k_ranges),
                    ("attn_type", attn_type)):
        if not isinstance(t, torch.Tensor):  # before .dim() below: an AttributeError would name nothing
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")


def validate_slice_values(q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
                          seqlen_q: int, seqlen_k: int) -> None:
    """Host-side value checks with row-precise messages (reads the tensors: not for the hot path).

    q_ranges/k_ranges: [R, 2] int, attn_type: [R] int. Raises ValueError naming
    the argument, the first bad row and its value. Overlap between slices is
    not checked (``gpusolver.masks.validate_slices`` does).
    """
    for name, rng, limit in (("q_ranges", q_ranges, seqlen_q), ("k_ranges", k_ranges, seqlen_k)):
        r = rng.detach().to("cpu", torch.int64)
        bad = ((r[:, 0] < 0) | (r[:, 0] > r[:, 1]) | (r[:, 1] > limit)).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            s, e = r[row].tolist()
            raise ValueError(f"{name}[{row}] = [{s}, {e}) must satisfy 0 <= start <= end <= {limit}")
    t = attn_type.detach().to("cpu", torch.int64)
    bad = ((t < 0) | (t > 3)).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(f"attn_type[{row}] = {int(t[row])} must be 0 FULL, 1 CAUSAL, 2 INV_CAUSAL or 3 BI_CAUSAL")


# Sync-free value checks report to a sink: ``gpusolver.errors`` installs its ``record`` and
# ``record_slice_table`` (this package imports nothing of gpusolver). Without one, none are computed.
_error_sink = None
_slices_sink = None


def set_error_sink(sink, slices_sink=None) -> None:
    """``sink(op, argument, message, bad, values)`` receives device-side checks;
    ``slices_sink(op, argument, message, q_ranges, k_ranges, attn_type, Tq, Tk)`` checks a
    slice table in one go (one launch on CUDA)."""
    global _error_sink, _slices_sink
    _error_sink, _slices_sink = sink, slices_sink


_SLICE_ARGS = ("q_ranges", "k_ranges", "attn_type")


def _slice_message(row: int, values: list[int]) -> str:
    """The message of a flagged slice row: values = (argument index, start or code, end, limit)."""
    which, a, b, limit = values[:4]
    if which == 2:
        return f"attn_type[{row}] = {a} must be 0 FULL, 1 CAUSAL, 2 INV_CAUSAL or 3 BI_CAUSAL"
    name = _SLICE_ARGS[which]
    return f"{name}[{row}] = [{a}, {b}) must satisfy 0 <= start <= end <= {limit}"


def _flag_slice_values(op: str, q_ranges, k_ranges, attn_type, seqlen_q: int, seqlen_k: int) -> None:
    """The sync-free twin of ``validate_slice_values``: one device flag, no host read."""
    if _slices_sink is not None:
        _slices_sink(op, "q_ranges/k_ranges/attn_type", _slice_message, q_ranges, k_ranges, attn_type,
                     seqlen_q, seqlen_k)


# the kinds of device error these ops report (registered ahead by the sink's owner)
ERROR_KINDS = [(op, "q_ranges/k_ranges/attn_type", _slice_message) for op in ("flex_attn", "flex_attn_backward")]


def _validating(q: torch.Tensor, validate: bool | None) -> bool:
    """Default: host checks for CPU tensors (cheap there), device flags elsewhere, when compiling
    and for fake tensors (which hold no values)."""
    if validate is None:
        if q.device.type != "cpu" or torch.compiler.is_compiling():
            return False
        from torch._subclasses.fake_tensor import is_fake

        return not is_fake(q)
    return bool(validate)


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    try:  # a string or a list would fail in float() with a message that names no argument
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    except (TypeError, ValueError, RuntimeError):
        scale = math.nan
    if not (scale > 0 and math.isfinite(scale)):  # the kernels take the running max before scaling
        raise ValueError(f"softmax_scale must be > 0 and finite (or None: D^-0.5), got {softmax_scale!r}")
    return scale


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
    validate: bool | None = None, flag_errors: bool = True,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a slice mask; returns (out, lse). Differentiable in q, k, v (not with ``accumulate``).

    Args:
        q: [Tq, Hq, D] fp16/bf16 (GPU) or fp32/fp16 (CPU), D in {16, 32, 64, 128}.
        k, v: [Tk, Hkv, D], same dtype and device; Hq a multiple of Hkv (GQA).
        q_ranges, k_ranges: [R, 2] int32 half-open ranges; a row with
            start == end in either is padding and changes nothing.
        attn_type: [R] int32: 0 FULL, 1 CAUSAL (bottom-right), 2 INV_CAUSAL
            (top-left), 3 BI_CAUSAL. Slices may share query rows but not entries.
        softmax_scale: > 0, defaults to D ** -0.5.
        softcap: > 0 caps scores as softcap * tanh(s / softcap); 0 disables.
        backend: "auto", "triton" or "torch" (see the module docstring).
        validate: check range and type values on the host and raise a
            row-precise ValueError (reads the tensors). Default: on for CPU
            tensors, off on GPU and under ``torch.compile``.
        flag_errors: when not validating, record the same checks as device
            error flags (``gpusolver.check_errors()`` reads them; no host read
            here). Ranges past the tensors never touch memory outside them:
            the kernels drop those entries.
        accumulate: (out_acc, lse_acc), contiguous fp32 tensors shaped as out
            and lse on q's device, or None. Given, this call's result (over
            keys disjoint from those already merged in) is merged into them in
            place with the log-sum-exp merge, in fp32 (its out never rounded
            to q's dtype), and they are returned; rows it sees no key of are
            left as they are, and no output is allocated (what a caller
            merging many calls' parts of the same rows wants). Start them at
            (0, -inf). Not differentiable.

    Returns:
        out: [Tq, Hq, D] in q's dtype (0 for rows with no valid key).
        lse: [Tq, Hq] fp32 natural-log log-sum-exp of the scaled scores
            (-inf for rows with no valid key).
        With ``accumulate``: its two tensors, this call's result merged in.
    """
    _check(q, k, v, q_ranges, k_ranges, attn_type, softcap, backend)
    if accumulate is not None:
        _check_fwd_accumulate(accumulate, q)
    if _validating(q, validate):
        validate_slice_values(q_ranges, k_ranges, attn_type, q.shape[0], k.shape[0])
    elif flag_errors:
        _flag_slice_values("flex_attn", q_ranges, k_ranges, attn_type, q.shape[0], k.shape[0])
    backend = _resolve_backend(q, backend)
    scale = _scale(q, softmax_scale)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), q_ranges.to(torch.int32).contiguous(),
            k_ranges.to(torch.int32).contiguous(), attn_type.to(torch.int32).contiguous(), scale, float(softcap),
            backend)
    if accumulate is None:
        return flex_attn_fwd_op(*args)
    flex_attn_fwd_acc_op(*args, *accumulate)
    return tuple(accumulate)


def _check_fwd_accumulate(accumulate, q: torch.Tensor) -> None:
    """The running result ``accumulate`` takes: (out_acc, lse_acc), fp32, shaped as out and lse, on
    q's device, contiguous (the kernel addresses them densely and writes them in place)."""
    if not isinstance(accumulate, (tuple, list)) or len(accumulate) != 2:
        raise ValueError(f"accumulate must be (out_acc, lse_acc), got {type(accumulate).__name__}"
                         + (f" of length {len(accumulate)}" if isinstance(accumulate, (tuple, list)) else ""))
    for name, t, shape in (("out_acc", accumulate[0], list(q.shape)), ("lse_acc", accumulate[1], list(q.shape[:2]))):
        _check_sum(name, t, shape, q)


def _check_sum(name: str, t, shape: list, q: torch.Tensor) -> None:
    """One fp32 tensor an accumulating call writes in place: shape, dtype, device, contiguity."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"accumulate {name} must be a torch.Tensor, got {type(t).__name__}")
    if list(t.shape) != shape or t.dtype != torch.float32 or t.device != q.device:
        raise ValueError(f"accumulate {name} must be fp32 {shape} on {q.device}, "
                         f"got {t.dtype} {list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"accumulate {name} must be contiguous (it is written in place), got strides {t.stride()}")


def _check_row_stat(name: str, t: torch.Tensor, q: torch.Tensor, q_name: str = "q") -> None:
    """A per-row statistic (lse, delta, dlse) must be [Tq, Hq] fp32 on the device of q (or dout)."""
    want = tuple(q.shape[:2])
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must be [Tq, Hq] = {list(want)}, got {list(t.shape)}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be fp32, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but {q_name} is on {q.device}")


def flex_attn_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor,
    softmax_scale: float | None = None, softcap: float = 0.0, *, backend: str = "auto",
    validate: bool | None = None, flag_errors: bool = True,
    accumulate: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``flex_attn`` over these slices, from each row's final lse and delta.

    ``P = exp(s - lse)``, ``dS = P * (dP - delta)``: with the row's FINAL lse
    and delta (over all its keys, wherever they were computed), this call's
    gradients are its exact share, so a row's dq summed over the calls that
    cover its keys, and each call's dk, dv, equal the whole-mask backward.

    Args:
        dout: [Tq, Hq, D] gradient of the row's final output, in q's dtype.
        q, k, v, q_ranges, k_ranges, attn_type, softmax_scale, softcap,
            backend, validate, flag_errors: as in ``flex_attn`` (the same slices and
            tensors this call's forward used).
        lse: [Tq, Hq] fp32 final lse of each row (natural log, -inf for
            rows with no valid key anywhere).
        delta: [Tq, Hq] fp32 ``row_delta(dout, out, dlse)`` of the final
            output out and the gradient dlse reaching the final lse.
        accumulate: (dq_acc, dk_acc, dv_acc), contiguous fp32 tensors shaped as
            q, k, v on q's device, or None. Given, the call adds its gradients
            (its exact share, in fp32: never rounded to q's dtype) into them in
            place and returns them; no gradient tensor is allocated (what a
            caller summing many calls' shares wants).

    Returns:
        dq: [Tq, Hq, D] in q's dtype (this call's share).
        dk, dv: [Tk, Hkv, D] in k's dtype (summed over each KV head's query heads).
        With ``accumulate``: its three tensors, the gradients added in.
    """
    _check(q, k, v, q_ranges, k_ranges, attn_type, softcap, backend)
    if tuple(dout.shape) != tuple(q.shape) or dout.dtype != q.dtype or dout.device != q.device:
        raise ValueError(f"dout must match q: got {tuple(dout.shape)} {dout.dtype} on {dout.device}, "
                         f"q is {tuple(q.shape)} {q.dtype} on {q.device}")
    _check_row_stat("lse", lse, q)
    _check_row_stat("delta", delta, q)
    if _validating(q, validate):
        validate_slice_values(q_ranges, k_ranges, attn_type, q.shape[0], k.shape[0])
    elif flag_errors:
        _flag_slice_values("flex_attn_backward", q_ranges, k_ranges, attn_type, q.shape[0], k.shape[0])
    if accumulate is not None:
        _check_accumulate(accumulate, q, k, v)
    backend = _resolve_backend(q, backend)
    scale = _scale(q, softmax_scale)
    args = (dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), lse.contiguous(), delta.contiguous(),
            q_ranges.to(torch.int32).contiguous(), k_ranges.to(torch.int32).contiguous(),
            attn_type.to(torch.int32).contiguous(), scale, float(softcap), backend)
    if accumulate is None:
        return flex_attn_bwd_delta_op(*args)
    flex_attn_bwd_delta_acc_op(*args, *accumulate)
    return tuple(accumulate)


def _check_accumulate(accumulate, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The sums ``accumulate`` takes: fp32, shaped as q, k, v, on q's device, contiguous (the kernels
    address them densely and write them in place: a copy would drop the writes)."""
    if not isinstance(accumulate, (tuple, list)) or len(accumulate) != 3:
        raise ValueError(f"accumulate must be (dq_acc, dk_acc, dv_acc), got {type(accumulate).__name__}"
                         + (f" of length {len(accumulate)}" if isinstance(accumulate, (tuple, list)) else ""))
    for name, t, like in (("dq_acc", accumulate[0], q), ("dk_acc", accumulate[1], k), ("dv_acc", accumulate[2], v)):
        _check_sum(name, t, list(like.shape), q)


def row_delta(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None = None,
              *, backend: str = "auto") -> torch.Tensor:
    """Row delta of the attention backward: ``rowsum(dout * out) - dlse``, summed in fp32.

    Args:
        dout: [Tq, Hq, D] gradient of the final output (fp16/bf16/fp32).
        out: [Tq, Hq, D] the final output (merged over all of a row's keys),
            same dtype and device as dout.
        dlse: [Tq, Hq] fp32 gradient reaching the final lse, or None (zero).
        backend: "auto", "triton" or "torch" (see the module docstring).

    Returns:
        delta: [Tq, Hq] fp32, the ``delta`` argument of ``flex_attn_backward``.
    """
    if dout.dim() != 3:
        raise ValueError(f"dout must be [Tq, Hq, D], got shape {tuple(dout.shape)}")
    if dout.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dout must be fp16, bf16 or fp32, got {dout.dtype}")
    if tuple(out.shape) != tuple(dout.shape) or out.dtype != dout.dtype or out.device != dout.device:
        raise ValueError(f"out must match dout: got {tuple(out.shape)} {out.dtype} on {out.device}, "
                         f"dout is {tuple(dout.shape)} {dout.dtype} on {dout.device}")
    if dlse is not None:
        _check_row_stat("dlse", dlse, dout, "dout")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    backend = _resolve_backend(dout, backend)
    return row_delta_op(dout.contiguous(), out.contiguous(), None if dlse is None else dlse.contiguous(), backend)
