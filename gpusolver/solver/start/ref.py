"""Torch twins of the start and restart states: where each variant's tasks begin.

``transpose_start`` is the reference the Triton ``transpose_start_triton``
(kernel.py) equals; ``restart`` is the persistent kernel's restart
(``rounds.py``) in torch.
"""
from __future__ import annotations

import torch

from gpusolver.solver.core import Tasks
from gpusolver.solver.start.shed import hull_length, shed_start

# the index of the "shed" start in ``strategies.STARTS`` (the steps import nothing above core)
SHED = 3


def transpose_start(tasks: Tasks, every_unit: bool = False) -> torch.Tensor:
    """The "transpose" start: [T] int64, the start rank of each task (torch twin of
    ``start.kernel.transpose_start_triton``).

    A QO unit (g, u) whose tasks need more remote key tokens than its own rows,
    priced in forward bytes (K/V there against Q there and O back), starts with
    all its tasks on rank b + g % s, where b = G * (host // G) is the first rank
    of the aligned block holding the unit and s = min(G, P - b) its size:
    within a block every rank computes one head group of every such row, as
    Ulysses does. Other units start on their query host. Long documents make
    owner-computes gather all G groups' K/V from every rank they span;
    transposed, a rank receives G - 1 rows of its head group from its block
    and only that group's K/V, which costs less once a document spans more
    than 1 + (q + o) / kv ranks (9 for GQA 64:8).

    ``every_unit`` (the "ulysses" start) transposes every unit, remote keys or not: with G
    head groups of even work this is Ulysses (times a ring over the P / G blocks), balanced
    whatever the mask, and moves what USP moves in the forward. Sparse indexer masks need it:
    their early rows need few remote keys and stay home under the rule above, which leaves
    the late blocks' ranks with about twice the mean work.
    """
    G, U = tasks.G, tasks.U
    remote = tasks.valid & (tasks.k_host != tasks.q_host)
    kv_tokens = torch.where(remote, tasks.khi - tasks.klo, 0).view(G * U, U).sum(1)
    rows = hull_length(tasks.qlo.view(G * U, U), tasks.qhi.view(G * U, U), tasks.valid.view(G * U, U), 1)
    flip = (kv_tokens * tasks.kv > rows * (tasks.q + tasks.o)) | every_unit
    host = tasks.unit_host  # [G*U] rank of each QO unit
    block = (host // G) * G
    target = block + (tasks.g.view(G * U, U)[:, 0] % (tasks.P - block).clamp(max=G))
    return torch.where(flip, target, host)[tasks.qo_unit]


def variant_starts(tasks: Tasks, variants, start: torch.Tensor | None = None, transpose_fn=None,
                   cap: torch.Tensor | None = None):
    """The start rank of each task for ``variants``: None when every variant starts from
    owner-computes, else [T] (one start for all) or [B, T] int64. ``transpose_fn`` (default
    ``transpose_start``) gives the "transpose" and "ulysses" starts, the second with
    ``every_unit``; ``shed.shed_start`` the "shed" start (it needs ``cap``, the largest balanced
    load); the others start on the query host. A given ``start`` ([T], the tiled refine's coarser
    plan) replaces every start but "shed", which is made at this tile level: the shed pieces of a
    finer level are not the coarser plan's. Kinds index ``strategies.STARTS``."""
    kinds = [v.start for v in variants]
    if start is not None and SHED not in kinds:
        return start
    if not any(kinds):
        return None
    transpose_fn = transpose_fn or transpose_start
    made = {k: start for k in kinds if k != SHED} if start is not None else {0: tasks.q_host}
    for k in sorted(set(kinds) - set(made)):
        made[k] = shed_start(tasks, cap) if k == SHED else transpose_fn(tasks, every_unit=k == 2)
    return torch.stack([made[k] for k in kinds])


def restart(tasks: Tasks, best_A: torch.Tensor, vol: torch.Tensor) -> torch.Tensor:
    """The restart state: ``best_A`` [B, T+1] with every task on its bottleneck rank, or hosted
    there, back on its query host. vol: [B, P] int64 bytes of ``best_A``; the bottleneck is
    the first rank of largest volume. Returns [B, T+1] int64."""
    P, T = tasks.P, tasks.T
    bn = vol.argmax(1, keepdim=True)  # [B, 1], first on ties
    home = torch.where(tasks.valid, tasks.q_host, P)
    back = (best_A[:, :T] == bn) | (home == bn)
    return torch.cat((torch.where(back, home, best_A[:, :T]), best_A[:, T:]), 1)

