"""What every backend shares: the error type, the async handle, byte counters."""
from __future__ import annotations

from typing import Callable

import torch


class CollectiveError(RuntimeError):
    """A collective that could not complete (a peer failed or the timeout passed).

    The message names the rank and the phase; raised instead of hanging.
    """


class Work:
    """Result of a call with ``async_op=True``: ``wait()`` returns the tensors.

    ``finish`` runs at the first ``wait()`` (it waits for the collective and
    unpacks or reduces the rows); later calls return the same result.
    """

    def __init__(self, finish: Callable[[], list[torch.Tensor]]):
        self._finish = finish
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            self._result = self._finish()
            self._finish = None
        return self._result

    @staticmethod
    def done(result: list[torch.Tensor]) -> "Work":
        return Work(lambda: result)


class HostTraffic:
    """Per-phase (sent, recv) byte counts of one rank, as host ints."""

    def __init__(self):
        self._bytes: dict[str, list[int]] = {}

    def add(self, phase: str, sent: int, recv: int) -> None:
        entry = self._bytes.setdefault(phase, [0, 0])
        entry[0] += int(sent)
        entry[1] += int(recv)

    def get(self, phase: str) -> tuple[int, int]:
        sent, recv = self._bytes.get(phase, (0, 0))
        return sent, recv

    def reset(self) -> None:
        self._bytes.clear()


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """``mask [B, N]`` bool -> ``[B, 1]`` int64: the first True position of each row, 0 when none
    (what ``mask.to(torch.int8).argmax(1, keepdim=True)`` gives in eager).

    A min over int64 positions rather than that argmax: inductor's CPU code for a vectorized
    int8/uint8 argmax reduces more value lanes than it has index lanes, so a row with no True
    (all values tied) can return an uninitialized index (upstream fix open: pytorch/pytorch#191543),
    which the gather after it then reads out of bounds. int64 lanes match the index lanes.
    """
    B, N = mask.shape
    if N == 0:
        return torch.zeros(B, 1, dtype=torch.int64, device=mask.device)
    pos = torch.arange(N, device=mask.device)
    first = torch.where(mask, pos, N).amin(1, keepdim=True)            # N when none
    return first.masked_fill(first == N, 0)


# Sync-free backends cannot raise on a bad routing value without a host read: they flag it
# through a sink that ``gpusolver.errors`` installs (this package imports nothing of ours).
_error_sink = None


def set_error_sink(sink) -> None:
    """``sink(op, argument, message, bad, values)`` receives the device-side routing checks."""
    global _error_sink
    _error_sink = sink


_ROUTING_ARGS = ("split", "split", "split", "send_index")


def _routing_message(row: int, values: list[int]) -> str:
    """values = (check, rank, count, limit); ``row`` is the rank (or the flat send position)."""
    check, rank, count, limit = values[:4]
    if check == 0:
        return f"split has a negative entry {count} in row {rank}"
    if check == 1:
        return (f"split column {rank} sends {count} rows to rank {rank}, more than recv_capacity {limit} "
                "(the rows past it are dropped)")
    if check == 2:
        return f"split row {rank} sends {count} rows, more than send_index holds ({limit})"
    return f"send_index of rank {rank} holds {count}, outside [-1, {limit}) (the local rows)"


def flag_routing(op: str, phase: str, split: torch.Tensor, send_index: torch.Tensor, n_rows: int,
                 capacity: int, ranks: torch.Tensor, recv_offset: torch.Tensor | None = None) -> None:
    """Device flags for a routing the collective cannot honour (no host read).

    split ``[P, P]``; send_index ``[B, C]`` of the B ranks ``ranks [B]`` run
    here; n_rows: local rows N; capacity: rows of each receive buffer;
    recv_offset: ``[P]`` first receive row of the call on each rank (default 0).
    """
    if _error_sink is None:
        return
    B, C = send_index.shape
    own = split.index_select(0, ranks)                                    # [B, P]
    recv = split.sum(0).index_select(0, ranks)                            # [B] last row filled, plus 1
    if recv_offset is not None:
        recv = recv + recv_offset.index_select(0, ranks)
    sent = own.sum(1)
    neg = own.amin(1)
    idx_bad = (send_index < -1) | (send_index >= n_rows)
    idx_val = torch.where(idx_bad, send_index, torch.zeros_like(send_index)).gather(
        1, first_true(idx_bad))[:, 0]
    checks = torch.stack([neg < 0, recv > capacity, sent > C, idx_bad.any(1)], 1)   # [B, 4]
    count = torch.stack([neg, recv, sent, idx_val], 1)
    limit = torch.stack([torch.full((B,), v, dtype=torch.int64, device=split.device)
                         for v in (0, capacity, C, n_rows)], 1)
    which = first_true(checks)                                            # first failing check per rank
    values = torch.cat([which, ranks[:, None], count.gather(1, which), limit.gather(1, which)], 1)
    _error_sink(f"{op} ({phase})", "split/send_index", _routing_message, checks.any(1), values)
