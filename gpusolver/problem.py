"""The solver's problem: block areas, needed token intervals, and byte costs.

Shape legend: G head groups, P ranks (CP size), c = S / P tokens per chunk,
n sub-chunk tiles per chunk, U = n * P units of c / n tokens per group.

A task ``(g, i, j)`` is query unit ``i`` against key unit ``j`` for head
group ``g``. Without tiling (n = 1) a unit is a rank's whole chunk: QO unit
``(g, i)`` lives on rank ``i`` and KV unit ``(g, j)`` on rank ``j``. With n
tiles, unit ``u`` is tile ``u % n`` of rank ``u // n``'s chunk, so one
chunk-pair's work splits into n x n tasks the solver may place apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockAreas:
    """Per-block work and needs, all device tensors.

    area:   [G, U, U] int64 — exact count of valid (q, k) entries of block (g, i, j).
    q_need: [G, U, U, 2] int64 — [lo, hi) rows of query unit i (unit-local,
            0 <= lo <= hi <= chunk) that have at least one valid entry in the block.
    k_need: [G, U, U, 2] int64 — [lo, hi) columns of key unit j (unit-local)
            that some row of the block attends.
    chunk:  tokens per unit (host int): c = S / P without tiling, c / n with n tiles.
    tiles:  n, units per rank (host int, default 1); U = n * P.

    An empty block has area 0 and needs [0, 0). The needs are bounding
    intervals: exact for document, window and causal masks, an upper bound
    for masks with holes inside a block.
    """

    area: torch.Tensor
    q_need: torch.Tensor
    k_need: torch.Tensor
    chunk: int
    tiles: int = 1

    def __post_init__(self):
        if not isinstance(self.tiles, int) or self.tiles < 1 or self.area.dim() < 2 \
                or self.area.shape[1] % self.tiles:
            raise ValueError(f"tiles must be a positive int dividing the unit count, got tiles={self.tiles!r} "
                             f"for area of shape {tuple(self.area.shape)}")

    @property
    def head_groups(self) -> int:
        return self.area.shape[0]

    @property
    def num_units(self) -> int:
        """U = tiles * P, units per head group."""
        return self.area.shape[1]

    @property
    def cp_size(self) -> int:
        return self.area.shape[1] // self.tiles

    @property
    def rank_tokens(self) -> int:
        """c = S / P, tokens per rank."""
        return self.chunk * self.tiles

    def unit_host(self) -> torch.Tensor:
        """[U] int64, the rank holding each unit (u // tiles)."""
        return torch.arange(self.num_units, device=self.area.device) // self.tiles

    def as_tiles(self, tiles: int) -> "BlockAreas":
        """Untiled areas computed for ``tiles * P`` ranks, read as ``tiles`` sub-chunk tiles per
        rank of a P-rank group: the same tensors, unit u on rank u // tiles (a tile is a chunk
        of a group ``tiles`` times larger)."""
        if self.tiles != 1:
            raise ValueError(f"as_tiles takes untiled areas, got tiles={self.tiles}")
        return self if tiles == 1 else BlockAreas(self.area, self.q_need, self.k_need, self.chunk, tiles)

    def coarsen(self, tiles: int = 1) -> "BlockAreas":
        """The same work at ``tiles`` units per rank (default 1, whole chunks; it must divide
        ``self.tiles``): areas summed over the merged tile pairs, needs as hulls of the merged
        tiles' needs in the new units' coordinates ([0, 0) for empty blocks). Sync-free; equal
        to the areas of the mask at ``tiles`` when the tiles' needs are exact."""
        n = self.tiles
        if not isinstance(tiles, int) or tiles < 1 or n % tiles:
            raise ValueError(f"tiles must be a positive int dividing {n}, got {tiles!r}")
        if tiles == n:
            return self
        G, P, c, f = self.head_groups, self.cp_size, self.chunk, n // tiles
        m = P * tiles  # units after merging f tiles into one
        area = self.area.view(G, m, f, m, f)
        used = area > 0
        offset = torch.arange(f, device=area.device) * c  # a tile's first token in its merged unit

        def hull(need, off):
            lo = torch.where(used, need[..., 0] + off, f * c).amin(dim=(2, 4))
            hi = torch.where(used, need[..., 1] + off, 0).amax(dim=(2, 4))
            some = used.any(dim=4).any(dim=2)
            return torch.stack((torch.where(some, lo, 0), torch.where(some, hi, 0)), dim=-1)

        q = hull(self.q_need.view(G, m, f, m, f, 2), offset.view(1, 1, f, 1, 1))
        k = hull(self.k_need.view(G, m, f, m, f, 2), offset.view(1, 1, 1, 1, f))
        return BlockAreas(area.sum(dim=(2, 4)), q, k, c * f, tiles)

    def refine(self, assignment: torch.Tensor) -> torch.Tensor:
        """An assignment of coarsened areas ([G, V, V] with V dividing U, e.g. [G, P, P] of whole
        chunks; every merged tile pair on its block's rank) as an assignment of these:
        [G, U, U] int32, -1 for empty tasks. Sync-free."""
        f = self.num_units // assignment.shape[1]
        tiled = assignment.to(torch.int32).repeat_interleave(f, dim=1).repeat_interleave(f, dim=2)
        return torch.where(self.area > 0, tiled, torch.full_like(tiled, -1))

    def to(self, device) -> "BlockAreas":
        """The same areas on ``device`` (e.g. "meta" to prove a consumer reads no values)."""
        return BlockAreas(self.area.to(device), self.q_need.to(device), self.k_need.to(device), self.chunk,
                          self.tiles)

    def expand_groups(self, head_groups: int) -> "BlockAreas":
        """The areas of a mask shared by all groups, computed once (G = 1), for ``head_groups`` groups."""
        if self.head_groups == head_groups:
            return self
        U = self.num_units
        return BlockAreas(self.area.expand(head_groups, U, U).contiguous(),
                          self.q_need.expand(head_groups, U, U, 2).contiguous(),
                          self.k_need.expand(head_groups, U, U, 2).contiguous(), self.chunk, self.tiles)

    def validate(self) -> "BlockAreas":
        G, U = self.area.shape[0], self.area.shape[1]
        if self.area.shape != (G, U, U) or self.area.dtype != torch.int64:
            raise ValueError(f"area must be int64 [G, U, U], got {self.area.dtype} {tuple(self.area.shape)}")
        for name, t in (("q_need", self.q_need), ("k_need", self.k_need)):
            if t.shape != (G, U, U, 2):
                raise ValueError(f"{name} must be [G, U, U, 2] = {(G, U, U, 2)}, got {tuple(t.shape)}")
        return self


KEEP_CHOICES = (True, False, "qo", "kv")


def kept_kinds(keep) -> tuple[str, ...]:
    """The unit kinds whose forward receive buffers a helper keeps for the backward
    (``keep_forward_buffers``): True both, False none, "qo" only Q, "kv" only K and V."""
    if keep is True:
        return ("qo", "kv")
    if keep is False:
        return ()
    if isinstance(keep, str) and keep in ("qo", "kv"):
        return (keep,)
    raise ValueError(f"keep_forward_buffers must be one of {KEEP_CHOICES}, got {keep!r}")


@dataclass(frozen=True)
class CommCost:
    """Bytes per transferred token of each unit kind, per head group.

    With G head groups a group carries ``hq = Hq / G`` query heads and
    ``hkv = Hkv / G`` KV heads (one with head-group flattening); ``D`` is the
    head dim and ``b`` the activation dtype's bytes. Sending ``n`` tokens of a
    unit from its host to a helper rank costs:

    forward
        QO: host -> helper ``n * q_fwd`` (Q, ``hq*D*b``), helper -> host
            ``n * o_fwd`` (partial O plus fp32 lse, ``hq*(D*b + 4)``).
        KV: host -> helper ``n * kv_fwd`` (K and V, ``2*hkv*D*b``).
    backward
        QO: host -> helper ``n * q_bwd`` (dO plus fp32 lse and fp32 delta,
            ``hq*(D*b + 8)``; plus Q again, ``hq*D*b``, when buffers are not
            kept), helper -> host ``n * dq_bwd`` (partial dQ, ``hq*D*b``).
        KV: host -> helper ``n * kv_bwd`` (nothing when buffers are kept,
            else K and V again, ``kv_fwd``), helper -> host ``n * dkv_bwd``
            (partial dK and dV, ``kv_fwd``).

    The backward follows the runtime's protocol: the QO host computes the row
    delta ``rowsum(dO * O)`` itself, so O never travels. With
    ``keep_forward_buffers`` (default) a helper keeps the Q, K and V it
    received in the forward; without it they are sent again (fewer saved
    activations, more bytes); ``"qo"`` keeps only Q (K and V sent again), ``"kv"`` only K
    and V (Q sent again). ``kept_kv_rows``: a helper that keeps K and V keeps only the first
    rows of its KV receive buffer and receives the rest again (``groupcomm.tail_routing``).
    Which units lie past those rows depends on the assignment, so a unit's ``kv_bwd`` is priced
    as kept (a lower bound: plans of the benchmark masks fill fewer KV rows than a budget of
    1.5x plain attention keeps, and pricing every row as sent again steers the solve to slower
    plans, ``benchmarks/results/layer_memory.md``); ``plan.pair_bytes`` and the simulator
    count the exact tail. ``kept_q_rows``: likewise for a helper that keeps Q (the rows past
    them travel again beside dO in ``bwd.qo``); a unit's ``q_bwd`` is priced as kept.
    ``kept_per_rank``: the two fields are one room instead (``room_size``), which each
    rank splits by its own fills, Q first (``split_kept_room``): a rank keeps every Q row it
    received up to the room, then K, V rows in the room left.
    """

    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dtype_bytes: int
    head_groups: int
    keep_forward_buffers: bool | str = True
    kept_kv_rows: int | None = None
    kept_q_rows: int | None = None
    kept_per_rank: bool = False

    def __post_init__(self):
        kept_kinds(self.keep_forward_buffers)  # raises on anything but True, False, "qo", "kv"
        for name in ("kept_kv_rows", "kept_q_rows"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be None or a non-negative int, got {v!r}")
        check_kept_per_rank(self.kept_per_rank, self.keep_forward_buffers, self.kept_q_rows, self.kept_kv_rows)
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
        again = 0 if "qo" in kept_kinds(self.keep_forward_buffers) else self.q_fwd  # Q re-sent
        return self.hq * (self.head_dim * self.dtype_bytes + 8) + again  # dO, fp32 lse and delta

    @property
    def dq_bwd(self) -> int:
        return self.hq * self.head_dim * self.dtype_bytes

    @property
    def kv_bwd(self) -> int:
        return 0 if "kv" in kept_kinds(self.keep_forward_buffers) else self.kv_fwd


    @property
    def dkv_bwd(self) -> int:
        return self.kv_fwd


def check_kept_per_rank(kept_per_rank, keep, kept_q_rows, kept_kv_rows) -> None:
    """``kept_per_rank`` needs both kinds kept and both rows given (they size the room)."""
    if not isinstance(kept_per_rank, bool):
        raise ValueError(f"kept_per_rank must be a bool, got {kept_per_rank!r}")
    if kept_per_rank and (set(kept_kinds(keep)) != {"qo", "kv"} or kept_q_rows is None or kept_kv_rows is None):
        raise ValueError(f"kept_per_rank=True splits one room between Q and K, V: it needs keep_forward_buffers=True "
                         f"and both kept_q_rows and kept_kv_rows set, got keep_forward_buffers={keep!r}, "
                         f"kept_q_rows={kept_q_rows!r}, kept_kv_rows={kept_kv_rows!r}")


def room_size(q_rows: int, kv_rows: int, q_row: int, kv_row: int, qo_capacity: int, kv_capacity: int) -> int:
    """The room ``kept_per_rank`` splits, in the unit of ``q_row`` and ``kv_row`` (one row of each):
    ``q_rows`` Q rows and ``kv_rows`` K, V rows, each count at most its receive buffer's rows, as
    ``plan.memory`` counts the kept bytes. The pricing and the runtime both size it here."""
    return min(q_rows, qo_capacity) * q_row + min(kv_rows, kv_capacity) * kv_row


def split_kept_room(fill_q, fill_kv, room: int, q_row: int, kv_row: int):
    """(kept Q rows, kept K, V rows) of ranks that received ``fill_q`` QO and ``fill_kv`` KV rows
    and keep ``room`` (in the same unit as ``q_row`` and ``kv_row``, the size of one row of each):
    Q first, as many rows as fit, then K, V rows in what is left. Host ints, or ``[P]`` int64
    tensors (every rank's, computed the same on every rank without a host read)."""
    if isinstance(fill_q, torch.Tensor):
        kept_q = fill_q.clamp(max=room // q_row)
        return kept_q, torch.minimum(fill_kv, (room - kept_q * q_row) // kv_row)
    kept_q = min(fill_q, room // q_row)
    return kept_q, min(fill_kv, (room - kept_q * q_row) // kv_row)
