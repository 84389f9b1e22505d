"""The slice mask form: a list of (query range, key range, type) rectangles.

Shape legend: R slices, G head groups (optional leading dim), S tokens.

    q_ranges:  [R, 2] or [G, R, 2] int32, half-open [start, end) query rows
    k_ranges:  [R, 2] or [G, R, 2] int32, half-open [start, end) key columns
    attn_type: [R]    or [G, R]    int32, one of the codes below

For a slice with query range [qs, qe) and key range [ks, ke), entry (q, k) of
the rectangle is valid when

    FULL       (0): always
    CAUSAL     (1): k <= q + (ke - qe)          bottom-right aligned diagonal
    INV_CAUSAL (2): k >= q + (ks - qs)          top-left aligned diagonal
    BI_CAUSAL  (3): both of the above

A row with ``start == end`` in either range is padding and contributes
nothing; callers pad R to a fixed size this way to keep shapes static.
Slices may share query rows but must not cover the same (q, k) entry twice.

The dense rebuild, for the reader (and what ``to_dense`` does)::

    dense = zeros(S_q, S_k, bool)
    for (qs, qe), (ks, ke), t in zip(q_ranges, k_ranges, attn_type):
        for q in range(qs, qe):
            lo = max(ks, q + ks - qs) if t in (2, 3) else ks
            hi = min(ke, q + ke - qe + 1) if t in (1, 3) else ke
            dense[q, lo:hi] = True
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# the type codes live in ``masks.types``; importing them from here still works
from gpusolver.masks.types import ATTN_TYPE_NAMES, BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL  # noqa: F401
from gpusolver.masks.validation import slices_to_dense, validate_slices

_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class AttnSlices:
    """A slice mask held in device tensors (see the module docstring).

    ``total_seqlen_q`` / ``total_seqlen_k`` are host ints (configuration, not
    mask values): they size every output, so shapes never depend on the mask.
    """

    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type: torch.Tensor
    total_seqlen_q: int
    total_seqlen_k: int

    def __post_init__(self):
        check_slices_meta(self.q_ranges, self.k_ranges, self.attn_type,
                          self.total_seqlen_q, self.total_seqlen_k)

    @property
    def num_slices(self) -> int:
        return self.q_ranges.shape[-2]

    @property
    def grouped(self) -> bool:
        """True when the mask carries a leading head-group dim [G, R, ...]."""
        return self.q_ranges.dim() == 3

    @property
    def device(self) -> torch.device:
        return self.q_ranges.device

    def per_group(self, head_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_ranges [G,R,2], k_ranges [G,R,2], attn_type [G,R]) int64, broadcast to G groups."""
        q, k, t = self.q_ranges.long(), self.k_ranges.long(), self.attn_type.long()
        if not self.grouped:
            q, k, t = q[None], k[None], t[None]
        elif q.shape[0] != head_groups:
            raise ValueError(
                f"mask has a head-group dim of {q.shape[0]} but head_groups={head_groups}; "
                "pass head_groups equal to the mask's leading dim, or an ungrouped [R, 2] mask")
        shape_q = (head_groups,) + tuple(q.shape[1:])
        shape_t = (head_groups,) + tuple(t.shape[1:])
        return q.expand(shape_q), k.expand(shape_q), t.expand(shape_t)

    def validate(self, cp_size: int | None = None, check_overlap: bool | None = None) -> "AttnSlices":
        """Full host-side value checks with row-precise messages (reads the tensors).

        Not for the hot path: it copies the mask to the host. Returns self.
        """
        validate_slices(self, cp_size=cp_size, check_overlap=check_overlap)
        return self

    def value_error(self) -> torch.Tensor:
        """0-dim bool on the mask's device: some range is reversed or outside
        [0, S], or some type code is not 0..3. Sync-free (the device-side twin
        of ``validate``, which names the row)."""
        q, k, t = self.q_ranges, self.k_ranges, self.attn_type
        bad_q = (q[..., 0] < 0) | (q[..., 0] > q[..., 1]) | (q[..., 1] > self.total_seqlen_q)
        bad_k = (k[..., 0] < 0) | (k[..., 0] > k[..., 1]) | (k[..., 1] > self.total_seqlen_k)
        bad_t = (t < FULL) | (t > BI_CAUSAL)
        return (bad_q | bad_k | bad_t).any()

    def to_dense(self, head_group: int = 0) -> torch.Tensor:
        """The dense [S_q, S_k] bool mask of one head group (host-side, small masks)."""
        return slices_to_dense(self, head_group)


def check_slices_meta(q_ranges, k_ranges, attn_type, total_seqlen_q, total_seqlen_k) -> None:
    """Shape / dtype / device checks: host metadata only, always run."""
    for name, t in (("q_ranges", q_ranges), ("k_ranges", k_ranges), ("attn_type", attn_type)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if q_ranges.dim() not in (2, 3) or q_ranges.shape[-1] != 2:
        raise ValueError(f"q_ranges must be [R, 2] or [G, R, 2], got {tuple(q_ranges.shape)}")
    if k_ranges.shape != q_ranges.shape:
        raise ValueError(f"k_ranges shape {tuple(k_ranges.shape)} must equal q_ranges shape {tuple(q_ranges.shape)}")
    if tuple(attn_type.shape) != tuple(q_ranges.shape[:-1]):
        raise ValueError(
            f"attn_type shape {tuple(attn_type.shape)} must be q_ranges.shape[:-1] = {tuple(q_ranges.shape[:-1])}")
    if k_ranges.device != q_ranges.device or attn_type.device != q_ranges.device:
        raise ValueError(
            f"q_ranges, k_ranges, attn_type must share a device, got {q_ranges.device}, "
            f"{k_ranges.device}, {attn_type.device}")
    for name, n in (("total_seqlen_q", total_seqlen_q), ("total_seqlen_k", total_seqlen_k)):
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
