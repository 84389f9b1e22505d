"""The receive rows of every ``Operands`` a layer allocates: X's remote rows, the running out and
the fp32 sums of the pipelined executor (``gpusolver.runtime.operands``); and of every cast the
one-remote-stage executor starts (``record_cast_rows``).

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


def record_cast_rows() -> list[int]:
    """The receive rows (``recv_capacity``) of every cast ``dist_attn``'s one-remote-stage executor
    starts (``runtime.dist_attn.issue``: its buffers, or new ones the group makes). Patched for good,
    as ``record_operand_rows``."""
    import importlib

    dist_attn = importlib.import_module("gpusolver.runtime.dist_attn")  # the module, not the function
    seen: list[int] = []
    cast = dist_attn.group_cast

    def recorded(tensors, send_index, split, recv_capacity, *args, **kwargs):
        seen.append(recv_capacity)
        return cast(tensors, send_index, split, recv_capacity, *args, **kwargs)

    dist_attn.group_cast = recorded
    return seen
