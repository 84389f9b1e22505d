"""Several row tensors travel as one: each row becomes bytes, rows are concatenated.

A tensor ``[*lead, n, *f]`` of any dtype is viewed as ``[*lead, n, bytes(f)]``
uint8; the packed row is the concatenation over tensors, in call order.
Unpacking slices the byte columns back and views them as the original dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class RowLayout:
    """dtype, trailing shape and byte width of each packed tensor, in order."""
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    widths: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return sum(self.widths)


def row_layout(tensors: list[torch.Tensor], lead: int) -> RowLayout:
    """Layout of tensors whose rows sit at dim ``lead`` (0 per rank, 1 with a rank dim)."""
    shapes = tuple(tuple(t.shape[lead + 1:]) for t in tensors)
    dtypes = tuple(t.dtype for t in tensors)
    widths = tuple(prod(f) * t.element_size() for f, t in zip(shapes, tensors))
    return RowLayout(dtypes, shapes, widths)


def as_bytes(t: torch.Tensor, lead: int) -> torch.Tensor:
    """``[*lead, n, *f]`` -> ``[*lead, n, bytes(f)]`` uint8: a view when each row's bytes are
    contiguous (a narrowed or strided-row tensor included), else a copy."""
    x = t.reshape(*t.shape[:lead + 1], prod(t.shape[lead + 1:]))
    if x.stride(-1) != 1:
        # a last dim of size 1 may keep any stride and still count as contiguous (an lse of one
        # head per row is [n, 1] with stride n), but a dtype view needs stride 1 there
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(torch.uint8)


def bytes_are_a_view(t: torch.Tensor, lead: int) -> bool:
    """Whether ``as_bytes(t, lead)`` is a view of ``t`` (from shapes and strides only, so it traces
    under ``torch.compile``): each row's trailing dims are contiguous and hold more than one element
    (a row of one element may keep any stride; it is then copied, which is always correct)."""
    expect = 1
    for size, stride in zip(reversed(t.shape[lead + 1:]), reversed(t.stride()[lead + 1:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return expect > 1


def pack(tensors: list[torch.Tensor], lead: int) -> torch.Tensor:
    """``[*lead, n, row_bytes]`` uint8: the rows of all tensors side by side."""
    parts = [as_bytes(t, lead) for t in tensors]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def unpack(buf: torch.Tensor, layout: RowLayout, views: bool = False) -> list[torch.Tensor]:
    """Inverse of ``pack``: ``[*lead, n, row_bytes]`` uint8 -> one tensor per layout entry.

    With several tensors each is a contiguous copy of its byte columns (what a caller may keep,
    save or pickle). ``views``: a view of ``buf`` instead (rows strided by ``row_bytes``) where
    its offset and the row width are multiples of its element size, for rows consumed at once
    (a reduce): the received rows then exist once, not once packed and once per tensor.
    """
    out, start = [], 0
    for dtype, shape, width in zip(layout.dtypes, layout.shapes, layout.widths):
        cols = buf[..., start:start + width]
        size = torch.empty((), dtype=dtype).element_size()
        if len(layout.widths) > 1 and (not views or start % size or buf.shape[-1] % size):
            cols = cols.contiguous()
        start += width
        out.append(cols.view(dtype).reshape(*buf.shape[:-1], *shape))
    return out


def word_dtype(row_bytes: int) -> torch.dtype:
    """Widest integer word that divides the row: rows move as words, not bytes."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0:
            return dtype
    return torch.uint8
