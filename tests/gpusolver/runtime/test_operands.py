"""Operands: group-major rows written straight from natural-layout shards, and no group-major copy
of q, k, v or dO in a sub-staged layer (issue 29)."""
import importlib
import weakref

import pytest
import torch

from gpusolver.runtime.layout import to_group_major
from gpusolver.runtime.operands import Operands
from tests.gpusolver.runtime._cases import make_config, make_inputs, make_mask, tight_plan
from tests.gpusolver.runtime.test_dist_attn import _run


@pytest.mark.parametrize("lead", [0, 1], ids=["rank", "batched"])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_groups_writes_the_group_major_rows(lead, G):
    """Operands(groups=G) of a [*, c, H, D] shard holds exactly to_group_major's rows, then cap more."""
    g = torch.Generator().manual_seed(G)
    pre = (3,) if lead else ()
    q = torch.randn(*pre, 5, 8, 6, generator=g)
    lse = torch.randn(*pre, 5, 8, generator=g)
    for zero in (True, False):
        got = Operands([q, lse], 7, lead, zero=zero, groups=G)
        want = Operands([to_group_major(q, G, lead).contiguous(), to_group_major(lse, G, lead).contiguous()], 7,
                        lead, zero=zero)
        assert got.n == want.n == 5 * G
        for a, b in zip(got.local(), want.local()):
            assert a.shape == b.shape and torch.equal(a, b)
        assert [a.shape for a in got.remote()] == [b.shape for b in want.remote()]


def test_join_checks_the_rows():
    a = Operands([torch.zeros(4, 2)], 3, 0)
    assert len(a.join(Operands([torch.ones(4, 5)], 3, 0)).x) == 2
    with pytest.raises(ValueError, match="differ"):
        a.join(Operands([torch.ones(4, 2)], 2, 0))


def test_sub_stages_make_no_group_major_copy(monkeypatch):
    """A sub-staged layer writes q, k, v and dO group-major into its operands and returns O and the
    gradients straight in the natural layout: the runtime makes no group-major copy of any
    [.., c, H, D] tensor (only of the small [.., c, H] delta, computed from the natural O)."""
    P, c, Hq, Hkv, S = 4, 32, 4, 2, 4
    plan, _ = tight_plan(make_mask("docs-causal", P * c, seed=3), make_config(P, Hq, Hkv, num_stages=S))
    assert plan.num_stages == S + 1 and plan.comm.head_groups > 1  # and the local tail
    copied = []

    def spy(x, groups, lead=0):
        copied.append(tuple(x.shape))
        return to_group_major(x, groups, lead)

    # the modules (the package's ``dist_attn`` name is the function)
    for name in ("gpusolver.runtime.dist_attn", "gpusolver.runtime.pipelined"):
        monkeypatch.setattr(importlib.import_module(name), "to_group_major", spy)
    got = _run(plan, P, *make_inputs(P * c, Hq, Hkv, seed=5))
    assert got["dq"].abs().sum() > 0
    assert copied and all(s == (P, c, Hq) for s in copied), copied  # the delta only


def test_sub_stage_reduces_free_their_inputs(monkeypatch):
    """Each sub-stage reduce's partials are handed over: none is alive once the reduce has been issued
    (LocalGroup moves them at once), so no reduce's partials are held through the next sub-stage; its
    accumulators are the host rows of the running ones, merged into in place (issue 29)."""
    P, c, Hq, Hkv, S = 4, 32, 4, 2, 4
    plan, _ = tight_plan(make_mask("docs-causal", P * c, seed=3), make_config(P, Hq, Hkv, num_stages=S))
    pipelined = importlib.import_module("gpusolver.runtime.pipelined")
    real, alive, calls = pipelined.group_reduce, [], []

    def spy(partials, *args, **kw):
        refs = [weakref.ref(t) for t in partials]
        acc = args[2]
        # args[2]: acc, views of the running accumulators' host rows (their base: n rows more after them)
        assert kw.get("inplace") is True and all(a._base is not None and a.dtype == torch.float32 for a in acc)
        work = real(partials, *args, **kw)
        assert all(r is a for r, a in zip(work.wait(), acc))  # the result is acc itself
        calls.append(kw.get("phase"))
        alive.extend(kw.get("phase") for r in refs if r() is not None)
        return work

    monkeypatch.setattr(pipelined, "group_reduce", spy)
    _run(plan, P, *make_inputs(P * c, Hq, Hkv, seed=5))
    assert len(calls) == 3 * plan.num_stages and not alive, alive  # fwd.o, bwd.dq, bwd.dkv per sub-stage


@pytest.mark.parametrize("lead", [0, 1], ids=["rank", "batched"])
def test_dtype_and_zeros(lead):
    """dtype converts the local rows as they are copied in (what ``.float()`` then a copy gives);
    ``Operands.zeros`` is all zeros with the rows of ``like`` plus cap."""
    pre = (3,) if lead else ()
    o = torch.randn(*pre, 6, 2, 4).to(torch.bfloat16)
    got = Operands([o], 5, lead, zero=True, dtype=torch.float32)
    want = Operands([o.float()], 5, lead, zero=True)
    assert got.x[0].dtype == torch.float32 and torch.equal(got.x[0], want.x[0])
    z = Operands.zeros([o], 5, lead, torch.float32)
    assert z.n == 6 and z.x[0].shape == want.x[0].shape and z.x[0].dtype == torch.float32
    assert not z.x[0].any()
