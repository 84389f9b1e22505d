"""The receive rows of every ``Operands`` a layer allocates: X's remote rows, the running out and
the fp32 sums of the pipelined executor (``gpusolver.runtime.operands``).

``record_operand_rows()`` patches the class for good and returns the list it appends to: call it
in a forked rank (``tests._dist.run_ranks``), whose process ends with the rank.
"""
from __future__ import annotations

from gpusolver.runtime import operands


def record_operand_rows() -> list[int]:
    seen: list[int] = []
    init, zeros = operands.Operands.__init__, operands.Operands.zeros.__func__

    def recorded_init(self, local, cap, *args, **kwargs):
        seen.append(cap)
        init(self, local, cap, *args, **kwargs)

    def recorded_zeros(cls, like, cap, *args, **kwargs):
        seen.append(cap)
        return zeros(cls, like, cap, *args, **kwargs)

    operands.Operands.__init__ = recorded_init
    operands.Operands.zeros = classmethod(recorded_zeros)
    return seen
