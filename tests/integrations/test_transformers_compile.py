"""Activation checkpointing and ``torch.compile`` of a Hugging Face model under gpusolver.

Checkpointing (both kinds) recomputes each layer's attention in the backward; the
gradients must still match the single-process model. A compiled model is correct for
any sequence of masks: compiled once (``fullgraph``), called over three packed batches
with repeats, against the eager CP model, with no recompile when the mask changes.
Two ways: plans solved outside the graph (``cp_plan=``), or the mask itself with the
solve inside the graph (the device solver). Compiles cost tens of seconds on this
CPU, so those cases are ``slow``.
"""
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import torch._dynamo  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from gpusolver.integrations.transformers import cp_plans  # noqa: E402
from gpusolver.packing import pack, shard_loss  # noqa: E402
from groupcomm import LocalGroup, TorchGroup  # noqa: E402
from tests._dist import run_ranks  # noqa: E402
from tests._testing import assert_close  # noqa: E402
from tests.integrations._hf import VOCAB, cp_attention, models, train_side_by_side  # noqa: E402
from tests.integrations.test_transformers import _assert_records  # noqa: E402

ORDER = (0, 0, 1, 2, 1)           # three packed batches, each seen again after another
DOCS = ([10, 6, 16], [20, 12], [3, 9, 4, 16])


def _checkpointed(rank, P, kind):
    return train_side_by_side("llama", TorchGroup(), steps=3, checkpointing=kind)


@pytest.mark.parametrize("kind", ["non-reentrant", "reentrant"])
def test_checkpointing_matches_one_process(kind):
    for records in run_ranks(_checkpointed, 2, kind, timeout=240):
        _assert_records(records)
        assert [r["attn_calls"] for r in records] == [4, 8, 12]  # 2 layers, each run again in the backward
        assert [r["solves"] for r in records] == [1, 2, 3]        # the recompute takes the step's plan


@pytest.mark.slow
def test_checkpointing_on_a_local_group():
    records = train_side_by_side("llama", LocalGroup(4), steps=2, checkpointing="non-reentrant")
    _assert_records(records, steps=2)
    assert [r["attn_calls"] for r in records] == [4, 8]


def _compiled_against_eager(family: str, P: int, mode: str, grads: bool):
    warnings.filterwarnings("ignore", message="imbalance_tol")
    group = LocalGroup(P)
    attn = cp_attention(group)
    if mode == "mask":
        attn.solver = "device"    # the sync-free solve traces into the graph (the reference solver reads values)
    _, model = models(family)
    gen = torch.Generator().manual_seed(0)
    # max_documents: the mask keeps one shape for every batch, so the graph's inputs do too
    batches = [pack(torch.randint(0, VOCAB, (32,), generator=gen), d, group=group, max_documents=4) for d in DOCS]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for n, i in enumerate(ORDER):
        b = batches[i]
        results = []
        for run in (model, compiled):
            model.zero_grad()
            source = dict(cp_plan=cp_plans(attn, b.mask, model.config)) if run is compiled and mode == "plan" \
                else dict(cp_mask=b.mask)
            logits = run(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False, **source).logits
            if grads:
                shard_loss(logits, b.labels, b.num_targets).backward()
            results.append([logits.detach()] + ([p.grad.clone() for p in model.parameters()] if grads else []))
        for j, (want, got) in enumerate(zip(*results)):
            assert_close(f"call {n} (batch {i}) {'logits' if j == 0 else f'grad {j - 1}'}", want, got,
                         atol=1e-5, rtol=0)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for {len(DOCS)} masks"


@pytest.mark.slow
def test_compiled_with_plans_windowed_and_full_layers():
    """Qwen2 with a full and a windowed layer: cp_plan holds one plan per window; gradients too."""
    _compiled_against_eager("qwen2-window", 2, "plan", grads=True)


@pytest.mark.slow
def test_compiled_with_masks_solves_in_the_graph():
    _compiled_against_eager("llama", 2, "mask", grads=False)
