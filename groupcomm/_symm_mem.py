"""``SymmMemGroup``: sync-free group collectives on GPU over torch symmetric memory.

Each rank owns one receive buffer per (capacity, row bytes), allocated once
with ``_symmetric_memory.empty`` and mapped into every peer by
``rendezvous``; the handle gives the peers' buffer addresses. A call:

1. computes, on device, the destination rank and row of every send position
   (``put_arguments``, pure torch, tested on CPU);
2. device barrier: every peer has copied the previous call's rows out;
3. the put kernel (``_put_kernel``, ``PEER_TABLE=True``) stores each row
   straight into its destination's buffer through the peer pointer table;
4. device barrier: every row of this call has landed;
5. copies the local buffer out, zeroing rows past this rank's fill.

Splits and offsets never leave the device, so the call is CUDA-graph
capturable. Intra-node only (peer pointers over NVLink). Across nodes, with
NVSHMEM, ``torch.ops.symm_mem.all_to_all_vdev`` takes device split tensors
and is the alternative (not used here). A peer that never arrives makes the
device barrier time out (``timeout``), which traps on the device: the
host-side ``CollectiveError`` of ``TorchGroup`` is not available here.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ._base import Work
from ._pack import pack, row_layout, unpack, word_dtype
from ._reduce import reduce_rows
from ._routing import fill_mask, put_targets, return_index, traffic_rows


def symm_mem_usable(process_group=None) -> tuple[bool, str]:
    """Whether ``SymmMemGroup`` can serve this group here, and why (for the log line)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not dist.is_initialized():
        return False, "torch.distributed is not initialized"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False, "torch has no symmetric memory"
    if dist.get_backend(process_group) != "nccl":
        return False, f"backend {dist.get_backend(process_group)} is not nccl"
    if dist.get_world_size(process_group) > torch.cuda.device_count():
        return False, "the group spans more than one node"
    return True, "CUDA symmetric memory on one node"


def put_arguments(split: torch.Tensor, send_index: torch.Tensor, rank: int, capacity: int,
                  recv_offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(peer ``[C]``, row ``[C]``) int64 of one rank's send positions, -1 peer where nothing is sent.

    split ``[P, P]``, send_index ``[C]``: the routing arguments of this rank; recv_offset
    ``[P]``: the first row of the call on each destination (default 0).
    """
    ranks = torch.full((1,), rank, dtype=torch.int64, device=split.device)
    peer, row = put_targets(split, send_index[None], ranks, capacity, recv_offset)
    return peer[0], row[0]


def peer_table(buffer_ptrs: list[int], local_ptr: int, rank: int, device) -> torch.Tensor:
    """``[P]`` int64 addresses of the peers' buffers, shifted by the local tensor's offset in its block."""
    offset = local_ptr - buffer_ptrs[rank]
    return torch.tensor([p + offset for p in buffer_ptrs], dtype=torch.int64, device=device)


_SIDE_STREAMS: dict = {}


def _on_side_stream(move, inputs: list[torch.Tensor]) -> Work:
    """Run ``move()`` (puts and barriers) on a second CUDA stream, so the caller's next kernels
    (stage 0 of a layer) overlap it; ``wait()`` joins the streams. Off CUDA it runs inline.

    Fork/join through events keeps it CUDA-graph capturable; ``record_stream`` tells the
    caching allocator which stream uses each tensor, so no buffer is reused too early.
    """
    device = inputs[0].device
    if device.type != "cuda":
        return Work.done(move())
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        result = move()
        done = torch.cuda.Event()
        done.record(side)
    for t in inputs:
        t.record_stream(side)

    def join() -> list[torch.Tensor]:
        main.wait_event(done)
        for t in result:
            t.record_stream(main)
        return result

    return Work(join)


class SymmMemGroup:
    """One rank of an intra-node NCCL group; rows move with the put kernel through peer pointers.

    ``traffic(phase)`` returns this rank's (sent, recv) bytes as host ints;
    the counters accumulate on device and are read only when asked.
    Buffers are symmetric, so ``recv_capacity`` and ``send_cap`` must be the
    same on every rank (static configuration). The first call per (capacity,
    row bytes) allocates and rendezvouses (collective, host work): make it
    before capturing a CUDA graph.
    """

    batched = False

    def __init__(self, process_group=None, timeout: timedelta | None = None):
        self._setup(process_group, dist.get_rank(process_group), dist.get_world_size(process_group), timeout)

    def _setup(self, process_group, rank: int, size: int, timeout: timedelta | None) -> None:
        self.process_group = process_group
        self.rank = rank
        self.size = size
        self.timeout_ms = 0 if timeout is None else int(timeout.total_seconds() * 1000)
        self._buffers: dict[tuple[int, int], tuple] = {}
        self._traffic: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"SymmMemGroup(rank={self.rank}, P={self.size})"

    def _buffer(self, rows: int, row_bytes: int, device):
        key = (rows, row_bytes)
        if key not in self._buffers:
            if torch.device(device).type != "cuda":
                raise ValueError(f"SymmMemGroup needs CUDA tensors, got {device}")
            from torch.distributed import _symmetric_memory as symm_mem
            word = word_dtype(row_bytes)
            width = row_bytes // torch.empty((), dtype=word).element_size()
            buf = symm_mem.empty((max(rows, 1), width), dtype=word, device=device)
            handle = symm_mem.rendezvous(buf, self.process_group)
            table = peer_table(handle.buffer_ptrs, buf.data_ptr(), self.rank, device)
            self._buffers[key] = (buf, handle, table)
        return self._buffers[key]

    def _move(self, rows: torch.Tensor, send_index: torch.Tensor, split: torch.Tensor,
              capacity: int) -> torch.Tensor:
        """``rows [N, W]`` uint8 of this rank -> its receive buffer ``[capacity, W]`` uint8."""
        from ._put_kernel import put_rows
        W = rows.shape[-1]
        buf, handle, table = self._buffer(capacity, W, rows.device)
        src = rows.contiguous().view(buf.dtype)
        peer, row = put_arguments(split, send_index, self.rank, capacity)
        handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        put_rows(src[None], send_index[None], peer[None], row[None], peer_ptrs=table, capacity=capacity)
        handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        ranks = torch.full((1,), self.rank, dtype=torch.int64, device=split.device)
        keep = fill_mask(split, ranks, capacity)[0]
        out = torch.where(keep[:, None], buf[:capacity], torch.zeros_like(buf[:capacity]))
        return out.view(torch.uint8)

    def _count(self, phase: str, split: torch.Tensor, row_bytes: int, back: bool) -> None:
        sent, recv = traffic_rows(split)
        step = torch.stack([sent[self.rank], recv[self.rank]]) * row_bytes
        if back:
            step = step.flip(0)
        prev = self._traffic.get(phase)
        self._traffic[phase] = step if prev is None else prev + step

    def _cast(self, tensors, send_index, split, recv_capacity, phase, host_split):
        layout = row_layout(tensors, 0)
        self._count(phase, split, layout.row_bytes, back=False)
        return _on_side_stream(lambda: unpack(self._move(pack(tensors, 0), send_index, split, recv_capacity),
                                              layout), list(tensors) + [send_index, split])

    def _cast_into(self, tensors, send_index, split, out, recv_offset, phase, host_split, host_recv_offset):
        """The rows land in the symmetric buffer at this call's own rows (``recv_offset`` on), and only
        those rows are copied into ``out``: calls sharing a buffer never touch each other's rows."""
        layout = row_layout(tensors, 0)
        capacity = out[0].shape[0]
        self._count(phase, split, layout.row_bytes, back=False)

        def move():
            from ._put_kernel import put_rows
            rows = pack(tensors, 0)
            buf, handle, table = self._buffer(capacity, rows.shape[-1], rows.device)
            src = rows.contiguous().view(buf.dtype)
            peer, row = put_arguments(split, send_index, self.rank, capacity, recv_offset)
            handle.barrier(channel=0, timeout_ms=self.timeout_ms)
            put_rows(src[None], send_index[None], peer[None], row[None], peer_ptrs=table, capacity=capacity)
            handle.barrier(channel=0, timeout_ms=self.timeout_ms)
            ranks = torch.full((1,), self.rank, dtype=torch.int64, device=split.device)
            mine = fill_mask(split, ranks, capacity, recv_offset)[0]
            for o, got in zip(out, unpack(buf[:capacity].view(torch.uint8), layout)):
                o.copy_(torch.where(mine.view(-1, *([1] * (o.dim() - 1))), got, o))
            return list(out)
        return _on_side_stream(move, list(tensors) + list(out) + [send_index, split, recv_offset])

    def _reduce(self, partials, send_index, split, acc, op, phase, host_split, deterministic, inplace=False,
                owned=False):
        """Moves and merges when called (``inplace``: into acc's tensors, on the caller's stream)."""
        capacity = partials[0].shape[0]
        layout = row_layout(partials, 0)
        ranks = torch.full((1,), self.rank, dtype=torch.int64, device=split.device)
        rows = pack(partials, 0)
        partials.clear()  # the call's own list (group_reduce(consume=True)): the partials go once moved
        back = self._move(rows, return_index(split, ranks, capacity)[0], split.t().contiguous(), send_index.shape[0])
        del rows
        dest, _ = put_targets(split, send_index[None], ranks, capacity)
        ret = [t[None] for t in unpack(back, layout, views=True)]
        targets = list(acc)
        mine = [a[None] for a in acc]  # in place: views of acc's tensors, written through
        acc.clear()
        out = reduce_rows(mine, ret, send_index[None], dest, op, self.size, deterministic, inplace)
        self._count(phase, split, layout.row_bytes, back=True)
        return Work.done(targets if inplace else [t[0] for t in out])

    def traffic(self, phase: str) -> tuple[int, int]:
        """(sent, recv) bytes this rank moved to / from other ranks in ``phase`` (reads the device counter)."""
        t = self._traffic.get(phase)
        if t is None:
            return 0, 0
        sent, recv = t.tolist()
        return sent, recv

    def drop_landed_sends(self) -> None:
        """Nothing kept: no send outlives its call (``TorchGroup``'s p2p sends may)."""

    def wait_sends(self) -> None:
        """Nothing to wait for: each put ends in a barrier of the whole group, before ``wait()`` returns
        (``TorchGroup``'s p2p sends may outlive it)."""

    def reset_traffic(self) -> None:
        self._traffic.clear()
