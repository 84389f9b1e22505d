"""What one sparse layer (``sparse_dist_attn``: NSA block selection, DSA token top-k) holds for its
backward and at its peak, per rank, next to plain attention of the same shard.

Measured as ``layer_memory.py`` measures the slice layer: ``SavedBytes`` (saved-tensor hooks) gives
what the layer keeps from forward to backward, ``LiveBytes`` (a dispatch mode that follows every
storage the layer's ops create until it is freed) each pass's transient peak on top of its inputs.
On ``device="meta"`` at real shapes (8192 tokens per rank, GQA 64:8, D = 128, bf16) through
``LocalGroup``, whose buffers are the plan's default capacities: memory on a static-shape group
depends on shapes only, so the plan is owner-computes (each task on its query's host) rather than
a solve, as ``layer_memory.shape_plan``. The default config: ``num_stages="auto"`` (sparse layers:
four sub-stages inside one node, here up to 8 ranks without a topology, one remote stage across
nodes; column S), NSA's K and V by key block. ``TorchGroup`` allocates its receive buffers
at each rank's fill instead (``LayerRoutes.recv_rows``): there these are upper bounds.

    python benchmarks/sparse_memory.py --kinds nsa,dsa --P 8,16 --stages auto,1 --md benchmarks/results/sparse_memory.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import markdown_table, parse_list  # noqa: E402
from benchmarks.layer_memory import REAL, LiveBytes, SavedBytes, layer_shapes  # noqa: E402
from gpusolver import nvtx  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.masks import dsa_topk_indices, nsa_block_indices  # noqa: E402
from gpusolver.masks.sparse import BlockSparseMask, TokenTopKMask  # noqa: E402
from gpusolver.plan.sparse import SelectionSpec, build_sparse_plan, default_kv_block  # noqa: E402
from gpusolver.runtime.sparse_attn import gather_sparse_areas, local_selection, sparse_dist_attn  # noqa: E402
from groupcomm import LocalGroup  # noqa: E402

MB = 1e6
NSA_BLOCK, NSA_TOPN, DSA_TOPK = 64, 16, 2048  # the selections of sparse_bench.py


def make_mask(kind: str, P: int, c: int, num_kv_heads: int, seed: int, topk: int = DSA_TOPK,
              top_n: int = NSA_TOPN):
    """The layer's selection over ``P * c`` tokens, on meta (its indices drawn on the CPU)."""
    S = P * c
    if kind == "nsa":
        return BlockSparseMask(nsa_block_indices(S, num_kv_heads, NSA_BLOCK, top_n, seed=seed).to("meta"),
                               NSA_BLOCK, S)
    if kind == "dsa":
        return TokenTopKMask(dsa_topk_indices(S, topk, seed=seed).to("meta"), S)
    raise ValueError(f"--kinds: {kind!r} is not 'nsa' or 'dsa'")


def owner_plan(mask, config: SolverConfig, group):
    """The sparse plan of owner-computes on the default capacities, through the sharded flow."""
    config = config.for_sparse()
    kv_block = default_kv_block(mask, config)
    areas, error, used = gather_sparse_areas(mask, config, group, kv_block)
    G, U, n = areas.head_groups, areas.num_units, config.chunk_tiles
    owner = (torch.arange(U, device=areas.area.device) // n).view(1, U, 1).expand(G, U, U)
    assignment = torch.where(areas.area > 0, owner, -1).to(torch.int32)
    spec = SelectionSpec.of(mask, G)
    return build_sparse_plan(areas, assignment, config, spec, mask.total_seqlen_k, mask_error=error,
                             used_blocks=used, kv_block=kv_block)


def measure(kind: str, P: int, keep: bool, seed: int = 0, shapes: dict = REAL, num_stages="auto",
            **selection) -> dict:
    """Kept and transient bytes per rank of one sparse layer, forward and backward, on meta;
    ``selection``: ``make_mask``'s ``topk`` / ``top_n`` (default the benchmark's)."""
    c, Hq, Hkv, D, dtype = (shapes[k] for k in ("tokens_per_rank", "num_heads_q", "num_heads_kv", "head_dim",
                                                  "dtype"))
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=dtype,
                          keep_forward_buffers=keep, num_stages=num_stages)
    group = LocalGroup(P)
    mask = make_mask(kind, P, c, Hkv, seed, **selection)
    plan = owner_plan(mask, config, group)
    q, k, v = (torch.empty(P, c, h, D, dtype=dtype, device="meta", requires_grad=True) for h in (Hq, Hkv, Hkv))
    sel = local_selection(mask, group)
    fwd, bwd = LiveBytes(), LiveBytes()
    prev = nvtx.set_enabled(True)
    try:
        with SavedBytes() as saved, fwd:
            out, lse = sparse_dist_attn(q, k, v, sel, plan, group, keep_forward_buffers=keep, validate=False)
        with bwd:
            torch.autograd.backward(out, torch.ones_like(out))
    finally:
        nvtx.set_enabled(prev)
    ref = layer_shapes(shapes, P)
    kept, fwd_peak, bwd_peak = saved.total / P, fwd.peak / P, bwd.peak / P
    return {"kind": kind, "P": P, "S": plan.num_stages, "keep": "yes" if keep else "no",
            "kv_block": "yes" if plan.kv_blocks is not None else "no",
            "kept_mb": kept / MB, "plain_mb": ref["plain_kept"] / MB, "kept_ratio": kept / ref["plain_kept"],
            "fwd_mb": fwd_peak / MB, "bwd_mb": bwd_peak / MB, "own_mb": ref["own"] / MB,
            "peak_ratio": max(fwd_peak, bwd_peak) / ref["own"]}


COLUMNS = [("kind", "kind", ""), ("P", "P", "d"), ("S", "S", "d"), ("keep", "keep", ""),
           ("K, V by block", "kv_block", ""),
           ("kept MB", "kept_mb", ".1f"), ("plain attn MB", "plain_mb", ".1f"), ("kept / plain", "kept_ratio", ".2f"),
           ("fwd transient MB", "fwd_mb", ".1f"), ("bwd transient MB", "bwd_mb", ".1f"),
           ("own q,k,v,out MB", "own_mb", ".1f"), ("peak / own", "peak_ratio", ".2f")]


def render(rows: list[dict], command: str) -> str:
    lines = ["# Sparse layer memory per rank: kept for the backward and transient peak", "",
             f"Command: `{command}`", "",
             "Measured on `device=\"meta\"` through `LocalGroup` (buffers at the plan's default capacities), "
             "8192 tokens per rank, GQA 64:8, D = 128, bf16, the default sub-stages S (`num_stages=\"auto\"`: "
             "4 inside one node, 1 across nodes), owner-computes plan "
             f"(NSA: blocks of {NSA_BLOCK} keys, top-{NSA_TOPN}; DSA: top-{DSA_TOPK} tokens). "
             "own: the shard's q, k, v and out; plain attn: what a single-device attention of the shard "
             "keeps (q, k, v, out, lse).", "", markdown_table(rows, COLUMNS)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="nsa,dsa")
    ap.add_argument("--P", default="8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="auto",
                    help="num_stages values (comma list of 'auto' or ints; default the layer's 'auto')")
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    stages = [s if s == "auto" else int(s) for s in parse_list(args.stages, str, name="--stages")]
    rows = []
    for kind in parse_list(args.kinds, str, name="--kinds"):
        for P in parse_list(args.P, name="--P"):
            for S, keep in ((S, keep) for S in stages for keep in (True, False)):
                r = measure(kind, P, keep, args.seed, num_stages=S)
                rows.append(r)
                print(f"{kind} P={P} S={r['S']} keep={keep}: kept {r['kept_mb']:.1f} MB = "
                      f"{r['kept_ratio']:.2f}x plain; "
                      f"transient fwd {r['fwd_mb']:.1f} bwd {r['bwd_mb']:.1f} MB = "
                      f"{r['peak_ratio']:.2f}x own (meta, LocalGroup)", flush=True)
    if args.md:
        command = "python benchmarks/sparse_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.md).write_text(render(rows, command.strip()))
    return rows


if __name__ == "__main__":
    main()
