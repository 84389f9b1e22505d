"""What ``attn_implementation="gpusolver"`` refuses, and the other ways to give it the mask.

Each refusal is a ``ValueError`` / ``TypeError`` that names what to pass; the checks run
before any collective, so most of these cases never reach the attention kernels.
"""
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import gpusolver  # noqa: E402
from gpusolver.integrations import transformers as gps_tf  # noqa: E402
from gpusolver.integrations.transformers import cp_context, cp_plans, register  # noqa: E402
from gpusolver.masks import sliding_window_mask  # noqa: E402
from gpusolver.packing import pack  # noqa: E402
from groupcomm import LocalGroup, TorchGroup  # noqa: E402
from tests._dist import run_ranks  # noqa: E402
from tests._testing import assert_close  # noqa: E402
from tests.integrations._hf import VOCAB, cp_attention, models  # noqa: E402

P, LENGTHS = 4, [10, 14, 8]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="imbalance_tol")
        yield


def _setup(family="llama", group=None, **overrides):
    group = LocalGroup(P) if group is None else group
    attn = cp_attention(group)
    _, model = models(family, **overrides)
    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(3))
    return attn, model, pack(tokens, LENGTHS, group=group)


def test_missing_mask_names_what_to_pass():
    _, model, b = _setup()
    with pytest.raises(ValueError, match="cp_mask=.*cp_context"):
        model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False)


def test_context_and_plans_give_the_cp_mask_output():
    attn, model, b = _setup("qwen2-window")
    with torch.no_grad():
        want = model(input_ids=b.input_ids, position_ids=b.position_ids, cp_mask=b.mask, use_cache=False).logits
        with cp_context(b.mask):
            got = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits
        plans = cp_plans(attn, b.mask, model.config)
        assert sorted(plans, key=str) == [5, None]  # the full layer's plan and the windowed layer's
        planned = model(input_ids=b.input_ids, position_ids=b.position_ids, cp_plan=plans, use_cache=False).logits
        with cp_context(plan=plans):
            planned_in_context = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits
    assert_close("cp_context", want, got, atol=0, rtol=0)
    assert_close("cp_plan", want, planned, atol=0, rtol=0)
    assert_close("cp_context(plan=)", want, planned_in_context, atol=0, rtol=0)
    with pytest.raises(ValueError, match="one of cp_mask= and cp_plan="):
        model(input_ids=b.input_ids, position_ids=b.position_ids, cp_mask=b.mask, cp_plan=plans, use_cache=False)
    with pytest.raises(ValueError, match="sliding_window=5"):
        model(input_ids=b.input_ids, position_ids=b.position_ids, cp_plan={None: plans[None]}, use_cache=False)


def test_dropout_in_training_is_refused():
    _, model, b = _setup(attention_dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match="attention_dropout=0.0"):
        model(input_ids=b.input_ids, position_ids=b.position_ids, cp_mask=b.mask, use_cache=False)


def test_padding_attention_mask_is_refused():
    _, model, b = _setup()
    pad = torch.ones_like(b.input_ids)
    pad[2, -1] = 0
    with pytest.raises(ValueError, match="row 2: attention_mask has padding"):
        model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=pad, cp_mask=b.mask, use_cache=False)


def test_missing_positions_on_local_group():
    _, model, b = _setup()
    with pytest.raises(ValueError, match=r"position_ids has shape \(1, 8\), expected \[P, c\]"):
        model(input_ids=b.input_ids, cp_mask=b.mask, use_cache=False)


def test_default_positions_flagged_without_a_host_read():
    """Sync-free mode: the positions check is a device error flag that check_errors() reads."""
    attn, model, b = _setup()
    attn.validate = False
    default = torch.arange(b.input_ids.shape[1]).expand(P, -1)
    with torch.no_grad():
        model(input_ids=b.input_ids, position_ids=default, cp_mask=b.mask, use_cache=False)
    with pytest.raises(ValueError, match=r"row 1 \(rank 1\): position_ids are the model's default 0..7"):
        gpusolver.check_errors()


def _forgotten_positions(rank, P):
    attn, model, b = _setup(group=TorchGroup())
    if rank == 0:  # rank 0's default positions are right: it would wait in the layer's collective
        return None
    try:
        model(input_ids=b.input_ids[None], cp_mask=b.mask, use_cache=False)
    except ValueError as e:
        return str(e)
    return "no error"


def test_missing_positions_on_a_process_group():
    _, msg = run_ranks(_forgotten_positions, 2, timeout=120)
    assert "rank 1" in msg and "pass position_ids=" in msg, msg


def test_batch_must_match_the_group():
    _, model, b = _setup()
    with pytest.raises(ValueError, match=r"batch is 1, but LocalGroup\(4\) runs every rank at once"):
        model(input_ids=b.input_ids[:1], position_ids=b.position_ids[:1], cp_mask=b.mask, use_cache=False)


def test_scale_must_match():
    attn, model, b = _setup()
    attn.softmax_scale = 0.5
    with pytest.raises(ValueError, match="softmax_scale=0.17"):
        model(input_ids=b.input_ids, position_ids=b.position_ids, cp_mask=b.mask, use_cache=False)


def test_window_needs_a_document_mask():
    _, model, b = _setup("mistral")
    with pytest.raises(ValueError, match="document-causal rows .*packing.document_mask"):
        model(input_ids=b.input_ids, position_ids=torch.arange(32).view(P, -1), cp_mask=sliding_window_mask(32, 4),
              use_cache=False)


def test_wrong_mask_size():
    _, model, b = _setup()
    with pytest.raises(ValueError, match="cp_mask covers 16 tokens but the shards are P \\* c = 4 \\* 8 = 32"):
        model(input_ids=b.input_ids, position_ids=b.position_ids, cp_mask=sliding_window_mask(16, 4),
              use_cache=False)


def test_register_arguments(monkeypatch):
    attn = cp_attention(LocalGroup(2))
    with pytest.raises(TypeError, match="DynamicCPAttention"):
        register(object())
    with pytest.raises(ValueError, match="'sdpa'"):
        register(attn, "sdpa")
    monkeypatch.setattr(gps_tf, "_warned_versions", set())
    import transformers
    monkeypatch.setattr(transformers, "__version__", "9.1.0")
    with pytest.warns(UserWarning, match="transformers 9.1.0 is not a version gpusolver is tested with"):
        register(attn)
