"""``python -m gpusolver demo``: a few model-like layers over a CP group, each with its own dynamic mask.

A tiny attention-only model (RMS norm, q/k/v projections, ``DynamicCPAttention``,
output projection, residual) runs forward and backward over the CP group.
Every layer draws a fresh mask (packed documents by default: a new
document mix each layer, as a new batch would bring), solves it on the
activations' device and runs ``dist_attn``. The group is ``LocalGroup(P)``
(P simulated ranks in this process), or the real ranks when launched by
``torchrun`` (``WORLD_SIZE`` / ``RANK`` set; NCCL on GPUs, gloo on CPU).

Every layer is checked against single-process dense attention: its q, k, v,
out and gradients are gathered (to rank 0 under torchrun) and compared
with ``attn_kernels.reference.dense_attn`` run on the same inputs. The
bytes the group's counters saw are checked against the plan's volumes.

Shape legend: S = P * c tokens, P ranks, c tokens per rank, Hq / Hkv heads,
D head dim, d = Hq * D model width.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, replace

import torch

from gpusolver.baselines import ring_attention, usp
from gpusolver.cli.args import build_mask
from gpusolver.config import SolverConfig
from gpusolver.plan import BUFFER_OVERFLOW, CALC_OVERFLOW, IMBALANCED, status_names
from gpusolver.solve import solve

FWD_PHASES = ("fwd.qo", "fwd.kv", "fwd.o")
BWD_PHASES = ("bwd.qo", "bwd.q", "bwd.kv", "bwd.dq", "bwd.dkv")
# relative error allowed against the fp64 reference, by activation dtype
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass
class Launch:
    """Where the demo runs: the group, this process's rank (None for LocalGroup), P, device."""

    group: object
    rank: int | None
    P: int
    device: torch.device
    distributed: bool

    @property
    def leader(self) -> bool:
        return self.rank in (None, 0)


@dataclass
class LayerRow:
    layer: int
    slices: int
    solve_ms: float
    imbalance: float
    fwd: int
    bwd: int
    usp_fwd: int
    usp_bwd: int
    ring_fwd: int
    ring_bwd: int
    err_out: float
    err_grad: float
    counters_match: bool
    note: str = ""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(args) -> Launch:
    """LocalGroup(P) in this process, or this rank of a torchrun job."""
    if not under_torchrun():
        from groupcomm import LocalGroup

        device = args.device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        P = 8 if args.cp_size is None else args.cp_size
        return Launch(LocalGroup(P), None, P, device, False)

    import torch.distributed as dist

    from groupcomm import default_group

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if args.cp_size not in (None, world):
        raise SystemExit(f"gpusolver demo: -P {args.cp_size} but torchrun started {world} ranks")
    local = int(os.environ.get("LOCAL_RANK", rank))
    want_cuda = torch.cuda.is_available() if args.device is None else args.device.type == "cuda"
    device = torch.device("cuda", local) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if want_cuda else "gloo")
    return Launch(default_group(), rank, world, device, True)


class TinyModel:
    """Attention-only layers on sequential shards: ``h += attn(rms(h)) @ wo`` (no MLP, no bias).

    Weights are seeded host tensors moved to the device, so every rank holds the same ones.
    """

    def __init__(self, layers: int, Hq: int, Hkv: int, D: int, *, seed: int, device, dtype):
        g = torch.Generator().manual_seed(seed)
        d = Hq * D
        self.Hq, self.Hkv, self.D, self.d = Hq, Hkv, D, d

        def w(n_in, n_out):
            return (torch.randn(n_in, n_out, generator=g) / math.sqrt(n_in)).to(device, dtype)

        self.weights = [(w(d, Hq * D), w(d, Hkv * D), w(d, Hkv * D), w(Hq * D, d)) for _ in range(layers)]

    def layer(self, i: int, h: torch.Tensor, attn, plan):
        """One layer on this rank's shard ``h [.., c, d]``; returns (h, (q, k, v, out)) with grads retained."""
        wq, wk, wv, wo = self.weights[i]
        x = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
        q = (x @ wq).unflatten(-1, (self.Hq, self.D))
        k = (x @ wk).unflatten(-1, (self.Hkv, self.D))
        v = (x @ wv).unflatten(-1, (self.Hkv, self.D))
        out = attn(q, k, v, plan=plan)
        for t in (q, k, v, out):
            t.retain_grad()
        return h + out.flatten(-2) @ wo, (q, k, v, out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _solve(mask, config: SolverConfig, device: torch.device):
    """(plan, ms, note): the timed solve, re-solved with worst-case buffers if the demo's tight ones overflow."""
    _sync(device)
    t0 = time.perf_counter()
    plan = solve(mask, config, validate=False)
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3
    status = int(plan.status.item())  # host read, after the timing: the demo reports every layer
    note = ""
    if status & (CALC_OVERFLOW | BUFFER_OVERFLOW):
        wide = replace(config, max_recv_rows=None, max_stage_slices=None)
        plan = solve(mask, wide, validate=False)
        status, note = int(plan.status.item()), "worst-case buffers"
    bad = status & ~IMBALANCED
    if bad:
        raise RuntimeError(f"the plan is not usable ({' | '.join(status_names(bad))}):\n{plan.summary()}")
    return plan, ms, note


def _gather(x: torch.Tensor, run: Launch) -> torch.Tensor:
    from gpusolver.runtime import unshard

    return unshard(x.detach().contiguous(), run.group)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got.double() - want.double()).abs().max().item() / max(scale, 1e-12)


def _check_layer(mask, run: Launch, tensors) -> tuple[float, float]:
    """(out error, gradient error) of one layer against dense fp64 attention, relative to the largest
    reference value; computed on the leader (every rank takes part in the gathers)."""
    from attn_kernels.reference import dense_attn

    q, k, v, out = tensors
    gathered = [_gather(t, run) for t in (q, k, v, out, out.grad, q.grad, k.grad, v.grad)]
    if not run.leader:
        return math.nan, math.nan
    qg, kg, vg, og, d_out, dq, dk, dv = gathered
    qq, kk, vv = (t.double().requires_grad_() for t in (qg, kg, vg))
    ref_out, _ = dense_attn(qq, kk, vv, mask.to_dense().to(qq.device))  # the dense mask is built on the host
    rq, rk, rv = torch.autograd.grad(ref_out, (qq, kk, vv), d_out.double())
    err_grad = max(_rel_err(dq, rq), _rel_err(dk, rk), _rel_err(dv, rv))
    return _rel_err(og, ref_out), err_grad


def _counted(run: Launch, phases) -> tuple[torch.Tensor, torch.Tensor]:
    """(sent, recv) bytes the group's counters saw in ``phases``: ``[P]`` (LocalGroup) or this rank's."""
    sent = recv = 0
    for ph in phases:
        s, r = run.group.traffic(ph)
        sent, recv = sent + torch.as_tensor(s).cpu(), recv + torch.as_tensor(r).cpu()
    return torch.as_tensor(sent), torch.as_tensor(recv)


def _phases_match(run: Launch, phases, sent_want, recv_want) -> bool:
    """The bytes the group's counters saw in ``phases`` equal ``sent_want`` / ``recv_want`` (``[P]``
    lists from the plans), on every rank."""
    sent, recv = _counted(run, phases)
    want_s, want_r = torch.tensor(sent_want), torch.tensor(recv_want)
    if run.rank is not None:
        want_s, want_r = want_s[run.rank], want_r[run.rank]
    ok = torch.equal(sent.long(), want_s) and torch.equal(recv.long(), want_r)
    if run.distributed:
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], device=run.device if run.device.type == "cuda" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    return ok


def _kib(n: int) -> str:
    return f"{n / 1024:.0f}"


def _pct(a: int, b: int) -> str:
    return f"{100.0 * (a / b - 1):+.0f} %" if b else "n/a"


def _err(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1e}"


def format_table(rows: list[LayerRow]) -> str:
    # step = fwd + bwd: the bytes a training step waits for, what the solver minimises by default
    lines = ["| layer | slices | solve ms | imbalance | fwd KiB | fwd vs USP | fwd vs ring | bwd KiB | bwd vs USP "
             "| bwd vs ring | step KiB | step vs USP | step vs ring | out err | grad err | bytes = plan |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        note = f" ({r.note})" if r.note else ""
        lines.append(f"| {r.layer} | {r.slices} | {r.solve_ms:.1f}{note} | {r.imbalance:.3f} | {_kib(r.fwd)} | "
                     f"{_pct(r.fwd, r.usp_fwd)} | {_pct(r.fwd, r.ring_fwd)} | {_kib(r.bwd)} | "
                     f"{_pct(r.bwd, r.usp_bwd)} | {_pct(r.bwd, r.ring_bwd)} | {_kib(r.fwd + r.bwd)} | "
                     f"{_pct(r.fwd + r.bwd, r.usp_fwd + r.usp_bwd)} | {_pct(r.fwd + r.bwd, r.ring_fwd + r.ring_bwd)} | "
                     f"{_err(r.err_out)} | {_err(r.err_grad)} | "
                     f"{'yes' if r.counters_match else 'NO'} |")
    return "\n".join(lines)


def _progress(n: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a declared dependency; a bare environment still runs the demo
        return range(n)
    return tqdm(range(n), desc="layers", unit="layer", disable=not enabled, leave=False)


class _Passes:
    """Forward and backward over every layer, from the same inputs each time."""

    def __init__(self, model, attn, masks, config, run_: Launch, h0, target):
        self.model, self.attn, self.masks, self.config, self.run_ = model, attn, masks, config, run_
        self.h0, self.target = h0, target

    def run(self, *, checks: bool, progress: bool):
        """(layers, backward bytes match, seconds). ``checks``: time each solve, read each plan's status
        and the group's byte counters (host reads); without, the layers alone, as a profile should see them."""
        from gpusolver.runtime import shard
        from gpusolver.runtime.pipelined import counter_phases

        run_, device = self.run_, self.run_.device
        h = shard(self.h0, run_.group).requires_grad_()
        layers, bwd_sent, bwd_recv = [], None, None
        t_start = time.perf_counter()
        for i in _progress(len(self.masks), progress):
            if checks:
                plan, ms, note = _solve(self.masks[i], self.config, device)
                run_.group.reset_traffic()
            else:
                plan, ms, note = solve(self.masks[i], self.config, validate=False), math.nan, ""
            h, tensors = self.model.layer(i, h, self.attn, plan)
            fwd_ok = True
            if checks:
                m = plan.metrics.to_dict()
                fwd_ok = _phases_match(run_, counter_phases(FWD_PHASES, plan.comm.num_stages), m["fwd_send"],
                                       m["fwd_recv"])
                # the backward the layer runs: the metrics price a buffer kept in part (the memory
                # budget's) as kept, the plan's pair bytes count the rows it casts again
                bwd = plan.pair_bytes("bwd")
                sent_, recv_ = bwd.sum(1).tolist(), bwd.sum(0).tolist()
                bwd_sent = sent_ if bwd_sent is None else [a + b for a, b in zip(bwd_sent, sent_)]
                bwd_recv = recv_ if bwd_recv is None else [a + b for a, b in zip(bwd_recv, recv_)]
            layers.append((plan, ms, note, tensors, fwd_ok))
        loss = (h * shard(self.target, run_.group)).float().sum()
        if checks:
            run_.group.reset_traffic()
        loss.backward()
        _sync(device)
        seconds = time.perf_counter() - t_start
        # one backward runs every layer: its counters are checked against the plans' summed volumes
        stages = {plan.comm.num_stages for plan, *_ in layers}
        bwd_phases = sorted({ph for S in stages for ph in counter_phases(BWD_PHASES, S)})
        bwd_ok = _phases_match(run_, bwd_phases, bwd_sent, bwd_recv) if checks else True
        return layers, bwd_ok, seconds


def _profiled_pass(passes: _Passes, device: torch.device, say) -> None:
    """Two more passes with the NVTX ranges on, the second between cudaProfilerStart / Stop
    (``nsys profile --capture-range=cudaProfilerApi``): the first compiles what the ranges add."""
    from gpusolver import nvtx

    prev = nvtx.set_enabled(True)
    try:
        passes.run(checks=False, progress=False)
        if device.type == "cuda":
            torch.cuda.profiler.start()
        _, _, seconds = passes.run(checks=False, progress=False)
        if device.type == "cuda":
            torch.cuda.profiler.stop()
    finally:
        nvtx.set_enabled(prev)
    say(f"profiled pass (NVTX ranges on, no host reads between layers): {seconds * 1e3:.1f} ms")


def demo_config(args, P: int, c: int) -> SolverConfig:
    """The solver config of the demo: the CLI's shapes, and receive buffers of two chunks' rows
    per kind instead of the worst case ``G * c * (P - 1)`` (on CPU the attention twin's cost grows
    with the buffer rows; a plan that needs more is re-solved with the worst case)."""
    hq, hkv = args.heads
    G = hkv
    return SolverConfig(cp_size=P, num_heads_q=hq, num_heads_kv=hkv, head_dim=args.head_dim, dtype=args.dtype,
                        max_recv_rows=min(2 * G * c, G * c * max(P - 1, 1)), max_stage_slices=16)


def run(args) -> int:
    """The demo; returns the exit status (0 when every layer matches the reference)."""
    torch.set_num_threads(1)  # many small ops: extra threads only add overhead on CPU (and under torchrun)
    run_ = launch(args)
    P, c, device, dtype = run_.P, args.tokens_per_rank, run_.device, args.dtype
    S = P * c
    config = demo_config(args, P, c)
    from gpusolver.runtime import DynamicCPAttention, PlanCache

    attn = DynamicCPAttention(run_.group, config, plan_cache=PlanCache())
    model = TinyModel(args.layers, config.num_heads_q, config.num_heads_kv, config.head_dim, seed=args.seed,
                      device=device, dtype=dtype)
    g = torch.Generator().manual_seed(args.seed + 1)
    h0 = torch.randn(S, model.d, generator=g).to(device, dtype)
    target = torch.randn(S, model.d, generator=g).to(device, dtype)
    where = (f"LocalGroup({P}) in one process" if run_.rank is None else
             f"{P} ranks under torchrun ({type(run_.group).__name__})")
    say = print if run_.leader else (lambda *a, **k: None)
    say(f"gpusolver demo: {args.layers} layers, mask '{args.mask}' (a fresh one per layer), S = {S} tokens "
        f"({c} per rank), P = {P} on {where}, device {device}, Hq:Hkv = {config.num_heads_q}:{config.num_heads_kv}, "
        f"D = {config.head_dim}, {str(dtype).replace('torch.', '')}")

    masks = [build_mask(args.mask, S, args.seed + i, device=device) for i in range(args.layers)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # imbalance is reported in the table, not warned
        # warm-up: first-call costs (kernel compiles) stay out of the table; the CPU torch path
        # compiles nothing, so there a warm-up solve would only repeat a layer's work
        warm = device.type != "cpu"
        if warm:
            _solve(masks[0], config, device)
        dims = dict(seqlen=S, cp_size=P, num_heads_q=config.num_heads_q, num_heads_kv=config.num_heads_kv,
                    head_dim=config.head_dim, dtype_bytes=config.dtype_bytes)
        base_usp, base_ring = usp(**dims), ring_attention(**dims)
        passes = _Passes(model, attn, masks, config, run_, h0, target)
        layers, bwd_ok, seconds = passes.run(checks=True, progress=run_.leader)
        rows = []
        for i, (plan, ms, note, tensors, fwd_ok) in enumerate(layers):
            err_out, err_grad = _check_layer(masks[i], run_, tensors) if args.check else (math.nan, math.nan)
            m = plan.metrics
            rows.append(LayerRow(i, int(masks[i].q_ranges.shape[-2]), ms, float(m.imbalance.item()),
                                 int(m.fwd_bottleneck.item()), int(m.bwd_bottleneck.item()),
                                 base_usp.fwd_bottleneck, base_usp.bwd_bottleneck,
                                 base_ring.fwd_bottleneck, base_ring.bwd_bottleneck, err_out, err_grad,
                                 fwd_ok and bwd_ok, note))
    plans = [entry[0] for entry in layers]
    status = 0
    if run_.leader:
        tol = TOLERANCE.get(dtype, 5e-2)
        print(format_table(rows))
        after = "after one warm-up solve" if warm else "with no warm-up: nothing compiles on CPU"
        print(f"\n{args.layers} layers forward + backward in {seconds:.1f} s (solve ms {after}; "
              f"errors relative to the largest fp64 reference value, tolerance {tol:g}).")
        print("Bytes are this toy shape's bottleneck per rank (the busiest rank's max of send and receive); "
              "USP and ring move whole chunks whatever the mask. "
              "The figures at real shapes (8K tokens per rank, 64:8 heads, D = 128, bf16, P = 8..64) come from "
              "the benchmarks: python -m gpusolver bench, benchmarks/results/.")
        if args.out:
            from gpusolver.viz import draw_plan

            draw_plan(plans[-1], config, args.out, title=f"demo layer {args.layers - 1}: mask '{args.mask}', "
                                                      f"P={P}, S={S}")
            print(f"picture of the last layer's plan: {args.out}")
        bad = [r.layer for r in rows if not r.counters_match or
               (args.check and not (r.err_out <= tol and r.err_grad <= tol))]
        if bad:
            print(f"FAILED: layers {bad} differ from the reference or moved other bytes than their plan")
            status = 1
        else:
            print(("every layer matches the single-process reference, and " if args.check else
                   "(no reference check) ") + "the group moved exactly the plans' bytes")
    if args.profile:
        _profiled_pass(passes, device, say)
    return status
