"""Executing plans: the distributed attention function's building blocks.

``simulate_forward`` runs one layer's forward pass for all P ranks of a plan
in a single process (the exchange is done by indexing), with the real
attention and merge ops: the oracle the distributed runtime is tested
against, and a check that a plan's metas mean what they say.
"""
from gpusolver.runtime.simulate import group_major, simulate_forward, ungroup

__all__ = ["simulate_forward", "group_major", "ungroup"]
