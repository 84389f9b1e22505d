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
