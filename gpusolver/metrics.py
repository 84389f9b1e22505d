"""What a plan costs: per-rank load, bytes moved, bottleneck, balance.

Shape legend: G head groups, P ranks, c tokens per chunk.

``evaluate`` is sync-free (static shapes, no host reads) and runs inside the
device solver; ``PlanMetrics.to_dict`` / ``summary`` and ``check_assignment``
are host-side.

Byte counts per transferred range of ``n`` tokens (``CommCost`` factors):

    ===========  ========================  ======================
    unit, pass   host (i or j)             helper rank r
    ===========  ========================  ======================
    QO fwd       send n*q_fwd (Q),         recv n*q_fwd,
                 recv n*o_fwd (O, lse)     send n*o_fwd
    KV fwd       send n*kv_fwd (K, V)      recv n*kv_fwd
    QO bwd       send n*q_bwd (dO, lse,    recv n*q_bwd,
                 delta; Q if re-cast),
                 recv n*dq_bwd (dQ)        send n*dq_bwd
    KV bwd       send n*kv_bwd (K, V if    recv n*kv_bwd,
                 re-cast, else 0),
                 recv n*dkv_bwd (dK, dV)   send n*dkv_bwd
    ===========  ========================  ======================

With the default ``keep_forward_buffers`` the backward's KV direction is the
forward's reversed (KV hosts receive dK, dV and send nothing), so a plan
with a small forward bottleneck need not have a small backward one.

The ranges are those of ``transfer_ranges`` (hull of the needed tokens per
(unit, destination)), so the volumes are the bytes the plan really moves. The
``*_chunk`` bottlenecks count every transferred range as the whole chunk c:
the upper bound a mask-unaware collective would pay for the same assignment.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from gpusolver.problem import BlockAreas, CommCost
from gpusolver.transfers import transfer_ranges

__all__ = ["PlanMetrics", "evaluate", "owner_computes_assignment", "check_assignment"]


@dataclass(frozen=True)
class PlanMetrics:
    """Costs of one assignment, all tensors on the assignment's device.

    load:                  [P] int64, summed area of the tasks on each rank.
    fwd_send, fwd_recv:    [P] int64, forward bytes each rank sends / receives.
    bwd_send, bwd_recv:    [P] int64, backward bytes each rank sends / receives.
    fwd_bottleneck:        [] int64, max over ranks of max(fwd_send, fwd_recv).
    bwd_bottleneck:        [] int64, the same for backward.
    imbalance:             [] float64, max load / mean load (1.0 when no work).
    local_fraction:        [] float64, share of the area computed where both
                           its QO and KV units live (i == j == rank); 1.0
                           when there is no work.
    fwd_bottleneck_chunk:  [] int64, forward bottleneck with every transferred
                           range counted as the whole chunk (upper bound).
    bwd_bottleneck_chunk:  [] int64, the same for backward.
    step_bottleneck:       [] int64 (property), fwd_bottleneck + bwd_bottleneck: the
                           bytes a training step waits for, what the device solver
                           minimises with ``SolverConfig(objective="training")``.
    """

    load: torch.Tensor
    fwd_send: torch.Tensor
    fwd_recv: torch.Tensor
    bwd_send: torch.Tensor
    bwd_recv: torch.Tensor
    fwd_bottleneck: torch.Tensor
    bwd_bottleneck: torch.Tensor
    imbalance: torch.Tensor
    local_fraction: torch.Tensor
    fwd_bottleneck_chunk: torch.Tensor
    bwd_bottleneck_chunk: torch.Tensor

    @property
    def step_bottleneck(self) -> torch.Tensor:
        return self.fwd_bottleneck + self.bwd_bottleneck

    def to_dict(self) -> dict:
        """Host copy: per-rank fields as lists of ints, scalars as int / float (and step_bottleneck)."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name).detach().cpu()
            out[f.name] = t.tolist() if t.dim() else t.item()
        out["step_bottleneck"] = out["fwd_bottleneck"] + out["bwd_bottleneck"]
        return out

    def summary(self) -> str:
        """A short human-readable table (host-side)."""
        d = self.to_dict()
        lines = [
            f"fwd bottleneck {_fmt_bytes(d['fwd_bottleneck'])} (whole-chunk {_fmt_bytes(d['fwd_bottleneck_chunk'])}), "
            f"bwd bottleneck {_fmt_bytes(d['bwd_bottleneck'])} (whole-chunk {_fmt_bytes(d['bwd_bottleneck_chunk'])}), "
            f"step (fwd + bwd) {_fmt_bytes(d['step_bottleneck'])}",
            f"imbalance {d['imbalance']:.3f}, local fraction {d['local_fraction']:.3f}",
            f"{'rank':>4} {'load':>12} {'fwd send':>10} {'fwd recv':>10} {'bwd send':>10} {'bwd recv':>10}",
        ]
        for r, row in enumerate(zip(d["load"], d["fwd_send"], d["fwd_recv"], d["bwd_send"], d["bwd_recv"])):
            load, *vols = row
            lines.append(f"{r:>4} {load:>12} " + " ".join(f"{_fmt_bytes(v):>10}" for v in vols))
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n}"


def _check_meta(areas: BlockAreas, assignment: torch.Tensor) -> None:
    """Shape-only checks (host metadata, no value reads)."""
    G, U = areas.head_groups, areas.num_units
    if tuple(assignment.shape) != (G, U, U):
        dims = "[G, P, P]" if areas.tiles == 1 else "[G, U, U] (U = chunk tiles * P)"
        raise ValueError(f"assignment must be {dims} = {(G, U, U)}, got {tuple(assignment.shape)}")
    if assignment.dtype.is_floating_point or assignment.dtype == torch.bool:
        raise ValueError(f"assignment must be an integer tensor, got {assignment.dtype}")


def _volumes(qo_len: torch.Tensor, kv_len: torch.Tensor, cost: CommCost, tiles: int):
    """Per-rank (fwd_send, fwd_recv, bwd_send, bwd_recv), each [P] int64.

    qo_len, kv_len: [G, U(unit), P(dest)] int64 tokens moved per (unit, dest);
    unit u lives on rank u // tiles.
    """
    by_host = lambda x: x.sum(dim=(0, 2)).view(-1, tiles).sum(1)  # noqa: E731
    qo_out, qo_in = by_host(qo_len), qo_len.sum(dim=(0, 1))  # by host, by helper
    kv_out, kv_in = by_host(kv_len), kv_len.sum(dim=(0, 1))
    fwd_send = qo_out * cost.q_fwd + qo_in * cost.o_fwd + kv_out * cost.kv_fwd
    fwd_recv = qo_out * cost.o_fwd + qo_in * cost.q_fwd + kv_in * cost.kv_fwd
    bwd_send = qo_out * cost.q_bwd + qo_in * cost.dq_bwd + kv_out * cost.kv_bwd + kv_in * cost.dkv_bwd
    bwd_recv = qo_out * cost.dq_bwd + qo_in * cost.q_bwd + kv_out * cost.dkv_bwd + kv_in * cost.kv_bwd
    return fwd_send, fwd_recv, bwd_send, bwd_recv


def _bottleneck(send: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
    return torch.maximum(send, recv).amax()


def evaluate(areas: BlockAreas, assignment: torch.Tensor, cost: CommCost) -> PlanMetrics:
    """Load, bytes moved and balance of an assignment. Sync-free.

    areas:      BlockAreas, area [G, U, U] int64, q_need / k_need [G, U, U, 2] int64
                (U = P without tiling).
    assignment: [G, U, U] int32/int64, rank computing task (g, i, j); -1 for
                empty tasks (area 0). Values are not checked here (see
                ``check_assignment``); a non-empty task set to -1 counts nowhere.
    cost:       CommCost with ``cost.head_groups == G``.

    Returns PlanMetrics (see its docstring) on ``assignment.device``.
    """
    _check_meta(areas, assignment)
    if cost.head_groups != areas.head_groups:
        raise ValueError(f"cost.head_groups={cost.head_groups} must equal areas' G={areas.head_groups}")
    P = areas.cp_size
    area = areas.area
    asg = assignment.long()
    ranks = torch.arange(P, device=asg.device)

    # load[r] = sum of area over tasks with asg == r; -1 (empty) adds nowhere
    on_rank = asg[..., None] == ranks  # [G, U, U, P(r)]
    load = torch.where(on_rank, area[..., None], 0).sum(dim=(0, 1, 2))
    total = area.sum()

    qo_range, kv_range = transfer_ranges(areas, assignment)
    qo_len = qo_range[..., 1] - qo_range[..., 0]  # [G, U(i), P(r)]
    kv_len = kv_range[..., 1] - kv_range[..., 0]  # [G, U(j), P(r)]
    n = areas.tiles
    fwd_send, fwd_recv, bwd_send, bwd_recv = _volumes(qo_len, kv_len, cost, n)
    # whole-chunk upper bound: every range that moves counts as its whole unit (c tokens untiled)
    c = areas.chunk
    cf_send, cf_recv, cb_send, cb_recv = _volumes((qo_len > 0).long() * c, (kv_len > 0).long() * c, cost, n)

    totf = total.double()
    has_work = total > 0
    one = torch.ones((), dtype=torch.float64, device=totf.device)
    imbalance = torch.where(has_work, load.amax().double() * P / totf.clamp(min=1.0), one)
    host = areas.unit_host()
    both_here = (host[:, None] == host[None, :]) & (asg == host[:, None])  # [G, U, U]
    local = torch.where(both_here, area, 0).sum()
    local_fraction = torch.where(has_work, local.double() / totf.clamp(min=1.0), one)
    return PlanMetrics(
        load=load, fwd_send=fwd_send, fwd_recv=fwd_recv, bwd_send=bwd_send, bwd_recv=bwd_recv,
        fwd_bottleneck=_bottleneck(fwd_send, fwd_recv), bwd_bottleneck=_bottleneck(bwd_send, bwd_recv),
        imbalance=imbalance, local_fraction=local_fraction,
        fwd_bottleneck_chunk=_bottleneck(cf_send, cf_recv), bwd_bottleneck_chunk=_bottleneck(cb_send, cb_recv),
    )


def owner_computes_assignment(areas: BlockAreas) -> torch.Tensor:
    """Every non-empty task on its query host: [G, U, U] int32, -1 for empty tasks.

    The owner-computes baseline: no QO traffic, only the KV each query chunk
    needs travels. Sync-free.
    """
    G, U = areas.head_groups, areas.num_units
    host = areas.unit_host().to(torch.int32).view(1, U, 1).expand(G, U, U)
    return torch.where(areas.area > 0, host, torch.full_like(host, -1))


def check_assignment(areas: BlockAreas, assignment: torch.Tensor) -> None:
    """Host-side validation (reads the tensors): raises ValueError naming the task.

    assignment must be an integer [G, U, U] tensor (U = P untiled); each non-empty task
    (area > 0) on a rank in [0, P); each empty task -1.
    """
    _check_meta(areas, assignment)
    P = areas.cp_size
    area = areas.area.detach().cpu()
    asg = assignment.detach().cpu().long()
    nonempty = area > 0
    bad = (nonempty & ((asg < 0) | (asg >= P))).nonzero()
    if bad.numel():
        g, i, j = bad[0].tolist()
        raise ValueError(
            f"assignment[{g}, {i}, {j}] = {asg[g, i, j].item()} but task (g={g}, i={i}, j={j}) has "
            f"area {area[g, i, j].item()} > 0 and must be on a rank in [0, {P}) ({bad.shape[0]} such tasks)")
    bad = (~nonempty & (asg != -1)).nonzero()
    if bad.numel():
        g, i, j = bad[0].tolist()
        raise ValueError(
            f"assignment[{g}, {i}, {j}] = {asg[g, i, j].item()} but task (g={g}, i={i}, j={j}) is empty "
            f"(area 0) and must be -1 ({bad.shape[0]} such tasks)")
