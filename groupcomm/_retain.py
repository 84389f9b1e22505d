"""Python keeps the tensors of the last few ``torch.distributed`` collectives.

A gloo collective runs on the process group's worker threads, whose handle
holds its input and output tensors. When Python drops its references first,
each tensor's Python object is kept alive by that handle and freed later on
the worker thread, which must take the GIL to do it. When that happens
while the interpreter shuts down (a run's last collectives, then exit), the
thread cannot take the GIL and the process aborts ("terminate called without
an active exception"), after every step went well. Holding the tensors of the
last ``RECENT`` collectives here means the worker drops only a C++ reference;
Python frees them later, on its own thread. Only CPU tensors are held (gloo):
NCCL buffers are device memory a model may need back at once.
"""
from __future__ import annotations

from collections import deque

import torch

RECENT = 8  # collectives whose tensors stay referenced (at most two are in flight at once)

_held: deque = deque(maxlen=RECENT)


def retain(*tensors: torch.Tensor) -> None:
    """Keep the exact tensor objects handed to one collective (its views too: each is its own object)."""
    kept = tuple(t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu")
    if kept:
        _held.append(kept)


def held() -> int:
    """How many collectives' tensors are held now."""
    return len(_held)


def release() -> None:
    """Drop every held tensor (call once no collective can be in flight, e.g. after destroy_process_group)."""
    _held.clear()
