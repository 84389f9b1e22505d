"""Host-side builders of common slice masks.

Each builder returns an ``AttnSlices`` whose tensors are int32 on ``device``
(default CPU): ``q_ranges [R, 2]``, ``k_ranges [R, 2]``, ``attn_type [R]``.
``pad_to`` appends padding rows ``[0, 0)`` (type FULL, contributing nothing)
so that R is a fixed number across batches, as ``torch.compile`` wants.

Lengths are checked on the host; a bad one raises ValueError naming it.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from gpusolver.masks.slices import AttnSlices
from gpusolver.masks.types import BI_CAUSAL, CAUSAL, FULL

Row = tuple[int, int, int, int, int]  # (q_start, q_end, k_start, k_end, attn_type)


def _positive(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _lengths(name: str, lengths) -> list[int]:
    """Host list of positive ints from a sequence or a 1-D integer tensor."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {lengths.dtype} {tuple(lengths.shape)}")
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):  # None, a bare int
        raise TypeError(f"{name} must be a sequence of positive ints or a 1-D integer tensor, got "
                        f"{type(lengths).__name__} {lengths!r}")
    out = [int(v) if isinstance(v, np.integer) else v for v in lengths]
    if not out:
        raise ValueError(f"{name} must hold at least one length")
    for i, v in enumerate(out):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}[{i}] = {v!r} must be a positive int")
    return out


_INT32_MAX = (1 << 31) - 1


def _build(rows: list[Row], total_q: int, total_k: int, device, pad_to: int | None) -> AttnSlices:
    if max(total_q, total_k) > _INT32_MAX:
        raise ValueError(f"a mask of {max(total_q, total_k)} tokens does not fit the int32 ranges of AttnSlices "
                         f"(at most {_INT32_MAX}; the solver supports S <= gpusolver.limits.MAX_SEQLEN)")
    if pad_to is not None:
        if not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < len(rows):
            raise ValueError(
                f"pad_to={pad_to!r} must be an int >= the {len(rows)} slices this mask needs")
        rows = rows + [(0, 0, 0, 0, FULL)] * (pad_to - len(rows))
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return AttnSlices(
        q_ranges=table[:, 0:2].contiguous().to(device),
        k_ranges=table[:, 2:4].contiguous().to(device),
        attn_type=table[:, 4].contiguous().to(device),
        total_seqlen_q=total_q,
        total_seqlen_k=total_k,
    )


def full_mask(seqlen: int, *, device="cpu", pad_to: int | None = None) -> AttnSlices:
    """Bidirectional attention over ``seqlen`` tokens: one FULL slice."""
    s = _positive("seqlen", seqlen)
    return _build([(0, s, 0, s, FULL)], s, s, device, pad_to)


def causal_mask(seqlen: int, *, device="cpu", pad_to: int | None = None) -> AttnSlices:
    """Causal attention over ``seqlen`` tokens (key <= query): one CAUSAL slice."""
    s = _positive("seqlen", seqlen)
    return _build([(0, s, 0, s, CAUSAL)], s, s, device, pad_to)


def sliding_window_mask(seqlen: int, window: int, *, band_rows: int | None = None,
                        device="cpu", pad_to: int | None = None) -> AttnSlices:
    """Causal sliding window: query q attends keys ``[q - window + 1, q]`` (clipped at 0).

    Slices: one CAUSAL slice ``q, k in [0, w)`` (w = min(window, seqlen)) for the
    first rows, whose window is clipped at 0, and BI_CAUSAL band slices for the
    rest. A band slice with query rows ``[a, b)`` takes keys ``[a - window + 1, b)``:
    its top-left diagonal gives ``k >= q - window + 1`` and its bottom-right one
    ``k <= q``. One band slice covers all rows unless ``band_rows`` splits the
    band into pieces of at most that many query rows.
    """
    s = _positive("seqlen", seqlen)
    window = _positive("window", window)
    w = min(window, s)
    rows: list[Row] = [(0, w, 0, w, CAUSAL)]
    step = s - w if band_rows is None else _positive("band_rows", band_rows)
    for a in range(w, s, max(step, 1)):
        b = min(a + step, s)
        rows.append((a, b, a - window + 1, b, BI_CAUSAL))
    return _build(rows, s, s, device, pad_to)


def _doc_rows(doc_lengths: list[int], attn_type: int) -> list[Row]:
    rows, start = [], 0
    for n in doc_lengths:
        rows.append((start, start + n, start, start + n, attn_type))
        start += n
    return rows


def varlen_full_mask(doc_lengths: Sequence[int] | torch.Tensor, *, device="cpu",
                     pad_to: int | None = None) -> AttnSlices:
    """Packed documents, bidirectional inside each: one FULL slice per document.

    doc_lengths: host ints (or a 1-D integer tensor), each > 0; S = their sum.
    """
    lengths = _lengths("doc_lengths", doc_lengths)
    s = sum(lengths)
    return _build(_doc_rows(lengths, FULL), s, s, device, pad_to)


def varlen_causal_mask(doc_lengths: Sequence[int] | torch.Tensor, *, device="cpu",
                       pad_to: int | None = None) -> AttnSlices:
    """Packed documents, causal inside each: one CAUSAL slice per document.

    doc_lengths: host ints (or a 1-D integer tensor), each > 0; S = their sum.
    """
    lengths = _lengths("doc_lengths", doc_lengths)
    s = sum(lengths)
    return _build(_doc_rows(lengths, CAUSAL), s, s, device, pad_to)


def _prefix_rows(start: int, length: int, prefix: int) -> list[Row]:
    # FULL: every query of the document sees the whole prefix; CAUSAL: the
    # queries after the prefix see the non-prefix keys up to themselves.
    rows: list[Row] = []
    if prefix > 0:
        rows.append((start, start + length, start, start + prefix, FULL))
    if prefix < length:
        rows.append((start + prefix, start + length, start + prefix, start + length, CAUSAL))
    return rows


def prefix_lm_mask(seqlen: int, prefix_len: int, *, device="cpu", pad_to: int | None = None) -> AttnSlices:
    """Prefix-LM: every query attends the first ``prefix_len`` keys; later keys causally.

    Query q attends key k when ``k < prefix_len`` or ``k <= q``. Slices: FULL
    ``q [0, S) x k [0, prefix_len)`` and CAUSAL ``q, k [prefix_len, S)`` (either
    is left out when empty). ``0 <= prefix_len <= seqlen``.
    """
    s = _positive("seqlen", seqlen)
    if not isinstance(prefix_len, int) or isinstance(prefix_len, bool) or not 0 <= prefix_len <= s:
        raise ValueError(f"prefix_len must be an int in [0, seqlen={s}], got {prefix_len!r}")
    return _build(_prefix_rows(0, s, prefix_len), s, s, device, pad_to)


def varlen_prefix_lm_mask(doc_lengths: Sequence[int] | torch.Tensor, prefix_lengths: Sequence[int] | torch.Tensor,
                          *, device="cpu", pad_to: int | None = None) -> AttnSlices:
    """Packed documents, each a prefix-LM (see ``prefix_lm_mask``) over its own tokens.

    doc_lengths: host ints, each > 0; prefix_lengths: one host int per document,
    ``0 <= prefix_lengths[i] <= doc_lengths[i]``. Up to two slices per document.
    """
    lengths = _lengths("doc_lengths", doc_lengths)
    if isinstance(prefix_lengths, torch.Tensor):
        prefix_lengths = prefix_lengths.tolist()
    prefixes = [int(v) if isinstance(v, np.integer) else v for v in prefix_lengths]
    if len(prefixes) != len(lengths):
        raise ValueError(
            f"prefix_lengths has {len(prefixes)} entries but doc_lengths has {len(lengths)}; give one per document")
    rows: list[Row] = []
    start = 0
    for i, (n, p) in enumerate(zip(lengths, prefixes)):
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= n:
            raise ValueError(f"prefix_lengths[{i}] = {p!r} must be an int in [0, doc_lengths[{i}]={n}]")
        rows += _prefix_rows(start, n, p)
        start += n
    return _build(rows, start, start, device, pad_to)
