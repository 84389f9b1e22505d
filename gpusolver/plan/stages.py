"""Sub-stages of the remote work: which of S sub-stages computes each remote task.

Shape legend: G head groups, P ranks, n sub-chunk tiles per chunk, U = n * P units.

Stage 0 of rank r holds its tasks whose query and key units are both hosted on
r; they need nothing from the network. The rest of r's tasks are cut into S
sub-stages 1..S so that (a) what can arrive first computes first, and (b) each
sub-stage carries a set share of the work (the first and the last a smaller
one), so no rank waits on a large first or last piece.

Arrival. Each (source, destination) pair moves ``bytes[src, dst]`` (Q, K and V of
the forward, at the plan's byte sizes). A destination receives from all its
sources at once and its receive link is shared: under fair sharing a source
whose total is ``b`` finishes at ``(sum of the smaller totals + b * (number of
totals >= b)) / bandwidth``, per link class (NVLink inside a node, InfiniBand
across; one class without a topology). A task is ready when its last remote
source has landed; intra-node tasks order before inter-node ones when a
topology is known (the class is the first key), then by that landing time,
then by task index (deterministic ties).

Shares. In that order a rank's remote tasks are dealt by their running work:
a task whose work so far (before it) is ``w`` of the rank's total ``W`` goes to
the stage whose share of ``W`` holds ``w`` (one large task may span a stage
boundary; it is never split). With S >= 3 the first and the last sub-stage
carry half the share of the others (``stage_shares``: 1, 2, ..., 2, 1):
every helper waits for its first cast before its first sub-stage, so a small
first piece starts them sooner, and the last sub-stage's partials return with
nothing left to hide them, so a small last piece shortens that exposed tail.
On the benchmark masks solved on ``h200_hgx`` (P = 16-64, seeds 0-2, p2p) it
lowered the median simulated step over the ideal bound from 1.12 to 1.09 at
S = 4 and took S = 8 from 12 to 14 of 18 masks within 1.15x the ideal bound
(``benchmarks/results/stages_bench_topo.md``); equal shares and a small last
piece only did less.

Local tail. The forward attends stage 0 while the first casts fly, but a rank
only takes in the partial results of its own rows once it has ended its own
sub-stage (a point-to-point receive is posted with the reduce that sends its
partials), and the last sub-stage's partials return with nothing to hide them.
With ``local_tail`` > 0 a share of each rank's local work moves from stage 0 to a
local-only sub-stage S + 1 after the S remote ones: its casts and reduces are
empty (point-to-point posts nothing for them), so the rank posts each reduce
sooner and attends its own rows while the last partials land. The tail takes
the rank's local tasks at and past ``1 - local_tail`` of its local work, in task
order. In the backward, where stage 0 already runs last, it only moves
those tasks ahead of stage 0. On the benchmark masks solved on ``h200_hgx``
(P = 16-64, seeds 0-2, S = 4 over p2p) half the local work in the tail took
the median simulated step over the ideal bound from 1.084 to 1.071 and the
worst from 1.334 to 1.302, no mask slower (``benchmarks/results/local_tail_bench.md``);
a tail inside the last remote sub-stage, or local work spread over the remote
ones, gained nothing.

Solver-independent (any assignment), deterministic and sync-free: static
shapes, no host reads, the same on every rank. ``num_stages = 1`` gives stage 1
to every remote task, the two-stage layer (no tail).
"""
from __future__ import annotations

import torch

from gpusolver.config import TAIL_SCALE, sub_stages, tail_parts
from gpusolver.problem import BlockAreas, CommCost
from gpusolver.transfers import transfer_ranges


def pair_bytes_fwd(areas: BlockAreas, assignment: torch.Tensor, cost: CommCost | None) -> torch.Tensor:
    """``[P(src), P(dst)]`` int64 forward cast bytes (Q to helpers, K and V to helpers).

    Without a ``cost`` rows are weighed 1 each (QO and KV alike).
    """
    P, n = areas.cp_size, areas.tiles
    qo, kv = transfer_ranges(areas, assignment)
    rows = lambda r: (r[..., 1] - r[..., 0]).sum(0).view(P, n, P).sum(1)  # noqa: E731  [src host, dst]
    q_b, kv_b = (1, 1) if cost is None else (cost.q_fwd, cost.kv_fwd)
    return rows(qo) * q_b + rows(kv) * kv_b


def landing_time(pair: torch.Tensor, topology=None) -> tuple[torch.Tensor, torch.Tensor]:
    """When ``dst`` has all of ``src``'s bytes: ``(inter [P, P] bool, seconds [P, P] float64)``.

    pair: ``[P, P]`` int64 bytes src -> dst (the diagonal is ignored).
    topology: anything with ``ranks_per_node``, ``nvlink_gbps`` and ``ib_gbps``
        (``gpusolver.topology.Topology``); None is one class of bandwidth 1 byte/s.
    ``inter`` marks the pairs that cross nodes (the link class); seconds are the
    fair-share finish time within that class at dst's receive link.
    """
    P = pair.shape[0]
    dev = pair.device
    ranks = torch.arange(P, device=dev)
    b = pair.to(torch.float64) * (ranks[:, None] != ranks[None, :])
    if topology is None:
        inter = torch.zeros(P, P, dtype=torch.bool, device=dev)
        bw = torch.ones(P, P, dtype=torch.float64, device=dev)
    else:
        node = ranks // int(topology.ranks_per_node)
        inter = node[:, None] != node[None, :]
        bw = torch.where(inter, float(topology.ib_gbps), float(topology.nvlink_gbps)).to(torch.float64) * 1e9
    # [s', s, dst]: does source s' share dst's link class with s and finish before it (by bytes, then index)?
    same = (inter[:, None, :] == inter[None, :, :]) & (ranks[:, None, None] != ranks[None, None, :])
    bs, bo = b[:, None, :], b[None, :, :]
    before = same & ((bs < bo) | ((bs == bo) & (ranks[:, None, None] < ranks[None, :, None])))
    after = same & ~before  # s itself and the sources at or above it: they share the link until s is done
    done = (torch.where(before, bs, 0).sum(0) + torch.where(after, bo, 0).sum(0)) / bw
    return inter, done


def stage_shares(num_stages: int) -> list[int]:
    """Each sub-stage's share of a rank's remote work, in integer weights: ``[1, 2, ..., 2, 1]`` for
    S >= 3 (the first and the last carry half), equal for S <= 2 (see the module docstring)."""
    if num_stages <= 2:
        return [1] * num_stages
    return [1] + [2] * (num_stages - 2) + [1]


def assign_stages(areas: BlockAreas, assignment: torch.Tensor, num_stages: int, *, cost: CommCost | None = None,
                  topology=None, local_tail: float = 0.0) -> torch.Tensor:
    """The sub-stage of every task: ``[G, U, U]`` int32, -1 empty or unassigned, 0 local, 1..S remote,
    S + 1 the local tail (``sub_stages``).

    areas:      BlockAreas (area [G, U, U] int64, needs).
    assignment: [G, U, U] integer, rank computing task (g, i, j); -1 for empty tasks.
    num_stages: S >= 1 (host int), remote sub-stages.
    cost:       byte sizes per row for the landing-time model (default: 1 per row).
    topology:   link classes and bandwidths (default: one class); see ``landing_time``.
    local_tail: share in [0, 1] of each rank's local work computed in sub-stage S + 1, in sixteenths
                (S > 1 only; 0: none, the local work all in stage 0).
    Sync-free.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    parts = tail_parts(local_tail)
    P = areas.cp_size
    host = areas.unit_host()
    a = assignment.long()
    live = (a >= 0) & (a < P) & (areas.area > 0)
    r = a.clamp(0, P - 1)
    remote = live & ((host.view(1, -1, 1) != r) | (host.view(1, 1, -1) != r))
    base = torch.where(live, 0, -1)
    if num_stages == 1:
        return torch.where(remote, 1, base).to(torch.int32)
    if sub_stages(num_stages, local_tail) > num_stages:
        tail = _running_share(torch.where(live & ~remote, r, P), areas.area, P, parts)
        base = torch.where(tail, num_stages + 1, base)

    # ready key of each task, (class, seconds): its last remote source to land (a local unit adds nothing)
    inter, t = landing_time(pair_bytes_fwd(areas, assignment, cost), topology)
    hi, hj = host.view(1, -1, 1).expand_as(r), host.view(1, 1, -1).expand_as(r)
    q_rem, k_rem = hi != r, hj != r
    cq, ck = q_rem & inter[hi, r], k_rem & inter[hj, r]
    cls = cq | ck
    tq = torch.where(q_rem & (cq == cls), t[hi, r], 0.0)
    tk = torch.where(k_rem & (ck == cls), t[hj, r], 0.0)
    ready = torch.maximum(tq, tk).reshape(-1)

    # per rank, in (class, ready) order, ties by task index: running work before each task
    rank_key = torch.where(remote, r, P).reshape(-1)
    order = torch.sort(ready, stable=True).indices
    order = order[torch.sort(cls.reshape(-1)[order].to(torch.int8), stable=True).indices]
    order = order[torch.sort(rank_key[order], stable=True).indices]
    work = torch.where(remote, areas.area, 0).reshape(-1)
    w_sorted = work[order]
    r_sorted = rank_key[order]
    before, total = _running_work(w_sorted, r_sorted, P)
    shares = stage_shares(num_stages)
    bounds = torch.tensor(shares[:-1], dtype=torch.int64, device=a.device).cumsum(0)   # [S - 1]
    # a task's stage: 1 + the stage boundaries at or below its running work, in integers
    # (before / W >= bound / sum(shares)), exact and the same on every rank
    at = before[:, None] * sum(shares) >= bounds[None, :] * total.clamp(min=1)[:, None]
    stage_sorted = 1 + at.sum(1)
    stage = torch.empty_like(stage_sorted).scatter_(0, order, stage_sorted.clamp(max=num_stages))
    return torch.where(remote, stage.view_as(a), base).to(torch.int32)


def _running_work(w_sorted: torch.Tensor, r_sorted: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For tasks sorted by rank (``r_sorted``, P for none) with work ``w_sorted``: (the rank's work
    before each task, the rank's total work at each task), int64."""
    incl = w_sorted.cumsum(0)
    total = torch.zeros(P + 1, dtype=torch.int64, device=w_sorted.device).scatter_add_(0, r_sorted, w_sorted)
    first = total.cumsum(0) - total                       # work of the ranks before, in the sorted list
    return incl - w_sorted - first[r_sorted], total[r_sorted]


def _running_share(rank: torch.Tensor, area: torch.Tensor, P: int, parts: int) -> torch.Tensor:
    """[G, U, U] bool: the tasks of each rank (``rank``, P for none) at and past ``1 - parts /
    TAIL_SCALE`` of its work, in task order."""
    key = rank.reshape(-1)
    order = torch.sort(key, stable=True).indices          # by rank, then task index
    w_sorted = torch.where(key < P, area.reshape(-1), 0)[order]
    before, total = _running_work(w_sorted, key[order], P)
    late = (before * TAIL_SCALE >= (TAIL_SCALE - parts) * total) & (key[order] < P) & (total > 0)
    return torch.empty_like(late).scatter_(0, order, late).view_as(rank)
