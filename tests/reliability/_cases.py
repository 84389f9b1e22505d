"""Shared helpers of the reliability tests: small problems, the flag reader, the fuzz budget."""
from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
from hypothesis import settings

from gpusolver import errors
from gpusolver.masks import AttnSlices

D = 32  # the smallest head dim the kernels take


def fuzzing() -> bool:
    """True under ``make fuzz`` (``--hypothesis-profile=fuzz``): the searches scale up."""
    return settings.get_current_profile_name() == "fuzz"


def budget(ci: int, fuzz: int) -> int:
    """Examples per property: a bounded, derandomized set in CI, thousands under ``make fuzz``
    (times ``FUZZ_SCALE``, default 1, for a run bounded to the time at hand)."""
    return max(1, round(fuzz * float(os.environ.get("FUZZ_SCALE", "1")))) if fuzzing() else ci


def slices(rows, S_q: int, S_k: int | None = None, dtype=torch.int32) -> AttnSlices:
    """An ``AttnSlices`` from ``(qs, qe, ks, ke, type)`` rows (no value checks: may be bad on purpose)."""
    t = torch.tensor(rows, dtype=dtype).reshape(-1, 5)
    return AttnSlices(t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous(), S_q,
                      S_q if S_k is None else S_k)


def qkv(Tq: int, Tk: int, Hq: int = 2, Hkv: int = 1, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(Tq, Hq, D, generator=g).to(dtype), torch.randn(Tk, Hkv, D, generator=g).to(dtype),
            torch.randn(Tk, Hkv, D, generator=g).to(dtype))


@contextlib.contextmanager
def clean_flags():
    """Start and end with an empty flag table (a failing test leaves none behind)."""
    errors.reset()
    try:
        yield
    finally:
        errors.reset()


def flagged(match: str):
    """``check_errors()`` must raise a ValueError whose message matches ``match``, then be clear."""
    with pytest.raises(ValueError, match=match) as info:
        errors.check_errors()
    errors.check_errors()  # read once: the flags were cleared
    return str(info.value)


@contextlib.contextmanager
def quiet():
    """Imbalance warnings are expected on the tiny masks here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
