"""What runs where: the support matrix, as data, and the call-time check that reads it.

``check_supported(q, k, v, group)`` is called by ``dist_attn`` before any work:
it reads host metadata only (device types, dtypes, shapes, the group's
backend), so it is free on the hot path and traces under ``torch.compile``.
``check_tensors`` and ``softmax_scale_of`` are the layer entry points' other
call-time checks (argument kinds, the scale), host-only as well.
``support_matrix_markdown()`` renders the same data as the tables of
``docs/support_matrix.md`` (a test keeps the page equal to it).
"""
from __future__ import annotations

import math

import torch

__all__ = ["MASKS", "EXECUTION", "DTYPES", "HEAD_DIMS", "check_supported", "check_tensors", "softmax_scale_of",
           "support_matrix_markdown"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)  # the attention kernels' head dims

# mask form -> (block areas, solve to a plan, the layer that runs it, note)
MASKS = {
    "slices `[R]`: FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL, padding rows": ("yes", "yes", "yes", ""),
    "slices per head group `[G, R]`": ("yes", "yes", "yes",
                                        "under torch.compile the solve is traced op by op"),
    "NSA block selection `[T, Hkv, n]`": ("yes", "yes: `SparsePlan`", "`sparse_dist_attn`, `DynamicCPAttention`",
                                          "each rank passes its own query rows; their area rows are all-gathered"),
    "DSA token top-k `[T, k]`": ("yes", "yes: `SparsePlan`", "`sparse_dist_attn`, `DynamicCPAttention`",
                                 "each rank passes its own query rows; their area rows are all-gathered"),
    "NSA layer: selection + sliding window (`NSALayerMask`)": ("yes", "yes", "`DynamicCPAttention`",
                                                               "two branches, each with its own out and lse"),
}

# (device, attention backend, collective, process-group backend or None) -> note
EXECUTION = {
    ("cpu", "torch twin (dense, fp32 math)", "LocalGroup", None): "P simulated ranks in one process",
    ("cpu", "torch twin (dense, fp32 math)", "TorchGroup", "gloo"): "all-to-all-v; split sizes read once per layer",
    ("cuda", "Triton kernels", "LocalGroup", None): "P simulated ranks on one GPU; sync-free, CUDA-graph capturable",
    ("cuda", "Triton kernels", "TorchGroup", "nccl"): "all-to-all-v; split sizes read once per layer",
    ("cuda", "Triton kernels", "SymmMemGroup", "nccl"): "one node; sync-free, CUDA-graph capturable",
}

GQA = ("Hq a multiple of Hkv (MHA, GQA, MQA); head-group flattening (default) splits work per KV head, "
       "G = Hkv; `head_group_flatten=False` makes G = 1")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _group_backend(group) -> str | None:
    """The process-group backend of a per-rank group ('gloo', 'nccl', ...), None for LocalGroup."""
    if getattr(group, "batched", False) or torch.compiler.is_compiling():
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return str(dist.get_backend(getattr(group, "process_group", None))).lower()
    except (RuntimeError, ValueError):
        return None


def check_tensors(**tensors) -> None:
    """Raise TypeError naming the first argument that is not a ``torch.Tensor`` (the shape checks
    after it would read ``.dim()`` of a list or None: an AttributeError naming nothing)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def softmax_scale_of(softmax_scale, head_dim: int) -> float:
    """The layer's softmax scale as a float: ``head_dim ** -0.5`` for None. Raises ValueError naming
    ``softmax_scale`` unless it is a positive finite number, before any collective is issued (the
    kernels would refuse it only at the first attention launch, and ``float("x")`` names nothing)."""
    if softmax_scale is None:
        return head_dim ** -0.5
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
        scale = math.nan
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"softmax_scale must be > 0 and finite (or None: D^-0.5), got {softmax_scale!r}")
    return scale


def check_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> None:
    """Raise ValueError when (device, dtype, head dim, GQA, collective) is outside the support matrix.

    q: ``[.., c, Hq, D]``, k / v: ``[.., c, Hkv, D]``; group: a ``groupcomm`` group. Host metadata only.
    """
    dev = q.device.type
    for name, t in (("k", k), ("v", v)):
        if t.device.type != dev or t.dtype != q.dtype:
            raise ValueError(f"{name} is {_name(t.dtype)} on {t.device} but q is {_name(q.dtype)} on {q.device}: "
                             "q, k and v must share dtype and device")
    if dev not in ("cpu", "cuda", "meta"):
        raise ValueError(f"dist_attn runs on cpu and cuda tensors, got {q.device} (docs/support_matrix.md)")
    if q.dtype not in DTYPES:
        raise ValueError(f"dist_attn supports {', '.join(map(_name, DTYPES))}, got {_name(q.dtype)} "
                         "(docs/support_matrix.md)")
    D = q.shape[-1]
    if D not in HEAD_DIMS or k.shape[-1] != D:
        raise ValueError(f"the attention kernels take head dims {HEAD_DIMS} (q and k equal), got q D = {D}, "
                         f"k D = {k.shape[-1]} (docs/support_matrix.md)")
    Hq, Hkv = q.shape[-2], k.shape[-2]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"Hq = {Hq} query heads must be a multiple of Hkv = {Hkv} KV heads (GQA)")
    if dev == "meta":
        return
    kind = type(group).__name__
    backend = _group_backend(group)
    rows = [key for key in EXECUTION if key[0] == dev and key[2] == kind]
    if not rows:
        allowed = sorted({key[2] for key in EXECUTION if key[0] == dev})
        raise ValueError(f"{kind} does not run on {dev} tensors; on {dev} use {' or '.join(allowed)} "
                         "(docs/support_matrix.md)")
    wanted = {key[3] for key in rows}
    if backend is not None and None not in wanted and backend not in wanted:
        raise ValueError(f"{kind} over a '{backend}' process group with {dev} tensors is not supported: "
                         f"use a {' or '.join(sorted(wanted))} group for {dev} tensors (docs/support_matrix.md)")


def support_matrix_markdown() -> str:
    """The support tables of ``docs/support_matrix.md``, rendered from this module's data."""
    lines = ["| mask form | block areas | solve -> plan | layer | note |", "|---|---|---|---|---|"]
    lines += [f"| {m} | {a} | {s} | {d} | {n} |" for m, (a, s, d, n) in MASKS.items()]
    lines += ["", "| device | attention | collective | process group | dtypes | head dims | note |",
              "|---|---|---|---|---|---|---|"]
    dtypes = ", ".join(map(_name, DTYPES))
    dims = ", ".join(map(str, HEAD_DIMS))
    lines += [f"| {dev} | {att} | {coll} | {pg or '-'} | {dtypes} | {dims} | {note} |"
              for (dev, att, coll, pg), note in EXECUTION.items()]
    lines += ["", f"GQA: {GQA}."]
    return "\n".join(lines) + "\n"
