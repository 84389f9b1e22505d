"""Run a function on P forked ranks joined by a gloo process group on 127.0.0.1.

``run_ranks(fn, P, *args)`` forks P processes, initialises gloo with a free
port, calls ``fn(rank, P, *args)`` in each and returns the ranks' results in
rank order. A child's exception is raised in the parent with its rank (or
returned, with ``return_exceptions=True``). Every child is joined with a
timeout and killed if it hangs, so a test never blocks.

Children report through files (``torch.save``). A rank that succeeded waits
until every rank has reported (its peers may still be reading what it sent);
a rank that failed leaves at once, as a crashed process would. Children
leave with ``os._exit``, so no atexit or process-group teardown can hang.
Forked children set one torch thread first: the parent's OpenMP pool does
not survive a fork.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _portable(e: BaseException) -> BaseException:
    """The exception itself if it pickles, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _child(fn, rank: int, P: int, port: int, args, folder: str, pg_timeout: timedelta, release,
           timeout: float) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                                timeout=pg_timeout)
        report = {"ok": True, "result": fn(rank, P, *args)}
    except BaseException as e:  # reported to the parent, which decides
        report = {"ok": False, "error": _portable(e), "traceback": traceback.format_exc()}
    path = os.path.join(folder, f"rank{rank}.pt")
    try:
        try:
            torch.save(report, path + ".tmp")
        except Exception as e:  # an unpicklable result
            report = {"ok": False, "error": RuntimeError(f"result of rank {rank} does not pickle: {e}"),
                      "traceback": traceback.format_exc()}
            torch.save(report, path + ".tmp")
        os.replace(path + ".tmp", path)
        if report["ok"]:
            # stay until every rank has reported: peers may still read what this rank sent.
            # A failed rank leaves at once, as a crashed process would.
            release.wait(timeout)
    finally:
        os._exit(0)


def run_ranks(fn, P: int, *args, timeout: float = 60.0, pg_timeout: timedelta = timedelta(seconds=30),
              return_exceptions: bool = False) -> list:
    """``[fn(0, P, *args), ..., fn(P-1, P, *args)]``, each run in its own forked gloo rank.

    timeout: seconds for all ranks together; hung ranks are killed and a
    TimeoutError names them. pg_timeout: the process group's own timeout.
    return_exceptions: return a failed rank's exception instead of raising.
    """
    ctx = mp.get_context("fork")
    folder = tempfile.mkdtemp(prefix="ranks")
    port = free_port()
    release = ctx.Event()
    procs = [ctx.Process(target=_child, args=(fn, r, P, port, args, folder, pg_timeout, release, timeout),
                         daemon=True) for r in range(P)]
    paths = [os.path.join(folder, f"rank{r}.pt") for r in range(P)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(os.path.exists(path) or not p.is_alive() for path, p in zip(paths, procs)):
                break
            time.sleep(0.01)
        release.set()
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        if hung:
            raise TimeoutError(f"ranks {hung} of {P} did not finish within {timeout} s")
        results, failed = [], []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited (code {procs[r].exitcode}) without reporting a result")
            report = torch.load(path, weights_only=False)
            results.append(report["result"] if report["ok"] else report["error"])
            if not report["ok"]:
                failed.append((r, report))
        if failed and not return_exceptions:
            # every failing rank is listed: the first in rank order is often only a victim of another
            lines = [f"rank {r} failed: {rep['error']!r}"[:400] for r, rep in failed]
            details = "\n".join(f"--- rank {r} ---\n{rep['traceback'][-2000:]}" for r, rep in failed)
            raise RuntimeError("\n".join(lines) + "\n" + details) from failed[0][1]["error"]
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(folder, ignore_errors=True)
