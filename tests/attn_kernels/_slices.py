"""Random slice lists for the attention tests (host-side, seeded)."""
from __future__ import annotations

import torch


def random_slices(seqlen_q: int, seqlen_k: int, seed: int, num_pad: int = 2,
                  skip_prob: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-overlapping slices with shared query rows, empty rows and dummy rows.

    The key axis is cut in two halves; in each half the query axis is split
    into random segments (different cut points per half, so slices of the two
    halves share query rows with unaligned bounds), each segment (unless
    skipped, leaving rows without keys) gets a random key sub-range of that
    half and a random type. ``num_pad`` dummy rows are inserted at random
    positions. Returns q_ranges [R, 2], k_ranges [R, 2], attn_type [R] int32.
    """
    g = torch.Generator().manual_seed(seed)

    def rint(lo: int, hi: int) -> int:  # inclusive bounds
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    rows = []
    half = rint(1, seqlen_k - 1)
    for k_lo, k_hi in ((0, half), (half, seqlen_k)):
        q0 = 0
        while q0 < seqlen_q:
            q1 = min(seqlen_q, q0 + rint(1, max(1, seqlen_q // 2)))
            if float(torch.rand(1, generator=g)) >= skip_prob:
                ks = rint(k_lo, k_hi - 1)
                ke = rint(ks + 1, k_hi)
                rows.append(((q0, q1), (ks, ke), rint(0, 3)))
            q0 = q1
    for _ in range(num_pad):
        pos = rint(0, len(rows))
        s = rint(0, seqlen_q)
        rows.insert(pos, ((s, s), (0, rint(0, seqlen_k)), rint(0, 3)) if pos % 2 else
                    ((0, rint(0, seqlen_q)), (s % (seqlen_k + 1),) * 2, rint(0, 3)))
    q_ranges = torch.tensor([r[0] for r in rows], dtype=torch.int32).reshape(-1, 2)
    k_ranges = torch.tensor([r[1] for r in rows], dtype=torch.int32).reshape(-1, 2)
    attn_type = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    return q_ranges, k_ranges, attn_type


def ranges(q, k, t):
    """Slice tensors from Python lists: ([[qs, qe]..], [[ks, ke]..], [t..]) -> int32 tensors."""
    return (torch.tensor(q, dtype=torch.int32).reshape(-1, 2), torch.tensor(k, dtype=torch.int32).reshape(-1, 2),
            torch.tensor(t, dtype=torch.int32))


def split_keys(q_ranges, k_ranges, attn_type, m: int):
    """Cut a slice list at key m into the part over keys [0, m) and the part over [m, Tk).

    Returns two slice lists (as ``ranges`` gives them); the second one's key
    ranges are relative to m, as a rank holding only keys [m, Tk) sees them.
    A CAUSAL bound cut by m leaves some rows with all keys of the left part
    (those become FULL, or INV_CAUSAL re-anchored at their first row), and
    likewise an INV_CAUSAL bound on the right part. Empty pieces are dropped.
    """
    left, right = [], []
    for (qs, qe), (ks, ke), t in zip(q_ranges.tolist(), k_ranges.tolist(), attn_type.tolist()):
        if qs >= qe or ks >= ke:
            continue
        if ke <= m:
            left.append((qs, qe, ks, ke, t))
            continue
        if ks >= m:
            right.append((qs, qe, ks - m, ke - m, t))
            continue
        causal, inv = t in (1, 3), t in (2, 3)
        d_hi, d_lo = ke - qe, ks - qs  # causal: k <= q + d_hi; inv: k >= q + d_lo
        # left, keys [ks, m): the causal bound binds on rows q < q1 only
        q1 = min(max(m - 1 - d_hi, qs), qe) if causal else qs
        if q1 > qs and q1 + d_hi > ks:
            left.append((qs, q1, ks, q1 + d_hi, t))
        ks1 = q1 + d_lo if inv else ks  # keeps k >= q + d_lo for rows from q1
        if q1 < qe and ks1 < m:
            left.append((q1, qe, ks1, m, 2 if inv else 0))
        # right, keys [m, ke): the inv bound binds on rows q >= q2 only
        q2 = min(max(m - d_lo + 1, qs), qe) if inv else qe
        if q2 < qe and q2 + d_lo < ke:
            right.append((q2, qe, q2 + d_lo - m, ke - m, t))
        ke2 = q2 + d_hi if causal else ke  # keeps k <= q + d_hi for rows before q2
        if q2 > qs and ke2 > m:
            right.append((qs, q2, 0, ke2 - m, 1 if causal else 0))
    return tuple(ranges([r[:2] for r in rows], [r[2:4] for r in rows], [r[4] for r in rows])
                 for rows in (left, right))
