"""Packed batches under context parallelism: a packed sequence to this rank's shard.

A packed batch is one sequence of S tokens holding several documents (their
lengths, or ``cu_seqlens``), the same on every rank of the CP group. Under
sequential sharding rank p trains on tokens ``[p * c, (p + 1) * c)``,
``c = S / P``, so the three things that need care are done here, on the
whole sequence, before sharding:

- labels: shifted on the whole sequence (the pair that crosses a shard
  boundary is kept), with -100 at each document's last token (its next
  token belongs to another document);
- positions: global (``arange(S)``) or per document (restarting at 0), so
  RoPE sees the same positions as in a single process;
- the mask: causal inside each document, optionally a sliding window inside
  each document; the whole sequence's slices, held by every rank.

The loss is the shard's summed token loss over the valid targets of the
**whole sequence** (``shard_loss``); summed over the ranks it is exactly the
single-process mean. ``pack`` counts the targets from the whole labels it
holds (no collective); ``count_targets`` all-reduces a shard's count over the
CP group for loaders that only hold their shard.

Shape legend: S tokens of the packed sequence, P ranks, c = S / P, V vocab,
R mask slices. ``LocalGroup`` (P simulated ranks) stacks per-rank tensors
with a leading ``[P]``.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpusolver import errors
from gpusolver.masks.constructors import varlen_causal_mask
from gpusolver.masks.slices import BI_CAUSAL, CAUSAL, AttnSlices
from gpusolver.runtime.layout import _rank_and_size, shard

IGNORE_INDEX = -100
POSITIONS = ("document", "global")

_WINDOW_MESSAGE = ("row {row}: a sliding window applies to document-causal rows (CAUSAL, q range == k range), "
                   "got q [{v0}, {v1}), k [{v2}, {v3}), type {v4}: pass the documents' causal mask "
                   "(gpusolver.packing.document_mask)")
errors.register("windowed", "mask", _WINDOW_MESSAGE)


@dataclass(frozen=True)
class PackedBatch:
    """This rank's share of one packed sequence (``[P, c]`` stacks on a ``LocalGroup``).

    input_ids:    ``[c]`` int64, tokens ``[rank * c, (rank + 1) * c)`` of the sequence.
    labels:       ``[c]`` int64, the next token of the same document, -100 at each
                  document's last token and on padding.
    position_ids: ``[c]`` int64, global or per-document positions of the shard's tokens.
    mask:         ``AttnSlices`` of the whole sequence (every rank holds it).
    num_targets:  ``[]`` int64, valid targets (labels != -100) of the whole sequence.
    doc_lengths:  host list of the documents' lengths (with the padding document, if any).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    mask: AttnSlices
    num_targets: torch.Tensor
    doc_lengths: list[int]


def doc_lengths_from(doc_lengths=None, cu_seqlens=None) -> list[int]:
    """Host list of document lengths from exactly one of ``doc_lengths`` (ints or a 1-D
    integer tensor) and ``cu_seqlens`` (``[n + 1]`` cumulative offsets from 0)."""
    if (doc_lengths is None) == (cu_seqlens is None):
        raise ValueError("pass exactly one of doc_lengths= and cu_seqlens=")
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if len(cu) < 2 or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0 and hold at least two offsets, got {cu[:8]}")
        doc_lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        bad = [i for i, n in enumerate(doc_lengths) if n <= 0]
        if bad:
            raise ValueError(f"cu_seqlens must increase strictly: offsets {bad[0]} and {bad[0] + 1} are "
                             f"{cu[bad[0]]} and {cu[bad[0] + 1]}")
        return doc_lengths
    if isinstance(doc_lengths, torch.Tensor):
        if doc_lengths.dim() != 1 or doc_lengths.dtype.is_floating_point or doc_lengths.dtype == torch.bool:
            raise ValueError(f"doc_lengths must be a 1-D integer tensor, got {doc_lengths.dtype} "
                             f"{tuple(doc_lengths.shape)}")
        doc_lengths = doc_lengths.tolist()
    if isinstance(doc_lengths, (str, bytes)) or not isinstance(doc_lengths, Iterable):  # a bare int
        raise TypeError(f"doc_lengths must be a sequence of positive ints or a 1-D integer tensor, got "
                        f"{type(doc_lengths).__name__} {doc_lengths!r}")
    out = list(doc_lengths)
    if not out:
        raise ValueError("doc_lengths must hold at least one length")
    for i, n in enumerate(out):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"doc_lengths[{i}] = {n!r} must be a positive int")
    return out


def _ends(doc_lengths: Sequence[int], device) -> torch.Tensor:
    """``[S]`` bool: True at each document's last token."""
    ends = torch.zeros(sum(doc_lengths), dtype=torch.bool, device=device)
    ends[torch.tensor(doc_lengths, device=device).cumsum(0) - 1] = True
    return ends


def shift_labels(tokens: torch.Tensor, doc_lengths: Sequence[int], labels: torch.Tensor | None = None) -> torch.Tensor:
    """``[S]`` targets of the whole sequence: ``labels[t + 1]`` (default ``tokens``), -100 at
    each document's last token. ``labels`` may already hold -100 (prompt tokens, say)."""
    src = tokens if labels is None else labels
    out = torch.cat([src[1:], src.new_full((1,), IGNORE_INDEX)]).long()
    return out.masked_fill(_ends(doc_lengths, tokens.device), IGNORE_INDEX)


def document_positions(doc_lengths: Sequence[int], device="cpu") -> torch.Tensor:
    """``[S]`` int64 position of each token inside its document (0 at each document's start)."""
    lengths = torch.tensor(list(doc_lengths), device=device)
    starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths, output_size=int(sum(doc_lengths)))
    return torch.arange(starts.numel(), device=device) - starts


def document_mask(doc_lengths: Sequence[int], *, sliding_window: int | None = None, device="cpu",
                  max_documents: int | None = None) -> AttnSlices:
    """Causal inside each document; with ``sliding_window = w`` a query sees the last w keys
    of its document (itself included), as Hugging Face's ``sliding_window`` does.

    max_documents: pad the mask to this many documents (``2 * max_documents`` slices with a
    window), so R stays fixed across batches under ``torch.compile``.
    """
    # as given: varlen_causal_mask names a bad one (list() of None, or of a tensor's 0-dim items, did not)
    mask = varlen_causal_mask(doc_lengths, device=device, pad_to=max_documents)
    return mask if sliding_window is None else windowed(mask, sliding_window)


def windowed(mask: AttnSlices, window: int, *, validate: bool | None = None) -> AttnSlices:
    """A document-causal mask cut to a causal sliding window of ``window`` keys (sync-free).

    Each row ``q, k in [a, b)`` (CAUSAL) becomes a CAUSAL row ``[a, m)`` with ``m =
    min(b, a + window)``, where the window is clipped at the document's start, and a
    BI_CAUSAL band with queries ``[m, b)`` and keys ``[m - window + 1, b)`` (empty when
    the document is no longer than the window). R rows give 2R, in the same order;
    padding rows stay padding. Other rows are an error: a ``ValueError`` in validation
    mode (default for CPU tensors), else a device error flag (``gpusolver.check_errors()``).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (keys, the query included), got {window!r}")
    if not isinstance(mask, AttnSlices):
        raise TypeError(f"mask must be an AttnSlices, got {type(mask).__name__}")
    q, k, t = mask.q_ranges, mask.k_ranges, mask.attn_type
    qs, qe, ks, ke = q[..., 0], q[..., 1], k[..., 0], k[..., 1]
    padding = (qs == qe) | (ks == ke)
    bad = ~padding & ((t != CAUSAL) | (qs != ks) | (qe != ke))
    if validate is None:
        validate = mask.device.type == "cpu" and not torch.compiler.is_compiling()
    if validate:
        flat = bad.reshape(-1)
        if bool(flat.any()):
            r = int(flat.int().argmax())
            v = torch.stack([qs, qe, ks, ke, t], -1).reshape(-1, 5)[r].tolist()
            raise ValueError("windowed: mask " + _WINDOW_MESSAGE.format(row=r, v0=v[0], v1=v[1], v2=v[2], v3=v[3],
                                                                         v4=v[4]))
    else:
        errors.record("windowed", "mask", _WINDOW_MESSAGE, bad.reshape(-1),
                      torch.stack([qs, qe, ks, ke, t], -1).reshape(-1, 5))
    mid = torch.minimum(qe, qs + window)
    head_q = torch.stack([torch.where(padding, 0, qs), torch.where(padding, 0, mid)], -1)
    band = ~padding & (mid < qe)                    # the document is longer than the window
    band_q = torch.stack([torch.where(band, mid, 0), torch.where(band, qe, 0)], -1)
    band_k = torch.stack([torch.where(band, mid - window + 1, 0), torch.where(band, qe, 0)], -1)
    head_t = torch.full_like(t, CAUSAL)
    band_t = torch.full_like(t, BI_CAUSAL)
    lead = q.shape[:-2]
    rows = 2 * q.shape[-2]
    return AttnSlices(torch.stack([head_q, band_q], -2).reshape(*lead, rows, 2).to(q.dtype),
                      torch.stack([head_q, band_k], -2).reshape(*lead, rows, 2).to(k.dtype),
                      torch.stack([head_t, band_t], -1).reshape(*lead, rows).to(t.dtype),
                      mask.total_seqlen_q, mask.total_seqlen_k)


def pack(tokens: torch.Tensor, doc_lengths=None, *, group, cu_seqlens=None, labels: torch.Tensor | None = None,
         positions: str = "document", sliding_window: int | None = None, pad_to_multiple: int | None = None,
         pad_token_id: int = 0, max_documents: int | None = None) -> PackedBatch:
    """This rank's shard of one packed sequence, its labels, positions and the mask.

    tokens:          ``[S]`` integer tokens of the whole packed sequence (the same on every rank).
    doc_lengths / cu_seqlens: the documents (exactly one; host ints, or tensors read once).
    group:           the CP group (``TorchGroup``, ``SymmMemGroup``, ``LocalGroup``), or None for
                     one process holding the whole sequence (a single-process reference).
    labels:          ``[S]`` unshifted targets with -100 where a token is no target (default: tokens).
    positions:       ``"document"`` (restart at each document) or ``"global"`` (``arange(S)``).
    sliding_window:  a window of this many keys inside each document (None: causal).
    pad_to_multiple: pad S up to a multiple of this (default P) with one padding document
                     of ``pad_token_id`` (no targets; it attends only itself).
    max_documents:   pad the mask's slices to this many documents (fixed shapes for compile).
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype.is_floating_point:
        raise ValueError(f"tokens must be a 1-D integer tensor [S], got "
                         f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
    lengths = doc_lengths_from(doc_lengths, cu_seqlens)
    S = tokens.shape[0]
    if sum(lengths) != S:
        raise ValueError(f"the documents hold {sum(lengths)} tokens but tokens has S = {S}")
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != tokens.shape):
        raise ValueError(f"labels must be a tensor of tokens' shape {tuple(tokens.shape)}, got "
                         f"{tuple(getattr(labels, 'shape', ()))}")
    P = 1 if group is None else _rank_and_size(group)[1]
    multiple = P if pad_to_multiple is None else pad_to_multiple
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1 or multiple % P:
        raise ValueError(f"pad_to_multiple must be a positive multiple of P = {P}, got {pad_to_multiple!r}")
    pad = -S % multiple
    if pad:
        tokens = torch.cat([tokens, tokens.new_full((pad,), pad_token_id)])
        if labels is not None:
            labels = torch.cat([labels, labels.new_full((pad,), IGNORE_INDEX)])
        lengths = lengths + [pad]
    targets = shift_labels(tokens, lengths, labels)
    if pad:
        targets[-pad:] = IGNORE_INDEX
    pos = document_positions(lengths, tokens.device) if positions == "document" else \
        torch.arange(tokens.shape[0], device=tokens.device)
    mask = document_mask(lengths, sliding_window=sliding_window, device=tokens.device, max_documents=max_documents)
    cut = (lambda x: x) if group is None else (lambda x: shard(x, group))
    return PackedBatch(input_ids=cut(tokens.long()), labels=cut(targets), position_ids=cut(pos), mask=mask,
                       num_targets=(targets != IGNORE_INDEX).sum(), doc_lengths=lengths)


def count_targets(labels: torch.Tensor, group) -> torch.Tensor:
    """``[]`` int64 valid targets (labels != -100) of the whole sequence from this rank's
    ``[c]`` labels: all-reduced over the CP group (summed over the rank dim on a ``LocalGroup``)."""
    rank, _ = _rank_and_size(group)
    count = (labels != IGNORE_INDEX).sum()
    if rank is not None:
        dist.all_reduce(count, group=getattr(group, "process_group", group))
    return count


def shard_loss(logits: torch.Tensor, labels: torch.Tensor, num_targets: torch.Tensor | int) -> torch.Tensor:
    """The shard's summed cross-entropy over the whole sequence's ``num_targets`` (fp32).

    logits ``[..., c, V]``, labels ``[..., c]`` (-100 ignored). Summed over the CP ranks
    (their gradients summed, as FSDP / DDP over the CP group do after scaling) it is the
    single-process mean loss; no target anywhere gives 0, not NaN.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels' shape {tuple(labels.shape)} plus the vocab")
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
    if isinstance(num_targets, torch.Tensor):
        return total / num_targets.clamp(min=1).to(total.dtype)
    return total / max(int(num_targets), 1)
