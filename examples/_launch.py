"""Start an example on P local ranks: under ``torchrun`` (its environment), or forked here.

``launch(fn, P)`` calls ``fn(rank, P)`` on every rank of a gloo group and returns
rank 0's result. Without ``torchrun`` it forks P processes joined over 127.0.0.1
(a CPU run on one machine), each joined with a timeout so a hang is an error.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, P: int, port: int, queue) -> None:
    try:
        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                                timeout=timedelta(seconds=60))
        result = fn(rank, P)
        dist.barrier()  # peers may still be reading what this rank sent
        queue.put((rank, True, result))
    except BaseException:  # reported to the parent, which raises
        queue.put((rank, False, traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # the result is written before the process leaves
        os._exit(0)  # no atexit or process-group teardown can hang a finished rank


def launch(fn, P: int, timeout: float = 300.0):
    """``fn(0, P)``'s result, with ``fn(rank, P)`` run on each of P gloo ranks."""
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        dist.init_process_group("gloo")
        try:
            return fn(dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
    ctx = mp.get_context("fork")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, P, port, queue), daemon=True) for r in range(P)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(P):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
        return results[0]
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
