"""``LocalGroup``: P simulated ranks in one process, every per-rank tensor with a leading rank dim.

Sync-free: no host reads, so it runs on ``device="meta"``. ``impl="torch"``
moves rows with ``put_rows_ref``; ``impl="triton"`` with the put kernel over
one stacked ``[P, capacity, W]`` buffer (the indexing the GPU backend uses
with peer pointers). Both give the same bits.
"""
from __future__ import annotations

import torch

from ._base import Work
from ._pack import as_bytes, bytes_are_a_view, pack, row_layout, unpack, word_dtype
from ._put_ref import put_rows_fresh, put_rows_inplace
from ._reduce import reduce_rows
from ._routing import put_targets, return_index, traffic_rows


class LocalGroup:
    """P ranks simulated in one process (tests, simulation).

    Per-rank tensors carry a leading rank dim: rows ``[P, N, *f]``,
    ``send_index [P, send_cap]``, results ``[P, recv_capacity, *f]``; ``split``
    is the shared ``[P, P]`` matrix. ``traffic(phase)`` returns ``[P]`` int64
    device tensors (sent, recv), accumulated on device.
    """

    batched = True

    def __init__(self, P: int, impl: str = "torch"):
        if isinstance(P, bool) or not isinstance(P, int) or P < 1:
            raise ValueError(f"LocalGroup: P must be an int >= 1, got {P!r}")
        if impl not in ("torch", "triton"):
            raise ValueError(f"LocalGroup: impl must be 'torch' or 'triton', got {impl!r}")
        self.size = P
        self.impl = impl
        self._traffic: dict[str, torch.Tensor] = {}
        self._pairs: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"LocalGroup(P={self.size}, impl={self.impl!r})"

    # -- moving rows ---------------------------------------------------------------------------

    def _move(self, rows: torch.Tensor, send_index: torch.Tensor, split: torch.Tensor,
              capacity: int) -> torch.Tensor:
        """``rows [P, N, W]`` uint8 -> receive buffers ``[P, capacity, W]`` uint8 (zero past the fill)."""
        P, _, W = rows.shape
        ranks = torch.arange(P, device=rows.device)
        peer, row = put_targets(split, send_index, ranks, capacity)
        if self.impl == "torch":
            return put_rows_fresh(rows, send_index, peer, row, P, capacity)
        from ._put_kernel import put_rows
        word = word_dtype(W)
        src = rows.contiguous().view(word)
        out = torch.zeros(P, capacity, src.shape[-1], dtype=word, device=rows.device)
        put_rows(src, send_index, peer, row, out)
        return out.view(torch.uint8)

    def _count(self, phase: str, split: torch.Tensor, row_bytes: int, back: bool) -> None:
        if torch.compiler.is_compiling():
            # a traced counter would be a tensor leaking out of the compiled graph (dynamo
            # refuses it inside autograd.Function): counters count eager calls only
            return
        sent, recv = traffic_rows(split)
        if back:
            sent, recv = recv, sent
        step = torch.stack([sent, recv]) * row_bytes
        prev = self._traffic.get(phase)
        self._traffic[phase] = step if prev is None else prev + step
        off_diag = 1 - torch.eye(split.shape[0], dtype=split.dtype, device=split.device)  # self rows never move
        pairs = (split.t() if back else split) * off_diag * row_bytes
        prev = self._pairs.get(phase)
        self._pairs[phase] = pairs if prev is None else prev + pairs

    # -- the two collectives (arguments already checked by the entry points) -------------------

    def _cast(self, tensors, send_index, split, recv_capacity, phase, host_split):
        layout = row_layout(tensors, 1)
        buf = self._move(pack(tensors, 1), send_index, split, recv_capacity)
        self._count(phase, split, layout.row_bytes, back=False)
        return Work.done(unpack(buf, layout))

    def _cast_into(self, tensors, send_index, split, out, recv_offset, phase, host_split, host_recv_offset):
        """Each tensor's rows straight into its ``out`` buffer from ``recv_offset`` on (one put per
        tensor, in place: the rest of ``out`` is untouched)."""
        ranks = torch.arange(self.size, device=split.device)
        R = out[0].shape[1]
        peer, row = put_targets(split, send_index, ranks, R, recv_offset)
        for t, o in zip(tensors, out):
            width = row_layout([t], 1).row_bytes
            word = word_dtype(width)
            src = as_bytes(t, 1).view(word)
            dst = as_bytes(o, 1).view(word)  # a view of o when its rows' bytes are contiguous, else a copy
            inplace = bytes_are_a_view(o, 1)
            if self.impl == "torch":  # written where they land: no copy of o, no staging buffer
                put_rows_inplace(src, send_index, peer, row, dst)
            else:  # the kernel writes contiguous rows: a strided view is staged and written back
                from ._put_kernel import put_rows
                staged = dst if dst.is_contiguous() else dst.contiguous()
                put_rows(src.contiguous(), send_index, peer, row, staged)
                if staged is not dst:
                    dst.copy_(staged)
            if not inplace:
                o.copy_(dst.view(torch.uint8).view(o.dtype).view(o.shape))
        self._count(phase, split, row_layout(tensors, 1).row_bytes, back=False)
        return Work.done(list(out))

    def _reduce(self, partials, send_index, split, acc, op, phase, host_split, deterministic, inplace=False,
                owned=False):
        """Moves and merges when called (``inplace``: into acc's tensors, now); ``wait()`` only hands
        the result over."""
        P = self.size
        capacity = partials[0].shape[1]
        layout = row_layout(partials, 1)
        ranks = torch.arange(P, device=split.device)
        # the way back is a cast with split.T, each helper sending its filled rows in buffer order;
        # each tensor moves on its own (no packed copy of the partials), and the partials go (the
        # list is this call's own: group_reduce's) before the sums are made
        index, back_split = return_index(split, ranks, capacity), split.t().contiguous()
        ret = []
        for i in range(len(partials)):
            t, partials[i] = partials[i], None
            ret.append(unpack(self._move(as_bytes(t, 1), index, back_split, send_index.shape[1]),
                              row_layout([t], 1))[0])
            del t
        partials.clear()
        dest, _ = put_targets(split, send_index, ranks, capacity)
        out = reduce_rows(acc, ret, send_index, dest, op, P, deterministic, inplace)
        self._count(phase, split, layout.row_bytes, back=True)
        return Work.done(out)

    # -- byte counters -------------------------------------------------------------------------

    def traffic(self, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(sent, recv) bytes of each rank in ``phase``: ``[P]`` int64 each, to/from other ranks.

        A phase never seen gives CPU zeros.
        """
        t = self._traffic.get(phase)
        if t is None:
            t = torch.zeros(2, self.size, dtype=torch.int64)
        return t[0], t[1]

    def pair_traffic(self, phase: str) -> torch.Tensor:
        """``[P(src), P(dst)]`` int64 bytes moved from each rank to each other rank in ``phase``.

        Its row sums are ``traffic(phase)[0]``, its column sums ``traffic(phase)[1]``.
        A phase never seen gives CPU zeros.
        """
        t = self._pairs.get(phase)
        return torch.zeros(self.size, self.size, dtype=torch.int64) if t is None else t

    def drop_landed_sends(self) -> None:
        """Nothing kept: no send outlives its call (``TorchGroup``'s p2p sends may)."""

    def wait_sends(self) -> None:
        """Nothing to wait for: a call's ``wait()`` has moved every row (``TorchGroup``'s p2p sends
        may outlive it)."""

    def reset_traffic(self) -> None:
        self._traffic.clear()
        self._pairs.clear()
