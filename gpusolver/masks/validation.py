"""Host-side checks and the dense rebuild of a slice mask.

Everything here reads mask values on the host (it copies the tensors to the
CPU), so none of it belongs on the hot path: it is the ``validate=True`` path
and the test oracle. Messages name the argument, the head group (for grouped
masks), the row and the offending values.

Shape legend: R slices, G head groups, S_q / S_k query / key tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from gpusolver.masks.types import ATTN_TYPE_NAMES, BI_CAUSAL, CAUSAL, INV_CAUSAL

# Overlap is checked pair by pair (exact, O(R^2) per group, any S); above this many
# slice rows per group the default skips it (pass check_overlap=True to force it).
OVERLAP_CHECK_MAX_SLICES = 4096


def check_heads(num_heads_q: int, num_heads_kv: int) -> int:
    """Check a GQA head layout and return the query heads per KV head (Hq / Hkv)."""
    for name, v in (("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_heads_q % num_heads_kv:
        raise ValueError(
            f"num_heads_q={num_heads_q} must be divisible by num_heads_kv={num_heads_kv} "
            f"(each KV head serves the same number of query heads)")
    return num_heads_q // num_heads_kv


def _host_arrays(mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [G,R,2], k [G,R,2], t [G,R]) int64 numpy copies; G = 1 for ungrouped masks."""
    if mask.device.type == "meta":
        raise ValueError("host-side mask checks read the mask values; got tensors on device 'meta'")
    q = mask.q_ranges.detach().to("cpu", torch.int64).numpy()
    k = mask.k_ranges.detach().to("cpu", torch.int64).numpy()
    t = mask.attn_type.detach().to("cpu", torch.int64).numpy()
    if not mask.grouped:
        q, k, t = q[None], k[None], t[None]
    return q, k, t


def _where(grouped: bool, g: int) -> str:
    return f"[group {g}] " if grouped else ""


def _row_bounds(qs: int, qe: int, ks: int, ke: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query row of a slice, the valid key interval [lo, hi) (absolute columns)."""
    q = np.arange(qs, qe, dtype=np.int64)
    lo = np.maximum(ks, q + (ks - qs)) if t in (INV_CAUSAL, BI_CAUSAL) else np.full_like(q, ks)
    hi = np.minimum(ke, q + (ke - qe) + 1) if t in (CAUSAL, BI_CAUSAL) else np.full_like(q, ke)
    return lo, hi


def _covers(row, q: int, k: int) -> bool:
    """Whether slice ``row = ((qs, qe), (ks, ke), type)`` covers entry (q, k)."""
    (qs, qe), (ks, ke), t = row
    if not (qs <= q < qe and ks <= k < ke):
        return False
    lo = max(ks, q + ks - qs) if t in (INV_CAUSAL, BI_CAUSAL) else ks
    hi = min(ke, q + ke - qe + 1) if t in (CAUSAL, BI_CAUSAL) else ke
    return lo <= k < hi


def _check_ranges(name: str, ranges: np.ndarray, total: int, total_name: str, grouped: bool) -> None:
    start, end = ranges[..., 0], ranges[..., 1]
    bad = np.argwhere((start > end) | (start < 0) | (end > total))
    if not bad.size:
        return
    g, r = bad[0].tolist()
    s, e = int(start[g, r]), int(end[g, r])
    if s > e:
        raise ValueError(f"{name} {_where(grouped, g)}row {r}: start {s} > end {e}")
    raise ValueError(f"{name} {_where(grouped, g)}row {r}: [{s}, {e}) is outside [0, {total_name}={total})")


_FAR = 1 << 40  # "no diagonal": farther than any offset of int32 ranges


def _diagonals(q: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slice, the valid offsets ``k - q`` lie in ``[lo, hi]``: CAUSAL bounds hi, INV_CAUSAL lo."""
    causal = (t == CAUSAL) | (t == BI_CAUSAL)
    inv = (t == INV_CAUSAL) | (t == BI_CAUSAL)
    hi = torch.where(causal, k[..., 1] - q[..., 1], _FAR)
    lo = torch.where(inv, k[..., 0] - q[..., 0], -_FAR)
    return lo, hi


def overlap_witness(q: torch.Tensor, k: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                    others: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which slices of ``others`` share an entry with each slice of ``rows``, and the first one.

    q, k: ``[..., R, 2]`` int64 ranges, t: ``[..., R]`` int64 types (a leading group
    dim is carried); rows ``[A]``, others ``[B]`` int64 slice indices. Returns
    ``(clash [..., A, B] bool, wq, wk [..., A, B] int64)``: the lexicographically first
    entry (q, k) covered by both (meaningful where clash). Exact and O(A * B): two slices
    meet iff some q in both query ranges has ``max(k0, q + lo) <= min(k1 - 1, q + hi)``,
    which is an interval condition on q. Padding rows (an empty range) meet nothing.
    Sync-free (torch ops, static shapes): the device twin is built on it too.
    """
    lo, hi = _diagonals(q, k, t)
    def pick(x, idx):
        return x.index_select(-1 if x.dim() == t.dim() else -2, idx)
    qa, qb = pick(q, rows)[..., :, None, :], pick(q, others)[..., None, :, :]
    ka, kb = pick(k, rows)[..., :, None, :], pick(k, others)[..., None, :, :]
    q0, q1 = torch.maximum(qa[..., 0], qb[..., 0]), torch.minimum(qa[..., 1], qb[..., 1])
    k0, k1 = torch.maximum(ka[..., 0], kb[..., 0]), torch.minimum(ka[..., 1], kb[..., 1])
    dlo = torch.maximum(pick(lo, rows)[..., :, None], pick(lo, others)[..., None, :])
    dhi = torch.minimum(pick(hi, rows)[..., :, None], pick(hi, others)[..., None, :])
    first = torch.maximum(q0, k0 - dhi)
    last = torch.minimum(q1 - 1, k1 - 1 - dlo)
    clash = (first <= last) & (k0 < k1) & (dlo <= dhi)
    return clash, first, torch.maximum(k0, first + dlo)


def _check_overlap(q: np.ndarray, k: np.ndarray, t: np.ndarray, grouped: bool, block: int = 512) -> None:
    """The first slice row (in order) that covers an entry an earlier row covers, per group."""
    tq, tk, tt = torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(t)
    R = q.shape[1]
    for g in range(q.shape[0]):
        for a in range(0, R, block):
            rows = torch.arange(a, min(a + block, R))
            clash, wq, wk = overlap_witness(tq[g], tk[g], tt[g], rows, torch.arange(R))
            clash &= torch.arange(R)[None, :] < rows[:, None]             # earlier rows only
            hit = clash.any(1).nonzero()
            if not hit.numel():
                continue
            i = int(hit[0, 0])
            r = a + i
            js = clash[i].nonzero()[:, 0]
            # the first entry row r shares with any earlier row, and the first row covering it
            key = wq[i, js] * (1 << 32) + wk[i, js]
            qq, kk = int(wq[i, js[key.argmin()]]), int(wk[i, js[key.argmin()]])
            first = next(int(j) for j in js if bool(_covers_t(tq[g, j], tk[g, j], tt[g, j], qq, kk)))
            (qs, qe), (ks, ke), ty = q[g, r].tolist(), k[g, r].tolist(), int(t[g, r])
            (fqs, fqe), (fks, fke) = q[g, first].tolist(), k[g, first].tolist()
            raise ValueError(
                f"q_ranges/k_ranges {_where(grouped, g)}row {r} ({ATTN_TYPE_NAMES.get(ty, ty)} "
                f"q [{qs}, {qe}) k [{ks}, {ke})) covers entry (q={qq}, k={kk}) already covered by "
                f"row {first} (q [{fqs}, {fqe}) k [{fks}, {fke})); slices must not overlap")


def _covers_t(q: torch.Tensor, k: torch.Tensor, t: torch.Tensor, qq: int, kk: int) -> bool:
    row = (tuple(q.tolist()), tuple(k.tolist()), int(t))
    return _covers(row, qq, kk)


def validate_slices(mask, cp_size: int | None = None, check_overlap: bool | None = None) -> None:
    """Full host-side value checks of an ``AttnSlices`` mask; raises ValueError on the first problem.

    Checks, in order: ``cp_size`` divides ``total_seqlen_q`` and ``total_seqlen_k``
    (when given); every q range lies in ``[0, total_seqlen_q]`` with start <= end,
    every k range likewise against ``total_seqlen_k``; every ``attn_type`` is a
    code 0..3; and no (q, k) entry is covered by two slices of the same group.
    The overlap check compares slices pair by pair in closed form (exact at any
    S; ``overlap_witness``), so by default (``check_overlap=None``) it runs when
    a group has at most ``OVERLAP_CHECK_MAX_SLICES`` rows.

    Reads the tensors on the host: not for the hot path.
    """
    s_q, s_k = mask.total_seqlen_q, mask.total_seqlen_k
    if cp_size is not None:
        if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size <= 0:
            raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
        for name, n in (("total_seqlen_q", s_q), ("total_seqlen_k", s_k)):
            if n % cp_size:
                raise ValueError(
                    f"{name}={n} must be divisible by cp_size={cp_size} "
                    f"(pad the sequence to a multiple of {cp_size})")
    q, k, t = _host_arrays(mask)
    _check_ranges("q_ranges", q, s_q, "total_seqlen_q", mask.grouped)
    _check_ranges("k_ranges", k, s_k, "total_seqlen_k", mask.grouped)
    bad = np.argwhere((t < 0) | (t > 3))
    if bad.size:
        g, r = bad[0].tolist()
        raise ValueError(
            f"attn_type {_where(mask.grouped, g)}row {r}: code {int(t[g, r])} is not one of "
            f"0 FULL, 1 CAUSAL, 2 INV_CAUSAL, 3 BI_CAUSAL")
    if check_overlap is None:
        check_overlap = q.shape[1] <= OVERLAP_CHECK_MAX_SLICES
    if check_overlap:
        _check_overlap(q, k, t, mask.grouped)


def slices_to_dense(mask, head_group: int = 0) -> torch.Tensor:
    """The dense mask of one head group: bool [S_q, S_k] on the CPU.

    Follows the rebuild in ``gpusolver.masks.slices`` exactly: padding rows
    (an empty q or k range) contribute nothing; a grouped mask [G, R, ...]
    picks group ``head_group``, an ungrouped one is the same for every group.
    Range values must already be valid (see ``validate_slices``). Host-side,
    for small masks and tests.
    """
    if not isinstance(head_group, int) or head_group < 0:
        raise ValueError(f"head_group must be a non-negative int, got {head_group!r}")
    q, k, t = _host_arrays(mask)
    if mask.grouped and head_group >= q.shape[0]:
        raise ValueError(f"head_group={head_group} is out of range for a mask with {q.shape[0]} head groups")
    g = head_group if mask.grouped else 0
    dense = np.zeros((mask.total_seqlen_q, mask.total_seqlen_k), dtype=bool)
    for r in range(q.shape[1]):
        (qs, qe), (ks, ke), ty = q[g, r].tolist(), k[g, r].tolist(), int(t[g, r])
        if qs == qe or ks == ke:
            continue
        lo, hi = _row_bounds(qs, qe, ks, ke, ty)
        cols = np.arange(ks, ke, dtype=np.int64)
        dense[qs:qe, ks:ke] |= (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    return torch.from_numpy(dense)
