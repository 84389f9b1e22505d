"""The solver's problem: block areas, needed token intervals, and byte costs.

Shape legend: G head groups, P ranks (CP size), c = S / P tokens per chunk.

A task ``(g, i, j)`` is query chunk ``i`` against key chunk ``j`` for head
group ``g``. QO unit ``(g, i)`` lives on rank ``i``; KV unit ``(g, j)`` on
rank ``j``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockAreas:
    """Per-block work and needs, all device tensors.

    area:   [G, P, P] int64 — exact count of valid (q, k) entries of block (g, i, j).
    q_need: [G, P, P, 2] int64 — [lo, hi) rows of query chunk i (chunk-local,
            0 <= lo <= hi <= c) that have at least one valid entry in the block.
    k_need: [G, P, P, 2] int64 — [lo, hi) columns of key chunk j (chunk-local)
            that some row of the block attends.
    chunk:  c, tokens per chunk (host int).

    An empty block has area 0 and needs [0, 0). The needs are bounding
    intervals: exact for document, window and causal masks, an upper bound
    for masks with holes inside a block.
    """

    area: torch.Tensor
    q_need: torch.Tensor
    k_need: torch.Tensor
    chunk: int

    @property
    def head_groups(self) -> int:
        return self.area.shape[0]

    @property
    def cp_size(self) -> int:
        return self.area.shape[1]

    def to(self, device) -> "BlockAreas":
        """The same areas on ``device`` (e.g. "meta" to prove a consumer reads no values)."""
        return BlockAreas(self.area.to(device), self.q_need.to(device), self.k_need.to(device), self.chunk)

    def expand_groups(self, head_groups: int) -> "BlockAreas":
        """The areas of a mask shared by all groups, computed once (G = 1), for ``head_groups`` groups."""
        if self.head_groups == head_groups:
            return self
        P = self.cp_size
        return BlockAreas(self.area.expand(head_groups, P, P).contiguous(),
                          self.q_need.expand(head_groups, P, P, 2).contiguous(),
                          self.k_need.expand(head_groups, P, P, 2).contiguous(), self.chunk)

    def validate(self) -> "BlockAreas":
        G, P = self.area.shape[0], self.area.shape[1]
        if self.area.shape != (G, P, P) or self.area.dtype != torch.int64:
            raise ValueError(f"area must be int64 [G, P, P], got {self.area.dtype} {tuple(self.area.shape)}")
        for name, t in (("q_need", self.q_need), ("k_need", self.k_need)):
            if t.shape != (G, P, P, 2):
                raise ValueError(f"{name} must be [G, P, P, 2] = {(G, P, P, 2)}, got {tuple(t.shape)}")
        return self


@dataclass(frozen=True)
class CommCost:
    """Bytes per transferred token of each unit kind, per head group.

    With G head groups a group carries ``hq = Hq / G`` query heads and
    ``hkv = Hkv / G`` KV heads (one with head-group flattening). Sending
    ``n`` tokens of a unit from its host to a helper rank costs:

    forward
        QO: host -> helper ``n * q_fwd`` (Q), helper -> host ``n * o_fwd``
            (partial O in the activation dtype plus fp32 lse).
        KV: host -> helper ``n * kv_fwd`` (K and V).
    backward
        QO: host -> helper ``n * q_bwd`` (Q, O, dO, fp32 lse),
            helper -> host ``n * dq_bwd`` (partial dQ).
        KV: host -> helper ``n * kv_fwd`` (K, V), helper -> host
            ``n * kv_fwd`` (partial dK, dV).
    """

    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dtype_bytes: int
    head_groups: int

    def __post_init__(self):
        if self.num_heads_q % self.num_heads_kv:
            raise ValueError(f"num_heads_q={self.num_heads_q} must be a multiple of num_heads_kv={self.num_heads_kv}")
        if self.num_heads_kv % self.head_groups:
            raise ValueError(f"num_heads_kv={self.num_heads_kv} must be a multiple of head_groups={self.head_groups}")

    @property
    def hq(self) -> int:
        return self.num_heads_q // self.head_groups

    @property
    def hkv(self) -> int:
        return self.num_heads_kv // self.head_groups

    @property
    def q_fwd(self) -> int:
        return self.hq * self.head_dim * self.dtype_bytes

    @property
    def o_fwd(self) -> int:
        return self.hq * (self.head_dim * self.dtype_bytes + 4)

    @property
    def kv_fwd(self) -> int:
        return 2 * self.hkv * self.head_dim * self.dtype_bytes

    @property
    def q_bwd(self) -> int:
        return self.hq * (3 * self.head_dim * self.dtype_bytes + 4)

    @property
    def dq_bwd(self) -> int:
        return self.hq * self.head_dim * self.dtype_bytes
