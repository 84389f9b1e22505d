"""Slice-attention kernel benchmark: forward / backward TFLOP/s next to SDPA (flash) and FlexAttention.

Registry of masks (each: slices for ``flex_attn``, a FlexAttention mask_mod,
whether SDPA can express it) and one runner. FLOPs count the mask area only:

    forward  = 4 * area * Hq * D      (QK^T and PV, 2 FLOPs per multiply-add)
    backward = 2.5 * forward          (QK^T recompute, dV, dP, dQ, dK)

so every implementation is charged the same useful work and a sparser mask is
not rewarded for skipping blocks. Timing: warm-up, then each repetition after
zeroing a 256 MiB buffer (flushes L2), CUDA events.

    python benchmarks/kernel_bench.py                     # GPU: 4K-64K tokens, D=128, bf16
    python benchmarks/kernel_bench.py --seqlens 8192 --masks causal
    python benchmarks/kernel_bench.py --smoke             # CPU: tiny shapes, fp32, checks it runs
"""
from __future__ import annotations

import argparse
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from attn_kernels import flex_attn


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


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32: check the script runs")
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384, 65536])
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hkv", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
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
