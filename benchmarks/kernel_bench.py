"""Slice-attention kernel benchmark: forward / backward TFLOP/s next to SDPA (flash) and FlexAttention.

Registry of masks (each: slices for ``flex_attn``, a FlexAttention mask_mod,
whether SDPA can express it) and one runner. FLOPs count the mask area only:

    forward  = 4 * area * Hq * D      (QK^T and PV, 2 FLOPs per multiply-add)
    backward = 2.5 * forward          (QK^T recompute, dV, dP, dQ, dK)

so every implementation is charged the same useful work and a sparser mask is
not rewarded for skipping blocks. Timing: warm-up, then each repetition after
zeroing a 256 MiB buffer (flushes L2), CUDA events.

``--static`` needs no GPU. It prints the compiler's view of each kernel at
its sm_90 launch configs (bf16, D = 128, GQA 64:8; the mask type is data, so
full and causal masks run the same code): registers, spills, and SASS
instructions per iteration of the interior (mask-free) and masked inner
loops, next to the full-scan kernels of ``--baseline REF``. Then what one
plan stage costs at P ranks (packed causal and full documents, the heaviest
rank): programs, slice visits (work list against scanning the whole padded
slice table, as the full-scan kernels did) and inner-loop iterations.

    python benchmarks/kernel_bench.py                     # GPU: 4K-64K tokens, D=128, bf16
    python benchmarks/kernel_bench.py --seqlens 8192 --masks causal
    python benchmarks/kernel_bench.py --smoke             # CPU: tiny shapes, fp32, checks it runs
    python benchmarks/kernel_bench.py --static --baseline a54d6db --out benchmarks/results/kernel_static.md
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from attn_kernels import flex_attn
from attn_kernels.flex_attn import kernel, worklist

_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class MaskCase:
    """One benchmark mask: ``slices(S) -> (q_ranges [R,2], k_ranges [R,2], attn_type [R])`` int32 (host),
    ``doc_ids(S) -> [S] int64`` for FlexAttention's mask_mod, and SDPA's ``is_causal`` (None: not expressible)."""

    name: str
    slices: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    causal: bool
    sdpa_is_causal: bool | None


def _one(S: int, t: int):
    r = torch.tensor([[0, S]], dtype=torch.int32)
    return r, r.clone(), torch.tensor([t], dtype=torch.int32)


def doc_lengths(S: int, seed: int = 0) -> list[int]:
    """Packed documents: lengths drawn log-uniformly in [S/64, S/4] with a fixed seed, the last one cut to fit."""
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    lo, hi = math.log(max(S // 64, 1)), math.log(max(S // 4, 1))
    while total < S:
        n = int(math.exp(lo + (hi - lo) * float(torch.rand(1, generator=g))))
        n = max(1, min(n, S - total))
        lens.append(n)
        total += n
    return lens


def _varlen_causal(S: int):
    bounds = torch.tensor([0] + doc_lengths(S)).cumsum(0).to(torch.int32)
    r = torch.stack([bounds[:-1], bounds[1:]], dim=1)
    return r, r.clone(), torch.ones(r.shape[0], dtype=torch.int32)


MASKS = {
    "full": MaskCase("full", lambda S: _one(S, 0), causal=False, sdpa_is_causal=False),
    "causal": MaskCase("causal", lambda S: _one(S, 1), causal=True, sdpa_is_causal=True),
    "varlen_causal": MaskCase("varlen_causal", _varlen_causal, causal=True, sdpa_is_causal=None),
}


def mask_area(q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type: torch.Tensor) -> int:
    """Exact count of valid (q, k) entries of a slice list (host-side, int64)."""
    area = 0
    for (qs, qe), (ks, ke), t in zip(q_ranges.tolist(), k_ranges.tolist(), attn_type.tolist()):
        q = torch.arange(qs, qe, dtype=torch.int64)
        lo = torch.clamp(q + ks - qs, min=ks) if t in (2, 3) else torch.full_like(q, ks)
        hi = torch.clamp(q + ke - qe + 1, max=ke) if t in (1, 3) else torch.full_like(q, ke)
        area += int((hi - lo).clamp(min=0).sum())
    return area


def _timer(device: torch.device, reps: int, warmup: int):
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=device) if device.type == "cuda" else None

    def run(fn) -> float:
        """Median milliseconds of fn()."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]

    return run


def _impls(case: MaskCase, S: int, hq: int, hkv: int, device: torch.device):
    """name -> (forward(q, k, v) -> out [S, Hq, D], or None with the reason it is unavailable)."""
    qr, kr, t = (x.to(device) for x in case.slices(S))
    impls = {"flex_attn": (lambda q, k, v: flex_attn(q, k, v, qr, kr, t)[0], None)}
    if case.sdpa_is_causal is None:
        impls["sdpa"] = (None, "mask not expressible")
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH

        def sdpa(q, k, v):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    is_causal=case.sdpa_is_causal, enable_gqa=hq != hkv)
            return o[0].transpose(0, 1)

        impls["sdpa"] = (sdpa, None)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:  # pragma: no cover - torch without FlexAttention
        impls["flex_attention"] = (None, str(e))
        return impls
    doc = torch.zeros(S, dtype=torch.int64, device=device)
    for i, (s, e) in enumerate(qr.tolist()):  # host-side set-up, outside timing
        doc[s:e] = i

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (kv_idx <= q_idx) if case.causal else same

    block_mask = create_block_mask(mask_mod, None, None, S, S, device=device.type)
    fa = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

    def flex(q, k, v):
        o = fa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
               block_mask=block_mask, enable_gqa=hq != hkv)
        return o[0].transpose(0, 1)

    impls["flex_attention"] = (flex, None)
    return impls


def run(masks, seqlens, hq, hkv, head_dim, dtype, device, reps, warmup) -> list[dict]:
    """Benchmark every (mask, S, implementation); returns one row dict per measurement."""
    timer = _timer(device, reps, warmup)
    rows = []
    for name in masks:
        case = MASKS[name]
        for S in seqlens:
            area = mask_area(*case.slices(S))
            fwd_flops = 4 * area * hq * head_dim
            q = torch.randn(S, hq, head_dim, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(S, hkv, head_dim, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(S, hkv, head_dim, device=device, dtype=dtype, requires_grad=True)
            dout = torch.randn_like(q)
            for impl, (fn, why) in _impls(case, S, hq, hkv, device).items():
                row = dict(mask=name, S=S, impl=impl, fwd_ms=None, fwd_tflops=None, bwd_ms=None,
                           bwd_tflops=None, note=why or "")
                if fn is not None:
                    qd, kd, vd = q.detach(), k.detach(), v.detach()
                    with torch.no_grad():
                        row["fwd_ms"] = timer(lambda: fn(qd, kd, vd))
                    row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
                    try:
                        out = fn(q, k, v)
                        row["bwd_ms"] = timer(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                        row["bwd_tflops"] = 2.5 * fwd_flops / row["bwd_ms"] / 1e9
                    except (NotImplementedError, RuntimeError) as e:
                        row["note"] = f"no backward: {str(e).splitlines()[0][:40]}"
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    def f(x, spec):
        return "n/a" if x is None else format(x, spec)

    head = f"{'mask':<14}{'S':>7}  {'impl':<15}{'fwd ms':>10}{'fwd TF/s':>10}{'bwd ms':>10}{'bwd TF/s':>10}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['mask']:<14}{r['S']:>7}  {r['impl']:<15}{f(r['fwd_ms'], '.3f'):>10}"
                     f"{f(r['fwd_tflops'], '.3g'):>10}{f(r['bwd_ms'], '.3f'):>10}{f(r['bwd_tflops'], '.3g'):>10}"
                     f"  {r['note']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# --static: compiler proxies and plan-stage cost, on CPU

# The full-scan kernels (before the work lists): kernel -> (program block, inner block, warps, stages).
BASELINE_CONFIGS = {"fwd": (128, 64, 8, 2), "dq": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2)}
_BASELINE_NAMES = {"fwd": "_flex_fwd_kernel", "dq": "_flex_bwd_dq_kernel", "dkdv": "_flex_bwd_dkdv_kernel"}
_BASELINE_PTRS = {"fwd": "q k v o lse:f qr:i kr:i type:i", "dq": "q k v do lse:f delta:f dq qr:i kr:i type:i",
                  "dkdv": "q k v do lse:f delta:f dk dv qr:i kr:i type:i"}


def _sm90():
    sys.path.insert(0, str(_ROOT))  # the compile helper the tests use
    from tests._sm90 import compile_sm90

    return compile_sm90


def _baseline_records(ref: str, hq: int, hkv: int, head_dim: int) -> tuple[list[dict], str]:
    """Records of the full-scan kernels of git ``ref`` (its kernel.py copied to a temp module)."""
    src = subprocess.run(["git", "show", f"{ref}:attn_kernels/flex_attn/kernel.py"], cwd=_ROOT, check=True,
                         capture_output=True, text=True).stdout
    folder = tempfile.mkdtemp(prefix="kernel_baseline_")
    Path(folder, "baseline_flex_kernel.py").write_text(src)
    records = []
    for kind, (block, inner, warps, stages) in BASELINE_CONFIGS.items():
        sig, attrs = {}, {}
        for p in _BASELINE_PTRS[kind].split():
            name, _, t = p.partition(":")
            sig["p_" + name] = {"": "*bf16", "f": "*fp32", "i": "*i32"}[t]
            attrs["p_" + name] = [["tt.divisibility", 16]]
        sig.update(Tq="i32", Tk="i32", R="i32", sm_scale="fp32", softcap="fp32")
        attrs.update(Tq=[["tt.divisibility", 16]], Tk=[["tt.divisibility", 16]])
        blocks = dict(BLOCK_Q=inner, BLOCK_K=block) if kind == "dkdv" else dict(BLOCK_Q=block, BLOCK_K=inner)
        const = dict(HQ=hq, HKV=hkv, HEAD_DIM=head_dim, USE_SOFTCAP=False, DOT_PRECISION="tf32", **blocks)
        sig.update({n: "constexpr" for n in const})
        records.append(dict(module="baseline_flex_kernel", name=_BASELINE_NAMES[kind], kind=kind, signature=sig,
                            attrs=attrs, constexprs=const, options=dict(num_warps=warps, num_stages=stages)))
    return records, folder


def compile_rows(baseline: str | None, hq: int = 64, hkv: int = 8, head_dim: int = 128) -> list[dict]:
    """One row per (kernel, config): the launch config, its autotune set and the baseline's config."""
    records, rows, path = [], [], [str(_ROOT)]
    for rec in kernel.gpu_launch_records(8192, hq, hkv, head_dim)[:3]:
        default = (rec["options"], {k: rec["constexprs"][k] for k in ("BLOCK_Q", "BLOCK_K")})
        variants = [default] + [(a["options"], a["constexprs"]) for a in rec["autotune"]
                                if (a["options"], a["constexprs"]) != default]
        for i, (options, blocks) in enumerate(variants):
            records.append(dict(rec, constexprs=dict(rec["constexprs"], **blocks), options=options))
            rows.append(dict(kernel=rec["kind"], version="work list", role="launch" if i == 0 else "autotune"))
    if baseline:
        base, folder = _baseline_records(baseline, hq, hkv, head_dim)
        records += base
        path.append(folder)
        rows += [dict(kernel=r["kind"], version=f"full scan {baseline}", role="launch") for r in base]
    results = _sm90()(records, stats=True, jobs=2, python_path=path)
    for row, rec, res in zip(rows, records, results):
        c, o = rec["constexprs"], rec["options"]
        program, inner = (c["BLOCK_K"], c["BLOCK_Q"]) if row["kernel"] == "dkdv" else (c["BLOCK_Q"], c["BLOCK_K"])
        loops = res.get("mma_loops") or []
        row.update(config=f"{program}x{inner} w{o['num_warps']} s{o['num_stages']}", error=res["error"],
                   regs=res.get("regs"), spills=f"{res.get('spill_stores')}/{res.get('spill_loads')}",
                   stack=res.get("stack"), interior=min(loops) if len(loops) > 1 else None,
                   masked=max(loops) if loops else None)
    return rows


def _blocks(kind: str) -> tuple[int, int]:
    cfg = kernel.GPU_CONFIGS[kind]
    return cfg.block, cfg.inner


def stage_rows(mask_kind: str, cp_size: int, tokens_per_rank: int, hq: int = 64, hkv: int = 8) -> list[dict]:
    """Cost of the heaviest rank's two plan stages: programs, slice visits and inner iterations per kernel.

    A stage runs on group-major rows with Hq/G query heads and Hkv/G KV heads
    per row. Forward and dQ programs are (query head, query block); dK/dV
    programs are (KV head, key block) and loop over the group's query heads.
    The full-scan kernels visited every row of the padded table in every
    program (dK/dV: once per query head).
    """
    from _common import make_mask

    from gpusolver import SolverConfig, solve

    cfg = SolverConfig(cp_size=cp_size, num_heads_q=hq, num_heads_kv=hkv)
    plan = solve(make_mask(mask_kind, cp_size, seed=0, tokens_per_rank=tokens_per_rank), cfg, validate=False)
    G, calc = cfg.head_groups, plan.calc
    heads_q, heads_kv = hq // G, hkv // G
    rows = []
    for stage in (0, 1):
        n = G * plan.comm.chunk + (plan.comm.buffers.largest_recv if stage else 0)
        rects = [worklist.slice_rect(calc.q_ranges[r, stage], calc.k_ranges[r, stage], calc.attn_type[r, stage], n, n)
                 for r in range(cp_size)]
        work = [worklist.inner_iterations(x, 0, n, *_blocks("fwd"))["iterations"] for x in rects]
        r = max(range(cp_size), key=work.__getitem__)
        for kind in ("fwd", "dq", "dkdv"):
            axis, heads, loops = (1, heads_kv, heads_q // heads_kv) if kind == "dkdv" else (0, heads_q, 1)
            block, inner = _blocks(kind)
            old_block, old_inner = BASELINE_CONFIGS[kind][:2]
            new = worklist.inner_iterations(rects[r], axis, n, block, inner)
            old = worklist.inner_iterations(rects[r], axis, n, old_block, old_inner)
            old_programs = heads * -(-n // old_block)
            rows.append(dict(
                mask=mask_kind, P=cp_size, stage=stage, rank=r, rows=n, kernel=kind,
                slices=f"{int(calc.num_rows[r, stage])}/{calc.capacity}",
                programs=heads * -(-n // block), visits=heads * loops * new["visits"],
                iterations=heads * loops * new["iterations"], interior=new["interior"] / max(new["iterations"], 1),
                old_programs=old_programs, old_visits=old_programs * loops * calc.capacity,
                old_iterations=heads * loops * old["iterations"]))
    return rows


_COMPILE_COLUMNS = [("kernel", "kernel", ""), ("version", "version", ""), ("config", "config", ""),
                    ("role", "role", ""), ("registers", "regs", "d"), ("spills st/ld", "spills", ""),
                    ("stack B", "stack", "d"), ("SASS/iter interior", "interior", "d"),
                    ("SASS/iter masked", "masked", "d")]
_STAGE_COLUMNS = [("mask", "mask", ""), ("stage", "stage", "d"), ("kernel", "kernel", ""), ("rows", "rows", "d"),
                  ("slice rows real/capacity", "slices", ""), ("programs", "programs", "d"),
                  ("slice visits", "visits", "d"), ("inner iterations", "iterations", "d"),
                  ("interior share", "interior", ".2f"), ("full-scan programs", "old_programs", "d"),
                  ("full-scan visits", "old_visits", "d"), ("full-scan iterations", "old_iterations", "d")]


def static_report(cp_size: int, tokens_per_rank: int, baseline: str | None, compile_kernels: bool,
                  masks=("causal", "full")) -> tuple[list[dict], list[dict], str]:
    """(compile rows, stage rows, markdown text) of ``--static``."""
    sys.path.insert(0, str(_ROOT / "benchmarks"))  # _common, as the solver benchmarks use it
    from _common import markdown_table

    comp = compile_rows(baseline) if compile_kernels else []
    stages = [row for m in masks for row in stage_rows(m, cp_size, tokens_per_rank)]
    text = []
    if comp:
        text += ["Kernels at their sm_90 launch configs (bf16, D = 128, Hq:Hkv = 64:8; config = program block x "
                 "inner block, warps, stages; SASS/iter = instructions in one pass of the innermost loop):", "",
                 markdown_table(comp, _COMPILE_COLUMNS), ""]
    text += [f"One plan stage of the heaviest rank at P = {cp_size}, {tokens_per_rank} tokens per rank (packed "
             "documents), summed over programs and heads. An inner iteration is one step of the config's tile "
             "(program block x inner block; the full-scan dQ and dK/dV stepped 64 x 64); the interior share is "
             "the iterations that run without a mask:", "", markdown_table(stages, _STAGE_COLUMNS)]
    return comp, stages, "\n".join(text)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32: check the script runs")
    p.add_argument("--static", action="store_true", help="CPU: compiler proxies and plan-stage cost (no GPU)")
    p.add_argument("--cp", type=int, default=64, help="--static: ranks P of the plan stages")
    p.add_argument("--tokens-per-rank", type=int, default=8192, help="--static: tokens per rank")
    p.add_argument("--baseline", default=None, help="--static: git ref of the full-scan kernels to compile too")
    p.add_argument("--no-compile", action="store_true", help="--static: skip the sm_90 compiles")
    p.add_argument("--out", default=None, help="--static: also write the tables to this markdown file")
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384, 65536])
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hkv", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    if a.static:
        comp, stages, text = static_report(a.cp, a.tokens_per_rank, a.baseline, not a.no_compile)
        print(text)
        if a.out:
            Path(a.out).write_text(f"# Slice-attention kernels: static proxies (no GPU)\n\n"
                                   f"`python benchmarks/kernel_bench.py {' '.join(argv or sys.argv[1:])}`\n\n{text}\n")
        return comp + stages
    if a.smoke:
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        device, dtype = torch.device("cpu"), torch.float32
        seqlens, hq, hkv, head_dim, reps, warmup = [128], 2, 1, 32, 1, 0
    else:
        if not torch.cuda.is_available():
            p.error("no GPU found: run with --smoke on CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        seqlens, hq, hkv, head_dim, reps, warmup = a.seqlens, a.hq, a.hkv, a.head_dim, a.reps, a.warmup
    rows = run(a.masks, seqlens, hq, hkv, head_dim, dtype, device, reps, warmup)
    print(f"device={device} dtype={dtype} Hq={hq} Hkv={hkv} D={head_dim}")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
