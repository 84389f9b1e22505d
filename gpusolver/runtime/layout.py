"""Token layouts of the runtime: group-major rows, and sequential shards.

Shape legend: S tokens, P ranks, c = S / P, G head groups, H heads (h = H / G
per group), D head dim. A leading rank dim ``[P, ...]`` (``LocalGroup``) is
carried through unchanged by every function here.

Group-major rows (``gpusolver.plan.meta``): a rank's ``[c, H, *tail]`` shard
is viewed as ``[G * c, h, *tail]``, row ``g * c + t`` = token t with the h
heads of group g. CalcMeta and CommMeta index these rows.

Sequential shards: rank p holds tokens ``[p * c, (p + 1) * c)`` in their
natural order, so RoPE positions, the label shift and the loss need no
permutation.
"""
from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from groupcomm import retain


def to_group_major(x: torch.Tensor, groups: int, lead: int = 0) -> torch.Tensor:
    """``[*lead, c, H, *tail]`` -> ``[*lead, G * c, H / G, *tail]`` (a copy unless G = 1)."""
    if groups == 1:
        return x
    c, H = x.shape[lead], x.shape[lead + 1]
    pre, tail = x.shape[:lead], x.shape[lead + 2:]
    x = x.reshape(*pre, c, groups, H // groups, *tail).transpose(lead, lead + 1)
    return x.reshape(*pre, groups * c, H // groups, *tail)


def from_group_major(rows: torch.Tensor, groups: int, lead: int = 0) -> torch.Tensor:
    """``[*lead, G * c, h, *tail]`` -> ``[*lead, c, G * h, *tail]`` (the inverse of ``to_group_major``)."""
    if groups == 1:
        return rows
    n, h = rows.shape[lead], rows.shape[lead + 1]
    pre, tail = rows.shape[:lead], rows.shape[lead + 2:]
    x = rows.reshape(*pre, groups, n // groups, h, *tail).transpose(lead, lead + 1)
    return x.reshape(*pre, n // groups, groups * h, *tail)


def natural_copy(rows: torch.Tensor, groups: int, lead: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``from_group_major(rows, groups, lead)`` as a new tensor in ``dtype`` (default rows'), written by
    one strided copy: neither a converted copy in the group-major layout nor a natural copy in the old
    dtype is made (an fp32 sum becomes its bf16 gradient in the caller's layout in one pass)."""
    n, h = rows.shape[lead], rows.shape[lead + 1]
    pre, tail = rows.shape[:lead], rows.shape[lead + 2:]
    out = rows.new_empty((*pre, n // groups, groups * h, *tail), dtype=dtype or rows.dtype)
    out.unflatten(lead + 1, (groups, h)).transpose(lead, lead + 1).copy_(rows.unflatten(lead, (groups, n // groups)))
    return out


def _rank_and_size(group) -> tuple[int | None, int]:
    """(rank, P) of a per-rank group, (None, P) of a ``LocalGroup`` (all ranks at once)."""
    if getattr(group, "batched", False):
        return None, group.size
    if hasattr(group, "rank") and hasattr(group, "size"):
        return group.rank, group.size
    return dist.get_rank(group), dist.get_world_size(group)


def _check_dim(op: str, x, dim, lead: int = 0) -> None:
    """x a tensor and dim an int indexing its dims after the first ``lead`` (a ``LocalGroup``'s rank
    dim), before ``x.shape[dim]`` reads it (an IndexError or an AttributeError there names neither)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    ndim = x.dim() - lead
    try:
        ok = not isinstance(dim, bool) and -ndim <= operator.index(dim) < ndim
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{op}: dim={dim!r} must be an int in [{-ndim}, {ndim}) for x of shape {tuple(x.shape)}"
                         + (" (dim indexes the chunk, after the rank dim)" if lead else ""))


def shard(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (tokens keep their order).

    ``x`` is the whole sequence, ``dim`` of size S divisible by P. With a
    ``LocalGroup`` the result stacks every rank's chunk: ``[P, ..., c, ...]``
    (rank dim first).
    """
    _check_dim("shard", x, dim)
    rank, P = _rank_and_size(group)
    S = x.shape[dim]
    if S % P:
        raise ValueError(f"shard: x.shape[{dim}] = {S} must be divisible by the group size P = {P}")
    if rank is None:
        return torch.stack(x.chunk(P, dim=dim))
    return x.narrow(dim, rank * (S // P), S // P)


def unshard(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """The whole sequence from every rank's chunk (the inverse of ``shard``).

    A ``LocalGroup`` takes the stacked ``[P, ..., c, ...]`` (``dim`` indexes the
    chunk without the rank dim); a process group all-gathers (not differentiable).
    """
    rank, P = _rank_and_size(group)
    _check_dim("unshard", x, dim, lead=int(rank is None))
    if rank is None:
        if x.shape[0] != P:
            raise ValueError(f"unshard: x must have a leading rank dim of P = {P}, got {tuple(x.shape)}")
        return torch.cat(x.unbind(0), dim=dim)
    pg = getattr(group, "process_group", group)
    parts = [torch.empty_like(x) for _ in range(P)]
    mine = x.contiguous()
    dist.all_gather(parts, mine, group=pg)
    retain(mine, *parts)  # freed by Python, never by a gloo worker thread (groupcomm._retain)
    return torch.cat(parts, dim=dim)
