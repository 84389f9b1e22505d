"""Hugging Face Transformers models under context parallelism: ``attn_implementation="gpusolver"``.

``register(attn)`` registers an attention function (``AttentionInterface``)
that runs the given ``DynamicCPAttention`` on the layer's q, k, v shards, and
a mask function (``AttentionMaskInterface``) that hands the model's 2-D
``attention_mask`` through unchanged so that a padding mask is refused, not
silently dropped. Register before the model is built, then build it with
``attn_implementation="gpusolver"`` (or call ``model.set_attn_implementation``).

Each call of the model is this rank's shard of one packed sequence:

- ``TorchGroup`` / ``SymmMemGroup``: batch 1, ``input_ids [1, c]``;
- ``LocalGroup(P)`` (P simulated ranks in one process): batch P, row p is rank p.

The layer's mask is the whole sequence's ``AttnSlices`` (``gpusolver.packing``
builds it), given as ``model(..., cp_mask=mask)`` or, for code that drops
unknown keyword arguments, ``with cp_context(mask): model(...)``. A compiled
model can be given plans solved outside the graph instead: ``cp_plan=plan``
(one ``Plan``, or ``cp_plans(attn, mask, config)``: one per window size).

What the function maps and what it refuses (each refusal says what to pass):

- ``sliding_window`` (Qwen2, Mistral): the document mask is cut to the window
  inside each document (``gpusolver.packing.windowed``), solved under its own
  plan name so full and windowed layers keep one plan each;
- ``scaling`` must equal the module's softmax scale (default ``D ** -0.5``);
- attention dropout > 0, ``softcap``, a padding ``attention_mask``, a KV cache
  that makes keys longer than queries, a missing mask, and on rank p > 0
  positions equal to the model's default ``0 .. c-1`` where the shard's first
  token continues a document (the caller forgot ``position_ids``).

The value checks (padding, positions) run once per forward, at layer 0: on
the host in validation mode (the default for CPU tensors), else as device
error flags that ``gpusolver.check_errors()`` reads. With a mask function
registered, transformers itself looks for packed sequences in
``position_ids`` once per mask it builds (a host read in eager mode, skipped
under ``torch.compile``); the mask it would build is not used.

Under ``torch.compile`` pass ``cp_mask=`` or ``cp_plan=`` as arguments (the
tested way); ``cp_context`` is read from a module global, for eager models.

Versions: written for and tested with transformers ``TESTED_VERSIONS``; it
needs ``AttentionInterface`` and ``AttentionMaskInterface`` (transformers 5).
Another version warns once at ``register``: the keyword arguments that models
pass to attention functions change between releases.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import torch

from gpusolver import errors
from gpusolver.masks.slices import CAUSAL, FULL, INV_CAUSAL, AttnSlices
from gpusolver.packing import windowed
from gpusolver.plan import Plan
from gpusolver.runtime.layout import _rank_and_size
from gpusolver.runtime.module import DynamicCPAttention

TESTED_VERSIONS = ("5.23",)  # major.minor releases the tests run against (tests/integrations)

_MISSING_MASK = ("no CP mask: pass cp_mask=<the whole sequence's AttnSlices> to the model call (e.g. "
                 "gpusolver.packing.pack(...).mask), wrap the call in `with cp_context(mask):`, or pass cp_plan=")
_POSITIONS_MESSAGE = ("row {row} (rank {v0}): position_ids are the model's default 0..{v1} (what it makes when "
                      "none are passed) but in the mask the shard's first token continues a document: pass "
                      "position_ids= (PackedBatch.position_ids, per document or global: rank * c + arange(c))")
_PADDING_MESSAGE = ("row {row}: attention_mask has padding (a 0): gpusolver takes no padding mask; pack the "
                    "documents (gpusolver.packing.pack pads with a document of its own) and drop attention_mask")
errors.register("gpusolver attention", "position_ids", _POSITIONS_MESSAGE)
errors.register("gpusolver attention", "attention_mask", _PADDING_MESSAGE)

_context: list[tuple[AttnSlices | None, object]] = []  # the open cp_context blocks, innermost last
_warned_versions: set[str] = set()


@contextlib.contextmanager
def cp_context(mask: AttnSlices | None = None, *, plan=None):
    """Inside the block, every gpusolver attention call without ``cp_mask=`` / ``cp_plan=`` uses
    ``mask`` (the whole sequence's ``AttnSlices``) or ``plan`` (a ``Plan``, or ``{window: Plan}``)."""
    if (mask is None) == (plan is None):
        raise ValueError("cp_context: pass exactly one of mask= and plan=")
    if mask is not None and not isinstance(mask, AttnSlices):
        raise TypeError(f"cp_context: mask must be an AttnSlices, got {type(mask).__name__}")
    _context.append((mask, plan))
    try:
        yield
    finally:
        _context.pop()


def _require_transformers():
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(f"gpusolver.integrations.transformers needs transformers with AttentionInterface and "
                          f"AttentionMaskInterface (tested: {', '.join(TESTED_VERSIONS)}): {e}") from e
    version = transformers.__version__
    if ".".join(version.split(".")[:2]) not in TESTED_VERSIONS and version not in _warned_versions:
        _warned_versions.add(version)
        warnings.warn(f"transformers {version} is not a version gpusolver is tested with "
                      f"({', '.join(TESTED_VERSIONS)}); the attention function's keyword arguments may differ",
                      stacklevel=3)
    return AttentionInterface, AttentionMaskInterface


def register(attn: DynamicCPAttention, name: str = "gpusolver") -> str:
    """Register ``attn_implementation=name`` running ``attn`` for every attention layer; returns ``name``.

    Register before the model is built (transformers checks the name when it builds the
    model). Registering again under the same name replaces the module it runs.
    """
    if not isinstance(attn, DynamicCPAttention):
        raise TypeError(f"register: attn must be a DynamicCPAttention, got {type(attn).__name__}")
    if not isinstance(name, str) or not name or name in ("eager", "sdpa", "flex_attention") \
            or name.startswith("flash_attention"):
        raise ValueError(f"register: name must be a new attention implementation name, got {name!r}")
    attention_interface, mask_interface = _require_transformers()

    def gpusolver_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return _attention(attn, module, query, key, value, attention_mask, scaling, dropout, kwargs)

    attention_interface.register(name, gpusolver_attention)
    mask_interface.register(name, _hand_through_padding)
    return name


def _hand_through_padding(*, attention_mask=None, **_):
    """The model's mask function: the 2-D ``attention_mask`` (bool ``[B, c]``) or None,
    unchanged, so that the attention function can refuse padding."""
    return attention_mask


def cp_plans(attn: DynamicCPAttention, mask: AttnSlices, config) -> dict:
    """``{window: Plan}`` for every window size the model's layers use (None: full attention),
    solved now, outside any compiled graph; pass it as ``cp_plan=``. ``config`` is the
    model's config (``sliding_window``, ``layer_types``)."""
    windows = {None}
    window = getattr(config, "sliding_window", None)
    if window is not None:
        types = getattr(config, "layer_types", None)
        windows = {window if t == "sliding_attention" else None for t in types} if types else {window}
    validate = attn.validate if attn.validate is not None else mask.device.type == "cpu"
    return {w: attn.plan_for(mask if w is None else _windowed_once(mask, w, validate), mask.device, _mask_name(w))
            for w in windows}


def _mask_name(window: int | None) -> str:
    return "default" if window is None else f"window{window}"


_windowed_cache: dict[int, tuple[AttnSlices, AttnSlices]] = {}


def _windowed_once(mask: AttnSlices, window: int, validate: bool | None) -> AttnSlices:
    """The windowed mask, made once per mask object and window: the plan cache keys on
    the mask object, so every windowed layer must pass the same one. Under
    ``torch.compile`` it is made inside the graph (a cache on identity would outlive the
    values a graph traced)."""
    if torch.compiler.is_compiling():
        return windowed(mask, window, validate=False)
    hit = _windowed_cache.get(window)
    if hit is not None and hit[0] is mask:
        return hit[1]
    out = windowed(mask, window, validate=validate)
    _windowed_cache[window] = (mask, out)
    return out


def _source(kwargs):
    """(mask, plan) from the call's keyword arguments, else from the innermost cp_context."""
    mask, plan = kwargs.get("cp_mask"), kwargs.get("cp_plan")
    if mask is None and plan is None and _context:
        mask, plan = _context[-1]
    if mask is None and plan is None:
        raise ValueError(_MISSING_MASK)
    if mask is not None and plan is not None:
        raise ValueError("pass one of cp_mask= and cp_plan=, not both")
    if mask is not None and not isinstance(mask, AttnSlices):
        raise TypeError(f"cp_mask must be the whole sequence's AttnSlices, got {type(mask).__name__}")
    return mask, plan


def _pick_plan(plan, window):
    if isinstance(plan, dict):
        if window not in plan:
            raise ValueError(f"cp_plan has plans for windows {sorted(plan, key=str)} but this layer has "
                             f"sliding_window={window}: build it with cp_plans(attn, mask, model.config)")
        plan = plan[window]
    if not isinstance(plan, Plan):
        raise TypeError(f"cp_plan must be a Plan or {{window: Plan}}, got {type(plan).__name__}")
    return plan


def _attention(attn, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """query ``[B, Hq, c, D]``, key / value ``[B, Hkv, c, D]`` (RoPE applied) -> ``([B, c, Hq, D], None)``."""
    group = attn.group
    rank, P = _rank_and_size(group)
    B, _, c, D = query.shape
    want = P if rank is None else 1
    if B != want:
        what = f"LocalGroup({P}) runs every rank at once: batch P = {P}, row p is rank p's shard" if rank is None \
            else "a process group runs one packed sequence per CP group: batch 1, this rank's shard"
        raise ValueError(f"gpusolver attention: the batch is {B}, but {what} (gpusolver.packing.pack)")
    if key.shape[2] != c:
        raise ValueError(f"gpusolver attention: {key.shape[2]} keys for {c} queries: a KV cache is not supported; "
                         "call the model with use_cache=False")
    if dropout:
        raise ValueError(f"gpusolver attention: attention dropout {dropout} in training is not supported; "
                         "build the model with attention_dropout=0.0")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"gpusolver attention: softcap={kwargs['softcap']} is not supported")
    expected = attn.softmax_scale if attn.softmax_scale is not None else D ** -0.5
    if scaling is not None and not math.isclose(scaling, expected, rel_tol=1e-6):
        raise ValueError(f"gpusolver attention: the model scales by {scaling} but DynamicCPAttention by "
                         f"{expected}: build it with softmax_scale={scaling}")
    mask, plan = _source(kwargs)
    if mask is not None and mask.total_seqlen_q != P * c:
        raise ValueError(f"gpusolver attention: cp_mask covers {mask.total_seqlen_q} tokens but the shards are "
                         f"P * c = {P} * {c} = {P * c}")
    validate = attn.validate if attn.validate is not None else \
        (query.device.type == "cpu" and not torch.compiler.is_compiling())
    if getattr(module, "layer_idx", 0) == 0:  # the same for every layer: check once per forward
        _check_padding(attention_mask, validate)
        _check_positions(kwargs.get("position_ids"), mask, rank, P, c, validate)
    window = kwargs.get("sliding_window")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, c, H, D]
    if rank is not None:
        q, k, v = q[0], k[0], v[0]
    if plan is not None:
        out = attn(q, k, v, plan=_pick_plan(plan, window))
    elif window is None:
        out = attn(q, k, v, mask)
    else:
        out = attn(q, k, v, _windowed_once(mask, window, validate), mask_name=_mask_name(window))
    return (out if rank is None else out[None]), None


def _check_padding(attention_mask, validate: bool) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"gpusolver attention: attention_mask of shape {tuple(getattr(attention_mask, 'shape', ()))}"
                         " is not supported: the mask is cp_mask=, the whole sequence's AttnSlices")
    padded = ~attention_mask.bool().all(-1)
    if validate:
        if bool(padded.any()):
            raise ValueError("gpusolver attention: attention_mask " +
                             _PADDING_MESSAGE.format(row=int(padded.int().argmax())))
    else:
        errors.record("gpusolver attention", "attention_mask", _PADDING_MESSAGE, padded)


def _attends_previous(mask: AttnSlices, x: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: query ``x[b]`` sees key ``x[b] - 1`` in some slice (of any head group)."""
    qs, qe = mask.q_ranges[..., 0].reshape(-1).long(), mask.q_ranges[..., 1].reshape(-1).long()
    ks, ke = mask.k_ranges[..., 0].reshape(-1).long(), mask.k_ranges[..., 1].reshape(-1).long()
    t = mask.attn_type.reshape(-1)
    x = x[:, None].to(qs.device)
    inside = (qs <= x) & (x < qe) & (ks <= x - 1) & (x - 1 < ke)
    # CAUSAL keeps k <= q + (ke - qe), INV_CAUSAL k >= q + (ks - qs), BI_CAUSAL both, FULL neither
    upper = (t == FULL) | (t == INV_CAUSAL) | (qe - ke <= 1)
    lower = (t == FULL) | (t == CAUSAL) | (qs - ks >= 1)
    return (inside & upper & lower).any(-1)


def _check_positions(position_ids, mask: AttnSlices | None, rank: int | None, P: int, c: int,
                     validate: bool) -> None:
    """Refuse the model's default positions where they are certainly wrong (see the module docstring)."""
    if position_ids is None:
        raise ValueError("gpusolver attention: the model passed no position_ids to its attention layers; "
                         "call it with position_ids= (PackedBatch.position_ids)")
    rows = P if rank is None else 1
    if position_ids.dim() != 2 or position_ids.shape != (rows, c):
        hint = f"[P, c] = [{P}, {c}]: every rank's positions" if rank is None else f"[1, c] = [1, {c}]"
        raise ValueError(f"gpusolver attention: position_ids has shape {tuple(position_ids.shape)}, expected {hint}; "
                         "pass position_ids= (PackedBatch.position_ids)")
    if mask is None:
        return  # with plans alone the documents are unknown here
    ranks = torch.arange(P, device=position_ids.device) if rank is None else \
        torch.full((1,), rank, device=position_ids.device)
    default = (position_ids == torch.arange(c, device=position_ids.device)).all(-1)
    bad = default & (ranks > 0) & _attends_previous(mask, ranks * c).to(default.device)
    if validate:
        if bool(bad.any()):
            row = int(bad.int().argmax())
            raise ValueError("gpusolver attention: " + _POSITIONS_MESSAGE.format(
                row=row, v0=int(ranks[row]), v1=c - 1))
    else:
        errors.record("gpusolver attention", "position_ids", _POSITIONS_MESSAGE, bad,
                      torch.stack([ranks, torch.full_like(ranks, c - 1)], -1))
