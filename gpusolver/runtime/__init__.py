"""Executing plans: one attention layer over a CP group, forward and backward.

- ``dist_attn(q, k, v, plan, group)``: the layer from a Plan, over a
  ``groupcomm`` group (``LocalGroup`` simulates P ranks in one process).
- ``DynamicCPAttention``: the model-facing module; it solves each layer's
  mask on the device (one solve per mask and step) and runs ``dist_attn``.
- ``shard`` / ``unshard``: contiguous sequential chunks; tokens keep their
  order, so RoPE positions, the label shift and the loss need no permutation.
- ``simulate_forward``: the single-process forward oracle of a plan.
"""
from gpusolver.runtime.dist_attn import LayerRoutes, dist_attn, layer_routes
from gpusolver.runtime.layout import from_group_major, shard, to_group_major, unshard
from gpusolver.runtime.module import DynamicCPAttention, PlanCache, default_plan_cache
from gpusolver.runtime.simulate import group_major, simulate_forward, ungroup

__all__ = ["dist_attn", "layer_routes", "LayerRoutes", "DynamicCPAttention", "PlanCache", "default_plan_cache",
           "shard", "unshard", "to_group_major", "from_group_major", "simulate_forward", "group_major", "ungroup"]
