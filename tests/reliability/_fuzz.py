"""Strategies and oracles of the fuzz harness (``test_fuzz.py``).

Masks come from a mix of generators, degenerate ones included: empty (all
padding), one-token documents, one full-S range, random non-overlapping
slices with padding rows, packed causal / full documents, sliding windows,
optionally grouped ([G, R]) and with their rows shuffled.

``plan_coverage`` rebuilds, from a Plan's CalcMeta and CommMeta alone, how
many times each (group, query, key) entry is computed: the stage rows of
every rank mapped back to global tokens through the receive layout.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from attn_kernels.reference import dense_attn
from gpusolver.masks import AttnSlices
from gpusolver.masks.slices import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL
from tests.attn_kernels._slices import random_slices

KINDS = ("empty", "one-token-docs", "full-range", "causal-range", "random", "causal-docs", "full-docs", "window",
         "mixed-docs")


def _doc_lengths(S: int, rng: np.random.Generator, max_doc: int | None = None) -> list[int]:
    out, left = [], S
    while left:
        n = int(rng.integers(1, (max_doc or max(2, S // 3)) + 1))
        n = min(n, left)
        out.append(n)
        left -= n
    return out


def mask_rows(kind: str, S: int, seed: int) -> list[tuple[int, int, int, int, int]]:
    """(qs, qe, ks, ke, type) rows of one generated mask over S tokens (no overlaps)."""
    rng = np.random.default_rng(seed)
    if kind == "empty":
        return [(0, 0, 0, 0, FULL), (int(rng.integers(0, S + 1)),) * 2 + (0, S, CAUSAL)]
    if kind == "one-token-docs":
        return [(t, t + 1, t, t + 1, int(rng.integers(0, 4))) for t in range(S)]
    if kind == "full-range":
        return [(0, S, 0, S, FULL)]
    if kind == "causal-range":
        return [(0, S, 0, S, CAUSAL)]
    if kind == "random" and S < 2:
        return [(0, S, 0, S, FULL)]
    if kind == "random":
        q, k, t = random_slices(S, S, seed, num_pad=int(rng.integers(0, 4)))
        return [tuple(a) + tuple(b) + (int(c),) for a, b, c in zip(q.tolist(), k.tolist(), t.tolist())]
    if kind in ("causal-docs", "full-docs", "mixed-docs"):
        rows, start = [], 0
        for n in _doc_lengths(S, rng):
            typ = {"causal-docs": CAUSAL, "full-docs": FULL}.get(kind, int(rng.choice([FULL, CAUSAL])))
            rows.append((start, start + n, start, start + n, typ))
            start += n
        return rows
    if kind == "window":
        w = int(rng.integers(1, S + 1))
        rows = [(0, w, 0, w, CAUSAL)]
        if w < S:
            rows.append((w, S, 1, S, BI_CAUSAL))
        return rows
    raise ValueError(kind)


def make_mask(kind: str, S: int, seed: int, *, groups: int = 0, pad: int = 0, shuffle: bool = False,
              device="cpu") -> AttnSlices:
    """A generated mask; ``groups`` > 0 gives a grouped [G, R] mask (each group its own seed),
    ``pad`` extra padding rows, ``shuffle`` rows in random order."""
    rng = np.random.default_rng(seed + 7)
    tables = []
    for g in range(max(groups, 1)):
        rows = mask_rows(kind, S, seed + 1000 * g)
        rows += [(int(rng.integers(0, S + 1)),) * 2 + (0, int(rng.integers(0, S + 1)), 0) for _ in range(pad)]
        if shuffle:
            rows = [rows[i] for i in rng.permutation(len(rows))]
        tables.append(rows)
    R = max(len(r) for r in tables)
    tables = [r + [(0, 0, 0, 0, FULL)] * (R - len(r)) for r in tables]
    t = torch.tensor(tables, dtype=torch.int32)
    if not groups:
        t = t[0]
    return AttnSlices(t[..., 0:2].contiguous().to(device), t[..., 2:4].contiguous().to(device),
                      t[..., 4].contiguous().to(device), S, S)


def masks(max_s: int = 96, groups: bool = True):
    """Hypothesis strategy: (kind, S-independent seed, groups, pad, shuffle)."""
    return st.fixed_dictionaries({
        "kind": st.sampled_from(KINDS), "seed": st.integers(0, 2 ** 20),
        "groups": st.sampled_from([0, 2]) if groups else st.just(0),
        "pad": st.integers(0, 3), "shuffle": st.booleans()})


def dense(mask: AttnSlices, G: int) -> torch.Tensor:
    """[G, S, S] int64: 1 where group g's query attends the key (ungrouped: the same for all)."""
    return torch.stack([mask.to_dense(g if mask.grouped else 0) for g in range(G)]).long()


def dense_layer_reference(mask: AttnSlices, G: int, q, k, v, d_out) -> list[torch.Tensor]:
    """out, lse, dq, dk, dv of dense attention per head group (a grouped mask differs per group),
    in float64 and returned as float32, for q ``[T, 2 G, D]`` (two query heads a group), k, v
    ``[T, G, D]``, d_out like q."""
    hq = 2
    T, D = q.shape[0], q.shape[2]
    ref = [torch.zeros(T, h, *((D,) if i != 1 else ())) for i, h in enumerate((hq * G,) * 3 + (G, G))]
    for grp in range(G):
        dm = dense(mask, G)[grp].bool()
        qq, kk, vv = (x[:, grp * h:(grp + 1) * h].double().requires_grad_() for x, h in ((q, hq), (k, 1), (v, 1)))
        o, lse = dense_attn(qq, kk, vv, dm)
        o.backward(d_out[:, grp * hq:(grp + 1) * hq].double())
        for i, (t, h) in enumerate(((o, hq), (lse, hq), (qq.grad, hq), (kk.grad, 1), (vv.grad, 1))):
            ref[i][:, grp * h:(grp + 1) * h] = t.detach().float()
    return ref


def _stage_map(plan, rank: int, stage: int, which: str):
    """Stage row -> (group, global token) for rank's q ("qo") or k ("kv") rows; -1 where unused."""
    comm = plan.comm
    G, c, n = comm.head_groups, comm.chunk, comm.tiles
    cap = comm.buffers.recv(which)
    size = G * c + (cap if stage == 1 else 0)
    grp = np.full(size, -1, dtype=np.int64)
    tok = np.full(size, -1, dtype=np.int64)
    local = np.arange(G * c)
    grp[:G * c], tok[:G * c] = local // c, rank * c + local % c
    if stage == 1:
        rng = (comm.qo_range if which == "qo" else comm.kv_range).cpu().numpy()          # [G, U, P, 2]
        off = (comm.qo_recv_offset if which == "qo" else comm.kv_recv_offset).cpu().numpy()
        U = rng.shape[1]
        for g in range(G):
            for u in range(U):
                a, b = rng[g, u, rank]
                if b > a:
                    o = G * c + off[g, u, rank]
                    grp[o:o + b - a] = g
                    tok[o:o + b - a] = (u // n) * c + np.arange(a, b)
    return grp, tok


def plan_coverage(plan, S: int) -> np.ndarray:
    """[G, S, S] int64: how many (rank, stage, piece) entries of the plan compute each entry."""
    comm, calc = plan.comm, plan.calc
    G = comm.head_groups
    cover = np.zeros((G, S, S), dtype=np.int64)
    q_r, k_r, t_r = (x.cpu().numpy() for x in (calc.q_ranges, calc.k_ranges, calc.attn_type))
    for r in range(comm.cp_size):
        for s in range(2):
            qg, qt = _stage_map(plan, r, s, "qo")
            kg, kt = _stage_map(plan, r, s, "kv")
            for (qs, qe), (ks, ke), typ in zip(q_r[r, s], k_r[r, s], t_r[r, s]):
                if qs >= qe or ks >= ke:
                    continue
                x = np.arange(qs, qe)[:, None]
                y = np.arange(ks, ke)[None, :]
                ok = np.ones((qe - qs, ke - ks), dtype=bool)
                if typ in (CAUSAL, BI_CAUSAL):
                    ok &= y <= x + (ke - qe)
                if typ in (INV_CAUSAL, BI_CAUSAL):
                    ok &= y >= x + (ks - qs)
                xs, ys = np.nonzero(ok)
                xs, ys = xs + qs, ys + ks
                assert (qg[xs] >= 0).all() and (kg[ys] >= 0).all(), f"rank {r} stage {s}: a piece reads unused rows"
                assert (qg[xs] == kg[ys]).all(), f"rank {r} stage {s}: a piece pairs two head groups"
                np.add.at(cover, (qg[xs], qt[xs], kt[ys]), 1)
    return cover


def slice_area(rows) -> int:
    """Exact entry count of non-overlapping (qs, qe, ks, ke, type) rows, in Python ints (any S)."""
    total = 0
    for qs, qe, ks, ke, t in rows:
        if qs >= qe or ks >= ke:
            continue
        n = qe - qs
        if t == FULL:
            total += n * (ke - ks)
            continue
        for q in range(qs, qe) if n <= 4096 else ():
            lo = max(ks, q + ks - qs) if t in (INV_CAUSAL, BI_CAUSAL) else ks
            hi = min(ke, q + ke - qe + 1) if t in (CAUSAL, BI_CAUSAL) else ke
            total += max(0, hi - lo)
        if n > 4096:  # closed form per row segment: sum of a clipped linear function
            q = np.arange(qs, qe, dtype=np.int64)
            lo = np.maximum(ks, q + ks - qs) if t in (INV_CAUSAL, BI_CAUSAL) else np.full_like(q, ks)
            hi = np.minimum(ke, q + ke - qe + 1) if t in (CAUSAL, BI_CAUSAL) else np.full_like(q, ke)
            total += int(np.maximum(hi - lo, 0).sum())
    return total
