"""What one ``dist_attn`` layer holds for its backward and at its peak, next to plain attention.

Measured as a user would, with no GPU: ``torch.autograd.graph.saved_tensors_hooks`` around the
layer's forward count the bytes it keeps for the backward, with its outputs (unique storages: what
the forward leaves alive until the backward; plain attention's saved out is its output), and a
``TorchDispatchMode`` that follows every storage the layer's ops create until it is freed gives
the peak of the buffers the layer allocates on top of its inputs (transient). Both are divided
by P: a ``LocalGroup`` runs all P ranks in one process, each per-rank tensor with a leading
[P] dim.

Two runs per (mask kind, P):
- ``small``: real values on CPU (``--small-*`` shapes), the plan of the device solver;
- ``real``: 8K tokens per rank, Hq:Hkv = 64:8, D = 128, bf16 on ``device="meta"`` (the layer
  runs there; shapes, hence bytes, are the same as on a GPU and nothing is allocated). The
  plan is an owner-computes assignment built on meta (``shape_plan``): its values are
  meaningless, but every buffer has the static size the solved plan would give it.

Plain attention of the same shard keeps q, k, v, out and lse (``plain_kept``); the layer's own
activations are q, k, v and out (``own``). The merge columns are the most one reduce's merge of
the returned rows (``reduce_rows``) allocates above what was live when it began, its outputs
included; ``--fused-reduce`` runs the merges through groupcomm's fused kernels (the GPU default;
on meta their fakes, which make the kernels' outputs, all the kernels allocate). The plan.memory
columns are what ``plan.memory()`` prices for the same plan's collective buffers, next to what
was measured (with ``--relay`` every hop's buffers too; ``gpusolver.plan.memory`` says what it
leaves out).

    python benchmarks/layer_memory.py --cp-sizes 8,16,32,64 --md benchmarks/results/layer_memory.md
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    PACKED_KINDS, TOKENS_PER_RANK, make_mask, markdown_table, median, parse_list,
)
from gpusolver import SolverConfig, block_areas, solve  # noqa: E402
from gpusolver import nvtx  # noqa: E402
from gpusolver.capacity import keep_for_budget  # noqa: E402
from gpusolver.plan import build_plan  # noqa: E402
from gpusolver.runtime import dist_attn  # noqa: E402
from gpusolver.topology import Topology  # noqa: E402
import groupcomm._sim  # noqa: E402
from groupcomm import LocalGroup  # noqa: E402
from groupcomm._merge import fused_reduce  # noqa: E402

SMALL = {"tokens_per_rank": 64, "num_heads_q": 8, "num_heads_kv": 2, "head_dim": 32, "dtype": torch.float32}
REAL = {"tokens_per_rank": TOKENS_PER_RANK, "num_heads_q": 64, "num_heads_kv": 8, "head_dim": 128,
        "dtype": torch.bfloat16}


class SavedBytes:
    """Bytes of the unique storages autograd saves inside the ``with`` block, and of those passed to
    ``include`` (a layer's outputs: a saved copy of an output beside it counts twice, the output
    saved as itself once)."""

    def __init__(self):
        self.storages: dict[int, int] = {}
        self._keep = []  # the storages themselves, so an id is never reused while counted
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if id(s) not in self.storages:
            self.storages[id(s)] = s.nbytes()
            self._keep.append(s)
        return t

    def include(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._pack(t)

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._keep.clear()


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by ops run under the mode, each counted until freed.

    Storages that existed before the mode (the inputs) are not counted; a storage is freed
    when its last tensor dies (a weakref finaliser on the storage, whose Python object lives
    as long as the storage does). ``track``: also keep what made each live storage (op, shape,
    dtype, the innermost lines of gpusolver / groupcomm / attn_kernels that called it) and the
    live set at the peak (``at_peak``, biggest first). ``span()``: a block whose own peak (the
    most live above what was live when it began) goes into ``span_peak`` (the largest of all).
    """

    def __init__(self, track: bool = False):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.span_peak = 0
        self._span_max: int | None = None
        self._seen: set[int] = set()
        self.track = track
        self._what: dict[int, tuple] = {}
        self._peak_set: list[tuple] = []
        # the runtime's NVTX ranges (``gpusolver.nvtx``, on while measured: their push and pop ops
        # pass through this mode): the range open at the peak, and the peak inside each range
        self._ranges: list[str] = []
        self.peak_range = ""
        self.range_peaks: dict[str, int] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)
        self._what.pop(key, None)

    @staticmethod
    def _site() -> str:
        ours = ("gpusolver/", "groupcomm/", "attn_kernels/")
        frames = [f for f in traceback.extract_stack()[:-3] if any(o in f.filename for o in ours)]
        return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-2:]))

    @contextmanager
    def span(self):
        base = self._span_max = self.live
        try:
            yield
        finally:
            self.span_peak = max(self.span_peak, self._span_max - base)
            self._span_max = None

    def at_peak(self, top: int) -> list[tuple]:
        """(bytes, op, shape, dtype, site) of the ``top`` biggest storages live at the peak."""
        return sorted(self._peak_set, key=lambda x: -x[0])[:top]

    def breakdown(self) -> list[tuple]:
        """The live set at the peak grouped by what made it: (total bytes, count, op, shape,
        dtype, site), biggest first; every storage counted (their totals sum to ``peak``)."""
        groups: dict[tuple, list] = {}
        for n, *what in self._peak_set:
            g = groups.setdefault(tuple(what), [0, 0])
            g[0] += n
            g[1] += 1
        return sorted(((n, k, *what) for what, (n, k) in groups.items()), key=lambda x: -x[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("gpusolver.nvtx_"):
            if name.startswith("gpusolver.nvtx_push"):
                self._ranges.append(args[0])
                self.range_peaks.setdefault(args[0], self.live)
            elif self._ranges:
                self._ranges.pop()
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        # an output that shares an argument's storage (a view, an in-place op) allocated nothing:
        # without this, the first view of an input made before the mode would count as new
        given = {id(a.untyped_storage()) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = id(s)
                if key not in self._seen and key not in given:
                    self._seen.add(key)
                    self.live += s.nbytes()
                    weakref.finalize(s, self._free, key, s.nbytes())
                    if self.track:
                        self._what[key] = (s.nbytes(), str(func).removeprefix("aten."), tuple(t.shape),
                                           str(t.dtype).removeprefix("torch."), self._site())
        if self.live > self.peak:
            self.peak_range = " > ".join(self._ranges)
            if self.track:
                self._peak_set = list(self._what.values())
        self.peak = max(self.peak, self.live)
        if self._ranges:
            r = self._ranges[-1]
            self.range_peaks[r] = max(self.range_peaks[r], self.live)
        if self._span_max is not None:
            self._span_max = max(self._span_max, self.live)
        return out


def layer_shapes(shapes: dict, P: int) -> dict:
    c, Hq, Hkv, D = shapes["tokens_per_rank"], shapes["num_heads_q"], shapes["num_heads_kv"], shapes["head_dim"]
    b = torch.empty((), dtype=shapes["dtype"]).element_size()
    q = c * Hq * D * b
    kv = c * Hkv * D * b
    return {"own": 2 * q + 2 * kv, "plain_kept": 2 * q + 2 * kv + c * Hq * 4}


def shape_plan(mask, config: SolverConfig):
    """A plan with the static shapes of ``solve(mask, config)`` and no solve: owner-computes (task
    (g, i, j) on rank i's unit host). Bytes held and allocated depend only on shapes, so a meta
    run needs no solve (the device solver's rounds at P = 64 cost minutes on meta too)."""
    config = config.tiles_for(mask.total_seqlen_q)
    areas = block_areas(mask, config.cp_size, config.head_groups, tiles=config.chunk_tiles)
    U = areas.num_units
    owner = (torch.arange(U, device=mask.device) // config.chunk_tiles).view(1, U, 1)
    return build_plan(mask, areas, owner.expand(config.head_groups, U, U).to(torch.int32), config)


def make_config(P: int, shapes: dict, keep=True, budget=None, qo_chunks=None, stages=1, relay=None,
                cluster=None) -> SolverConfig:
    """The benchmark's config; ``qo_chunks``: the QO receive buffer in multiples of G * c (the budget
    runs': a smaller buffer the solve keeps its plans within, so that Q fits the budget whole);
    ``stages``: ``num_stages`` (an int or "auto"); ``relay``: a topology preset name, whose nodes the
    plan's relay transport crosses (``ib_relay=True``: relay at every S), or None (no topology);
    ``cluster``: a topology preset name whose transport and buffers are the default's there (direct
    with sub-stages, capacities sized per P across nodes: what a cluster user runs), or None."""
    if relay is not None and cluster is not None:
        raise ValueError(f"relay={relay!r} and cluster={cluster!r}: one topology at a time")
    name = relay if relay is not None else cluster
    topology = None if name is None else Topology.preset(name)
    config = SolverConfig(cp_size=P, num_heads_q=shapes["num_heads_q"], num_heads_kv=shapes["num_heads_kv"],
                          head_dim=shapes["head_dim"], dtype=shapes["dtype"], keep_forward_buffers=keep,
                          memory_budget=budget, num_stages=stages, topology=topology,
                          ib_relay=None if relay is None else True)
    if qo_chunks is None:
        return config
    return replace(config, max_qo_recv_rows=int(round(qo_chunks * config.head_groups * shapes["tokens_per_rank"])))


def measure(kind: str, P: int, shapes: dict, device: str, *, seed: int = 0, keep=True, budget=None,
            checkpoint: bool = False, qo_chunks=None, top: int = 0, fused: bool = False, stages=1,
            breakdown: bool = False, relay=None, cluster=None) -> dict:
    """Kept and peak bytes per rank of one layer (forward and backward) for one mask; ``checkpoint``:
    the layer under full activation checkpointing (non-reentrant: nothing saved, the forward run
    again inside the backward, whose peak is then counted); ``top``: also the biggest storages
    live at each pass's peak (``fwd_top``, ``bwd_top``: (bytes, op, shape, dtype, site)); ``fused``:
    the reduces through groupcomm's fused merge (what a GPU runs; on meta its fakes, which make
    the kernels' outputs and nothing else, as the kernels do), else the default (the torch path
    off CUDA); ``breakdown``: also every storage live at each pass's peak grouped by what made it
    (``fwd_breakdown``, ``bwd_breakdown``: (bytes, count, op, shape, dtype, site)), the runtime op
    (its NVTX range) running at the peak (``fwd_at``, ``bwd_at``) and the peak inside each op
    (``fwd_ops``, ``bwd_ops``: {range: bytes}, in the order they ran); ``relay``, ``cluster``: ``make_config``'s."""
    prev = nvtx.set_enabled(True)  # the ranges' push / pop ops tell LiveBytes which op runs (no-ops off CUDA)
    try:
        with fused_reduce(True if fused else None), _reduce_spans() as current:
            row = _measure(current, kind, P, shapes, device, seed=seed, keep=keep, budget=budget,
                           checkpoint=checkpoint, qo_chunks=qo_chunks, top=top, stages=stages, breakdown=breakdown,
                           relay=relay, cluster=cluster)
    finally:
        nvtx.set_enabled(prev)
    row["fused"] = "yes" if fused else "no"
    return row


@contextmanager
def _reduce_spans():
    """Every ``LocalGroup`` reduce's merge (``reduce_rows``) as a span of the ``LiveBytes`` in
    ``current[0]``: its own peak above what was live when it began (its outputs included)."""
    current = [None]
    merge = groupcomm._sim.reduce_rows

    def spanned(*args, **kwargs):
        if current[0] is None:
            return merge(*args, **kwargs)
        with current[0].span():
            return merge(*args, **kwargs)
    groupcomm._sim.reduce_rows = spanned
    try:
        yield current
    finally:
        groupcomm._sim.reduce_rows = merge


def _measure(current: list, kind: str, P: int, shapes: dict, device: str, *, seed: int, keep, budget, checkpoint: bool,
             qo_chunks, top: int, stages=1, breakdown: bool = False, relay=None, cluster=None) -> dict:
    c, D, dtype = shapes["tokens_per_rank"], shapes["head_dim"], shapes["dtype"]
    Hq, Hkv = shapes["num_heads_q"], shapes["num_heads_kv"]
    config = keep_for_budget(make_config(P, shapes, keep, budget, qo_chunks, stages, relay, cluster), c)  # what the budget keeps
    keep, kv_rows, q_rows = config.keep_forward_buffers, config.kept_kv_rows, config.kept_q_rows
    per_rank = config.kept_per_rank
    mask = make_mask(kind, P, seed, c, device=device)
    t0 = time.perf_counter()
    plan = solve(mask, config) if device == "cpu" else shape_plan(mask, config)
    solve_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(seed)

    def make(h):
        if device == "meta":
            return torch.empty(P, c, h, D, dtype=dtype, device="meta", requires_grad=True)
        return torch.randn(P, c, h, D, generator=g).to(dtype).requires_grad_()

    q, k, v = make(Hq), make(Hkv), make(Hkv)
    group = LocalGroup(P)
    fwd_live, bwd_live = LiveBytes(track=top > 0 or breakdown), LiveBytes(track=top > 0 or breakdown)
    def layer(q, k, v):
        return dist_attn(q, k, v, plan, group, keep_forward_buffers=keep, kept_kv_rows=kv_rows, kept_q_rows=q_rows,
                         kept_per_rank=per_rank)

    current[0] = fwd_live
    with SavedBytes() as saved, fwd_live:
        if checkpoint:
            out, lse = torch.utils.checkpoint.checkpoint(layer, q, k, v, use_reentrant=False)
        else:
            out, lse = layer(q, k, v)
        saved.include(out, lse)
    d_out = torch.ones_like(out) if device == "meta" else torch.randn(out.shape, generator=g).to(dtype)
    current[0] = bwd_live
    with bwd_live:
        torch.autograd.backward(out, d_out)
    current[0] = None
    ref = layer_shapes(shapes, P)
    row = {"kind": kind, "P": P, "S": config.num_stages, "transport": "relay" if plan.relay is not None else "direct",
           "topology": "—" if config.topology is None else config.topology.name,
           "budget": budget,
           "qo_recv": "default" if qo_chunks is None else f"{qo_chunks:g} Gc",
           "keep": keep, "kv_rows": _chunks(kv_rows, config, c), "q_rows": _chunks(q_rows, config, c),
           "split": _split(config),
           "ckpt": "yes" if checkpoint else "no", "device": device, "solve_s": solve_s,
           "kept": saved.total / P, "fwd_peak": fwd_live.peak / P, "bwd_peak": bwd_live.peak / P,
           "fwd_reduce": fwd_live.span_peak / P, "bwd_reduce": bwd_live.span_peak / P, **ref}
    if top:
        row["fwd_top"], row["bwd_top"] = fwd_live.at_peak(top), bwd_live.at_peak(top)
    if breakdown:
        for name, live in (("fwd", fwd_live), ("bwd", bwd_live)):
            row[f"{name}_breakdown"], row[f"{name}_at"] = live.breakdown(), live.peak_range
            row[f"{name}_ops"] = dict(live.range_peaks)
    row["kept_ratio"] = row["kept"] / ref["plain_kept"]
    row["peak_ratio"] = max(row["fwd_peak"], row["bwd_peak"]) / ref["own"]
    m = plan.memory(config)
    row.update({"plan_kept": 0 if checkpoint else m.kept, "plan_fwd": m.fwd_peak, "plan_bwd": m.bwd_peak})
    return row


def _split(config: SolverConfig) -> str:
    """How the kept rows are split: one room per rank by its fills (``kept_per_rank``), or the same
    first rows on every rank."""
    return "per rank" if config.kept_per_rank else "prefix"


def _chunks(rows, config: SolverConfig, c: int) -> str:
    """Kept rows of a buffer in multiples of G * c ("all" when the whole buffer is kept)."""
    return "all" if rows is None else f"{rows / (config.head_groups * c):.2f} Gc"


COLUMNS = [("kind", "kind", ""), ("P", "P", "d"), ("S", "S", "d"), ("topology", "topology", ""), ("transport", "transport", ""),
           ("budget", "budget", ""), ("QO recv", "qo_recv", ""),
           ("keep", "keep", ""), ("fused reduce", "fused", ""),
           ("kept Q rows", "q_rows", ""), ("kept KV rows", "kv_rows", ""), ("split", "split", ""),
           ("checkpointed", "ckpt", ""),
           ("kept MB", "kept", ".1f"), ("plan.memory kept MB", "plan_kept", ".1f"),
           ("plain attn MB", "plain_kept", ".1f"), ("kept / plain", "kept_ratio", ".2f"),
           ("fwd transient MB", "fwd_peak", ".1f"), ("bwd transient MB", "bwd_peak", ".1f"),
           ("fwd merge MB", "fwd_reduce", ".1f"), ("bwd merge MB", "bwd_reduce", ".1f"),
           ("plan.memory fwd MB", "plan_fwd", ".1f"), ("plan.memory bwd MB", "plan_bwd", ".1f"),
           ("own q,k,v,out MB", "own", ".1f"), ("peak / own", "peak_ratio", ".2f")]
STEP_COLUMNS = [("kind", "kind", ""), ("P", "P", "d"), ("seed", "seed", "d"), ("S", "S", "d"),
                ("solved on", "solved_on", ""), ("comm", "comm", ""),
                ("budget", "budget", ""), ("QO recv", "qo_recv", ""),
                ("status", "status", "d"), ("kept kinds", "budget_keep", ""),
                ("kept Q rows", "q_rows", ""), ("kept KV rows", "kv_rows", ""), ("split", "split", ""),
                ("step ms, all kept (simulated)", "keep_ms", ".2f"), ("step ms, budget (simulated)", "budget_ms", ".2f"),
                ("ratio", "step_ratio", ".3f"), ("step ms, nothing kept (simulated)", "none_ms", ".2f"),
                ("ratio none", "none_ratio", ".3f")]


MIN_MB = 1.0  # breakdown groups below this many MB per rank are summed, not listed
BREAKDOWN_COLUMNS = [("MB", "mb", ".1f"), ("count", "count", "d"), ("op", "op", ""), ("shape", "shape", ""),
                     ("dtype", "dtype", ""), ("made at", "site", "")]
TOP_COLUMNS = [("pass", "pass_", ""), ("P", "P", "d"), ("fused reduce", "fused", ""), ("MB", "mb", ".1f"),
               ("op", "op", ""), ("shape", "shape", ""),
               ("dtype", "dtype", ""), ("made at", "site", "")]


def step_cost(kind: str, P: int, budget: float, seed: int, topology: str, qo_chunks=None, stages=1,
              comm: str = "a2a", cluster: bool = False) -> dict:
    """Simulated training step (forward + backward, ``gpusolver.sim``, transport ``comm``) of the device
    solver's plan at real shapes on CPU, all three with ``stages`` sub-stages: everything kept, within
    ``budget`` (what is not kept cast again, the solve pricing it), and nothing kept. ``cluster``: each
    plan solved on ``topology`` as a cluster user's ``solve`` does (bytes priced by link class, the
    default's transport and buffers there); otherwise solved with no topology and only simulated on it."""
    from gpusolver.sim import simulate

    topo = Topology.preset(topology)
    c = REAL["tokens_per_rank"]
    mask = make_mask(kind, P, seed, c)
    times, resolved = {}, None
    for name, keep, b in (("keep", True, None), ("budget", True, budget), ("none", False, None)):
        config = make_config(P, REAL, keep, b, qo_chunks if b is not None else None, stages,
                             cluster=topology if cluster else None)
        plan = solve(mask, config)
        times[name] = simulate(plan, topo, comm=comm).step_ms
        if name == "budget":
            resolved, plan_status = keep_for_budget(config, c), plan.status
    return {"kind": kind, "P": P, "seed": seed, "S": resolved.num_stages,
            "solved_on": topology if cluster else "no topology", "comm": comm, "budget": budget,
            "status": int(plan_status),
            "qo_recv": "default" if qo_chunks is None else f"{qo_chunks:g} Gc",
            "budget_keep": resolved.keep_forward_buffers,
            "q_rows": _chunks(resolved.kept_q_rows, resolved, c), "split": _split(resolved),
            "kv_rows": _chunks(resolved.kept_kv_rows, resolved, c), "keep_ms": times["keep"],
            "budget_ms": times["budget"], "step_ratio": times["budget"] / times["keep"], "none_ms": times["none"],
            "none_ratio": times["none"] / times["keep"]}


def _mb(rows):
    keys = ("kept", "plain_kept", "fwd_peak", "bwd_peak", "fwd_reduce", "bwd_reduce", "own", "plan_kept", "plan_fwd",
            "plan_bwd")
    return [{k: (v / 1e6 if k in keys and v is not None else v) for k, v in r.items()} for r in rows]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp-sizes", default="8,16,32,64", help="P of the real-shape (meta) runs")
    p.add_argument("--small-cp-sizes", default="8", help="P of the small CPU runs")
    p.add_argument("--kinds", default=",".join(PACKED_KINDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-real", action="store_true", help="skip the real-shape runs on meta")
    p.add_argument("--no-small", action="store_true", help="skip the small runs on CPU")
    p.add_argument("--budget", type=float, default=1.5, help="memory_budget of the budget runs")
    p.add_argument("--budget-qo-chunks", type=float, default=None,
                   help="QO receive rows of the budget runs in multiples of G * c (default: the default buffer)")
    p.add_argument("--md", default=None, help="write the tables to this markdown file")
    p.add_argument("--step-cp-sizes", default="", help="P of the simulated step cost runs (device solver on CPU at "
                   "real shapes: minutes each at P >= 32); empty: none")
    p.add_argument("--step-seeds", default=None, help="mask seeds of the step cost runs (default: --seed)")
    p.add_argument("--topology", default="h200_hgx", help="the simulated cluster of the step cost runs")
    p.add_argument("--fused-reduce", choices=("off", "on", "both"), default="off",
                   help="reduce through groupcomm's fused merge (the GPU default; on meta its fakes): off (the "
                   "torch path, the CPU default), on, or both (every row measured each way)")
    p.add_argument("--stages", default="1", help="num_stages of every run: an int, or auto")
    p.add_argument("--comm", default="a2a", help="the simulated transport of the step cost runs: a2a, p2p, "
                   "p2p-batch")
    p.add_argument("--cluster", action="store_true", help="every config solved on --topology with the default's "
                   "transport and buffers there (direct with sub-stages, capacities sized per P across nodes)")
    p.add_argument("--relay", action="store_true", help="every config solved on --topology with relay transport "
                   "(ib_relay=True): inter-node rows cross InfiniBand once per node (the P must span its nodes)")
    p.add_argument("--breakdown", action="store_true", help="every storage live at each pass's peak, grouped by "
                   "what made it, the op running then and each op's own peak (real shapes, first kind, default "
                   "config)")
    p.add_argument("--top", type=int, default=0, help="list the N biggest storages live at each pass's peak "
                   "(real shapes, first kind, default config)")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    kinds = parse_list(args.kinds, str, name="--kinds")
    stages = args.stages if args.stages == "auto" else int(args.stages)
    if args.relay and args.cluster:
        raise SystemExit("layer_memory.py: --relay and --cluster pick two transports; give one")
    relay = args.topology if args.relay else None
    cluster = args.topology if args.cluster else None
    rows, steps = [], []
    fused_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.fused_reduce]
    for keep, budget, ckpt in ((True, None, False), (False, None, False), (True, args.budget, False),
                               (True, None, True)):
        qo = args.budget_qo_chunks if budget is not None else None
        for kind in kinds:
            for P in [] if args.no_small else parse_list(args.small_cp_sizes, name="--small-cp-sizes"):
                for fused in fused_modes:  # on CPU the fused merge runs its kernels: TRITON_INTERPRET=1
                    rows.append(measure(kind, P, SMALL, "cpu", seed=args.seed, keep=keep, budget=budget,
                                        checkpoint=ckpt, qo_chunks=qo, fused=fused, stages=stages, relay=relay, cluster=cluster))
            if not args.no_real:
                for P in parse_list(args.cp_sizes, name="--cp-sizes"):
                    first = keep is True and budget is None and not ckpt and kind == kinds[0]
                    for fused in fused_modes:
                        rows.append(measure(kind, P, REAL, "meta", seed=args.seed, keep=keep, budget=budget,
                                            checkpoint=ckpt, qo_chunks=qo, top=args.top if first else 0,
                                            fused=fused, stages=stages, breakdown=args.breakdown and first,
                                            relay=relay, cluster=cluster))
    step_ps = parse_list(args.step_cp_sizes, name="--step-cp-sizes") if args.step_cp_sizes else []
    step_seeds = parse_list(args.step_seeds, name="--step-seeds", minimum=0) if args.step_seeds else [args.seed]
    for kind, P, seed in ((k, P, s) for k in kinds for P in step_ps for s in step_seeds):
        steps.append(step_cost(kind, P, args.budget, seed, args.topology, args.budget_qo_chunks, stages,
                               args.comm, cluster=args.cluster))
        r = steps[-1]
        print(f"step {kind:6} P={P:3} seed {seed} S={r['S']} {args.comm} budget {args.budget} keeps "
              f"{r['budget_keep']} ({r['q_rows']} Q, {r['kv_rows']} KV): "
              f"{r['budget_ms']:.2f} ms vs {r['keep_ms']:.2f} all kept = {r['step_ratio']:.3f} "
              f"(nothing kept {r['none_ratio']:.3f}; simulated)", flush=True)
    for r in rows:
        print(f"{r['device']:4} {r['kind']:6} P={r['P']:3} S={r['S']} budget={r['budget']} keep={r['keep']!s:5} "
              f"fused {r['fused']:3} "
              f"kv rows {r['kv_rows']} ckpt {r['ckpt']} kept {r['kept'] / 1e6:9.1f} MB "
              f"= {r['kept_ratio']:.2f}x plain; transient fwd {r['fwd_peak'] / 1e6:9.1f} bwd "
              f"{r['bwd_peak'] / 1e6:9.1f} MB = {r['peak_ratio']:.2f}x own (merge fwd {r['fwd_reduce'] / 1e6:.1f} "
              f"bwd {r['bwd_reduce'] / 1e6:.1f} MB)"
              + (f"; plan.memory kept {r['plan_kept'] / 1e6:.1f} fwd {r['plan_fwd'] / 1e6:.1f} "
                 f"bwd {r['plan_bwd'] / 1e6:.1f} MB" if "plan_kept" in r else ""), flush=True)
    for r in rows:
        for name in ("fwd", "bwd"):
            for n, op, shape, dtype, site in r.get(f"{name}_top", []):
                print(f"top {name} P={r['P']:3} fused {r['fused']:3} {n / r['P'] / 1e6:8.1f} MB {op:24} "
                      f"{str(shape):26} {dtype:9} {site}")
    for r in rows:
        for name in ("fwd", "bwd"):
            if f"{name}_breakdown" not in r:
                continue
            print(f"breakdown {name} P={r['P']:3} S={r['S']} fused {r['fused']:3}: peak {r[name + '_peak'] / 1e6:.1f} MB "
                  f"in {r[name + '_at'] or '(no op)'}")
            for n, k, op, shape, dtype, site in r[f"{name}_breakdown"]:
                if n / r["P"] >= MIN_MB * 1e6:
                    print(f"  {n / r['P'] / 1e6:8.1f} MB {k:3}x {op:24} {str(shape):26} {dtype:9} {site}")
            print("  peak inside each op: " + ", ".join(f"{op} {n / r['P'] / 1e6:.0f}"
                                                        for op, n in r[f"{name}_ops"].items()))
    if args.md:
        text = render(rows, steps, argv)
        Path(args.md).write_text(text)
    return rows


def render(rows, steps, argv) -> str:
    cmd = "python benchmarks/layer_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    small = [r for r in rows if r["device"] == "cpu"]
    real = [r for r in rows if r["device"] == "meta"]
    s = SMALL
    parts = [f"## Layer memory per rank: kept for the backward and transient peak\n\n`{cmd}`\n"]
    if real:
        parts += [f"### Real shapes on meta: {REAL['tokens_per_rank']} tokens per rank, 64:8, D = 128, bf16\n",
                  markdown_table(_mb(real), COLUMNS)]
    if small:
        parts += [f"\n### Small shapes on CPU (real values): {s['tokens_per_rank']} tokens per rank, "
                  f"{s['num_heads_q']}:{s['num_heads_kv']}, D = {s['head_dim']}, fp32\n",
                  markdown_table(_mb(small), COLUMNS)]
    tops = [dict(pass_=name, P=r["P"], fused=r["fused"], mb=n / r["P"] / 1e6, op=op, shape=str(list(shape)),
                 dtype=dtype, site=site)
            for r in real for name in ("fwd", "bwd") for n, op, shape, dtype, site in r.get(f"{name}_top", [])]
    if tops:
        parts += [f"\n### The biggest storages live at each pass's peak (real shapes, {real[0]['kind']}, default "
                  "config; MB per rank, shapes with LocalGroup's leading [P])\n",
                  markdown_table(tops, TOP_COLUMNS)]
    for r in real:
        for name in ("fwd", "bwd"):
            if f"{name}_breakdown" not in r:
                continue
            groups = [dict(mb=n / r["P"] / 1e6, count=k, op=op, shape=str(list(shape)), dtype=dtype, site=site)
                      for n, k, op, shape, dtype, site in r[f"{name}_breakdown"] if n / r["P"] >= MIN_MB * 1e6]
            rest = r[f"{name}_peak"] / 1e6 - sum(g["mb"] for g in groups)
            parts += [f"\n### {name} transient peak, P = {r['P']}, S = {r['S']}, fused reduce {r['fused']}: "
                      f"{r[name + '_peak'] / 1e6:.1f} MB per rank, in `{r[name + '_at'] or '(no op)'}`\n",
                      f"Every storage live at the peak, grouped by what made it (MB per rank; shapes with "
                      f"LocalGroup's leading [P]; {rest:.1f} MB in groups under {MIN_MB} MB not listed).\n",
                      markdown_table(groups, BREAKDOWN_COLUMNS),
                      "\nPeak inside each op (MB per rank, in the order the ops ran): "
                      + ", ".join(f"`{op}` {n / r['P'] / 1e6:.0f}" for op, n in r[f"{name}_ops"].items()) + "\n"]
    if steps:
        parts += ["\n### Simulated step cost of the budget (real shapes, device solver on CPU, `gpusolver.sim`: "
                  "modelled, not measured)\n", markdown_table(steps, STEP_COLUMNS)]
        ratios = [r["step_ratio"] for r in steps]
        parts.append(f"\nBudget / all kept (simulated): median {median(ratios):.3f}, max {max(ratios):.3f}; "
                     f"{sum(x <= 1.03 for x in ratios)} of {len(ratios)} within 3 %.")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
