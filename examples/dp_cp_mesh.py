"""Data parallelism x context parallelism on a device mesh, with gpusolver as the CP attention.

``init_device_mesh`` lays the world out as ``(dp, cp)``: each row of the mesh is one
CP group that trains on one packed sequence (its own batch), and the rows are data-
parallel replicas. The CP attention runs over the mesh's ``"cp"`` process group; DDP
synchronises the gradients over every rank.

The loss: each rank sums its shard's token losses and divides by the valid targets of
the **global** batch (all ranks' sequences, all-reduced over ``"dp"``), so the sum of
every rank's loss is the mean over the global batch. DDP averages gradients over the
W = dp * cp ranks, so each rank scales its loss by W first: the averaged gradient is
then exactly the gradient of that mean (the weights are replicated over CP as well).

``train(rank, W)`` also trains the model in one process on the global batch and
returns the largest differences per step. Run it with ``python examples/dp_cp_mesh.py``
(4 forked gloo ranks, dp 2 x cp 2) or ``torchrun --nproc-per-node 4 examples/dp_cp_mesh.py``.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchtitan_style import ModelArgs, Transformer, packed_batches  # noqa: E402

from gpusolver import SolverConfig  # noqa: E402
from gpusolver.packing import pack, shard_loss  # noqa: E402
from gpusolver.runtime import DynamicCPAttention  # noqa: E402
from groupcomm import TorchGroup  # noqa: E402


def train(rank: int, world: int, dp: int = 2, steps: int = 3) -> list[dict]:
    """Per step: the global loss and the largest loss, logits and gradient differences."""
    warnings.filterwarnings("ignore", message="imbalance_tol")  # tiny shards: balance is not the point
    cp = world // dp
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group = TorchGroup(mesh["cp"].get_group())           # gpusolver's CP group: this mesh row
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    args = ModelArgs()
    config = SolverConfig(cp_size=cp, num_heads_q=args.n_heads, num_heads_kv=args.n_kv_heads,
                          head_dim=args.head_dim, dtype=torch.float32)
    solver = "device" if torch.cuda.is_available() else "reference"  # see torchtitan_style.train
    torch.manual_seed(0)
    model = Transformer(args, DynamicCPAttention(cp_group, config, solver=solver))
    reference = Transformer(args)
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model)                    # over every rank (the default group)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    # every replica draws all dp batches and trains on its own; the reference trains on all of them
    batches = [list(packed_batches(args, steps, seed=r)) for r in range(dp)]
    records = []
    for step in range(steps):
        tokens, docs = batches[dp_rank][step]
        batch = pack(tokens, docs, group=cp_group)
        count = batch.num_targets.clone()
        dist.all_reduce(count, group=mesh["dp"].get_group())  # the global batch's targets
        logits = ddp(batch.input_ids, batch.position_ids, batch.mask)
        loss = shard_loss(logits, batch.labels, count)
        (loss * world).backward()                           # DDP averages over the world: undo it
        total = loss.detach().clone()
        dist.all_reduce(total)

        ref_loss = torch.zeros(())
        wholes = [pack(t, d, group=None) for t, d in (b[step] for b in batches)]
        ref_count = sum(int(w.num_targets) for w in wholes)
        for i, w in enumerate(wholes):
            ref_logits = reference(w.input_ids, w.position_ids, w.mask)
            part = shard_loss(ref_logits, w.labels, ref_count)
            part.backward()
            ref_loss = ref_loss + part.detach()
            if i == dp_rank:
                c = logits.shape[0]
                logits_err = (logits.detach() - ref_logits.detach()[cp_rank * c:(cp_rank + 1) * c]).abs().max()
        records.append({
            "loss": total.item(),
            "loss_err": abs(total.item() - ref_loss.item()),
            "logits_err": logits_err.item(),
            "grads_err": max((p.grad - r.grad).abs().max().item()
                             for p, r in zip(model.parameters(), reference.parameters())),
        })
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks to fork, dp * cp (ignored under torchrun)")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    a = parser.parse_args()
    from _launch import launch

    records = launch(lambda rank, W: train(rank, W, a.dp, a.steps), a.nproc)
    if os.environ.get("RANK", "0") != "0":
        return
    for step, r in enumerate(records):
        print(f"step {step}: global loss {r['loss']:.6f}; max |DP x CP - one process|: loss {r['loss_err']:.2e}, "
              f"logits {r['logits_err']:.2e}, grads {r['grads_err']:.2e}")


if __name__ == "__main__":
    main()
