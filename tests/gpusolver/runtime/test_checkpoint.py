"""Activation checkpointing (reentrant and not) gives the gradients of the plain layer (DESIGN.md rule 7).

``torch.utils.checkpoint`` with ``use_reentrant=False`` (Hugging Face's default)
unpacks each saved tensor once in the recomputed forward: a backward that reads
``ctx.saved_tensors`` twice raised there. Every case runs ``dist_attn``,
``sparse_dist_attn`` and ``DynamicCPAttention`` with kept forward buffers and
without, plain and checkpointed, and compares out and the q, k, v gradients.
"""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gpusolver.runtime import DynamicCPAttention, PlanCache, dist_attn, shard
from gpusolver.runtime.sparse_attn import local_selection, sparse_dist_attn
from groupcomm import LocalGroup
from tests._testing import assert_close
from tests.gpusolver.runtime import _cases as slices
from tests.gpusolver.sparse import _cases as sparse

P, C, HQ, HKV = 2, 8, 4, 2
S = P * C


def _dist(keep: bool):
    mask = slices.make_mask("docs-causal", S, seed=3)
    plan, _ = slices.tight_plan(mask, slices.make_config(P, HQ, HKV, keep_forward_buffers=keep))
    assert int(plan.comm.qo_split.sum()) > 0  # remote query rows: the kept buffers are used
    group = LocalGroup(P)
    return group, lambda q, k, v: dist_attn(q, k, v, plan, group, keep_forward_buffers=keep)[0], slices.make_inputs


def _sparse(keep: bool):
    group = LocalGroup(P)
    mask = sparse.make_mask("nsa", S, HKV, seed=3)
    plan = sparse.scatter_plan(mask, sparse.make_config(P, HQ, HKV, keep=keep), group)
    assert int(plan.comm.qo_split.sum()) > 0
    sel = local_selection(mask, group)
    return group, lambda q, k, v: sparse_dist_attn(q, k, v, sel, plan, group, keep_forward_buffers=keep)[0], \
        sparse.make_inputs


def _module(keep: bool):
    group = LocalGroup(P)
    mask = slices.make_mask("docs-causal", S, seed=3)
    layer = DynamicCPAttention(group, slices.make_config(P, HQ, HKV, keep_forward_buffers=keep),
                               solver="reference", plan_cache=PlanCache())
    return group, lambda q, k, v: layer(q, k, v, mask), slices.make_inputs


def _dist_stages(keep: bool):
    """dist_attn with the remote work in 2 sub-stages (its own executor, saved operand buffers)."""
    mask = slices.make_mask("docs-causal", S, seed=3)
    plan, _ = slices.tight_plan(mask, slices.make_config(P, HQ, HKV, keep_forward_buffers=keep, num_stages=2))
    assert int(plan.comm.qo_split.sum()) > 0
    group = LocalGroup(P)
    return group, lambda q, k, v: dist_attn(q, k, v, plan, group, keep_forward_buffers=keep)[0], slices.make_inputs


LAYERS = {"dist_attn": _dist, "sparse_dist_attn": _sparse, "DynamicCPAttention": _module,
          "dist_attn_sub_stages": _dist_stages}


@pytest.mark.filterwarnings("ignore:imbalance_tol")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("keep", [True, False], ids=["keep", "recast"])
@pytest.mark.parametrize("which", list(LAYERS))
def test_checkpointed_grads_equal_plain(which, keep, reentrant):
    group, fn, make_inputs = LAYERS[which](keep)
    q, k, v, d_out, _ = (shard(x, group) for x in make_inputs(S, HQ, HKV, seed=3))
    results = []
    for ckpt in (False, True):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = checkpoint(fn, *x, use_reentrant=reentrant) if ckpt else fn(*x)
        (out * d_out).sum().backward()
        results.append([out.detach()] + [t.grad for t in x])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert a is not None and b is not None, name
        assert torch.equal(a, b), name  # the same ops on the same plan: bit-identical
