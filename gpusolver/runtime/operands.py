"""A stage's operands as one tensor per input: ``X = [local rows | receive buffer]``.

The remote stage's attention reads local rows and received rows through one
set of ranges, so both live in one allocation: the local rows are copied in
once, and the casts write into the last ``cap`` rows in place (``group_cast(out=...)``).
Nothing is ever concatenated or copied over, so the local rows and the buffers never
exist twice.
"""
from __future__ import annotations

import torch

__all__ = ["Operands", "rows"]


def rows(x: torch.Tensor, lead: int, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of ``x`` along the row dim ``lead`` (a view)."""
    return x.narrow(lead, start, length)


class Operands:
    """``X`` per tensor of ``local``, with ``cap`` receive rows after the local ones.

    zero: start the receive rows at zero (accumulators, and buffers whose unused rows a
    reduce may read); otherwise they are left uninitialised until a cast fills them.
    """

    def __init__(self, local: list[torch.Tensor], cap: int, lead: int, *, zero: bool = False):
        self.n, self.cap, self.lead = local[0].shape[lead], cap, lead
        self.x = []
        for t in local:
            shape = list(t.shape)
            shape[lead] = self.n + cap
            x = t.new_zeros(shape) if zero else t.new_empty(shape)
            rows(x, lead, 0, self.n).copy_(t)
            self.x.append(x)

    def remote(self) -> list[torch.Tensor]:
        """The receive buffers (views of ``X``'s last ``cap`` rows), what the casts write into."""
        return [rows(x, self.lead, self.n, self.cap) for x in self.x]
