"""Run a per-rank function over the ranks a process holds.

A real group holds one rank and its tensors have no rank dim; ``LocalGroup`` holds all P, every
per-rank tensor led by a ``[P]`` dim. Kernels run one rank at a time either way.
"""
from __future__ import annotations

import torch

__all__ = ["per_rank"]


def per_rank(ranks, batched: bool, fn, *tensors: torch.Tensor):
    """``fn(rank, *rank_tensors) -> tuple`` for each rank in ``ranks``. Batched results are written
    into one ``[P, ...]`` tensor each as they come, so a rank's result is dropped once copied: never
    all P ranks' results and their stack at once (what a memory measurement on ``LocalGroup`` would
    otherwise count twice, and one GPU never holds)."""
    if not batched:
        return fn(ranks[0], *tensors)
    outs = None
    for i, r in enumerate(ranks):
        res = fn(r, *(t[r] for t in tensors))
        if outs is None:
            outs = tuple(x.new_empty((len(ranks), *x.shape)) for x in res)
        for o, x in zip(outs, res):
            o[i].copy_(x)
        del res
    return outs
