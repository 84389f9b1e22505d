"""SolverConfig's field checks: each bad value refused at construction, naming the field and the value."""
from __future__ import annotations

import re

import pytest
import torch

from gpusolver import SolverConfig, solve
from gpusolver.masks import causal_mask
from gpusolver.plan.sparse import SparseSolverConfig


def _config(**kw) -> SolverConfig:
    return SolverConfig(**{**dict(cp_size=2, num_heads_q=2, num_heads_kv=1, head_dim=32), **kw})


def _raises(error, field: str, value, **kw) -> str:
    """``_config(field=value)`` raises ``error`` whose message names the field and the value."""
    with pytest.raises(error) as info:
        _config(**{field: value}, **kw)
    msg = str(info.value)
    assert field in msg and repr(value) in msg, msg
    return msg


@pytest.mark.parametrize("name,dtype", [
    ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16), ("float16", torch.float16),
    ("float32", torch.float32), ("bf16", torch.bfloat16), ("half", torch.float16), ("Float32", torch.float32),
])
def test_dtype_string_is_the_torch_dtype(name, dtype):
    """A Hugging Face config's torch_dtype="bfloat16" works as the dtype: stored as the torch.dtype."""
    config = _config(dtype=name)
    assert config.dtype is dtype and config == _config(dtype=dtype)
    assert config.dtype_bytes == torch.empty((), dtype=dtype).element_size()


def test_dtype_string_solves_like_the_dtype():
    """The reported failure: SolverConfig(dtype="bfloat16") then solve crashed in dtype_bytes (torch.empty)."""
    mask = causal_mask(64)
    by_name = solve(mask, _config(dtype="bfloat16", chunk_tiles=1))
    by_dtype = solve(mask, _config(dtype=torch.bfloat16, chunk_tiles=1))
    assert torch.equal(by_name.assignment, by_dtype.assignment)
    assert torch.equal(by_name.metrics.fwd_send, by_dtype.metrics.fwd_send)


@pytest.mark.parametrize("value,error", [
    (3, TypeError), (None, TypeError), (1.5, TypeError),
    ("int32", ValueError), (torch.int32, ValueError), (torch.bool, ValueError), ("auto", ValueError),
    ("bfloat", ValueError), ("torch.tensor", ValueError),
    # float dtypes the attention kernels do not run (gpusolver.support.DTYPES)
    (torch.float64, ValueError), ("float64", ValueError), (torch.float8_e4m3fn, ValueError),
    (torch.complex64, ValueError),
], ids=str)
def test_dtype_refused(value, error):
    msg = _raises(error, "dtype", value)
    assert re.search(r"float32, float16, bfloat16|torch.dtype", msg), msg


@pytest.mark.parametrize("value", ["yes", None, 1, 0])
def test_head_group_flatten_must_be_a_bool(value):
    """A truthy string, None or an int once picked G silently (None: G = 1)."""
    _raises(TypeError, "head_group_flatten", value)


@pytest.mark.parametrize("value", [True, 0, -1, 2.0, "4"])
def test_max_stage_slices_checked_at_construction(value):
    """True once passed as a capacity of 1 (a CALC_OVERFLOW later); the rest failed only in build_plan."""
    _raises(ValueError, "max_stage_slices", value)


@pytest.mark.parametrize("field,value", [
    ("selection_bytes", -1), ("selection_bytes", 2.5), ("selection_bytes", "4"), ("selection_bytes", True),
    ("branches", 0), ("branches", 3), ("branches", "1"), ("branches", 2.0),
])
def test_sparse_config_prices_are_checked(field, value):
    """Both price every query row of a sparse solve: a bad one skewed the plan with no error."""
    with pytest.raises(ValueError) as info:
        SparseSolverConfig(cp_size=2, **{field: value})
    assert field in str(info.value) and repr(value) in str(info.value)
    assert SparseSolverConfig(cp_size=2, selection_bytes=8, branches=2).branches == 2
