"""Torch twin of the put kernel (``_put_kernel.put_rows``), stacked-buffer form."""
from __future__ import annotations

import torch


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
    B, N, W = src.shape
    P, R, _ = out.shape
    flat = torch.cat([out.reshape(P * R, W), out.new_zeros(1, W)])
    if N == 0:
        return flat[:P * R].view(P, R, W)
    ok = (index >= 0) & (index < N) & (peer >= 0) & (peer < P) & (row >= 0) & (row < R)
    b = torch.arange(B, device=src.device, dtype=torch.int64)[:, None]
    rows = src[b, index.clamp(0, N - 1)].reshape(B * index.shape[1], W)  # src may be a strided view
    # invalid positions all write to the scratch row P*R, dropped below
    target = torch.where(ok, peer * R + row, torch.full_like(row, P * R)).reshape(-1)
    flat.index_put_((target,), rows)
    return flat[:P * R].view(P, R, W)
