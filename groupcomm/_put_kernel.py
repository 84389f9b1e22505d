"""The put kernel: each sending rank writes its rows straight into the receivers' buffers.

One program per (block of BLOCK_R send positions, sending rank b). For each
position it loads the source row index, the destination rank and row
(prepared by ``_routing.put_targets``) and copies the row in words of
BLOCK_W. The destination is addressed in one of two ways (``PEER_TABLE``):

- True: ``p_dst`` is a ``[P]`` int64 table of peer buffer addresses (torch
  symmetric memory: each rank's ``[R, W]`` buffer, mapped into every peer);
  the store goes through the peer's pointer, over NVLink on GPU.
- False: ``p_dst`` is one stacked ``[P, R, W]`` buffer, rank stride ``R * W``
  (``LocalGroup``, which runs it on CPU under ``TRITON_INTERPRET=1``).

Every load and store is masked: an out-of-bounds store under the
interpreter corrupts the process. Launch shapes depend only on (B, C, W).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _put_rows_kernel(p_src, p_index, p_peer, p_row, p_dst, N, C, W, P, R,
                     PEER_TABLE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    i_c = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_c = i_c * BLOCK_R + tl.arange(0, BLOCK_R)
    m_c = o_c < C
    # [BLOCK_R]
    b_index = tl.load(p_index + i_b * C + o_c, mask=m_c, other=-1)
    b_peer = tl.load(p_peer + i_b * C + o_c, mask=m_c, other=-1)
    b_row = tl.load(p_row + i_b * C + o_c, mask=m_c, other=0)
    m_r = m_c & (b_index >= 0) & (b_index < N) & (b_peer >= 0) & (b_peer < P) & (b_row >= 0) & (b_row < R)
    o_src = (i_b * N + b_index) * W
    if PEER_TABLE:
        b_addr = tl.load(p_dst + b_peer, mask=m_r, other=0)
        p_base = b_addr.to(tl.pointer_type(p_src.dtype.element_ty))
        o_dst = b_row * W
    else:
        p_base = p_dst
        o_dst = (b_peer * R + b_row) * W
    for i_w in range(0, tl.cdiv(W, BLOCK_W)):
        o_w = i_w * BLOCK_W + tl.arange(0, BLOCK_W)
        m_rw = m_r[:, None] & (o_w < W)[None, :]
        # [BLOCK_R, BLOCK_W]
        b_x = tl.load(p_src + o_src[:, None] + o_w[None, :], mask=m_rw, other=0)
        if PEER_TABLE:
            tl.store(p_base[:, None] + o_dst[:, None] + o_w[None, :], b_x, mask=m_rw)
        else:
            tl.store(p_base + o_dst[:, None] + o_w[None, :], b_x, mask=m_rw)


def put_rows(src: torch.Tensor, index: torch.Tensor, peer: torch.Tensor, row: torch.Tensor,
             out: torch.Tensor | None = None, *, peer_ptrs: torch.Tensor | None = None,
             capacity: int | None = None, block_rows: int = 16) -> torch.Tensor | None:
    """Copy ``src[b, index[b, p]]`` to row ``row[b, p]`` of rank ``peer[b, p]``'s buffer.

    src: ``[B, N, W]`` contiguous words; index, peer, row: ``[B, C]`` int64
    (position skipped when index or peer is negative or the row is out of range).
    Stacked form: ``out [P, R, W]`` (same dtype as src), written in place and
    returned. Peer-table form: ``peer_ptrs [P]`` int64 addresses of the peers'
    ``[capacity, W]`` buffers; returns None. Same contract as ``put_rows_ref``.
    """
    B, N, W = src.shape
    C = index.shape[1]
    if (out is None) == (peer_ptrs is None):
        raise ValueError("put_rows: pass exactly one of out (stacked buffer) or peer_ptrs (peer table)")
    if out is not None:
        if out.dtype != src.dtype or out.shape[2] != W or not out.is_contiguous():
            raise ValueError(f"put_rows: out must be contiguous [P, R, {W}] {src.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        P, R, dst = out.shape[0], out.shape[1], out
    else:
        if capacity is None:
            raise ValueError("put_rows: peer_ptrs needs capacity (rows of each peer buffer)")
        P, R, dst = peer_ptrs.shape[0], capacity, peer_ptrs
    if not src.is_contiguous():
        raise ValueError("put_rows: src must be contiguous")
    if B == 0 or C == 0 or W == 0 or src.device.type == "meta":  # meta: shapes only, no data to move
        return out
    block_w = min(triton.next_power_of_2(W), max(16, 4096 // block_rows))
    grid = (triton.cdiv(C, block_rows), B)
    _put_rows_kernel[grid](src, index.contiguous(), peer.contiguous(), row.contiguous(), dst, N, C, W, P, R,
                           PEER_TABLE=peer_ptrs is not None, BLOCK_R=block_rows, BLOCK_W=block_w)
    return out
