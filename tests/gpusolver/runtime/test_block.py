"""A tiny transformer block trained with DynamicCPAttention on gloo equals the single-process model.

The block: embedding, RMSNorm, QKV projection with RoPE by absolute
position, attention, output projection, residual, RMSNorm, LM head, and a
next-token loss. Shards are sequential, so rank p's positions are
``p * c + t`` and its labels are the global shifted labels' chunk p (the
last token of the sequence has none): no permutation anywhere.

Data-parallel over the CP group: the loss is the global mean (per-rank sums
all-reduced, over the global count of labelled tokens) and parameter grads
are all-reduced (summed) before each SGD step.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from attn_kernels.reference import dense_attn
from gpusolver.runtime import DynamicCPAttention, PlanCache, shard
from groupcomm import TorchGroup
from tests._dist import run_ranks
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import ATOL, D, RTOL, make_config, make_mask

S, HQ, HKV, VOCAB, STEPS, LR = 64, 4, 2, 48, 3, 0.5
HIDDEN = HQ * D
IGNORE = -100


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x [T, H, D]`` at absolute ``positions [T]`` (rotate-half form)."""
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)          # [D / 2]
    angles = positions.float()[:, None] * inv_freq[None]                          # [T, D / 2]
    cos, sin = (f(torch.cat((angles, angles), -1))[:, None] for f in (torch.cos, torch.sin))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm1 = RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, (HQ + 2 * HKV) * D, bias=False)
        self.proj = nn.Linear(HQ * D, HIDDEN, bias=False)
        self.norm2 = RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, positions, attend):
        """tokens, positions ``[T]`` -> logits ``[T, VOCAB]``; ``attend(q, k, v) -> out [T, HQ, D]``."""
        x = self.embed(tokens)
        q, k, v = self.qkv(self.norm1(x)).split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k, v = q.unflatten(-1, (HQ, D)), k.unflatten(-1, (HKV, D)), v.unflatten(-1, (HKV, D))
        x = x + self.proj(attend(rope(q, positions), rope(k, positions), v).flatten(-2))
        return self.head(self.norm2(x))


def _data():
    """Tokens ``[S]`` and next-token labels ``[S]`` (the last token has none) of one packed sequence."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (S,), generator=g)
    labels = torch.cat((tokens[1:], torch.tensor([IGNORE])))
    return tokens, labels, make_mask("docs-causal", S, seed=3)


def _model() -> Block:
    torch.manual_seed(0)
    return Block()


def _train_rank(rank, P):
    """STEPS SGD steps of the CP model on this rank: [(global loss, {name: all-reduced grad})]."""
    tokens, labels, mask = _data()
    group = TorchGroup()
    model = _model()
    attn = DynamicCPAttention(group, make_config(P, HQ, HKV), plan_cache=PlanCache())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    c = S // P
    tok, lab = shard(tokens, group), shard(labels, group)
    positions = rank * c + torch.arange(c)
    count = (lab != IGNORE).sum()
    dist.all_reduce(count)
    history = []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = model(tok, positions, lambda q, k, v: attn(q, k, v, mask))
        loss = F.cross_entropy(logits, lab, ignore_index=IGNORE, reduction="sum") / count
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        history.append((total, {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return history, attn.plan_cache.solves


def _train_reference():
    tokens, labels, mask = _data()
    dense = mask.to_dense()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = model(tokens, torch.arange(S), lambda q, k, v: dense_attn(q, k, v, dense)[0])
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)  # mean over the labelled tokens
        loss.backward()
        history.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return history


@pytest.mark.parametrize("P", [2, 4])
def test_trained_block_equals_single_process(P):
    results = run_ranks(_train_rank, P, timeout=120)
    ref = _train_reference()
    for rank, (history, solves) in enumerate(results):
        assert solves == 1  # one mask object: solved once, reused by every step
        for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(history, ref)):
            where = f"rank {rank} step {step}"
            assert_close(f"{where} loss", ref_loss, loss, atol=ATOL, rtol=RTOL)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                assert_close(f"{where} grad {name}", ref_grads[name], g, atol=ATOL, rtol=RTOL)
