"""What one rank of a cluster layer holds: ``TorchGroup`` at the rank's fill, real shapes, one process.

``layer_memory.py`` measures ``LocalGroup`` (all P ranks in one process, buffers at the plan's
capacities, on meta). A rank of a real cluster runs ``TorchGroup``, which sizes its receive
buffers, the operands over them, every fp32 sum over those rows and its reduce buffers by the
rows this rank really receives and returns (``runtime.pipelined.receive_rows``). This script
runs that path for one rank at a time on CPU, at real shapes, with a solved plan:

- a fake process group (``torch.distributed``'s ``"fake"`` backend, one process) stands for the
  other P - 1 ranks: every collective is issued with its real host split sizes and buffers, and
  moves no byte (the received rows hold garbage; nothing reads their values);
- the attention kernels are fakes that allocate what the kernels allocate (the forward its out
  ``[Tq, Hq, D]`` and fp32 lse, the backward its dq, dk, dv, or nothing when it accumulates
  into the fp32 sums) and compute nothing, so a rank at 8K tokens runs in seconds;
- everything else runs as on a rank: casts into buffers at the fill, the operands, the merges
  and the reduces, on their CPU torch paths (the merge twins make fp32 temporaries a window at a
  time, where the GPU's fused kernels make none: an upper bound there), with tensors freed when
  a GPU rank frees them (``groupcomm.retain``, which holds gloo's CPU tensors a while for its
  worker threads, is off: there are none).

The same dispatch mode as ``layer_memory.py`` counts every storage the layer's ops create
until it is freed (transient peak, forward and backward) and the saved-tensor hooks what it
keeps for the backward, with its outputs (a saved copy of O beside the output counts twice).
``own`` is the rank's q, k, v and out; ``plan.memory`` the plan's
buffers at capacity (what ``LocalGroup`` allocates), for comparison. All figures are measured,
per rank; the ranks measured are those receiving the most forward bytes (``--ranks``).

    python benchmarks/rank_memory.py --cp-sizes 16,32,64 --md benchmarks/results/rank_memory.md
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    PACKED_KINDS, environment, make_mask, markdown_table, parse_list, write_results, write_text,
)
from benchmarks.layer_memory import REAL, LiveBytes, SavedBytes, layer_shapes  # noqa: E402
from gpusolver import SolverConfig, solve  # noqa: E402
from gpusolver.capacity import keep_for_budget  # noqa: E402
from gpusolver.topology import Topology  # noqa: E402
from groupcomm import TorchGroup  # noqa: E402

MB = 1e6
# the modules that call groupcomm.retain by the name they imported
_RETAINERS = ("groupcomm._a2av", "gpusolver.runtime.dist_attn", "gpusolver.runtime.layout")


def _fake_forward(q, k, v, *args, accumulate=None, **kwargs):
    """The attention kernel's allocations: out ``[Tq, Hq, D]`` in q's dtype and the fp32 lse, or
    nothing when it merges into ``accumulate``."""
    if accumulate is not None:
        return accumulate
    return q.new_empty(*q.shape[:2], v.shape[-1]), q.new_zeros(q.shape[:2], dtype=torch.float32)


def _fake_backward(dout, q, k, v, *args, accumulate=None, **kwargs):
    """The backward kernel's allocations: dq, dk, dv, or nothing when it adds into ``accumulate``."""
    if accumulate is not None:
        return accumulate
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


SENDS = ("held", "landed")


class _Landed:
    """A fake point-to-point handle that reports itself complete: the send has landed by the time the
    group next looks (``TorchGroup`` drops a landed send's buffer at its next collective)."""

    def __init__(self, work):
        self._work = work

    def is_completed(self) -> bool:
        return True

    def wait(self, *args):
        return self._work.wait(*args)


@contextmanager
def fake_rank(rank: int, P: int, sends: str = "held"):
    """This process as ``rank`` of a fake group of P, the attention kernels as fakes, and the support
    check (which refuses a ``"fake"`` group: no bytes move, on purpose) off, for the ``with`` block.

    sends: when a point-to-point send completes, which decides how long ``TorchGroup`` holds its
    buffer. ``"held"``: never before the pass ends (the fake group's handles never complete), the
    most a rank can hold; ``"landed"``: by the group's next collective, the least (a GPU rank's sends
    land while it computes, so its next collective finds most of them done)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if sends not in SENDS:
        raise ValueError(f"sends must be one of {SENDS}, got {sends!r}")

    pipelined = sys.modules["gpusolver.runtime.pipelined"]
    runtime = sys.modules["gpusolver.runtime.dist_attn"]
    # groupcomm.retain holds the CPU tensors of the last collectives for gloo's worker threads (a CPU
    # workaround; NCCL buffers are never held): with no worker threads here, a GPU rank's lifetimes
    retainers = [m for m in (sys.modules[n] for n in _RETAINERS) if hasattr(m, "retain")]
    saved = (pipelined.flex_attn, pipelined.flex_attn_backward, runtime.check_supported,
             [m.retain for m in retainers])
    if dist.is_initialized():
        raise RuntimeError("rank_memory runs its own fake process group: torch.distributed is initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=P)
    pipelined.flex_attn, pipelined.flex_attn_backward = _fake_forward, _fake_backward
    runtime.check_supported = lambda *a, **k: None
    for m in retainers:
        m.retain = lambda *tensors: None
    batch = dist.batch_isend_irecv
    if sends == "landed":
        dist.batch_isend_irecv = lambda ops: [_Landed(w) for w in batch(ops)]
    try:
        yield TorchGroup(transport="p2p")
    finally:
        dist.batch_isend_irecv = batch
        pipelined.flex_attn, pipelined.flex_attn_backward, runtime.check_supported = saved[:3]
        for m, f in zip(retainers, saved[3]):
            m.retain = f
        dist.destroy_process_group()


def solved_plan(kind: str, P: int, seed: int, shapes: dict, topology: Topology):
    """The plan a cluster user's default config gives this mask (``gpusolver.solve`` on CPU, the
    memory budget's kept kinds priced), and that config with those kinds resolved."""
    config = SolverConfig(cp_size=P, num_heads_q=shapes["num_heads_q"], num_heads_kv=shapes["num_heads_kv"],
                          head_dim=shapes["head_dim"], dtype=shapes["dtype"], topology=topology)
    c = shapes["tokens_per_rank"]
    plan = solve(make_mask(kind, P, seed, c), config)
    return plan, keep_for_budget(config, c)  # what DynamicCPAttention runs the plan with


def busiest_ranks(plan, n: int) -> list[int]:
    """The ``n`` ranks that receive the most forward bytes (ties: the lower rank first)."""
    received = plan.pair_bytes("fwd").sum(0).tolist()
    return sorted(range(len(received)), key=lambda r: (-received[r], r))[:n]


def measure_rank(plan, config: SolverConfig, shapes: dict, rank: int, seed: int = 0, breakdown: bool = False,
                 sends: str = "held") -> dict:
    """Kept, forward and backward transient bytes of ``rank`` running ``plan`` on ``TorchGroup``;
    ``breakdown``: also what was live at each pass's peak, grouped by what made it
    (``LiveBytes.breakdown``) and the runtime op (NVTX range) running there; ``sends`` as in
    ``fake_rank``."""
    from gpusolver.runtime import dist_attn

    if plan.relay is not None or plan.comm.num_stages == 1:
        # the fakes stand in for the sub-stage executor's kernels only (runtime.pipelined): the other
        # executors would run the real kernels at real shapes on CPU, for hours
        raise ValueError(f"rank_memory measures direct sub-stage plans, got num_stages = "
                         f"{plan.comm.num_stages}, relay = {plan.relay is not None}")
    c, D, dtype = shapes["tokens_per_rank"], shapes["head_dim"], shapes["dtype"]
    g = torch.Generator().manual_seed(seed + rank)
    q, k, v = (torch.randn(c, h, D, generator=g).to(dtype).requires_grad_()
               for h in (shapes["num_heads_q"], shapes["num_heads_kv"], shapes["num_heads_kv"]))
    inputs = {id(x.untyped_storage()) for x in (q, k, v)}
    with fake_rank(rank, config.cp_size, sends) as group:
        fwd, bwd = LiveBytes(track=breakdown), LiveBytes(track=breakdown)
        with SavedBytes() as saved, fwd:
            out, lse = dist_attn(q, k, v, plan, group, keep_forward_buffers=config.keep_forward_buffers,
                                 kept_kv_rows=config.kept_kv_rows, kept_q_rows=config.kept_q_rows,
                                 kept_per_rank=config.kept_per_rank)
            saved.include(out, lse)
            made = sum(n for key, n in saved.storages.items() if key not in inputs)
        # what the forward made and left alive that autograd does not save (held on the side, out of
        # reach of saved-tensor hooks): the group's host copy of the splits (CPU) and little else
        unsaved = fwd.live - made
        d_out = torch.randn(out.shape, generator=g).to(dtype)
        with bwd:
            torch.autograd.backward(out, d_out)
        group.wait_sends()
    row = {"rank": rank, "kept": saved.total, "unsaved": unsaved, "fwd_peak": fwd.peak, "bwd_peak": bwd.peak}
    if breakdown:
        for name, live in (("fwd", fwd), ("bwd", bwd)):
            row[f"{name}_breakdown"], row[f"{name}_at"] = live.breakdown(), live.peak_range
    return row


def run(kind: str, P: int, seed: int, shapes: dict, topology: Topology, ranks: int, breakdown: bool = False) -> dict:
    plan, config = solved_plan(kind, P, seed, shapes, topology)
    t0 = time.perf_counter()
    measured = busiest_ranks(plan, ranks)
    rows = [measure_rank(plan, config, shapes, r, seed, breakdown) for r in measured]
    landed = [measure_rank(plan, config, shapes, r, seed, sends="landed") for r in measured]
    mem, ref = plan.memory(config), layer_shapes(shapes, P)
    worst = max(rows, key=lambda r: max(r["fwd_peak"], r["bwd_peak"]))
    return {"kind": kind, "P": P, "seed": seed, "S": config.num_stages,
            "transport": "relay" if plan.relay is not None else "direct", "ranks": ",".join(str(r["rank"]) for r in rows),
            "worst_rank": worst["rank"], "kept": max(r["kept"] for r in rows),
            "unsaved": max(r["unsaved"] for r in rows),
            "fwd_peak": max(r["fwd_peak"] for r in rows), "bwd_peak": max(r["bwd_peak"] for r in rows),
            "fwd_landed": max(r["fwd_peak"] for r in landed), "bwd_landed": max(r["bwd_peak"] for r in landed),
            "plain_kept": ref["plain_kept"], "own": ref["own"], "plan_fwd": mem.fwd_peak, "plan_bwd": mem.bwd_peak,
            "seconds": time.perf_counter() - t0,
            **({k: worst[k] for k in ("fwd_breakdown", "fwd_at", "bwd_breakdown", "bwd_at")} if breakdown else {})}


COLUMNS = [("kind", "kind", ""), ("P", "P", "d"), ("seed", "seed", "d"), ("S", "S", "d"), ("transport", "transport", ""),
           ("ranks measured", "ranks", ""), ("kept MB", "kept", ".1f"), ("kept / plain", "kept_ratio", ".2f"),
           ("held, not saved MB", "unsaved", ".2f"),
           ("fwd transient MB", "fwd_peak", ".1f"), ("bwd transient MB", "bwd_peak", ".1f"),
           ("peak / own", "peak_ratio", ".2f"), ("fwd MB, sends landed", "fwd_landed", ".1f"),
           ("bwd MB, sends landed", "bwd_landed", ".1f"), ("peak / own, sends landed", "landed_ratio", ".2f"),
           ("own q,k,v,out MB", "own", ".1f"),
           ("plan.memory fwd MB (capacity)", "plan_fwd", ".1f"), ("plan.memory bwd MB (capacity)", "plan_bwd", ".1f")]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp-sizes", default="16,32,64", help="P, each spanning nodes of the topology")
    p.add_argument("--kinds", default=",".join(PACKED_KINDS))
    p.add_argument("--seeds", type=int, default=1, help="seeds 0 .. N - 1 of each mask kind")
    p.add_argument("--topology", default="h200_hgx", help="the cluster (a Topology preset)")
    p.add_argument("--ranks", type=int, default=2, help="ranks measured per mask: those receiving the most")
    p.add_argument("--tokens-per-rank", type=int, default=REAL["tokens_per_rank"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--breakdown", action="store_true", help="print what is live at each pass's peak (worst rank)")
    p.add_argument("--md", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.ranks < 1 or args.seeds < 1:
        raise ValueError(f"--ranks and --seeds must be >= 1, got {args.ranks} and {args.seeds}")
    torch.set_num_threads(args.threads)
    shapes = dict(REAL, tokens_per_rank=args.tokens_per_rank)
    topology = Topology.preset(args.topology)
    rows = []
    for kind in parse_list(args.kinds, str):
        for P in parse_list(args.cp_sizes, int):
            for seed in range(args.seeds):
                row = run(kind, P, seed, shapes, topology, args.ranks, args.breakdown)
                row["kept_ratio"] = row["kept"] / row["plain_kept"]
                row["peak_ratio"] = max(row["fwd_peak"], row["bwd_peak"]) / row["own"]
                row["landed_ratio"] = max(row["fwd_landed"], row["bwd_landed"]) / row["own"]
                rows.append(row)
                print(f"{kind} P={P} seed={seed}: ranks {row['ranks']} fwd {row['fwd_peak'] / MB:.1f} MB, "
                      f"bwd {row['bwd_peak'] / MB:.1f} MB ({row['peak_ratio']:.2f}x own), kept "
                      f"{row['kept'] / MB:.1f} MB; sends landed: fwd {row['fwd_landed'] / MB:.1f} MB, bwd "
                      f"{row['bwd_landed'] / MB:.1f} MB ({row['landed_ratio']:.2f}x) ({row['seconds']:.0f} s)",
                      flush=True)
                for name in ("fwd", "bwd") if args.breakdown else ():
                    print(f"  {name} peak of rank {row['worst_rank']} in {row[name + '_at'] or '-'}:")
                    for n, count, op, shape, dtype, site in row.pop(f"{name}_breakdown")[:8]:
                        print(f"    {n / MB:8.1f} MB  {count} x {op} {shape} {dtype}  {site}")
    shown = [{k: (v / MB if k in ("kept", "unsaved", "fwd_peak", "bwd_peak", "fwd_landed", "bwd_landed", "plain_kept", "own",
                                               "plan_fwd", "plan_bwd")
                  else v) for k, v in r.items()} for r in rows]
    cmd = "python benchmarks/rank_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = environment()
    text = (f"## One rank's layer memory on `TorchGroup` at its fill ({args.topology}, measured)\n\n"
            f"`{cmd}` (torch {env['torch']}, {env['device']}, {env['torch_threads']} thread(s))\n\n"
            f"{shapes['tokens_per_rank']} tokens per rank, {shapes['num_heads_q']}:{shapes['num_heads_kv']}, "
            f"D = {shapes['head_dim']}, bf16, the default config on the topology (direct transport with "
            "sub-stages, capacities sized per P). One process per rank through a fake process group; "
            "attention kernels faked by their allocations; merges on their CPU torch paths. Per rank, "
            "the largest over the ranks measured. `kept`: the storages autograd saves (saved-tensor "
            "hooks), the outputs included; `held, not saved`: what the forward made and left alive "
            "beside them (the group's host copy of the splits). Transient columns: point-to-point send buffers held to "
            "the pass's end (the fake group's sends never complete: the most a rank holds); `sends "
            "landed`: each send complete by the group's next collective, which then drops its buffer "
            "(the least).\n\n" + markdown_table(shown, COLUMNS) + "\n")
    print(text)
    if args.json:
        write_results(args.json, {"rows": rows, "environment": env, "command": cmd}, args.md, text)
    elif args.md:
        write_text(args.md, text)
    return rows


if __name__ == "__main__":
    main()
