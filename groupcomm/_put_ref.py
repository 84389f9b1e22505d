"""Torch twin of the put kernel (``_put_kernel.put_rows``), stacked-buffer form."""
from __future__ import annotations

import torch

from ._base import first_true


def put_rows_ref(src: torch.Tensor, index: torch.Tensor, peer: torch.Tensor, row: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """Copy ``src[b, index[b, p]]`` to ``out[peer[b, p], row[b, p]]`` for every valid (b, p).

    src: ``[B, N, W]`` rows of the B sending ranks (any dtype, usually words);
    index, peer, row: ``[B, C]`` int64, a position is skipped when
    ``index < 0``, ``peer < 0`` or the target lies outside ``out``;
    out: ``[P, R, W]`` the stacked receive buffers, same dtype as src.
    Returns a new tensor (``out`` with the rows written); targets of valid
    positions must be distinct.
    """
    P, R, W = out.shape
    flat = torch.cat([out.reshape(P * R, W), out.new_zeros(1, W)])
    return put_rows_into(src, index, peer, row, flat, P, R)


def put_rows_fresh(src: torch.Tensor, index: torch.Tensor, peer: torch.Tensor, row: torch.Tensor,
                   P: int, R: int) -> torch.Tensor:
    """``put_rows_ref`` into zero receive buffers ``[P, R, W]`` allocated here (one allocation)."""
    flat = src.new_zeros(P * R + 1, src.shape[2])
    return put_rows_into(src, index, peer, row, flat, P, R)


def put_rows_into(src, index, peer, row, flat: torch.Tensor, P: int, R: int) -> torch.Tensor:
    """Write the rows into ``flat [P * R + 1, W]`` (its last row a scratch row); ``[P, R, W]`` view."""
    B, N, W = src.shape
    if N == 0:
        return flat[:P * R].view(P, R, W)
    ok = (index >= 0) & (index < N) & (peer >= 0) & (peer < P) & (row >= 0) & (row < R)
    # invalid positions all write to the scratch row P*R, dropped below
    target = torch.where(ok, peer * R + row, torch.full_like(row, P * R))
    idx = index.clamp(0, N - 1)
    for b in range(B):  # one sender at a time: the gathered rows are one rank's, not all B ranks'
        flat.index_put_((target[b],), src[b].index_select(0, idx[b]))
    return flat[:P * R].view(P, R, W)


def put_rows_inplace(src: torch.Tensor, index: torch.Tensor, peer: torch.Tensor, row: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """``put_rows_ref`` written into ``out [P, R, W]`` itself (any strides: a view of a larger tensor
    included), with no copy of it and no scratch row; returns ``out``.

    A skipped position writes the same row to the same place as its sender's first valid
    position (equal values: whichever write lands, the bits are the same); a sender with no
    valid position writes ``out[0, 0]``, which is put back as it was.
    """
    P, R, W = out.shape
    B, N, _ = src.shape
    if N == 0 or P * R == 0 or index.shape[1] == 0:  # nothing to send (a zero-capacity list) or nowhere to put it
        return out
    ok = (index >= 0) & (index < N) & (peer >= 0) & (peer < P) & (row >= 0) & (row < R)
    first = first_true(ok)                                             # [B, 1]: 0 when none is valid
    any_ok = ok.any(1)                                                 # [B]
    pick = lambda t: torch.where(ok, t, t.gather(1, first))            # noqa: E731
    idx = pick(index).clamp(0, N - 1)
    none = ~any_ok[:, None]                                            # such a sender writes out[0, 0] only
    dst_p = pick(peer).clamp(0, P - 1).masked_fill(none, 0)
    dst_r = pick(row).clamp(0, R - 1).masked_fill(none, 0)
    for b in range(B):  # one sender at a time: the gathered rows are one rank's, not all B ranks'
        keep = out[0, 0].clone()
        out.index_put_((dst_p[b], dst_r[b]), src[b].index_select(0, idx[b]))
        out[0, 0].copy_(torch.where(any_ok[b], out[0, 0], keep))
    return out
