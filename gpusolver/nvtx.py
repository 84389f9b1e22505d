"""NVTX ranges around the layer's phases, off by default; ``GPUSOLVER_NVTX=1`` turns them on.

    with nvtx_range("solve/areas"):
        areas = block_areas(...)

Names are ``<category>/<what>``: ``solve/...`` (areas, assignment, metas),
``comm/...`` (group-cast and group-reduce, with the phase), ``attn/...``
(each attention stage, forward and backward). ``benchmarks/profile/``
groups an nsys report's ranges by that category.

Off (the default) a range is an empty context manager: nothing is called
and nothing enters a traced graph. On, it calls two custom ops,
``gpusolver::nvtx_push`` and ``gpusolver::nvtx_pop``, registered as ordered
side effects, so ``torch.compile(fullgraph=True)`` keeps them (in order,
without a graph break) instead of tracing through ``torch.cuda.nvtx`` or
dropping calls with no outputs. The ops push and pop an NVTX range when CUDA
is available and do nothing on CPU. Under compile the ranges keep their order
with respect to each other, but the compiler may move kernels across them:
exact brackets need eager mode. Inside CUDA-graph capture the ranges mark the
capture, not the replays.

The environment switch is the one allowed by the project's style: it is read
once at import; ``set_enabled`` changes it at run time (tests, notebooks).
"""
from __future__ import annotations

import os

import torch

ENV = "GPUSOLVER_NVTX"

__all__ = ["nvtx_range", "enabled", "set_enabled", "ENV"]

_enabled = os.environ.get(ENV, "0").strip().lower() not in ("", "0", "false", "off", "no")


def enabled() -> bool:
    """Whether ``nvtx_range`` emits ranges."""
    return _enabled


def set_enabled(on: bool) -> bool:
    """Turn the ranges on or off; returns the previous setting. Compiled functions keep what they were
    traced with (call ``torch._dynamo.reset()`` to retrace)."""
    global _enabled
    prev, _enabled = _enabled, bool(on)
    return prev


def _cuda_nvtx() -> bool:
    # nvtx needs a CUDA build; on CPU the ops are no-ops
    return torch.cuda.is_available()


@torch.library.custom_op("gpusolver::nvtx_push", mutates_args=())
def nvtx_push(name: str) -> None:
    """Open an NVTX range named ``name`` (no-op without CUDA)."""
    if _cuda_nvtx():
        torch.cuda.nvtx.range_push(name)


@nvtx_push.register_fake
def _nvtx_push_fake(name: str) -> None:
    return None


@torch.library.custom_op("gpusolver::nvtx_pop", mutates_args=())
def nvtx_pop() -> None:
    """Close the innermost NVTX range (no-op without CUDA)."""
    if _cuda_nvtx():
        torch.cuda.nvtx.range_pop()


@nvtx_pop.register_fake
def _nvtx_pop_fake() -> None:
    return None


def _register_ordered(qualname: str) -> None:
    """Mark an op as an ordered side effect, so compile passes keep it and keep its order."""
    from torch._higher_order_ops.effects import _EffectType

    register = getattr(torch.library, "_register_effectful_op", None)
    if register is None:  # older torch: the same registry under its first name
        from torch._higher_order_ops.effects import _register_effectful_op as register
    register(qualname, _EffectType.ORDERED)


_register_ordered("gpusolver::nvtx_push")
_register_ordered("gpusolver::nvtx_pop")


class nvtx_range:
    """Context manager: an NVTX range around the block when enabled, nothing otherwise.

    A class rather than a generator, so dynamo traces it as a plain object under
    ``torch.compile(fullgraph=True)``.
    """

    __slots__ = ("name", "_on")

    def __init__(self, name: str):
        self.name = name
        self._on = False

    def __enter__(self):
        self._on = _enabled
        if self._on:
            torch.ops.gpusolver.nvtx_push(self.name)
        return self

    def __exit__(self, *exc):
        if self._on:
            torch.ops.gpusolver.nvtx_pop()
        return False
