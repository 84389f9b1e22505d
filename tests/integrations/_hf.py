"""Tiny random Hugging Face models trained side by side: under CP (gpusolver) and in one process.

``FAMILIES`` builds tiny configs (2 layers, hidden 64, head dim 32: the kernels take 32,
64 and 128). ``train_side_by_side`` runs optimizer steps on one packed batch per step,
the CP model on shards (``LocalGroup`` or this gloo rank's ``TorchGroup``) and the
reference on the whole sequence with the matching dense mask (a ``{layer type: mask}``
dict, so windowed and full layers each get their own), and returns the largest errors
of the loss, the logits and the gradients (summed over the CP ranks) at every step.
"""
from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: configs are built here

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from gpusolver import SolverConfig  # noqa: E402
from gpusolver.integrations.transformers import register  # noqa: E402
from gpusolver.masks import slices_to_dense  # noqa: E402
from gpusolver.packing import pack, shard_loss  # noqa: E402
from gpusolver.runtime import DynamicCPAttention, PlanCache, unshard  # noqa: E402

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 2, 1, 32
WINDOW = 5
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
               max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # layer 0 full, layer 1 windowed (layers from max_window_layers on slide)
    "qwen2-window": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                         max_window_layers=1)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW)),
}
# packed batches, one per step: documents (lengths summing to S = 32) change every step
BATCHES = ([10, 14, 8], [3, 20, 9], [32])


def config(family: str, **overrides):
    cls, _, extra = FAMILIES[family]
    return cls(**{**_COMMON, **extra, **overrides})


def models(family: str, seed: int = 0, **overrides):
    """(reference model on eager attention, the same weights on attn_implementation="gpusolver")."""
    cfg = config(family, **overrides)
    torch.manual_seed(seed)
    ref = FAMILIES[family][1]._from_config(cfg, attn_implementation="eager")
    cp = copy.deepcopy(ref)
    cp.set_attn_implementation("gpusolver")
    return ref, cp


def cp_attention(group) -> DynamicCPAttention:
    """The registered CP attention (reference solver: exact and cheap on CPU; own plan cache)."""
    config = SolverConfig(cp_size=group.size, num_heads_q=HEADS, num_heads_kv=KV_HEADS, head_dim=HEAD_DIM,
                          dtype=torch.float32)
    attn = DynamicCPAttention(group, config, solver="reference", plan_cache=PlanCache())
    register(attn)
    return attn


def _additive(mask) -> torch.Tensor:
    return torch.where(slices_to_dense(mask), 0.0, torch.finfo(torch.float32).min)[None, None]


def reference_masks(cfg, doc_lengths) -> dict:
    """``{layer type: [1, 1, S, S] additive mask}`` of the documents (windowed for sliding layers)."""
    from gpusolver.packing import document_mask

    window = getattr(cfg, "sliding_window", None)
    out = {"full_attention": _additive(document_mask(doc_lengths))}
    if window is not None:
        out["sliding_attention"] = _additive(document_mask(doc_lengths, sliding_window=window))
    if getattr(cfg, "layer_types", None) is None:  # one mask for every layer (Llama, Mistral)
        return out["full_attention" if window is None else "sliding_attention"]
    return out


def _sum_grads(model, group) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    if not getattr(group, "batched", False):  # a process group (LocalGroup holds every rank already)
        for g in grads:
            dist.all_reduce(g, group=group.process_group)
    return grads


def train_side_by_side(family: str, group, steps: int = 3, optimizer: str = "adamw", use_cache=False,
                       pass_ones_mask: bool = False, checkpointing: str | None = None) -> list[dict]:
    """Per step: ``{"loss", "logits", "grads"}`` max abs errors of the CP model against the reference.

    checkpointing: None, "reentrant" or "non-reentrant" activation checkpointing of the CP
    model's layers (transformers' ``gradient_checkpointing_enable``).
    """
    warnings.filterwarnings("ignore", message="imbalance_tol")  # tiny masks: balance is not the point here
    attn = cp_attention(group)
    calls = []
    attn.register_forward_hook(lambda *_: calls.append(1))
    ref, cp = models(family)
    ref.train()
    cp.train()
    if checkpointing is not None:
        cp.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    make = (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)) if optimizer == "adamw" else \
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    opt_ref, opt_cp = make(ref), make(cp)
    gen = torch.Generator().manual_seed(1)
    records = []
    for step in range(steps):
        lengths = BATCHES[step % len(BATCHES)]
        tokens = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
        batch = pack(tokens, lengths, group=group)
        local = batch.input_ids.dim() == 2                        # LocalGroup: [P, c]
        ids, pos = (batch.input_ids, batch.position_ids) if local else (batch.input_ids[None], batch.position_ids[None])
        extra = {"attention_mask": torch.ones_like(ids)} if pass_ones_mask and step == 0 else {}
        out = cp(input_ids=ids, position_ids=pos, cp_mask=batch.mask, use_cache=use_cache, **extra)
        logits = out.logits if local else out.logits[0]
        loss = shard_loss(logits, batch.labels, batch.num_targets)
        loss.backward()

        whole_ids = unshard(batch.input_ids, group)[None]
        whole_pos = unshard(batch.position_ids, group)[None]
        whole_labels = unshard(batch.labels, group)
        ref_out = ref(input_ids=whole_ids, position_ids=whole_pos, attention_mask=reference_masks(ref.config, lengths),
                      use_cache=False)
        ref_loss = shard_loss(ref_out.logits[0], whole_labels, batch.num_targets)
        ref_loss.backward()

        cp_logits = unshard(logits.detach().contiguous(), group)
        cp_loss = loss.detach().clone()
        if not local:  # the loss of the whole sequence is the sum of the ranks' shard losses
            dist.all_reduce(cp_loss, group=group.process_group)
        grads = _sum_grads(cp, group)
        records.append({
            "loss": (cp_loss - ref_loss).abs().item(),
            "logits": (cp_logits - ref_out.logits[0]).abs().max().item(),
            "grads": max((g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters())),
            "ref_loss": ref_loss.item(),
            "attn_calls": len(calls),        # forward calls of the CP attention so far (recomputes included)
            "solves": attn.plan_cache.solves,  # plans solved so far
        })
        for model, opt, gs in ((ref, opt_ref, None), (cp, opt_cp, grads)):
            if gs is not None:
                for p, g in zip(model.parameters(), gs):
                    p.grad = g
            opt.step()
            opt.zero_grad()
    return records
