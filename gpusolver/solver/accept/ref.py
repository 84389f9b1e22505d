"""Torch twin of the accept step: which proposals to apply, and the moves they make.

``accept`` and ``accept_apply`` are the references the Triton
``accept_triton`` and ``accept_apply_triton`` (kernel.py) equal entry for entry.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import Proposals, State


def _segment_running_sum(key: torch.Tensor, order_key: torch.Tensor, values: list[torch.Tensor]):
    """Sort proposals by ``order_key``; for each value, its running sum within runs of equal ``key``.

    Returns (order, [running sums in sorted order]).
    """
    B, N = key.shape
    order = torch.sort(order_key, dim=1, stable=True).indices
    k_sorted = key.gather(1, order)
    idx = torch.arange(N, device=key.device).expand(B, -1)
    new_seg = torch.cat((torch.ones_like(k_sorted[:, :1], dtype=torch.bool), k_sorted[:, 1:] != k_sorted[:, :-1]), 1)
    seg_start = torch.cummax(torch.where(new_seg, idx, 0), 1).values
    sums = []
    for v in values:
        csum = torch.cumsum(v.gather(1, order), 1)
        sums.append(csum - torch.where(seg_start > 0, csum.gather(1, (seg_start - 1).clamp(min=0)), 0))
    return order, sums


def accept(prop: Proposals, st: State, dest_cap, limit, excess, balance, training: bool = False,
           recv_caps: torch.Tensor | None = None) -> torch.Tensor:
    """Which proposals to apply: [B, N] bool.

    Each destination accepts proposals in score order while its load and
    volume stay within limits; then, while balancing, each source keeps its
    accepted proposals in score order until its excess is covered.

    The volume limit: forward-only, the destination's forward send and
    receive stay within ``limit`` (the threshold while balancing, the
    bottleneck less one after); ``training``, while balancing its forward plus
    backward volume stays within ``limit``, after it its forward and backward
    volumes stay below their bottlenecks. With ``recv_caps`` ([2, B] int64, each
    variant's QO and KV receive buffer rows) the QO and KV rows it receives stay
    within them, or do not grow.
    """
    B, N = prop.ok.shape
    P = st.load.shape[1]
    dev = prop.ok.device
    pos = torch.empty((B, N), dtype=torch.int64, device=dev)  # score order, index breaks ties
    pos.scatter_(1, torch.sort(prop.score, dim=1, stable=True).indices, torch.arange(N, device=dev).expand(B, -1))
    ok = prop.ok
    dest = torch.where(ok, prop.dest, P)
    zero = lambda x: torch.where(ok, x, 0)  # noqa: E731
    values = [prop.area, prop.dest_send, prop.dest_recv]
    if training:
        values += [prop.dest_bsend, prop.dest_brecv]
    if recv_caps is not None:
        values += [prop.dest_qin, prop.dest_kin]
    order, running = _segment_running_sum(dest, dest * N + pos, [zero(v) for v in values])
    r_area, r_send, r_recv = running[:3]
    pad = torch.zeros_like(st.load[:, :1])
    d_sorted = dest.gather(1, order)
    at_d = lambda t: torch.cat((t, pad), 1).gather(1, d_sorted)  # noqa: E731
    lim = limit[:, None]
    fits = at_d(st.load) + r_area <= dest_cap
    if training:
        fwd = torch.maximum(at_d(st.send) + r_send, at_d(st.recv) + r_recv)
        bwd = torch.maximum(at_d(st.bsend) + running[3], at_d(st.brecv) + running[4])
        fits &= torch.where(balance[:, None], (fwd + bwd).double() <= lim,
                            (fwd < st.bottleneck[:, None]) & (bwd < st.bwd_bottleneck[:, None]))
    else:
        fits &= ((at_d(st.send) + r_send).double() <= lim) & ((at_d(st.recv) + r_recv).double() <= lim)
    if recv_caps is not None:
        r_qin, r_kin = running[-2:]
        qc, kc = recv_caps[0][:, None], recv_caps[1][:, None]
        fits &= ((at_d(st.q_in) + r_qin <= qc) | (r_qin <= 0)) & ((at_d(st.k_in) + r_kin <= kc) | (r_kin <= 0))
    ok = ok & torch.zeros_like(ok).scatter(1, order, fits)
    # source side: stop once the excess is covered (balance phase only)
    src = torch.where(ok, prop.source, P)
    order, (r_src,) = _segment_running_sum(src, src * N + pos, [torch.where(ok, prop.area, 0)])
    a_sorted = torch.where(ok, prop.area, 0).gather(1, order)
    need = torch.cat((excess, pad), 1).gather(1, src.gather(1, order))
    keep = (r_src - a_sorted < need) | ~balance[:, None]
    return ok & torch.zeros_like(ok).scatter(1, order, keep)


def accept_apply(A: torch.Tensor, prop: Proposals, st: State, dest_cap, limit, excess, balance,
                 training: bool = False, recv_caps: torch.Tensor | None = None):
    """``accept`` and the moves it accepts, as the round loop applies them (torch twin).

    A: [B, T+1] int64 assignment (column T is a dummy). Other arguments as
    ``accept_triton``. Returns (A_next [B, T+1] int64: each kept proposal's
    tasks on its destination, stuck [B] bool: balancing and nothing kept).
    The dummy column of A_next is unspecified (the scatter parks unused task
    slots there); columns [0, T) are what the twins agree on.
    """
    B, T = A.shape[0], A.shape[1] - 1
    keep = accept(prop, st, dest_cap, limit, excess, balance, training, recv_caps)
    stuck = balance & ~keep.any(1)
    moving = torch.where(keep[..., None], prop.tasks, T)
    A = A.scatter(1, moving.view(B, -1), prop.dest[..., None].expand_as(moving).reshape(B, -1))
    return A, stuck

