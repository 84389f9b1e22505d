"""Argument types and shared options of the command line.

Each type raises ``argparse.ArgumentTypeError``, so a bad value ends in
argparse's one-line usage error and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# the mask kinds every command can build from a seed (slices; the runtime executes them)
MASK_KINDS = ("docs", "docs-full", "window", "prefix")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def stages(text: str) -> int | str:
    """``auto`` or a positive int (``SolverConfig.num_stages``; its upper limit is checked with the config)."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as e:  # its message, naming 'auto' too
        raise argparse.ArgumentTypeError(str(e).replace(", got", " or 'auto', got", 1)) from None


def heads(text: str) -> tuple[int, int]:
    """``"Hq:Hkv"`` (e.g. ``8:2``), or one number for MHA."""
    parts = text.split(":")
    try:
        hq, hkv = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        hq = hkv = 0
    if hq < 1 or hkv < 1:
        raise argparse.ArgumentTypeError(f"expected Hq:Hkv with positive ints (e.g. 8:2), got {text!r}")
    if hq % hkv:
        raise argparse.ArgumentTypeError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    return hq, hkv


def dtype(text: str) -> torch.dtype:
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPES)}, got {text!r}") from None


def device(text: str) -> torch.device:
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("--device cuda, but this torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device must be cpu or cuda, got {text!r}")
    return dev


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build_mask(kind: str, seqlen: int, seed: int, device="cpu"):
    """A seeded slice mask of ``kind`` (``MASK_KINDS``) over ``seqlen`` tokens.

    docs / docs-full: packed causal / bidirectional documents (real length histogram);
    window: a causal sliding window of a seeded width in [S/16, S/4];
    prefix: packed documents, each a prefix-LM with a seeded prefix length.
    """
    from gpusolver.masks import packed_document_lengths, packed_documents, sliding_window_mask, varlen_prefix_lm_mask

    if kind in ("docs", "docs-full"):
        return packed_documents(seqlen, seed=seed, causal=kind == "docs", device=device)
    g = torch.Generator().manual_seed(seed)
    if kind == "window":
        lo, hi = max(1, seqlen // 16), max(2, seqlen // 4)
        return sliding_window_mask(seqlen, int(torch.randint(lo, hi, (1,), generator=g)), device=device)
    if kind == "prefix":
        lengths = packed_document_lengths(seqlen, seed=seed)
        prefixes = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in lengths]
        return varlen_prefix_lm_mask(lengths, prefixes, device=device)
    raise ValueError(f"mask kind must be one of {MASK_KINDS}, got {kind!r}")


MASK_HELP = ("docs: packed causal documents (default); docs-full: packed bidirectional documents; "
             "window: causal sliding window of a random width; prefix: packed prefix-LM documents")
