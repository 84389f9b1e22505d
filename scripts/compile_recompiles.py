"""Recompiles per new mask of a compiled ``DynamicCPAttention`` (torch._dynamo's counters).

Compiles one layer (fullgraph, LocalGroup(2)), calls it over ``--masks``
packed-document masks of one row count, each twice, checks every output
against an eager layer, and prints the graphs compiled, the recompiles per
new mask and the time of the first (compiling) and the later calls.

    python scripts/compile_recompiles.py --backend aot_eager --masks 4
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from gpusolver import SolverConfig
from gpusolver.masks import varlen_causal_mask
from gpusolver.runtime import DynamicCPAttention, PlanCache, shard
from groupcomm import LocalGroup


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="aot_eager", help="torch.compile backend (aot_eager, inductor)")
    ap.add_argument("--masks", type=int, default=4, help="distinct masks, each called twice")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    P, c, Hq, Hkv, D = 2, 16, 2, 1, 32
    S = P * c
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32)
    group = LocalGroup(P)
    layer = DynamicCPAttention(group, config)  # the process-wide cache, as a model would use it
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard(torch.randn(S, h, D, generator=g), group) for h in (Hq, Hkv, Hkv))
    masks = []
    for i in range(args.masks):
        cuts = sorted(set(torch.randint(1, S, (3,), generator=torch.Generator().manual_seed(i)).tolist()))
        masks.append(varlen_causal_mask([b - a for a, b in zip([0, *cuts], [*cuts, S]) if b > a], pad_to=4))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda *a: layer(*a), fullgraph=True, backend=args.backend)
    times, worst = [], 0.0
    for m in masks:
        for _ in range(2):
            t = time.perf_counter()
            got = compiled(q, k, v, m)
            times.append(time.perf_counter() - t)
            ref = DynamicCPAttention(group, config, plan_cache=PlanCache())(q, k, v, m)
            worst = max(worst, (got - ref).abs().max().item())
    graphs = counters["stats"]["unique_graphs"]
    print(f"backend {args.backend}: {len(masks)} masks x 2 calls, {graphs} graph(s) compiled, "
          f"{(graphs - 1) / max(len(masks) - 1, 1):.2f} recompiles per new mask; "
          f"max |compiled - eager| = {worst:.2e}")
    print(f"first call (compile) {times[0]:.1f} s, later calls median {sorted(times[1:])[len(times[1:]) // 2]:.2f} s "
          "(this machine, shared)")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
