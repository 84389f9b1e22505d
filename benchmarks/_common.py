"""Helpers shared by the solver benchmarks: masks, timing, launch counting, tables, JSON.

- ``make_mask(kind, P, seed)``: the benchmark masks, packed documents drawn
  from the shipped length histogram (or one sequence: ``*-seq``),
  ``tokens_per_rank * P`` tokens.
- ``wall_time`` / ``cuda_time``: median seconds of repeated calls.
- ``LaunchCounter``: counts the aten ops dispatched (each one a kernel launch
  on a GPU, views aside), the host reads among them, and Triton launches.
- ``markdown_table``, ``write_json``, ``median``, ``parse_list``.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpusolver.capacity import keep_for_budget
from gpusolver.masks import AttnSlices, causal_mask, full_mask, packed_documents

TOKENS_PER_RANK = 8192
# mask kind -> (causal flag, description)
KINDS = {"causal": (True, "packed causal documents"), "full": (False, "packed full documents"),
         "causal-seq": (True, "one causal sequence"), "full-seq": (False, "one full-attention sequence")}
# the default benchmark masks
PACKED_KINDS = ("causal", "full")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# aten ops whose output size or value is read on the host: each one is a device -> host sync
# (``.item()``, ``bool(t)``, ``int(t)`` and ``float(t)`` all reach ``_local_scalar_dense``)
HOST_READ_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                 "unique_consecutive", "bincount")
# aten ops that copy between devices: a host read when the source is off the CPU and the result on it
COPY_OPS = ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize")
# Tensor methods that read values on the host without reaching the dispatcher for CPU tensors
# (on a device they copy to the host first): counted whatever the device, so a CPU run sees them
HOST_READ_METHODS = ("tolist", "numpy", "__array__")


def make_mask(kind: str, cp_size: int, seed: int, tokens_per_rank: int = TOKENS_PER_RANK,
              device="cpu") -> AttnSlices:
    """Packed-document slice mask of ``tokens_per_rank * cp_size`` tokens (int32 tensors on ``device``).

    kind: "causal" (varlen causal documents), "full" (varlen full documents), or
          "causal-seq" / "full-seq" (one sequence over all ranks; the seed is unused).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    causal = KINDS[kind][0]
    if kind.endswith("-seq"):
        return (causal_mask if causal else full_mask)(tokens_per_rank * cp_size, device=device)
    return packed_documents(tokens_per_rank * cp_size, seed=seed, causal=causal, device=device)


def parse_list(text: str, kind: type = int, allowed: Sequence | None = None, name: str = "value",
               minimum: int = 1) -> list:
    """``"8,16"`` -> ``[8, 16]``; raises ValueError naming ``name`` and the bad item. Ints below
    ``minimum`` are refused (``minimum=0`` for seeds)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            v = kind(item)
        except ValueError:
            raise ValueError(f"{name}: {item!r} is not a {kind.__name__}") from None
        if allowed is not None and v not in allowed:
            raise ValueError(f"{name}: {item!r} is not one of {list(allowed)}")
        if kind is int and v < minimum:
            raise ValueError(f"{name}: {item!r} must be " + ("positive" if minimum == 1 else f">= {minimum}"))
        out.append(v)
    if not out:
        raise ValueError(f"{name}: empty list {text!r}")
    return out


def add_cluster_sweep_args(p) -> None:
    """The arguments of a sweep of packed-document masks on a cluster preset: --P, --kinds,
    --tokens, --topology (read back with ``cluster_sweep``)."""
    from gpusolver.topology import PRESETS

    p.add_argument("--P", default="16,32,64", help="comma-separated CP sizes (default 16,32,64)")
    p.add_argument("--kinds", default=",".join(PACKED_KINDS), help="mask kinds (default causal,full)")
    p.add_argument("--tokens", type=int, default=TOKENS_PER_RANK, help="tokens per rank (default 8192)")
    p.add_argument("--topology", default="h200_hgx", choices=sorted(PRESETS), help="cluster preset")


def cluster_sweep(p, args):
    """(CP sizes, mask kinds, Topology) of ``add_cluster_sweep_args``' arguments; a bad list is
    the parser's error."""
    from gpusolver.topology import PRESETS

    try:
        sizes = parse_list(args.P, int, name="--P")
        kinds = parse_list(args.kinds, str, allowed=PACKED_KINDS, name="--kinds")
    except ValueError as e:
        p.error(str(e))
    return sizes, kinds, PRESETS[args.topology]


def plan_cache_path(cache, kind: str, P: int, seed: int, tokens: int, config) -> Path | None:
    """Where a benchmark mask's solved plan is cached under ``cache`` (None: no cache). A solve on a
    topology (``config.topology``) gives another assignment, so it gets a file of its own, and so does
    one at another bound than 1.10 (the default across nodes is 1.05: ``_mu1.05``), at other buffer
    capacities, or pricing another backward (``keep_tag``)."""
    if not cache:
        return None
    tag = "_topo" if config.topology is not None else ""
    return Path(cache) / (f"{kind}_P{P}_s{seed}_c{tokens}{tag}{mu_tag(config)}{caps_tag(config, tokens)}"
                          f"{keep_tag(config, tokens)}.pt")


def keep_tag(config, tokens: int) -> str:
    """The part of a cached plan's file name that names the backward its solve priced: none when the
    budget's solve prices everything kept (kinds kept in part are priced as kept, ``CommCost``: the
    same assignment as keeping everything), else ``_keep`` and the kinds kept (``_keepkv``: Q
    priced as received again). The kept rows are the plan's (``build_as_solved``), not the solve's."""
    keep = keep_for_budget(config, tokens).keep_forward_buffers
    if keep is True:
        return ""
    return "_keep" + {False: "none"}.get(keep, keep)


def build_as_solved(mask, areas, assignment, config, **kwargs):
    """``build_plan`` with ``config`` as ``gpusolver.solve`` runs it: the memory budget resolved to
    the receive buffers kept for the backward (``capacity.keep_for_budget``), so the plan's cost, its
    metrics and its simulated backward are those of the layer a user's default config runs (what is
    not kept is cast again), not of one that keeps everything."""
    from gpusolver.plan.build import build_plan

    return build_plan(mask, areas, assignment, keep_for_budget(config, areas.rank_tokens), **kwargs)


def caps_tag(config, tokens: int) -> str:
    """The part of a cached plan's file name that names its buffer capacities: none at
    ``capacity.DEFAULT_CHUNKS`` (the plans cached before the defaults across nodes were sized per
    P), else ``_caps`` and each buffer's rows in G·c (``_caps1.5-8-2-8``): the solve keeps a plan
    within its capacities, so an assignment solved at others is another plan."""
    from gpusolver.capacity import DEFAULT_CHUNKS, buffer_rows

    unit = config.head_groups * tokens
    worst = unit * (config.cp_size - 1)
    rows = buffer_rows(config, tokens).as_tuple()
    legacy = tuple(min(worst, k * unit) for k in DEFAULT_CHUNKS.values())
    return "" if rows == legacy else "_caps" + "-".join(f"{r / unit:.3g}" for r in rows)  # 1.1 G·c rounds up to a whole row: named 1.1


def mu_tag(config) -> str:
    """The part of a cached plan's file name that names its bound: none at 1.10 (the plans cached
    before the default across nodes became 1.05), else ``_mu1.05`` and so on."""
    return "" if config.imbalance_tol == 1.10 else f"_mu{config.imbalance_tol:.2f}"


def cached_assignment(mask, areas, config, path: Path | None):
    """The solver's assignment for (mask, areas, config) as ``solve()`` gives it (the memory budget
    resolved, ``capacity.keep_for_budget``: the solve prices what is cast again) and its CPU solve
    seconds, or the one a plan saved at ``path`` holds (seconds None); a fresh solve is saved there
    as a plan."""
    from gpusolver.plan import Plan
    from gpusolver.plan.build import build_plan
    from gpusolver.solve import solve_assignment

    if path is not None and path.exists():
        return Plan.load(path).assignment, None
    config = keep_for_budget(config, areas.rank_tokens)  # priced as solve() prices it
    t0 = time.perf_counter()
    asg = solve_assignment(areas, config, impl="torch")
    seconds = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        build_plan(mask, areas, asg, config).save(path, config=config)
    return asg, seconds


def median(xs: Sequence[float | None]) -> float | None:
    """Median of the non-None values, None when there are none."""
    vals = [float(x) for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratio(num, den) -> float | None:
    """num / den as a float, None when den is 0 (or either is None)."""
    if num is None or den is None or den == 0:
        return None
    return float(num) / float(den)


def wall_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Median wall seconds of ``repeats`` calls after ``warmup`` untimed ones; also the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def cuda_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls between CUDA events, after ``warmup`` calls (GPU only)."""
    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(repeats, 1)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), out


# Ops that only allocate: no kernel runs on a GPU.
ALLOC_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_"})


def _device_of(x) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


def _is_host_copy(func, args, kwargs, out) -> bool:
    """A copy whose source is off the CPU and whose result is on it (a device-to-host read)."""
    name = getattr(func, "_opname", getattr(func, "__name__", "").split(".")[0])
    if name not in COPY_OPS:
        return False
    if name == "copy_":  # copy_(dst, src)
        dst, src = _device_of(args[0]), _device_of(args[1]) if len(args) > 1 else None
    else:
        src, dst = _device_of(args[0]) if args else None, _device_of(out)
    return src is not None and dst is not None and src.type not in ("cpu", "meta") and dst.type == "cpu"


class _OpCounter(TorchDispatchMode):
    """Counts every op that reaches the Python dispatch key, by overload, and device-to-host copies."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.host_copies = 0
        self.paused = False  # inside a Triton launch: the interpreter's own tensor work is not ours

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.ops[func] += 1
            if _is_host_copy(func, args, kwargs or {}, out):
                self.host_copies += 1
        return out


def _triton_run_classes() -> list:
    """The Triton classes whose ``run`` launches a kernel (compiled and interpreted)."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction
        classes.append(JITFunction)
    except Exception:  # noqa: BLE001 - no Triton, or a layout this code does not know
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except Exception:  # noqa: BLE001
        pass
    return classes


@dataclass
class LaunchCounter:
    """Context manager counting what one block of code dispatches.

    aten_ops:        ops seen by a TorchDispatchMode (aten and custom ops).
    view_ops:        those among them that are views (no kernel on a GPU).
    alloc_ops:       those that only allocate (``empty`` and kin; no kernel).
    host_reads:      reads of a device value on the host, which must be 0 on the
                     hot path: ops that do (``.item()``, ``bool(t)``, ``nonzero``,
                     ...), device-to-host copies (``.cpu()``, ``.to("cpu")``,
                     ``copy_`` into a CPU tensor), and calls of ``.tolist()``,
                     ``.numpy()`` and ``__array__`` on any tensor (counted on CPU
                     too, where they reach no op: the same code on a GPU copies).
    triton_launches: calls of ``JITFunction.run`` / ``InterpretedFunction.run``
                     with ``warmup=False`` (one per kernel launch; autotuning
                     benchmark runs count too).
    triton_hooked:   False when the Triton hook could not be installed (then
                     ``triton_launches`` is 0 and ``note`` says why).

    ``launches`` estimates the kernel launches on a GPU: ops that are neither
    views nor allocations, plus Triton launches (the Triton interpreter's own
    tensor work inside a launch is not counted). A custom op that launches Triton kernels counts once as
    an op and once per Triton launch, an over-estimate of one per call.
    """

    aten_ops: int = 0
    view_ops: int = 0
    alloc_ops: int = 0
    host_reads: int = 0
    triton_launches: int = 0
    triton_hooked: bool = False
    note: str = ""
    by_op: Counter = field(default_factory=Counter)

    @property
    def launches(self) -> int:
        return self.aten_ops - self.view_ops - self.alloc_ops + self.triton_launches

    def __enter__(self) -> "LaunchCounter":
        self._patched = []
        classes = _triton_run_classes()
        try:
            for cls in classes:
                self._patch(cls)
            self.triton_hooked = bool(classes)
            if not classes:
                self.note = "triton not importable: triton launches not counted"
        except Exception as e:  # noqa: BLE001 - report 0 launches rather than fail the benchmark
            self._unpatch()
            self.triton_hooked = False
            self.note = f"triton hook failed ({type(e).__name__}: {e}): triton launches not counted"
        self._mode = _OpCounter()
        self._method_reads = 0
        self._patch_methods()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._unpatch()
        self.host_reads += self._mode.host_copies + self._method_reads
        self.by_op["device-to-host copy"] += self._mode.host_copies
        self.by_op["tolist/numpy"] += self._method_reads
        for func, n in self._mode.ops.items():
            name = getattr(func, "__name__", str(func))
            self.by_op[name] += n
            self.aten_ops += n
            if getattr(func, "is_view", False):
                self.view_ops += n
            elif getattr(func, "_opname", name.split(".")[0]) in ALLOC_OPS:
                self.alloc_ops += n
            if getattr(func, "_opname", name.split(".")[0]) in HOST_READ_OPS:
                self.host_reads += n

    def _patch_methods(self) -> None:
        counter = self
        self._depth = 0  # __array__ calls numpy(): one read, counted once
        for name in HOST_READ_METHODS:
            original = getattr(torch.Tensor, name)

            def method(t, *args, __original=original, **kwargs):
                mode = getattr(counter, "_mode", None)
                if mode is not None and not mode.paused and counter._depth == 0:
                    counter._method_reads += 1
                counter._depth += 1
                try:
                    return __original(t, *args, **kwargs)
                finally:
                    counter._depth -= 1

            own = name in torch.Tensor.__dict__
            setattr(torch.Tensor, name, method)
            self._patched.append((torch.Tensor, name, original if own else None))

    def _patch(self, cls) -> None:
        original = cls.__dict__["run"]
        counter = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            if not warmup:
                counter.triton_launches += 1
            mode = getattr(counter, "_mode", None)
            if mode is not None:
                mode.paused = True
            try:
                return original(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                if mode is not None:
                    mode.paused = False

        cls.run = run
        self._patched.append((cls, "run", original))

    def _unpatch(self) -> None:
        for cls, name, original in reversed(self._patched):
            if original is None:  # inherited: drop the override
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._patched = []

    def to_dict(self) -> dict:
        return {"aten_ops": self.aten_ops, "view_ops": self.view_ops, "alloc_ops": self.alloc_ops,
                "host_reads": self.host_reads,
                "triton_launches": self.triton_launches, "triton_hooked": self.triton_hooked,
                "launches": self.launches, "note": self.note, "top_ops": dict(self.by_op.most_common(12))}


def fmt(v, spec: str = ".2f", missing: str = "—") -> str:
    """Format a number for a table cell; ``missing`` for None or non-finite values."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec)


def _cell(v, spec: str) -> str:
    if v is None or isinstance(v, bool) or spec:
        return fmt(v, spec)
    return str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A GitHub markdown table: ``columns`` are (header, row key, format spec) triples."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    rule = "|" + "|".join("---:" if spec else ":---" for _, _, spec in columns) + "|"
    body = ["| " + " | ".join(_cell(r.get(k), spec) for _, k, spec in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def _finite_or_none(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def write_json(path: str | Path, payload: dict) -> Path:
    """Write ``payload`` as indented JSON (non-finite floats become null), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite_or_none(payload), indent=1, allow_nan=False) + "\n")
    return path


def write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def print_and_write(text: str, md_path: str | Path | None) -> None:
    """A benchmark's printed tables, also written to ``md_path`` when given."""
    print(text)
    if md_path:
        write_text(md_path, text)


def write_results(json_path: str | Path, payload: dict, md_path: str | Path | None, text: str) -> None:
    """A benchmark's outputs: the JSON payload, and the printed tables when ``md_path`` is given."""
    write_json(json_path, payload)
    if md_path:
        write_text(md_path, text)


def environment() -> dict:
    """Versions and hardware the numbers were taken on."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "triton": triton_version, "cuda": cuda,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch_threads": torch.get_num_threads()}


def compute_floor_ms(areas, config, topology) -> float:
    """The mean-compute lower bound of a training step, ms: forward plus backward attention time of
    the whole mask (``areas``: its ``block_areas``, any head groups) over ``config.cp_size`` ranks, at
    ``topology``'s rates (``Topology.attn_seconds``, the simulator's price of a compute). No plan's
    busiest rank computes less, so no plan's simulated step is below it."""
    entries, hq = float(areas.area.sum()), config.num_heads_q // areas.head_groups
    return sum(topology.attn_seconds(entries, hq, config.head_dim, phase) for phase in ("fwd", "bwd")) \
        * 1e3 / config.cp_size
