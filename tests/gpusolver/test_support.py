"""The support matrix: dist_attn refuses what it does not support with a clear message, and
docs/support_matrix.md shows the same tables as the code."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpusolver.support import check_supported, support_matrix_markdown
from groupcomm import LocalGroup
from tests._dist import run_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "support_matrix.md"


def _qkv(dtype=torch.float32, D=32, Hq=4, Hkv=2, device="cpu", lead=(2,)):
    return (torch.zeros(*lead, 8, Hq, D, dtype=dtype, device=device),
            torch.zeros(*lead, 8, Hkv, D, dtype=dtype, device=device),
            torch.zeros(*lead, 8, Hkv, D, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 32, 64, 128])
def test_supported_combinations_pass(dtype, D):
    check_supported(*_qkv(dtype, D), LocalGroup(2))
    check_supported(*_qkv(dtype, D, device="meta"), LocalGroup(2))


@pytest.mark.parametrize("kw, fragment", [
    (dict(dtype=torch.float64), "supports float32, float16, bfloat16"),
    (dict(D=48), "head dims (16, 32, 64, 128)"),
    (dict(Hq=6, Hkv=4), "multiple of Hkv"),
])
def test_unsupported_combinations_raise(kw, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_supported(*_qkv(**kw), LocalGroup(2))


def test_mixed_dtypes_raise():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="must share dtype and device"):
        check_supported(q, k.half(), v, LocalGroup(2))


def test_collective_must_fit_the_device():
    class SymmMemGroup:  # the name is what the matrix keys on; CUDA-only
        batched = False
    with pytest.raises(ValueError, match="SymmMemGroup does not run on cpu tensors; on cpu use LocalGroup or "
                                         "TorchGroup"):
        check_supported(*_qkv(lead=()), SymmMemGroup())


def _gloo_rank(rank, P):
    from groupcomm import TorchGroup

    check_supported(*_qkv(lead=()), TorchGroup())  # gloo with CPU tensors: supported
    return "ok"


def test_torch_group_on_gloo_is_supported_on_cpu():
    assert run_ranks(_gloo_rank, 2, timeout=60) == ["ok", "ok"]


def test_docs_page_shows_the_code_tables():
    text = DOC.read_text()
    assert support_matrix_markdown() in text, "docs/support_matrix.md is out of date: paste support_matrix_markdown()"
