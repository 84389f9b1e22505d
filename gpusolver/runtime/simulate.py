"""One layer's forward pass, for every rank of a plan, in one process.

Shape legend: S tokens, P ranks, c = S / P, G head groups, hq = Hq / G and
hkv = Hkv / G heads per group, D head dim.

Per rank r, as the distributed runtime does it:

1. local Q, K, V of chunk r in group-major rows: ``[G * c, hq | hkv, D]``;
2. the send lists (``CommMeta.send_index``) gather the rows each source
   ships; rank r's receive buffer is the concatenation of what each source
   sends it, sources ascending (``recv_capacity`` rows, zero past the fill);
3. stage 0 attends local rows only; remote stages 1..S (``num_stages`` S; the
   sub-stages share the one receive buffer per kind, each at its own rows) attend
   ``concat(local, buffer)`` (``CalcMeta`` ranges are in exactly these coordinates);
4. partial (out, lse) of received query rows go back to their host, where all
   partials of a row are merged with the log-sum-exp correction.

The exchange here is tensor indexing; a real run replaces it with the group
collectives. Host-side loops over ranks are fine: this is a simulator.
"""
from __future__ import annotations

import torch

from attn_kernels import flex_attn, merge_out_lse
from gpusolver.plan import Plan


def group_major(x: torch.Tensor, rank: int, chunk: int, groups: int) -> torch.Tensor:
    """[S, H, D] -> rank's chunk as group-major rows [G * c, H / G, D] (row g*c + t)."""
    c, G = chunk, groups
    local = x[rank * c:(rank + 1) * c]  # [c, H, D]
    return local.view(c, G, x.shape[1] // G, x.shape[2]).transpose(0, 1).reshape(G * c, x.shape[1] // G, x.shape[2])


def ungroup(rows: torch.Tensor, chunk: int, groups: int) -> torch.Tensor:
    """Group-major rows [G * c, h, ...] -> [c, G * h, ...] (the inverse of ``group_major``)."""
    c, G = chunk, groups
    h = rows.shape[1]
    return rows.view(G, c, h, *rows.shape[2:]).transpose(0, 1).reshape(c, G * h, *rows.shape[2:])


def _exchange(plan: Plan, kind: str, local: list[torch.Tensor]) -> list[torch.Tensor]:
    """Receive buffers [receive capacity of the kind, h, D] of every rank for ``kind`` ("qo" or "kv"):
    cast s (s in 1..S) lands at its ``*_stage_base`` row, sources ascending within it."""
    m = plan.comm
    P = m.cp_size
    if m.num_stages == 1:
        casts = [(None, m.qo_split if kind == "qo" else m.kv_split, torch.zeros(P, dtype=torch.long))]
    else:
        split = m.qo_stage_split if kind == "qo" else m.kv_stage_split
        base = m.qo_stage_base if kind == "qo" else m.kv_stage_base
        casts = [(s + 1, split[s], base[s]) for s in range(m.num_stages)]
    buffers = [local[r].new_zeros((m.buffers.recv(kind),) + tuple(local[r].shape[1:])) for r in range(P)]
    for stage, split, base in casts:
        sent = []
        for src in range(P):
            idx = m.send_index(kind, src, stage=stage)
            n = int(split[src].sum())
            sent.append(torch.split(local[src][idx[:n]], split[src].tolist()))  # pieces for each destination
        for r in range(P):
            rows = torch.cat([sent[src][r] for src in range(P)])
            start = int(base[r])
            buffers[r][start:start + rows.shape[0]] = rows
    return buffers


def simulate_forward(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the plan's forward pass on all ranks: (out [S, Hq, D], lse [S, Hq] fp32).

    q: [S, Hq, D], k/v: [S, Hkv, D] (the whole sequence; each rank uses its
    chunk). The plan must be usable (status without overflow bits).
    """
    m, calc = plan.comm, plan.calc
    G, P, c = m.head_groups, m.cp_size, m.chunk
    if q.shape[0] != P * c or k.shape[0] != P * c:
        raise ValueError(f"q and k must hold S = P * c = {P * c} tokens, got {q.shape[0]} and {k.shape[0]}")
    ql = [group_major(q, r, c, G) for r in range(P)]
    kl = [group_major(k, r, c, G) for r in range(P)]
    vl = [group_major(v, r, c, G) for r in range(P)]
    q_buf = _exchange(plan, "qo", ql)
    k_buf, v_buf = _exchange(plan, "kv", kl), _exchange(plan, "kv", vl)

    outs, lses = [], []
    for r in range(P):  # each rank: every stage, then merge its own rows
        o0, l0 = flex_attn(ql[r], kl[r], vl[r], calc.q_ranges[r, 0], calc.k_ranges[r, 0], calc.attn_type[r, 0],
                           softmax_scale)
        x = torch.cat((ql[r], q_buf[r])), torch.cat((kl[r], k_buf[r])), torch.cat((vl[r], v_buf[r]))
        o1, l1 = flex_attn(*x, calc.q_ranges[r, 1], calc.k_ranges[r, 1], calc.attn_type[r, 1], softmax_scale)
        for s in range(2, calc.q_ranges.shape[1]):  # sub-stages: the log-sum-exp merge is associative
            o1, l1 = merge_out_lse(o1, l1, *flex_attn(*x, calc.q_ranges[r, s], calc.k_ranges[r, s],
                                                      calc.attn_type[r, s], softmax_scale))
        outs.append(merge_out_lse(o0, l0, o1[:G * c], l1[:G * c]))
        lses.append((o1[G * c:], l1[G * c:]))  # partials of received query rows, in buffer order

    # partial results travel back to their hosts: rows of unit (g, u) on helper r sit at
    # qo_recv_offset[g, u, r] in r's buffer and belong to host u // n's rows g * c + lo + t
    merged = [list(o) for o in outs]
    hosts = m.unit_host().tolist()
    for r in range(P):
        part_o, part_l = lses[r]
        for u, h in enumerate(hosts):
            for g in range(G):
                lo, hi = m.qo_range[g, u, r].tolist()
                if hi <= lo:
                    continue
                off = int(m.qo_recv_offset[g, u, r])
                rows = slice(g * c + lo, g * c + hi)
                o_acc, l_acc = merged[h]
                new_o, new_l = merge_out_lse(o_acc[rows], l_acc[rows], part_o[off:off + hi - lo],
                                             part_l[off:off + hi - lo])
                o_acc = o_acc.clone()
                l_acc = l_acc.clone()
                o_acc[rows], l_acc[rows] = new_o, new_l
                merged[h] = [o_acc, l_acc]
    out = torch.cat([ungroup(o, c, G) for o, _ in merged])
    lse = torch.cat([ungroup(l, c, G) for _, l in merged])
    return out, lse
