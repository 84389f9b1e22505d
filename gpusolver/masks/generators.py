"""Seeded mask generators for tests and benchmarks (host-side, numpy ``Generator``).

- ``packed_document_lengths`` / ``packed_documents``: packed sequences whose
  document lengths follow the histogram in ``gpusolver/data/doc_length_distribution.csv``.
- ``nsa_block_indices``: an NSA-like block selection ``[T, Hkv, n]`` int32.
- ``dsa_topk_indices``: a DSA-like token top-k selection ``[T, k]`` int32.

In real training the sparse selections come out of the model's indexer (a
learned scorer run on device, sharded over the CP group); here random scores
stand in for it so the solver and kernels can be exercised with the same
shapes and validity rules. The same seed always gives the same result.
"""
from __future__ import annotations

import csv
import re
from functools import lru_cache
from importlib import resources

import numpy as np
import torch

from gpusolver.masks.constructors import varlen_causal_mask, varlen_full_mask
from gpusolver.masks.slices import AttnSlices

_DRAW_BATCH = 4096  # documents drawn per round until the pack is covered
_ROW_CHUNK = 256  # query rows scored at once by the sparse generators


def _positive(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


@lru_cache(maxsize=1)
def doc_length_histogram() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shipped histogram: (lo [B], hi [B] int64 inclusive bounds, prob [B] float64).

    Probabilities are the bins' document counts normalised to 1. The first
    bin starts at 0 in the data; its lower bound is raised to 1 (a document
    has at least one token).
    """
    text = resources.files("gpusolver").joinpath("data", "doc_length_distribution.csv").read_text()
    lo, hi, count = [], [], []
    for rec in csv.DictReader(text.splitlines()):
        a, b = (int(x) for x in re.findall(r"\d+", rec["range"]))
        lo.append(max(a, 1))
        hi.append(b)
        count.append(int(rec["number"]))
    prob = np.asarray(count, dtype=np.float64)
    return np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64), prob / prob.sum()


def packed_document_lengths(total_tokens: int, seed: int = 0) -> list[int]:
    """Document lengths of one packed sequence of ``total_tokens`` tokens (host ints).

    The pack is the whole sequence (``total_tokens``); ``quarter = max(1, total_tokens // 4)``.
    1. Draw documents until their lengths cover the pack: each picks a
       histogram bin by its probability, then a length uniform in the bin.
    2. Cut every document longer than ``quarter`` into ``quarter``-token pieces
       (plus the remainder).
    3. Shuffle the pieces.
    4. Pack them in order; the piece that crosses the end of the pack is split
       there and its tail is left out (it would start the next pack).

    Returns positive ints summing to ``total_tokens``, each at most ``quarter``.
    """
    total = _positive("total_tokens", total_tokens)
    rng = np.random.default_rng(seed)
    lo, hi, prob = doc_length_histogram()
    drawn: list[np.ndarray] = []
    covered = 0
    while covered < total:
        bins = rng.choice(len(prob), size=_DRAW_BATCH, p=prob)
        lengths = rng.integers(lo[bins], hi[bins], endpoint=True)
        need = np.searchsorted(np.cumsum(lengths), total - covered) + 1  # docs to cover the rest
        drawn.append(lengths[:need])
        covered += int(lengths[:need].sum())
    docs = np.concatenate(drawn)

    quarter = max(1, total // 4)
    pieces: list[int] = []
    for n in docs.tolist():
        full, rest = divmod(n, quarter)
        pieces += [quarter] * full + ([rest] if rest else [])
    pieces = [pieces[i] for i in rng.permutation(len(pieces)).tolist()]

    out, used = [], 0
    for n in pieces:
        take = min(n, total - used)
        out.append(take)
        used += take
        if used == total:
            break
    return out


def packed_documents(total_tokens: int, seed: int = 0, causal: bool = True, *, device="cpu",
                     pad_to: int | None = None) -> AttnSlices:
    """A packed-document slice mask (varlen causal, or varlen full when ``causal=False``).

    Document lengths come from ``packed_document_lengths(total_tokens, seed)``;
    one slice per document, int32 tensors on ``device``, optionally padded to
    ``pad_to`` rows.
    """
    lengths = packed_document_lengths(total_tokens, seed)
    build = varlen_causal_mask if causal else varlen_full_mask
    return build(lengths, device=device, pad_to=pad_to)


def nsa_block_indices(seqlen: int, num_kv_heads: int, block_size: int = 64, top_n: int = 16,
                      seed: int = 0, device="cpu") -> torch.Tensor:
    """An NSA-like selection: ``block_indices [T, Hkv, top_n]`` int32, ``-1`` = unused.

    Query t may select key blocks ``b <= t // block_size`` (causally valid). Its
    first block (0) and its local block (``t // block_size``) are always
    selected; the rest of the ``top_n`` are the highest of random scores
    (independent per query and KV head) among the other valid blocks. Rows with
    fewer than ``top_n`` valid blocks select all of them and pad with -1. Each
    row lists its blocks in ascending order, -1 padding last. In real use the
    NSA compression branch's scores produce this selection.
    """
    t_len = _positive("seqlen", seqlen)
    h = _positive("num_kv_heads", num_kv_heads)
    bs = _positive("block_size", block_size)
    n = _positive("top_n", top_n)
    if n < 2:
        raise ValueError(f"top_n must be >= 2 (the first and the local block are always selected), got {n}")
    num_blocks = -(-t_len // bs)
    rng = np.random.default_rng(seed)
    out = np.full((t_len, h, n), -1, dtype=np.int64)
    blocks = np.arange(num_blocks)
    width = min(n, num_blocks)
    for r0 in range(0, t_len, _ROW_CHUNK):
        t = np.arange(r0, min(r0 + _ROW_CHUNK, t_len))
        local = (t // bs)[:, None, None]
        score = rng.random((len(t), h, num_blocks))
        score = np.where((blocks == 0) | (blocks == local), 2.0, score)  # forced: above any random score
        score = np.where(blocks > local, -1.0, score)  # causally invalid: below any random score
        top = np.argsort(-score, axis=-1, kind="stable")[..., :width]
        top = np.where(np.take_along_axis(score, top, axis=-1) >= 0.0, top, num_blocks)
        top = np.sort(top, axis=-1)
        out[t, :, :width] = np.where(top == num_blocks, -1, top)
    return torch.from_numpy(out.astype(np.int32)).to(device)


def dsa_topk_indices(seqlen: int, topk: int = 2048, seed: int = 0, device="cpu") -> torch.Tensor:
    """A DSA-like token selection: ``topk_indices [T, topk]`` int32, ``-1`` = unused.

    Query t may select keys ``k <= t``. A row with at most ``topk`` valid keys
    selects all of them (``0..t``) and pads with -1; otherwise it takes the
    ``topk`` highest of random indexer scores over its valid keys. Each row
    lists its keys in ascending order, -1 padding last. In real use the DSA
    lightning indexer produces these indices on device (and its top-k may
    return future keys instead of -1; the mask form drops both).
    """
    t_len = _positive("seqlen", seqlen)
    k = _positive("topk", topk)
    rng = np.random.default_rng(seed)
    out = np.full((t_len, k), -1, dtype=np.int64)
    keys = np.arange(t_len)
    short = min(t_len, k)  # rows 0..short-1 have t + 1 <= k valid keys: take them all
    out[:short, :short] = np.where(keys[None, :short] <= keys[:short, None], keys[None, :short], -1)
    for r0 in range(short, t_len, _ROW_CHUNK):
        t = np.arange(r0, min(r0 + _ROW_CHUNK, t_len))
        width = t[-1] + 1
        score = rng.random((len(t), width), dtype=np.float32)
        score = np.where(keys[None, :width] <= t[:, None], score, -1.0)
        top = np.argpartition(-score, k - 1, axis=-1)[:, :k]
        out[t] = np.sort(top, axis=-1)
    return torch.from_numpy(out.astype(np.int32)).to(device)
