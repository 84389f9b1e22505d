"""Exit-status stress test: a small model trained over 4 gloo ranks, many times; counts bad exits.

Each run starts P ranks (env:// rendezvous on 127.0.0.1, as torchrun does):
forked from this process once torch is imported (``--start fork``, the
default: no import per rank), or fresh interpreters (``--start exec``, as
torchrun starts them). Either way a rank ends through a normal interpreter
exit (atexit, garbage collection, module teardown), never ``os._exit``. Each rank builds a two-layer model with
``DynamicCPAttention`` over ``default_group()``, trains a few steps on new
packed-document masks (forward, backward, optimizer step), checks the
device error flags, calls ``destroy_process_group()`` and leaves through a
normal interpreter exit, where an abort at teardown would show. The parent
counts the runs in which any rank exited with a status other than 0 and
prints the tail of a failed rank's stderr.

    python scripts/stress_gloo.py --runs 100 --ranks 4

Not part of ``make test``: it takes minutes (each run imports torch P times).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_main(steps: int, solver: str = "device") -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    from gpusolver import SolverConfig, check_errors
    from gpusolver.masks import varlen_causal_mask
    from gpusolver.runtime import DynamicCPAttention
    from groupcomm import default_group

    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    c, hidden, Hq, Hkv, D = 16, 32, 2, 1, 16
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32)
    group = default_group()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(hidden, (Hq + 2 * Hkv) * D, bias=False)
            self.out = nn.Linear(Hq * D, hidden, bias=False)
            self.attn = DynamicCPAttention(group, config, solver=solver)

        def forward(self, x, mask):
            q, k, v = self.qkv(x).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            o = self.attn(q.unflatten(-1, (Hq, D)), k.unflatten(-1, (Hkv, D)), v.unflatten(-1, (Hkv, D)), mask)
            return x + self.out(o.flatten(-2))

    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(Block(), Block())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    S = P * c
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        cuts = sorted(set(torch.randint(1, S, (3,), generator=g).tolist()))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, S]) if b > a]
        mask = varlen_causal_mask(lengths, pad_to=4)
        x = torch.randn(S, hidden, generator=g)[rank * c:(rank + 1) * c]
        y = x
        for block in model:
            y = block(y, mask)
        loss = y.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    check_errors()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(r: int, ranks: int, port: int) -> dict:
    return dict(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def _fork_run(ranks: int, steps: int, timeout: float, solver: str) -> tuple[list[int | None], list[str]]:
    """P forked ranks; each child returns to ``main`` and exits the interpreter normally."""
    port = _free_port()
    pids, logs = [], []
    for r in range(ranks):
        log = f"/tmp/stress_gloo_{os.getpid()}_{r}.err"
        pid = os.fork()
        if pid == 0:
            os.environ.update(_env(r, ranks, port))
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            raise _Child(steps)
        pids.append(pid)
        logs.append(log)
    deadline = time.time() + timeout
    codes = [None] * ranks
    while time.time() < deadline and any(c is None for c in codes):
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for i, pid in enumerate(pids):
        if codes[i] is None:  # hung: killed, reported as None
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    errs = []
    for log in logs:
        with open(log) as f:
            errs.append(f.read())
        os.remove(log)
    return codes, errs


class _Child(BaseException):
    """Raised in a forked child: unwinds to ``main``, which runs the rank and returns its status."""

    def __init__(self, steps: int):
        self.steps = steps


def _exec_run(ranks: int, steps: int, timeout: float, solver: str) -> tuple[list[int | None], list[str]]:
    port = _free_port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, **_env(r, ranks, port),
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", "--steps", str(steps),
                                       "--solver", solver], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.time() + timeout
    codes, errs = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.time()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            codes.append(None)  # hung
        errs.append(err)
    return codes, errs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run before its ranks are killed")
    ap.add_argument("--solver", choices=("device", "reference"), default="device",
                    help="the plans' solver (reference: the CPU one, faster here)")
    ap.add_argument("--start", choices=("fork", "exec"), default="fork",
                    help="fork ranks from this process (default) or start fresh interpreters")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_main:
        _rank_main(args.steps, args.solver)
        return 0
    if args.start == "fork":
        import torch  # imported once, before any fork; one thread: an OpenMP pool does not survive a fork
        torch.set_num_threads(1)
        import gpusolver.runtime  # noqa: F401
    bad = 0
    start = time.time()
    for run in range(args.runs):
        try:
            codes, errs = (_fork_run if args.start == "fork" else _exec_run)(args.ranks, args.steps, args.timeout,
                                                                                  args.solver)
        except _Child as child:  # this is a forked rank: run it, then leave through the normal exit
            _rank_main(child.steps, args.solver)
            return 0
        if any(code != 0 for code in codes):
            bad += 1
            worst = next(i for i, code in enumerate(codes) if code != 0)
            tail = "\n".join(errs[worst].strip().splitlines()[-8:])
            print(f"run {run}: exit codes {codes}; rank {worst} stderr tail:\n{tail}", flush=True)
        if (run + 1) % 10 == 0:
            print(f"{run + 1} runs, {bad} with a rank exiting != 0 ({time.time() - start:.0f} s)", flush=True)
    print(f"stress_gloo: {args.runs} runs of {args.ranks} gloo ranks x {args.steps} steps: "
          f"{bad} runs with a rank exiting != 0, {args.runs - bad} clean")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
