"""A stage's operands as one tensor per input: ``X = [local rows | receive buffer]``.

The remote stage's attention reads local rows and received rows through one
set of ranges, so both live in one allocation: the local rows are copied in
once, and the casts write into the last ``cap`` rows in place (``group_cast(out=...)``).
Nothing is ever concatenated or copied over, so the local rows and the buffers never
exist twice. A shard in the natural token layout is written group-major straight into
its local rows (``groups``): its group-major copy (``layout.to_group_major``) is never made.
"""
from __future__ import annotations

import torch

__all__ = ["Operands", "rows", "row_windows"]

# A window of fewer elements saves less memory than its ops cost (launches on a GPU, graph nodes
# under torch.compile): smaller row sets go in fewer windows, down to one.
WINDOW_MIN_ELEMENTS = 1 << 18


def rows(x: torch.Tensor, lead: int, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of ``x`` along the row dim ``lead`` (a view)."""
    return x.narrow(lead, start, length)


def row_windows(total: int, row_elements: int, pieces: int, least_elements: int) -> list[tuple[int, int]]:
    """(start, width) of at most ``pieces`` windows covering ``total`` rows of ``row_elements``
    elements each, each window at least ``least_elements`` elements (but one row): a windowed
    gather's temporary is a window of rows, never all of them."""
    least = -(-least_elements // max(1, row_elements))
    step = max(1, least, -(-total // pieces))
    return [(start, min(step, total - start)) for start in range(0, total, step)]


class Operands:
    """``X`` per tensor of ``local``, with ``cap`` receive rows after the local ones.

    zero: start the receive rows at zero (accumulators, and buffers whose unused rows a
    reduce may read); otherwise they are left uninitialised until a cast fills them.
    groups: one int per tensor of ``local`` (or one for all): G > 1 takes that tensor in the
    natural layout ``[*lead, c, H, *tail]`` and writes it as its G * c group-major rows
    ``[*lead, G * c, H / G, *tail]`` (``layout.to_group_major``'s rows, without its copy);
    1 (default): the tensor is rows already.
    dtype: X's dtype (default: each tensor's own); the local rows are converted as they are
    copied in, with no converted copy of them beside X.
    """

    def __init__(self, local: list[torch.Tensor], cap: int, lead: int, *, zero: bool = False,
                 groups: int | tuple[int, ...] = 1, dtype: torch.dtype | None = None):
        groups = (groups,) * len(local) if isinstance(groups, int) else tuple(groups)
        self.n, self.cap, self.lead = local[0].shape[lead] * groups[0], cap, lead
        self.x = []
        for t, g in zip(local, groups):
            pre, tail = list(t.shape[:lead]), list(t.shape[lead + 2 if g > 1 else lead + 1:])
            heads = [t.shape[lead + 1] // g] if g > 1 else []
            x = (t.new_zeros if zero else t.new_empty)(pre + [self.n + cap] + heads + tail, dtype=dtype or t.dtype)
            local_rows = rows(x, lead, 0, self.n)
            if g > 1:  # rows g * c + i <- token i's heads of group g: a strided copy, no temporary
                c = t.shape[lead]
                src = t.unflatten(lead + 1, (g, heads[0])).transpose(lead, lead + 1)
                local_rows.unflatten(lead, (g, c)).copy_(src)
            else:
                local_rows.copy_(t)
            self.x.append(x)

    @classmethod
    def zeros(cls, like: list[torch.Tensor], cap: int, lead: int, dtype: torch.dtype) -> "Operands":
        """``X`` of zeros in ``dtype``, shaped as ``like``'s rows plus ``cap`` (accumulators: no
        zero local rows are made to be copied in)."""
        ops = object.__new__(cls)
        ops.n, ops.cap, ops.lead = like[0].shape[lead], cap, lead
        ops.x = [t.new_zeros((*t.shape[:lead], ops.n + cap, *t.shape[lead + 1:]), dtype=dtype) for t in like]
        return ops

    def join(self, other: "Operands") -> "Operands":
        """One ``Operands`` of this one's tensors then ``other``'s (the same rows: n, cap, lead)."""
        if (other.n, other.cap, other.lead) != (self.n, self.cap, self.lead):
            raise ValueError(f"Operands.join: rows (n, cap, lead) {(self.n, self.cap, self.lead)} and "
                             f"{(other.n, other.cap, other.lead)} differ")
        joined = object.__new__(Operands)
        joined.n, joined.cap, joined.lead, joined.x = self.n, self.cap, self.lead, self.x + other.x
        return joined

    def local(self) -> list[torch.Tensor]:
        """The local rows (views of ``X``'s first ``n`` rows)."""
        return [rows(x, self.lead, 0, self.n) for x in self.x]

    def remote(self) -> list[torch.Tensor]:
        """The receive buffers (views of ``X``'s last ``cap`` rows), what the casts write into."""
        return [rows(x, self.lead, self.n, self.cap) for x in self.x]
