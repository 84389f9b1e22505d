"""Random routings and a plain-python oracle for group_cast / group_reduce (loops, float64)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    P: int
    N: int
    split: torch.Tensor        # [P, P] int64
    send_index: torch.Tensor   # [P, send_cap] int64, -1 padded
    recv_capacity: int


def random_routing(P: int, N: int, seed: int, extra_send: int = 2, extra_recv: int = 3) -> Routing:
    """Each source sends a random set of distinct rows to each other rank (rows repeat across ranks)."""
    g = torch.Generator().manual_seed(seed)
    split = torch.zeros(P, P, dtype=torch.int64)
    lists = []
    for s in range(P):
        rows = []
        for d in range(P):
            if d == s:
                continue
            k = int(torch.randint(0, N + 1, (1,), generator=g))
            rows += torch.randperm(N, generator=g)[:k].tolist()
            split[s, d] = k
        lists.append(rows)
    send_cap = max(len(r) for r in lists) + extra_send
    send_index = torch.full((P, send_cap), -1, dtype=torch.int64)
    for s, rows in enumerate(lists):
        send_index[s, :len(rows)] = torch.tensor(rows, dtype=torch.int64)
    recv_capacity = int(split.sum(0).max()) + extra_recv
    return Routing(P, N, split, send_index, recv_capacity)


def _blocks(r: Routing):
    """(s, d, q, host row, receive row) for every row that travels."""
    split = r.split.tolist()
    for d in range(r.P):
        for s in range(r.P):
            start = sum(split[s][:d])
            off = sum(split[k][d] for k in range(s))
            for q in range(split[s][d]):
                yield s, d, q, int(r.send_index[s, start + q]), off + q


def oracle_cast(t: torch.Tensor, r: Routing) -> torch.Tensor:
    """``t [P, N, *f]`` -> ``[P, recv_capacity, *f]``."""
    out = torch.zeros(r.P, r.recv_capacity, *t.shape[2:], dtype=t.dtype)
    for s, d, _, row, at in _blocks(r):
        out[d, at] = t[s, row]
    return out


def oracle_sum(partial: torch.Tensor, acc: torch.Tensor, r: Routing) -> torch.Tensor:
    """``acc [P, N, *f]`` plus every partial routed back, in float64."""
    out = acc.double().clone()
    for s, d, _, row, at in _blocks(r):
        out[s, row] += partial[d, at].double()
    return out


def oracle_lse(out_p, lse_p, out_acc, lse_acc, r: Routing):
    """Dense log-sum-exp merge of the host's (out, lse) with every partial of each row, float64."""
    parts = {(s, n): [(out_acc[s, n].double(), lse_acc[s, n].double())]
             for s in range(r.P) for n in range(r.N)}
    for s, d, _, row, at in _blocks(r):
        parts[(s, row)].append((out_p[d, at].double(), lse_p[d, at].double()))
    out = torch.zeros(out_acc.shape, dtype=torch.float64)
    lse = torch.zeros(lse_acc.shape, dtype=torch.float64)
    for (s, n), items in parts.items():
        ls = torch.stack([x[1] for x in items])              # [k, h]
        total = torch.logsumexp(ls, 0)                        # -inf where every lse is -inf
        safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
        w = torch.exp(ls - safe)                              # [k, h]
        out[s, n] = (w[..., None] * torch.stack([x[0] for x in items])).sum(0)
        lse[s, n] = total
    return out, lse
