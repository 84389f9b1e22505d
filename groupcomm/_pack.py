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


def packed_rows(n: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype],
                device: torch.device) -> list[torch.Tensor]:
    """Uninitialised ``[n, *shape]`` tensors, one per (shape, dtype), each the byte columns of one
    ``[n, row_bytes]`` uint8 buffer (``unpack(views=True)``): rows written there are already packed
    side by side, and ``packed_base`` gives the buffer back without the copy ``pack`` makes. Where
    a tensor's columns cannot be viewed in its dtype (unaligned) it is a copy, and ``packed_base``
    then finds no buffer: correct, only not copy-free."""
    widths = tuple(prod(f) * torch.empty((), dtype=d).element_size() for f, d in zip(shapes, dtypes))
    layout = RowLayout(tuple(dtypes), tuple(tuple(f) for f in shapes), widths)
    buf = torch.empty(n, layout.row_bytes, dtype=torch.uint8, device=device)
    return unpack(buf, layout, views=True)


def packed_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``[n, row_bytes]`` uint8 buffer whose byte columns ``tensors`` are, in order and covering
    every byte of its rows (``packed_rows``' tensors, or the same rows of them): ``pack(tensors, 0)``
    without the copy. None otherwise. Reads storage addresses: eager only (a host-side group)."""
    if len(tensors) < 2 or any(not bytes_are_a_view(t, 0) for t in tensors):
        return None
    parts = [as_bytes(t, 0) for t in tensors]
    n, width = parts[0].shape[0], sum(p.shape[-1] for p in parts)
    if n == 0:  # no rows: nothing to copy either way (an empty tensor's address says nothing)
        return None
    storage, at = parts[0].untyped_storage().data_ptr(), parts[0].data_ptr()
    for p in parts:
        if p.dim() != 2 or p.shape[0] != n or p.untyped_storage().data_ptr() != storage or p.data_ptr() != at \
                or (n > 1 and p.stride(0) != width):
            return None
        at += p.shape[-1]
    base = parts[0].as_strided((n, width), (width, 1))
    if base.storage_offset() + n * width > base.untyped_storage().nbytes():
        return None
    return base


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
