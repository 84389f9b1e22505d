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
