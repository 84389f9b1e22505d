"""What the CPU paths cost against their real work: the attention op's torch twin, the solve's torch path.

``attention``: one ``flex_attn`` forward and backward on CPU (the torch twin,
the op's CPU path) over 10 real slices (causal documents over Tq = Tk = 256
tokens, Hq = 4, Hkv = 2, D = 64, fp32), the slice table padded to 16 rows and
to 4,096 rows. The padding must cost next to nothing: the ratio is the
figure (target <= 1.5).

``solve``: ``gpusolver.solve`` on CPU tensors (the torch path) at the demo's
shape (its mask, heads and buffers) at the given P and tokens per rank: wall
and CPU seconds per solve (CPU time moves less with other load).

Wall times: the attention calls alternate and each side keeps its best of
``--repeats`` (after one warm-up call each); the solve is the median of
``--repeats`` after a warm-up. On this machine's threads (``--threads``), so
they move with other load on the machine.

    python benchmarks/cpu_paths.py                  # both parts
    python benchmarks/cpu_paths.py --part attention
    python benchmarks/cpu_paths.py --part solve --P 4,8 --tokens 128
    python benchmarks/cpu_paths.py --part solve --threads 1 --base /path/to/older/checkout   # before/after
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, run as a script or loaded by path

from _common import parse_list, wall_time  # noqa: E402
from attn_kernels import flex_attn  # noqa: E402

_DOC_BOUNDS = (0, 9, 40, 51, 90, 128, 131, 170, 200, 233, 256)  # 10 causal documents over 256 tokens


def _slices(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 10 documents as causal slices, then ``rows - 10`` padding rows (empty ranges)."""
    b = torch.tensor(_DOC_BOUNDS, dtype=torch.int32)
    real = torch.stack([b[:-1], b[1:]], 1)
    pad = torch.zeros(rows - real.shape[0], 2, dtype=torch.int32)
    qr = torch.cat([real, pad])
    return qr, qr.clone(), torch.ones(rows, dtype=torch.int32)


def attention(repeats: int) -> dict:
    T, HQ, HKV, D = _DOC_BOUNDS[-1], 4, 2, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, H, D, generator=g) for H in (HQ, HKV, HKV))

    def call(rows):
        args = _slices(rows)
        x = [a.clone().requires_grad_() for a in (q, k, v)]

        def fwd_bwd():
            out, lse = flex_attn(*x, *args)
            (out.sum() + lse.sum()).backward()
            return out.detach(), lse.detach(), *(a.grad for a in x)
        return fwd_bwd

    # interleaved, best of the repeats: other load on the machine hits both sides alike
    f16, f4k = call(16), call(4096)
    f16(), f4k()  # warm-up
    t16 = t4k = float("inf")
    for _ in range(repeats):
        a, r16 = wall_time(f16, 1, warmup=0)
        b, r4k = wall_time(f4k, 1, warmup=0)
        t16, t4k = min(t16, a), min(t4k, b)
    # the gradients accumulate over the repeats alike on both sides, so all five outputs compare
    same = all(torch.equal(a, b) for a, b in zip(r16, r4k))
    return dict(t16=t16, t4096=t4k, ratio=t4k / t16, equal=same)


def solve(P: int, tokens: int, repeats: int) -> tuple[float, float, str]:
    """(wall s, CPU s, plan digest) per ``solve`` of the demo's shape (GQA 8:2, D = 32, fp32, its
    buffers) at P; the digest hashes the plan's assignment and status, so two code versions can
    be shown to give the same plan."""
    import hashlib
    import time
    import warnings

    from gpusolver.cli.demo import build_mask
    from gpusolver.config import SolverConfig
    from gpusolver.solve import solve as solve_plan

    G = 2
    cfg = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=G, head_dim=32, dtype=torch.float32,
                       max_recv_rows=min(2 * G * tokens, G * tokens * max(P - 1, 1)), max_stage_slices=16)
    mask = build_mask("docs", P * tokens, 0, device=torch.device("cpu"))
    cpu = []

    def once():
        t0 = time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = solve_plan(mask, cfg, validate=False)
        cpu.append(time.process_time() - t0)
        return plan
    wall, plan = wall_time(once, repeats)
    digest = hashlib.sha256(plan.assignment.to(torch.int32).contiguous().numpy().tobytes())
    digest.update(str(int(plan.status)).encode())
    return wall, sorted(cpu[1:])[len(cpu[1:]) // 2], digest.hexdigest()[:16]


def compare_solve(base: Path, Ps, tokens: int, repeats: int, rounds: int, threads: int | None) -> dict:
    """The solve part run from this tree and from ``base`` (another checkout's root) in alternating
    subprocesses, ``rounds`` times each: per P the best CPU seconds of each side and whether their
    plans are equal. Alternating keeps the machine's other load alike on both sides."""
    import json
    import os
    import subprocess

    here = Path(__file__).resolve()
    out = {}
    for P in Ps:
        best = {"base": float("inf"), "this": float("inf")}
        digests = {}
        for _ in range(rounds):
            for side, root in (("base", base), ("this", here.parents[1])):
                cmd = [sys.executable, str(here), "--part", "solve", "--P", str(P), "--tokens", str(tokens),
                       "--repeats", str(repeats), "--json", *(["--threads", str(threads)] if threads else [])]
                env = dict(os.environ, PYTHONPATH=str(root))
                res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                text=True).stdout.splitlines()[-1])["solve"][str(P)]
                best[side] = min(best[side], res["cpu"])
                digests[side] = res["plan"]
        out[P] = dict(base=best["base"], this=best["this"], ratio=best["this"] / best["base"],
                      same_plan=digests["base"] == digests["this"])
        print(f"solve on CPU (torch path), demo shape, P = {P}, {tokens} tokens/rank: base {best['base'] * 1e3:.0f} ms "
              f"CPU, this tree {best['this'] * 1e3:.0f} ms CPU (best of {rounds} alternating runs of median of "
              f"{repeats}), ratio {out[P]['ratio']:.2f}, same plan: {out[P]['same_plan']}", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("all", "attention", "solve"), default="all")
    ap.add_argument("--P", default="4,8,16", help="solve: comma-separated P")
    ap.add_argument("--tokens", type=int, default=128, help="solve: tokens per rank")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--base", type=Path, default=None,
                    help="solve: also time the root of another checkout (e.g. an older commit), alternating")
    ap.add_argument("--rounds", type=int, default=3, help="--base: alternating runs per side")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = ap.parse_args(argv)
    if args.base is not None:
        return compare_solve(args.base, parse_list(args.P, name="--P"), args.tokens, args.repeats, args.rounds,
                             args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {}
    if args.part in ("all", "attention"):
        a = attention(args.repeats)
        result["attention"] = a
        print(f"flex_attn fwd+bwd on CPU, 10 real slices, T = 256: padded to 16 rows {a['t16'] * 1e3:.1f} ms, "
              f"to 4,096 rows {a['t4096'] * 1e3:.1f} ms, ratio {a['ratio']:.2f} (target <= 1.5), "
              f"outputs equal: {a['equal']}")
    if args.part in ("all", "solve"):
        result["solve"] = {}
        for P in parse_list(args.P, name="--P"):
            wall, cpu, digest = solve(P, args.tokens, args.repeats)
            result["solve"][P] = dict(wall=wall, cpu=cpu, plan=digest)
            print(f"solve on CPU (torch path), the demo's shape and mask, P = {P}, {args.tokens} tokens/rank: "
                  f"{wall * 1e3:.0f} ms wall, {cpu * 1e3:.0f} ms CPU per solve, plan {digest}")
    if args.json:
        import json

        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
