"""A torchtitan-style decoder trained under context parallelism with gpusolver.

The model is plain torch in the shape torchtitan's Llama takes (RMSNorm, RoPE from a
complex table, grouped-query attention, SwiGLU, pre-norm blocks). The only change for
CP is the attention call: each layer hands its q, k, v shards and the layer's mask
(the whole sequence's ``AttnSlices``) to ``DynamicCPAttention``. Layers alternate
full and sliding-window attention to show two masks under two plan names.

Each step trains on one packed sequence per CP group (``gpusolver.packing.pack``):
rank p holds tokens ``[p * c, (p + 1) * c)``, RoPE reads the shard's per-document
positions, labels were shifted on the whole sequence, and the loss is the shard's
sum over the whole sequence's target count. The weights are replicated over the CP
ranks, so their gradients are summed over the CP group.

``train(rank, P)`` also trains the same model in one process on the whole sequence
with dense masks and returns the largest differences per step. Run it with
``python examples/torchtitan_style.py --nproc 2`` (forks gloo ranks on 127.0.0.1) or
under ``torchrun --nproc-per-node 2``.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpusolver import SolverConfig  # noqa: E402
from gpusolver.masks import AttnSlices, slices_to_dense  # noqa: E402
from gpusolver.packing import pack, shard_loss, windowed  # noqa: E402
from gpusolver.runtime import DynamicCPAttention  # noqa: E402
from groupcomm import TorchGroup  # noqa: E402


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 2
    n_kv_heads: int = 1
    vocab_size: int = 64
    ffn_hidden: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    sliding_window: int | None = 6   # odd layers attend the last 6 keys of their document

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_table(head_dim: int, max_len: int, theta: float) -> torch.Tensor:
    """``[max_len, head_dim / 2]`` complex rotations ``exp(i * pos * theta^(-2j / head_dim))``."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` rotated pairwise by ``rot [T, D / 2]`` (complex)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rot[:, None, :]).flatten(-2).type_as(x)


class Attention(nn.Module):
    """GQA attention; ``cp_attn`` (a ``DynamicCPAttention``) for shards, else dense SDPA on the whole sequence."""

    def __init__(self, args: ModelArgs, cp_attn: DynamicCPAttention | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.cp_attn = cp_attn

    def forward(self, x: torch.Tensor, rot: torch.Tensor, mask: AttnSlices, mask_name: str) -> torch.Tensor:
        T = x.shape[0]                                      # this rank's c tokens (or all S, dense)
        q = rotate(self.wq(x).view(T, self.n_heads, self.head_dim), rot)
        k = rotate(self.wk(x).view(T, self.n_kv_heads, self.head_dim), rot)
        v = self.wv(x).view(T, self.n_kv_heads, self.head_dim)
        if self.cp_attn is not None:                        # GQA is native: no repeat of k, v
            out = self.cp_attn(q, k, v, mask, mask_name=mask_name)
        else:
            dense = slices_to_dense(mask).to(x.device)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=dense, enable_gqa=True).transpose(0, 1)
        return self.wo(out.reshape(T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, layer: int, args: ModelArgs, cp_attn: DynamicCPAttention | None):
        super().__init__()
        self.windowed = args.sliding_window is not None and layer % 2 == 1
        self.attention = Attention(args, cp_attn)
        self.feed_forward = FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, rot, masks: dict[str, AttnSlices]):
        name = "window" if self.windowed else "default"
        x = x + self.attention(self.attention_norm(x), rot, masks[name], name)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, cp_attn: DynamicCPAttention | None = None):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args, cp_attn) for i in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False)

    def masks(self, mask: AttnSlices) -> dict[str, AttnSlices]:
        """The document mask, and its windowed form for the windowed layers (made once per step,
        so every layer of a kind passes the same object and they share one plan)."""
        out = {"default": mask}
        if self.args.sliding_window is not None:
            out["window"] = windowed(mask, self.args.sliding_window)
        return out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: AttnSlices) -> torch.Tensor:
        """tokens, positions ``[T]`` (this rank's shard, or the whole sequence) -> logits ``[T, V]``."""
        x = self.tok_embeddings(tokens)
        rot = self.rope[positions]                            # RoPE of the shard's own positions
        masks = self.masks(mask)
        for layer in self.layers:
            x = layer(x, rot, masks)
        return self.output(self.norm(x))


def packed_batches(args: ModelArgs, steps: int, seed: int = 0):
    """Per step: (tokens [S], document lengths), S = 48; the documents change every step."""
    gen = torch.Generator().manual_seed(seed)
    lengths = ([11, 20, 17], [48], [5, 9, 30, 4])
    for step in range(steps):
        docs = lengths[step % len(lengths)]
        yield torch.randint(0, args.vocab_size, (sum(docs),), generator=gen), docs


def train(rank: int, P: int, steps: int = 3, args: ModelArgs | None = None) -> list[dict]:
    """Train under CP on this gloo rank and in one process side by side; per step the loss
    and the largest loss, logits and gradient differences."""
    warnings.filterwarnings("ignore", message="imbalance_tol")  # tiny shards: balance is not the point
    args = ModelArgs() if args is None else args
    group = TorchGroup()                                   # the CP group: here every rank
    config = SolverConfig(cp_size=P, num_heads_q=args.n_heads, num_heads_kv=args.n_kv_heads,
                          head_dim=args.head_dim, dtype=torch.float32)
    # the device solver is the sync-free one, for GPUs; on CPU the reference solver is faster at this size
    solver = "device" if torch.cuda.is_available() else "reference"
    torch.manual_seed(0)                                   # the same initial weights on every rank
    model = Transformer(args, DynamicCPAttention(group, config, solver=solver))
    reference = Transformer(args)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    records = []
    for tokens, docs in packed_batches(args, steps):
        batch = pack(tokens, docs, group=group)            # this rank's shard, labels, positions; the mask
        logits = model(batch.input_ids, batch.position_ids, batch.mask)
        loss = shard_loss(logits, batch.labels, batch.num_targets)
        loss.backward()
        for p in model.parameters():                       # replicated weights: sum over the CP group
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)                             # the whole sequence's loss

        whole = pack(tokens, docs, group=None)             # one process: the whole sequence
        ref_logits = reference(whole.input_ids, whole.position_ids, whole.mask)
        ref_loss = shard_loss(ref_logits, whole.labels, whole.num_targets)
        ref_loss.backward()
        c = logits.shape[0]
        records.append({
            "loss": total.item(),
            "loss_err": abs(total.item() - ref_loss.item()),
            "logits_err": (logits.detach() - ref_logits.detach()[rank * c:(rank + 1) * c]).abs().max().item(),
            "grads_err": max((p.grad - r.grad).abs().max().item()
                             for p, r in zip(model.parameters(), reference.parameters())),
        })
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="CP ranks to fork (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=3)
    a = parser.parse_args()
    from _launch import launch

    records = launch(lambda rank, P: train(rank, P, a.steps), a.nproc)
    if os.environ.get("RANK", "0") != "0":
        return
    for step, r in enumerate(records):
        print(f"step {step}: loss {r['loss']:.6f}; max |CP - one process|: loss {r['loss_err']:.2e}, "
              f"logits {r['logits_err']:.2e}, grads {r['grads_err']:.2e}")


if __name__ == "__main__":
    main()
