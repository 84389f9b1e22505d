"""Sparse masks (DSA token top-k, NSA block selection) through the solver, next to the baselines.

Masks come from the reference indexers (``gpusolver.indexers``) run rank by
rank, as the sharded flow runs them: each rank scores only its own queries
against every key, its row of block areas is computed, and the rows are
stacked (the all-gather). Hidden states are smooth in position (random anchors
every ``ANCHOR`` tokens, linearly interpolated, plus noise) and the indexers'
key projections are tied to their query projections, so a query scores
nearby and similar tokens high: selections mix local and far keys, as real
indexers' do, rather than being uniform.

- DSA: ``LightningIndexer`` (2 heads of 16, ReLU scores), top-k = 2048, with one KV head
  (G = 1, as DeepSeek's MLA layers: Hq = 64) and with GQA 64:8 (G = 8; the selection is
  shared by every head).
- NSA: ``CompressedKeyIndexer`` (block means, l = 64, top-n = 16, first block and two local
  blocks forced), GQA 64:8, G = 8, one 16-dim scoring head per KV head.

D = 128, bf16, mu = 1.10. For each (mask, P) it reports, each as forward / backward bottleneck
bytes (max over ranks of max(send, recv)):

    solver          the plan the library returns: the device solver's (``solve_assignment`` on
                    the sparse-priced config: the selection indices travel with Q and are
                    counted), or owner-computes where that is balanced and its modelled step
                    (busiest attention plus bytes, ``no_worse_than_owner``) is shorter; column
                    ``plan``); its imbalance and the
                    solve time (one solve, wall, CPU)
    owner           owner-computes: each rank computes its own queries and fetches the KV
                    they select (no Q travels)
    all-gather KV   every rank gathers the whole K, V (``baselines.all_gather_kv``)
    USP             Ulysses x ring (``baselines.usp``) plus the selection indices the Ulysses
                    all-to-all must also move: (u - 1) c rows of k int32 (DSA, shared by all heads)
                    or of Hkv / u * n int32 (NSA)

The solver prices K and V as hulls; NSA moves key blocks, so for NSA the solver optimises an
upper bound of what moves. ``priced`` / ``moved`` give both for the returned plan (forward +
backward bottleneck bytes per training step) and ``moved ÷ priced`` the gap. The plan's metrics
are the moved bytes (the runtime's byte counters equal them, tests/gpusolver/sparse).

KV transfer as hulls (one interval per (unit, destination)) and as exact token sets (only the
keys some assigned row selects; what a gather-list transfer would move) is measured for the
solver's plan and for owner-computes (``exact`` columns). For NSA the ``blocks`` columns are
what the runtime moves by default: the key blocks of l tokens the assigned rows attend
(``plan.sparse.KVBlocks``); DSA moves hulls (exact sets would save nothing there).

    python benchmarks/sparse_bench.py                  # the default grid (about 23 min, 2 shared cores)
    python benchmarks/sparse_bench.py --quick          # P = 8, 2K tokens per rank (seconds)
    python benchmarks/sparse_bench.py --dsa-P 8 --nsa-P 8,16 --seeds 0 --tokens-per-rank 8192

Seeds (``--seeds``) draw new hidden states and indexer weights; the cases in ``--one-seed`` run
the first seed only (the DSA indexer scores every (row, earlier key) pair: O(S^2)). DSA at
P = 32 and 64 is left out of the default grid: the indexer's measured time per scored pair
(reported) puts those masks at many minutes each on this machine.

Sub-stages (``--stages 1,2,4``): the returned plan is built with each ``num_stages`` S (its remote
work in S sub-stages, ``plan.stages``, ordered on ``--topology``) and its layer is simulated
(``gpusolver.sim.simulate``, every figure "simulated", not measured) with ``TorchGroup``'s a2a and p2p
transports: forward, backward and step in ms, the step over the same plan's at S = 1 (two stages),
the step over the ideal bound, the exposed communication's share of the step, and the step over
owner-computes' two-stage step with the same transport. The table goes to
``--stages-md`` / ``--stages-json``:

    python benchmarks/sparse_bench.py --dsa-P 16 --nsa-P 16,32 --big '' --seeds 0 --stages 1,2,4

``torch.set_num_threads(1)`` is set first (``--threads`` to change it: solve times then are not
comparable with one-thread runs; the recorded provenance says which).
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, run as a script or loaded by path

from _common import (RESULTS_DIR, environment, markdown_table, parse_list, ratio, write_results,  # noqa: E402
                     write_text)
from gpusolver.areas.sparse import areas_from_rows, sparse_area_rows  # noqa: E402
from gpusolver.baselines import all_gather_kv, ulysses_degree, usp  # noqa: E402
from gpusolver.config import SolverConfig  # noqa: E402
from gpusolver.indexers import CompressedKeyIndexer, LightningIndexer  # noqa: E402
from gpusolver.masks.sparse import BlockSparseMask, TokenTopKMask  # noqa: E402
from gpusolver.metrics import evaluate, owner_computes_assignment  # noqa: E402
from gpusolver.plan.sparse import (SelectionSpec, build_kv_blocks, build_sparse_plan, no_worse_than_owner,  # noqa: E402
                                   sparse_config)
from gpusolver.problem import BlockAreas  # noqa: E402
from gpusolver.solve import solve_assignment  # noqa: E402

ANCHOR = 256          # tokens between the hidden states' random anchors
DM = 32               # hidden size fed to the indexers
DSA_TOPK, NSA_BLOCK, NSA_TOPN = 2048, 64, 16
HQ, HKV_GQA, D = 64, 8, 128


def hidden_states(S: int, seed: int) -> torch.Tensor:
    """[S, DM] fp32: random anchors every ANCHOR tokens, linearly interpolated, plus noise."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randn(S // ANCHOR + 2, DM, generator=g)
    pos = torch.arange(S, dtype=torch.float32) / ANCHOR
    i = pos.long()
    w = (pos - i)[:, None]
    return 0.8 * ((1 - w) * anchors[i] + w * anchors[i + 1]) + 0.6 * torch.randn(S, DM, generator=g)


def dsa_indexer(seed: int, topk: int) -> LightningIndexer:
    ix = LightningIndexer.init(DM, heads=2, head_dim=16, topk=topk, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    # query heads near the key projection: a query scores keys with similar hidden states high
    ix.wq = ix.wk.repeat(1, 2) + 0.3 * torch.randn(DM, 32, generator=g) / DM ** 0.5
    ix.ww = ix.ww.abs()
    return ix


def nsa_projections(seed: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(wq, wk) [DM, hkv * 16]: one 16-dim scoring head per KV head, query tied to key."""
    g = torch.Generator().manual_seed(seed)
    wk = torch.randn(DM, hkv * 16, generator=g) / DM ** 0.5
    return wk + 0.3 * torch.randn(DM, hkv * 16, generator=g) / DM ** 0.5, wk


def make_problem(kind: str, P: int, c: int, seed: int, groups: int):
    """The sharded flow on one machine: per rank, the indexer on its rows, its area rows, and the
    keys its rows select (for exact-set volumes). Returns (BlockAreas, key_used [Gm, P, S] bool,
    SelectionSpec, indexer seconds)."""
    S = P * c
    x = hidden_states(S, seed)
    packed = []
    t_index = 0.0
    if kind == "dsa":
        ix = dsa_indexer(seed, DSA_TOPK)
        keys = ix.keys(x)  # the index keys, all-gathered (16 values per token)
        key_used = torch.zeros(1, P, S, dtype=torch.bool)
        for r in range(P):
            t0 = time.perf_counter()
            topk = ix(x[r * c:(r + 1) * c], keys, r * c)
            t_index += time.perf_counter() - t0
            shard = TokenTopKMask(topk, S, r * c)
            packed.append(sparse_area_rows(shard, P, 1).pack())
            kept = topk.long()
            kept = kept[(kept >= 0) & (kept <= r * c + torch.arange(c)[:, None])]
            key_used[0, r, kept] = True
        spec = SelectionSpec(1, 1, DSA_TOPK)
    else:
        hkv, l = HKV_GQA, NSA_BLOCK
        ix = CompressedKeyIndexer(block_size=l, top_n=NSA_TOPN, local_blocks=2)
        wq, wk = nsa_projections(seed, hkv)
        k_cmp = ix.compress((x @ wk).view(S, hkv, 16))
        key_used = torch.zeros(hkv, P, S, dtype=torch.bool)
        nb = k_cmp.shape[0]
        for r in range(P):
            t0 = time.perf_counter()
            blocks = ix((x[r * c:(r + 1) * c] @ wq).view(c, hkv, 16), k_cmp, r * c)
            t_index += time.perf_counter() - t0
            shard = BlockSparseMask(blocks, l, S, r * c)
            packed.append(sparse_area_rows(shard, P, hkv).pack())
            # a block's keys are used up to the last row that selected it (causal clip)
            row = (r * c + torch.arange(c)).view(c, 1, 1).expand_as(blocks)
            last = torch.full((hkv, nb + 1), -1, dtype=torch.int64)
            b = torch.where(blocks >= 0, blocks.long(), nb)
            head = torch.arange(hkv).view(1, hkv, 1).expand_as(blocks)
            last.view(-1).scatter_reduce_(0, (head * (nb + 1) + b).reshape(-1), row.reshape(-1), reduce="amax")
            keys = torch.arange(S)
            key_used[:, r] = keys[None, :] <= last[:, keys // l]
        spec = SelectionSpec(l, 1, NSA_TOPN)
    areas = areas_from_rows(torch.cat(packed), c)
    return areas, key_used, spec, t_index


def exact_kv_tokens(key_used: torch.Tensor, assignment: torch.Tensor, c: int) -> torch.Tensor:
    """[G, P(unit j), P(dest r)] keys of unit j that dest r needs for its tasks (exact token sets),
    0 for r = j. key_used: [Gm, P(i), S] (Gm = 1 for a selection shared by every group)."""
    G, P = assignment.shape[0], assignment.shape[1]
    S = key_used.shape[-1]
    j_of = torch.arange(S) // c
    need = torch.zeros(G, P, S, dtype=torch.bool)  # [g, dest, key]
    for i in range(P):
        dest = assignment[:, i, :].long()[:, j_of]  # [G, S]: where task (g, i, j(key)) runs
        used = key_used[:, i].expand(G, S) & (dest >= 0)
        need.view(-1).scatter_(0, (torch.arange(G)[:, None] * P * S + dest.clamp(min=0) * S
                                   + torch.arange(S))[used], True)
    count = need.view(G, P, P, c).sum(-1).transpose(1, 2)  # [G, j, r]
    return count * (1 - torch.eye(P, dtype=torch.int64))


def volumes(areas: BlockAreas, assignment: torch.Tensor, cost, key_used=None, kv_block=None) -> dict:
    """Bottlenecks (hull KV; exact-set KV when key_used is given; with kv_block also the key blocks the
    runtime's ``KVBlocks`` move) and imbalance of an assignment."""
    m = evaluate(areas, assignment, cost)
    out = {"imbalance": m.imbalance.item(), "fwd": int(m.fwd_bottleneck), "bwd": int(m.bwd_bottleneck)}
    if key_used is not None:
        from gpusolver.transfers import transfer_ranges

        qo, kv = transfer_ranges(areas, assignment)
        qo_len, kv_len = qo[..., 1] - qo[..., 0], kv[..., 1] - kv[..., 0]
        exact = exact_kv_tokens(key_used, assignment, areas.chunk)
        assert bool((exact <= kv_len).all()), "an exact token set is larger than its hull"
        fs, fr, bs, br = _per_rank(qo_len, exact, cost)
        out.update(fwd_exact=int(torch.maximum(fs, fr).max()), bwd_exact=int(torch.maximum(bs, br).max()),
                   kv_hull_tokens=int(kv_len.sum()), kv_exact_tokens=int(exact.sum()))
        if kv_block is not None:
            G, P, S = assignment.shape[0], assignment.shape[1], key_used.shape[-1]
            used = key_used.view(-1, P, S // kv_block, kv_block).any(-1).expand(G, P, S // kv_block)
            big = 1 << 40  # capacities do not matter here
            kb, _ = build_kv_blocks(used, assignment, 1, areas.chunk, kv_block, big, big)
            blocks = kb.need.long().view(G, P, -1, P).sum(2) * kv_block
            fs, fr, bs, br = _per_rank(qo_len, blocks, cost)
            out.update(fwd_blocks=int(torch.maximum(fs, fr).max()), bwd_blocks=int(torch.maximum(bs, br).max()))
    return out


def _per_rank(qo_len, kv_len, cost):
    """Per-rank (fwd send, fwd recv, bwd send, bwd recv) bytes of per-(unit, dest) token counts
    (the pricing of ``gpusolver.metrics``)."""
    qo_out, qo_in = qo_len.sum(dim=(0, 2)), qo_len.sum(dim=(0, 1))
    kv_out, kv_in = kv_len.sum(dim=(0, 2)), kv_len.sum(dim=(0, 1))
    fs = qo_out * cost.q_fwd + qo_in * cost.o_fwd + kv_out * cost.kv_fwd
    fr = qo_out * cost.o_fwd + qo_in * cost.q_fwd + kv_in * cost.kv_fwd
    bs = qo_out * cost.q_bwd + qo_in * cost.dq_bwd + kv_out * cost.kv_bwd + kv_in * cost.dkv_bwd
    br = qo_out * cost.dq_bwd + qo_in * cost.q_bwd + kv_out * cost.dkv_bwd + kv_in * cost.kv_bwd
    return fs, fr, bs, br


def usp_with_selection(S: int, config: SolverConfig, spec: SelectionSpec, hkv_sel: int) -> tuple[int, int]:
    """USP bottlenecks plus the selection rows its Ulysses all-to-all moves in the forward."""
    P = config.cp_size
    u = ulysses_degree(config.num_heads_kv, P)
    base = usp(seqlen=S, cp_size=P, num_heads_q=config.num_heads_q, num_heads_kv=config.num_heads_kv,
               head_dim=config.head_dim, dtype_bytes=config.dtype_bytes)
    c = S // P
    per_token = spec.width * 4 * (1 if hkv_sel == 1 else hkv_sel // u)  # shared rows, or this rank's heads
    return base.fwd_bottleneck + (u - 1) * c * per_token, base.bwd_bottleneck


def simulate_stages(areas, assignment, config: SolverConfig, spec, used, kv_block, stages, topology,
                    base: dict, owner=None) -> list[dict]:
    """The returned plan built at each S of ``stages`` and its layer simulated (a2a and p2p): rows of
    the sub-stage table, each also over owner-computes' two-stage step (``owner``: its assignment)
    with the same transport. Capacities: the worst case, so that no plan overflows (sizes only)."""
    from dataclasses import replace

    from gpusolver.sim import simulate

    G, P, c = config.head_groups, config.cp_size, areas.rank_tokens
    worst = G * c * (P - 1)
    rows, first = [], {}

    def built(asg, S):
        cfg = replace(config, num_stages=S, topology=topology)
        return build_sparse_plan(areas, asg, cfg, spec, P * c, used_blocks=used, kv_block=kv_block,
                                 recv_capacity=worst, send_capacity=worst)

    owner_plan = None if owner is None else built(owner, 1)
    owner_ms = {comm: simulate(owner_plan, topology, comm=comm).step_ms for comm in ("a2a", "p2p")} \
        if owner_plan is not None else {}
    for S in stages:
        plan = built(assignment, S)
        row = dict(base, S=S)
        for comm in ("a2a", "p2p"):
            t = simulate(plan, topology, comm=comm)
            first.setdefault(comm, t.step_ms)
            row.update({f"{comm}_fwd": t.fwd_ms, f"{comm}_bwd": t.bwd_ms, f"{comm}_step": t.step_ms,
                        f"{comm}_vs_S1": ratio(t.step_ms, first[comm]),
                        f"{comm}_vs_ideal": ratio(t.step_ms, t.ideal_ms),
                        f"{comm}_exposed": ratio(t.exposed_comm_ms, t.step_ms),
                        f"{comm}_vs_owner": ratio(t.step_ms, owner_ms[comm]) if owner_ms else None})
        rows.append(row)
    return rows


def run_case(kind: str, P: int, c: int, seed: int, areas, key_used, spec, t_index, groups: int,
             num_heads_kv: int, stages=(), topology=None) -> dict:
    S = P * c
    config = SolverConfig(cp_size=P, num_heads_q=HQ, num_heads_kv=num_heads_kv, head_dim=D,
                          head_group_flatten=groups > 1)
    G = config.head_groups
    areas = areas.expand_groups(G)
    priced = sparse_config(config, spec)
    cost = priced.cost()
    t0 = time.perf_counter()
    raw = solve_assignment(areas, priced)
    solve_s = time.perf_counter() - t0
    kv_block = NSA_BLOCK if kind == "nsa" else None  # what the runtime moves by default (default_kv_block)
    used = None if kv_block is None else \
        key_used.view(-1, P, S // kv_block, kv_block).any(-1).expand(G, P, S // kv_block)
    # the plan the library returns: the solver's, or owner-computes when balanced and modelled faster
    assignment = no_worse_than_owner(areas, raw, config, spec, used, kv_block)
    owner_asg = owner_computes_assignment(areas)
    pick = "owner" if torch.equal(assignment, owner_asg) and not torch.equal(raw, owner_asg) else "solver"
    solver = volumes(areas, assignment, cost, key_used, kv_block)
    owner = volumes(areas, owner_asg, cost, key_used, kv_block)
    dims = dict(seqlen=S, cp_size=P, num_heads_kv=num_heads_kv, head_dim=D, dtype_bytes=config.dtype_bytes)
    ag = all_gather_kv(**dims)
    usp_f, usp_b = usp_with_selection(S, config, spec, 1 if kind == "dsa" else num_heads_kv)
    name = {"dsa": f"DSA k={DSA_TOPK}", "nsa": f"NSA n={NSA_TOPN} l={NSA_BLOCK}"}[kind]
    row = {"mask": name, "heads": f"{HQ}:{num_heads_kv}", "G": G, "P": P, "c": c, "seed": seed, "plan": pick,
           "index_s": t_index, "solve_s": solve_s,
           "imb": solver["imbalance"], "owner_imb": owner["imbalance"]}
    MB = 1e6
    for label, v in (("", solver), ("owner_", owner)):
        row[f"{label}fwd"], row[f"{label}bwd"] = v["fwd"] / MB, v["bwd"] / MB
        row[f"{label}fwd_exact"], row[f"{label}bwd_exact"] = v["fwd_exact"] / MB, v["bwd_exact"] / MB
        row[f"{label}kv_exact_share"] = ratio(v["kv_exact_tokens"], v["kv_hull_tokens"])
    if kv_block is not None:
        row["fwd_blocks"], row["bwd_blocks"] = solver["fwd_blocks"] / MB, solver["bwd_blocks"] / MB
    row.update(ag_fwd=ag.fwd_bottleneck / MB, ag_bwd=ag.bwd_bottleneck / MB, usp_fwd=usp_f / MB, usp_bwd=usp_b / MB)
    # what the solver prices (hulls) and what the runtime moves (NSA: key blocks; DSA: hulls)
    priced = solver["fwd"] + solver["bwd"]
    moved = solver["fwd_blocks"] + solver["bwd_blocks"] if kv_block is not None else priced
    owner_moved = owner["fwd_blocks"] + owner["bwd_blocks"] if kv_block is not None else owner["fwd"] + owner["bwd"]
    row.update(priced_step=priced / MB, moved_step=moved / MB, moved_vs_priced=ratio(moved, priced),
               owner_moved_step=owner_moved / MB)
    row["step_vs_owner"] = ratio(moved, owner_moved)
    if stages:
        base = {k: row[k] for k in ("mask", "heads", "G", "P", "c", "seed", "plan")}
        row["stages"] = simulate_stages(areas, assignment, config, spec, used, kv_block, stages, topology, base,
                                        owner=owner_asg)
    return row


COLUMNS = [
    ("mask", "mask", ""), ("Hq:Hkv", "heads", ""), ("G", "G", ""), ("P", "P", ""), ("c", "c", ""),
    ("seed", "seed", ""), ("plan", "plan", ""), ("imb", "imb", ".3f"), ("fwd MB", "fwd", ".1f"),
    ("bwd MB", "bwd", ".1f"), ("solve s", "solve_s", ".2f"),
    ("owner imb", "owner_imb", ".3f"), ("owner fwd", "owner_fwd", ".1f"), ("owner bwd", "owner_bwd", ".1f"),
    ("AG-KV fwd", "ag_fwd", ".1f"), ("AG-KV bwd", "ag_bwd", ".1f"), ("USP fwd", "usp_fwd", ".1f"),
    ("USP bwd", "usp_bwd", ".1f"), ("step ÷ owner", "step_vs_owner", ".2f"),
]
GAP_COLUMNS = [
    ("mask", "mask", ""), ("G", "G", ""), ("P", "P", ""), ("c", "c", ""), ("seed", "seed", ""), ("plan", "plan", ""),
    ("priced step MB", "priced_step", ".1f"), ("moved step MB", "moved_step", ".1f"),
    ("moved ÷ priced", "moved_vs_priced", ".3f"), ("owner moved step MB", "owner_moved_step", ".1f"),
]
STAGE_COLUMNS = [
    ("mask", "mask", ""), ("Hq:Hkv", "heads", ""), ("P", "P", ""), ("c", "c", ""), ("seed", "seed", ""),
    ("plan", "plan", ""), ("S", "S", ""),
    ("a2a fwd ms", "a2a_fwd", ".3f"), ("a2a bwd ms", "a2a_bwd", ".3f"), ("a2a step ms", "a2a_step", ".3f"),
    ("a2a step ÷ S=1", "a2a_vs_S1", ".3f"), ("a2a ÷ ideal", "a2a_vs_ideal", ".3f"),
    ("a2a exposed", "a2a_exposed", ".3f"),
    ("p2p step ms", "p2p_step", ".3f"), ("p2p step ÷ S=1", "p2p_vs_S1", ".3f"),
    ("p2p ÷ ideal", "p2p_vs_ideal", ".3f"),
    ("p2p exposed", "p2p_exposed", ".3f"),
    ("a2a ÷ owner S=1", "a2a_vs_owner", ".3f"), ("p2p ÷ owner S=1", "p2p_vs_owner", ".3f"),
]


def render_stages(rows: list[dict], provenance: dict | None, topology: str) -> str:
    """The sub-stage table of a run (rows of ``simulate_stages``)."""
    head = [f"## Sparse plans in S remote sub-stages, simulated on `{topology}` (not measured): Hq = {HQ}, "
            f"D = {D}, bf16, mu = 1.10", ""]
    if provenance:
        pv = provenance
        head += [f"Commit `{pv.get('commit')}`, command `{pv.get('command')}`, machine {pv.get('machine')}, "
                 f"wall {pv.get('wall_s', 0.0) / 60:.1f} min.", ""]
    return "\n".join(head + [
        "The plan the library returns for each mask (as in `sparse_bench.md`), built with `num_stages` = S "
        "(sub-stages ordered by when their bytes land on this topology) and its layer simulated by "
        "`gpusolver.sim.simulate` with `TorchGroup`'s transports: a2a (one all-to-all-v per sub-stage) and "
        "p2p (each rank starts when its own rows have landed). `step ÷ S=1`: the step over the same "
        "plan's two-stage step (S = 1); `÷ ideal`: over the step's ideal bound; `exposed`: exposed "
        "communication's share of the step; `÷ owner S=1`: over owner-computes' two-stage step with the "
        "same transport (the returned plan is owner-computes where that is modelled faster, "
        "`plan.sparse.no_worse_than_owner`). NSA moves key blocks, DSA hulls.", "",
        markdown_table(rows, STAGE_COLUMNS), ""])


SUMMARY_COLUMNS = [
    ("mask", "mask", ""), ("Hq:Hkv", "heads", ""), ("P", "P", ""), ("c", "c", ""), ("seeds", "seeds", ""),
    ("plan (solver/owner)", "plans", ""), ("imb max", "imb_max", ".3f"), ("step ÷ owner min", "step_min", ".2f"),
    ("step ÷ owner max", "step_max", ".2f"), ("moved ÷ priced min", "gap_min", ".3f"),
    ("moved ÷ priced max", "gap_max", ".3f"), ("solve s max", "solve_max", ".2f"),
]
EXACT_COLUMNS = [
    ("mask", "mask", ""), ("G", "G", ""), ("P", "P", ""), ("c", "c", ""), ("seed", "seed", ""),
    ("fwd hull", "fwd", ".1f"), ("fwd exact", "fwd_exact", ".1f"), ("bwd hull", "bwd", ".1f"),
    ("bwd exact", "bwd_exact", ".1f"), ("fwd blocks", "fwd_blocks", ".1f"), ("bwd blocks", "bwd_blocks", ".1f"),
    ("KV exact ÷ hull", "kv_exact_share", ".3f"),
    ("owner fwd hull", "owner_fwd", ".1f"), ("owner fwd exact", "owner_fwd_exact", ".1f"),
    ("owner bwd hull", "owner_bwd", ".1f"), ("owner bwd exact", "owner_bwd_exact", ".1f"),
    ("owner KV exact ÷ hull", "owner_kv_exact_share", ".3f"), ("index s", "index_s", ".1f"),
]


def _provenance() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        commit = None
    return {"commit": commit, "command": "python " + shlex.join(sys.argv), "machine": platform.machine(),
            "processor": platform.processor(), **environment()}


def _one_seed_cases(text: str) -> set:
    """``"dsa:16,nsa:8:32768"`` -> {("dsa", 16, None), ("nsa", 8, 32768)} (c None: every c)."""
    out = set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or parts[0] not in ("dsa", "nsa"):
            raise ValueError(f"--one-seed: {item!r} is not kind:P or kind:P:c with kind dsa or nsa")
        out.add((parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dsa-P", default="8,16", help="CP sizes of the DSA masks ('' for none)")
    p.add_argument("--nsa-P", default="8,16,32,64", help="CP sizes of the NSA masks ('' for none)")
    p.add_argument("--tokens-per-rank", default="8192", help="c values (comma list)")
    p.add_argument("--big", default="nsa:8:32768",
                   help="extra kind:P:c cases, comma list ('' for none): the large-c end of the grid")
    p.add_argument("--seeds", default="0,1,2", help="seeds (comma list)")
    p.add_argument("--one-seed", default="dsa:16,nsa:64,nsa:8:32768",
                   help="kind:P[:c] cases that run the first seed only ('' for none)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--quick", action="store_true", help="P = 8, 2K tokens per rank, top-k 256, one seed: seconds")
    p.add_argument("--json", default=str(RESULTS_DIR / "sparse_bench.json"))
    p.add_argument("--md", default=str(RESULTS_DIR / "sparse_bench.md"))
    p.add_argument("--stages", default="", help="num_stages values to build and simulate the returned plan "
                   "with, comma list (e.g. 1,2,4; '' for none)")
    p.add_argument("--topology", default="h200_hgx", help="the cluster preset of --stages (gpusolver.topology)")
    p.add_argument("--stages-json", default=str(RESULTS_DIR / "sparse_stages.json"))
    p.add_argument("--stages-md", default=str(RESULTS_DIR / "sparse_stages.md"))
    p.add_argument("--from-json", default=None,
                   help="re-render --md from a saved run's JSON (its rows and provenance) without running")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        text = render(saved["rows"], saved["provenance"])
        write_text(args.md, text)
        return {"rows": saved["rows"], "text": text}
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    global DSA_TOPK
    cases = []
    cs = parse_list(args.tokens_per_rank, name="--tokens-per-rank")
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    if not seeds or min(seeds) < 0:
        raise ValueError(f"--seeds must list non-negative ints, got {args.seeds!r}")
    one_seed = _one_seed_cases(args.one_seed)
    stages = parse_list(args.stages, name="--stages") if args.stages.strip() else []
    if any(S < 1 for S in stages):
        raise ValueError(f"--stages must list positive ints, got {args.stages!r}")
    from gpusolver.topology import PRESETS

    if args.topology not in PRESETS:
        raise ValueError(f"--topology must be one of {sorted(PRESETS)}, got {args.topology!r}")
    topology = PRESETS[args.topology]
    if args.quick:
        DSA_TOPK = 256
        cases, seeds = [("dsa", 8, 2048), ("nsa", 8, 2048)], seeds[:1]
    else:
        sizes = lambda text, name: parse_list(text, name=name) if text.strip() else []  # noqa: E731 ('' = none)
        cases = [("dsa", P, c) for c in cs for P in sizes(args.dsa_P, "--dsa-P")]
        cases += [("nsa", P, c) for c in cs for P in sizes(args.nsa_P, "--nsa-P")]
        for item in filter(None, (s.strip() for s in args.big.split(","))):
            kind, P, c = item.split(":")
            cases.append((kind, int(P), int(c)))
    rows = []
    provenance = _provenance()  # the commit the run starts from (the tree may move during a long run)
    t_start = time.perf_counter()
    for kind, P, c in cases:
        only_first = (kind, P, None) in one_seed or (kind, P, c) in one_seed
        for seed in seeds[:1] if only_first else seeds:
            t0 = time.perf_counter()
            areas, key_used, spec, t_index = make_problem(kind, P, c, seed, 1 if kind == "dsa" else HKV_GQA)
            heads = [(1, 1), (HKV_GQA, HKV_GQA)] if kind == "dsa" else [(HKV_GQA, HKV_GQA)]
            for groups, hkv in heads:
                rows.append(run_case(kind, P, c, seed, areas, key_used, spec, t_index, groups, hkv, stages,
                                     topology))
            print(f"{kind} P={P} c={c} seed={seed}: {time.perf_counter() - t0:.1f} s (indexer {t_index:.1f} s)",
                  flush=True)
    wall = time.perf_counter() - t_start
    provenance["wall_s"] = wall
    text = render(rows, provenance)
    print(text)
    stage_rows = [x for r in rows for x in r.pop("stages", [])]
    write_results(args.json, {"provenance": provenance, "rows": rows}, args.md, text)
    out = {"rows": rows, "text": text}
    if stages:
        stage_text = render_stages(stage_rows, provenance, args.topology)
        print(stage_text)
        write_results(args.stages_json, {"provenance": provenance, "rows": stage_rows}, args.stages_md, stage_text)
        out.update(stage_rows=stage_rows, stage_text=stage_text)
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (mask, heads, P, c) over its seeds: ranges of the step ratio and the price gap."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["mask"], r["heads"], r["P"], r["c"]), []).append(r)
    out = []
    for (mask, heads, P, c), rs in groups.items():
        steps = [r["step_vs_owner"] for r in rs if r["step_vs_owner"] is not None]
        gaps = [r["moved_vs_priced"] for r in rs if r["moved_vs_priced"] is not None]
        n_owner = sum(r["plan"] == "owner" for r in rs)
        out.append({"mask": mask, "heads": heads, "P": P, "c": c, "seeds": len(rs),
                    "plans": f"{len(rs) - n_owner}/{n_owner}", "imb_max": max(r["imb"] for r in rs),
                    "step_min": min(steps, default=None), "step_max": max(steps, default=None),
                    "gap_min": min(gaps, default=None), "gap_max": max(gaps, default=None),
                    "solve_max": max(r["solve_s"] for r in rs),
                    # USP moves fewer bytes per step than the returned plan on every seed
                    "usp_below": all(r["usp_fwd"] + r["usp_bwd"] < r["moved_step"] for r in rs)})
    return out


def dsa_index_cost(rows: list[dict]) -> list[str]:
    """Lines on the DSA indexer's measured cost per scored (row, earlier key) pair, and what it
    implies for the DSA sizes left out of the run."""
    dsa = {(r["P"], r["c"], r["seed"]): r["index_s"] for r in rows if r["mask"].startswith("DSA")}
    if not dsa:
        return []
    per_pair = max(t / ((P * c) * (P * c + 1) / 2) for (P, c, _), t in dsa.items())
    c = max(c for _, c, _ in dsa)
    runs = ", ".join(f"P = {P} seed {seed}: {t:.0f} s" for (P, _, seed), t in sorted(dsa.items()))
    left = [P for P in (32, 64) if (P, c) not in {(P_, c_) for P_, c_, _ in dsa}]
    lines = [f"DSA indexer time per mask (all ranks; threads as recorded above): {runs}; at most "
             f"{per_pair * 1e9:.1f} ns per scored (row, earlier key) pair."]
    if left:
        est = ", ".join(f"P = {P}: about {per_pair * (P * c) * (P * c + 1) / 2 / 60:.0f} min per seed" for P in left)
        lines.append(f"DSA at c = {c} left out of this run, at that rate: {est}.")
    return lines


def where_not_to_use(summary: list[dict], within: float = 0.02) -> list[str]:
    """Lines naming the cases where the returned plan saves less than ``within`` of owner-computes'
    bytes per step on every seed (the solve buys nothing there) or USP moves less per step on every
    seed, and the range where the solve pays."""
    lines = []
    for r in summary:
        if r["step_max"] is None:
            continue
        seeds = f"{r['seeds']} seed{'s' if r['seeds'] > 1 else ''}"
        case = f"{r['mask']}, Hq:Hkv {r['heads']}, P = {r['P']}, c = {r['c']} ({seeds})"
        span = f"{r['step_min']:.2f}" if r["step_min"] == r["step_max"] else f"{r['step_min']:.2f}-{r['step_max']:.2f}"
        if r["step_min"] >= 1 - within:
            lines.append(f"- **skip the solve**: {case}: the returned plan moves {span} of owner-computes' "
                         "bytes per step; run owner-computes.")
        elif r.get("usp_below"):
            lines.append(f"- **use USP**: {case}: the returned plan moves {span} of owner-computes' bytes per "
                         "step, but USP moves fewer (fwd + bwd columns).")
        else:
            lines.append(f"- solve: {case}: {span} of owner-computes' bytes per step.")
    return lines


def render(rows: list[dict], provenance: dict | None = None) -> str:
    """The markdown tables of a run's rows (with the run's commit, command and machine)."""
    seeds = sorted({r["seed"] for r in rows})
    head = [f"## Sparse masks from the reference indexers: Hq = {HQ}, D = {D}, bf16, mu = 1.10, "
            f"seeds {', '.join(map(str, seeds))}", ""]
    if provenance:
        pv = provenance
        head += [f"Commit `{pv.get('commit')}`, command `{pv.get('command')}`, machine {pv.get('machine')} "
                 f"({pv.get('processor') or 'cpu'}, torch {pv.get('torch')}, {pv.get('torch_threads')} thread(s)), "
                 f"wall {pv.get('wall_s', 0.0) / 60:.1f} min.", ""]
    return "\n".join(head + [
        "Bottlenecks in MB (10^6 B) per pass, KV priced as hulls per (unit, destination) (what the "
        "solver prices; DSA moves them). NSA moves key blocks by default: its `blocks` columns below. "
        "`step ÷ owner`: bytes moved per training step (fwd + bwd bottleneck) by the returned plan over "
        "owner-computes', both as the runtime moves them.", "",
        "### Over seeds", "", markdown_table(summarize(rows), SUMMARY_COLUMNS), "",
        *[line + "\n" for line in dsa_index_cost(rows)],
        "### Where not to use the solver (owner-computes within 2 %, or USP lower, on every seed)", "",
        *where_not_to_use(summarize(rows)), "",
        "### Per seed", "",
        markdown_table(rows, COLUMNS), "",
        "### What the solver prices vs what moves (returned plan, bytes per training step)", "",
        markdown_table(rows, GAP_COLUMNS), "",
        "### KV as hulls vs exact token sets (solver plan, and owner-computes)", "",
        markdown_table(rows, EXACT_COLUMNS), ""])


if __name__ == "__main__":
    main()
