"""Routing arithmetic on device tensors: where each sent row lands.

Pure torch, static shapes, no host reads. Every function takes a leading
batch dim B of sending ranks (B = P in ``LocalGroup``, B = 1 on a real rank)
and their rank ids ``ranks [B]``.

For split ``[P(src), P(dst)]``:
- ``send_off[s, d] = sum(split[s, :d])``: first send position of s's rows for d;
- ``recv_off[s, d] = sum(split[:s, d])``: first receive row, on d, of s's rows.
Send position p of rank s (destination d, ``q = p - send_off[s, d]``) lands
on rank d at row ``recv_off[s, d] + q``.
"""
from __future__ import annotations

import torch


def split_offsets(split: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(send_off, recv_off), both ``[P, P]`` int64 exclusive prefix sums (see module doc)."""
    send_off = split.cumsum(1) - split
    recv_off = split.cumsum(0) - split
    return send_off, recv_off


def put_targets(split: torch.Tensor, send_index: torch.Tensor, ranks: torch.Tensor,
                recv_capacity: int, recv_offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination rank and row of every send position.

    split: ``[P, P]`` int64; send_index: ``[B, C]`` int64 (``-1`` = padding);
    ranks: ``[B]`` int64, the sending rank of each batch row;
    recv_offset: ``[P]`` int64, the first row of the call's rows on each destination
    (default 0: rows from source s start at ``sum(split[:s, d])``).
    Returns ``peer [B, C]`` int64 (``-1``: nothing sent from this position:
    padding, past the rank's row count, or past ``recv_capacity`` on the
    destination) and ``row [B, C]`` int64 (0 where ``peer`` is -1).
    """
    B, C = send_index.shape
    P = split.shape[0]
    own = split.index_select(0, ranks)                        # [B, P]
    incl = own.cumsum(1)                                      # [B, P]
    pos = torch.arange(C, device=split.device, dtype=torch.int64).expand(B, C)
    # destination of position p: the number of destinations whose block ends at or before p
    dest = torch.searchsorted(incl, pos.contiguous(), right=True)
    valid = (dest < P) & (send_index >= 0)
    dest = dest.clamp(max=P - 1)
    _, recv_off = split_offsets(split)
    start = (incl - own).gather(1, dest)                      # send_off[rank, dest]
    row = recv_off.index_select(0, ranks).gather(1, dest) + (pos - start)
    if recv_offset is not None:
        row = row + recv_offset[dest]
    valid &= row < recv_capacity
    peer = torch.where(valid, dest, torch.full_like(dest, -1))
    row = torch.where(valid, row, torch.zeros_like(row))
    return peer, row


def return_index(split: torch.Tensor, ranks: torch.Tensor, recv_capacity: int) -> torch.Tensor:
    """Send index of the reverse move (reduce): ``[B, recv_capacity]`` int64.

    A reduce sends each filled receive row back to its source, in buffer
    order, so it is a cast with ``split.T`` whose send index is the identity
    over the rank's fill (``sum(split[:, rank])``) and ``-1`` after it.
    """
    fill = split.sum(0).index_select(0, ranks)                # [B]
    rows = torch.arange(recv_capacity, device=split.device, dtype=torch.int64)
    rows = rows.expand(ranks.shape[0], recv_capacity)
    return torch.where(rows < fill[:, None], rows, torch.full_like(rows, -1))


def fill_mask(split: torch.Tensor, ranks: torch.Tensor, recv_capacity: int,
              recv_offset: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, recv_capacity]`` bool: receive rows that hold this call's data (from the rank's
    ``recv_offset``, default 0, up to it plus its fill)."""
    if recv_offset is None:
        return return_index(split, ranks, recv_capacity) >= 0
    start = recv_offset.index_select(0, ranks)[:, None]
    rows = torch.arange(recv_capacity, device=split.device, dtype=torch.int64)[None]
    return (rows >= start) & (rows < start + split.sum(0).index_select(0, ranks)[:, None])


def traffic_rows(split: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows each rank sends to / receives from other ranks in a cast: ``([P], [P])`` int64."""
    off = split - torch.diag_embed(torch.diagonal(split))
    return off.sum(1), off.sum(0)


def tail_split(split: torch.Tensor, first_row: int | torch.Tensor) -> torch.Tensor:
    """``[P, P]``: the rows of each source that land at receive rows ``>= first_row`` (``tail_routing``).

    first_row: a host int (the same row on every destination) or a ``[P]`` int64 device tensor,
    one first row per destination (a negative one keeps every row)."""
    _, recv_off = split_offsets(split)
    if isinstance(first_row, torch.Tensor):  # per destination: broadcast along the source dim
        first_row = first_row.to(split.dtype).view(1, -1)
    return split - torch.minimum(split, (first_row - recv_off).clamp(min=0))


def tail_routing(split: torch.Tensor, send_index: torch.Tensor, ranks: torch.Tensor,
                 first_row: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of the same cast restricted to receive rows ``>= first_row``.

    A cast with the returned ``(split_tail [P, P], send_index_tail [B, C])`` and receive
    capacity ``recv_capacity - first_row`` fills row ``j`` of each rank's buffer with what the
    full cast puts at row ``first_row + j``: sources fill a buffer in ascending order, so the
    rows past ``first_row`` are a suffix of each source's run (the straddling source's tail,
    then every later source whole). Static shapes, no host read.

    first_row: a host int, or a ``[P]`` int64 tensor of one non-negative first row per
    destination (then row ``j`` of rank d's tail is the full cast's row ``first_row[d] + j``:
    cast it with ``recv_offset``, ``group_cast``, to land each rank's tail at its own row).
    """
    B, C = send_index.shape
    P = split.shape[0]
    split_tail = tail_split(split, first_row)
    skip = split - split_tail                                         # rows of s for d below first_row
    own = split.index_select(0, ranks)                                # [B, P]
    own_skip = skip.index_select(0, ranks)
    own_tail = own - own_skip
    tail_incl = own_tail.cumsum(1)
    pos = torch.arange(C, device=split.device, dtype=torch.int64).expand(B, C).contiguous()
    dest = torch.searchsorted(tail_incl, pos, right=True)            # [B, C]
    valid = dest < P
    dest = dest.clamp(max=P - 1)
    # the tail position's place in the full send list: its destination's run, past the skipped rows
    orig = (own.cumsum(1) - own + own_skip - (tail_incl - own_tail)).gather(1, dest) + pos
    index = send_index.gather(1, orig.clamp(0, C - 1))
    return split_tail, torch.where(valid, index, torch.full_like(index, -1))
