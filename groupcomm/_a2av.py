"""``TorchGroup``: group collectives as one ``torch.distributed`` all-to-all-v per call.

gloo on CPU, NCCL on GPU. ``all_to_all_single`` takes its split sizes as
host lists, so this backend needs the split matrix on the host: that is the
one sync point of the layer, made once by ``host_splits`` and shared by every
cast and reduce (forward and backward) that passes it as ``host_split``.
"""
from __future__ import annotations

import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from ._base import CollectiveError, HostTraffic, Work
from ._pack import as_bytes, pack, packed_base, row_layout, unpack
from ._reduce import reduce_rows
from ._retain import retain
from ._routing import put_targets


class HostSplits:
    """The ``[P, P]`` split matrix (or a stack ``[B, P, P]`` of them) on the host, copied once
    without blocking.

    On CUDA the copy goes into pinned memory behind an event; ``get()`` waits
    for it and returns the matrix as a list of lists (cached). ``parts()`` of a
    stack gives one ``HostSplits`` per matrix, all sharing the one copy.
    """

    def __init__(self, split: torch.Tensor):
        if split.dim() not in (2, 3) or split.shape[-1] != split.shape[-2]:
            raise ValueError(f"host_splits: split must be [P, P] or [B, P, P], got {tuple(split.shape)}")
        self._event = None
        self._rows: list[list[int]] | None = None
        if split.is_cuda:
            self._host = torch.empty(split.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(split, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = split.detach().to(torch.int64, copy=True)

    def get(self) -> list[list[int]]:
        if self._rows is None:
            if self._event is not None:
                # THE sync point of the all-to-all-v backend: NCCL and gloo take split sizes as
                # host lists. One P x P copy per layer, awaited when the first collective starts.
                self._event.synchronize()
            self._rows = self._host.tolist()
        return self._rows

    def parts(self) -> list["HostSplits"]:
        """One ``HostSplits`` per matrix of a ``[B, P, P]`` stack (they share this copy)."""
        if self._host.dim() != 3:
            raise ValueError(f"parts() needs a [B, P, P] stack, this holds {tuple(self._host.shape)}")
        return [_HostSplitPart(self, b) for b in range(self._host.shape[0])]


class _HostSplitPart(HostSplits):
    """Matrix ``b`` of a stacked ``HostSplits``: its ``get()`` waits for the shared copy."""

    def __init__(self, parent: HostSplits, b: int):  # noqa: D107 - no copy of its own
        self._parent, self._b = parent, b

    def get(self) -> list[list[int]]:
        return self._parent.get()[self._b]


def host_splits(split: torch.Tensor) -> HostSplits:
    """Start the one device-to-host copy of ``split [P, P]`` (or ``[B, P, P]``: then pass
    ``.parts()[b]``); pass the result as ``host_split=``."""
    return HostSplits(split)


class TorchGroup:
    """One rank of a ``torch.distributed`` process group (default: the world).

    ``timeout`` bounds each wait (default: the process group's own timeout);
    a failed or timed-out exchange raises ``CollectiveError``.
    ``transport``: ``"p2p"`` (default) posts one send and one receive per peer with rows to
    move (``batch_isend_irecv``), so a pair's rows need not wait for the whole group (what
    sub-stages overlap with: the simulated step at S = 4 is 0.75x of one all-to-all-v stage,
    benchmarks/results/stages_bench.md); ``"a2a"`` moves each call's rows in one
    ``all_to_all_single`` (the default before 2026-12-03). With ``"p2p"`` a
    call's ``wait()`` waits for this rank's receives only: its sends stay in flight,
    held here from the moment the call is made (their buffers are this group's own
    copies, or partials handed over with ``consume=True``), until ``wait_sends()`` or a
    later call finds them done, whether or not the call's own ``wait()`` has come
    (NCCL's handles say when they are done; gloo's only once waited, so a gloo group
    holds them until ``wait_sends()``). A backend that completes a batch as one handle
    (NCCL's coalesced batch) waits for its sends with its receives.
    ``traffic(phase)`` returns this rank's (sent, recv) bytes as host ints.
    """

    batched = False
    # it sizes every move from the host copy of the split, so a reduce's partials may hold only the
    # rows this rank received (``group_reduce(recv_capacity=)``)
    sizes_from_host = True

    def __init__(self, process_group=None, timeout: timedelta | None = None, transport: str = "p2p"):
        if transport not in ("a2a", "p2p"):
            raise ValueError(f"TorchGroup: transport must be 'a2a' or 'p2p', got {transport!r}")
        if not dist.is_initialized():
            raise ValueError("TorchGroup: torch.distributed is not initialized (call init_process_group)")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        self.timeout = timeout
        self.transport = transport
        self._traffic = HostTraffic()
        self._sends: list = []  # (phase, [send Work], send tensors) of p2p calls whose sends are not yet waited for

    def __repr__(self) -> str:
        return f"TorchGroup(rank={self.rank}, P={self.size})"

    def _host_matrix(self, split: torch.Tensor, host_split) -> list[list[int]]:
        if host_split is None:
            host_split = HostSplits(split)  # blocking here: no copy was started ahead
        rows = host_split.get() if isinstance(host_split, HostSplits) else host_split
        P = self.size
        if len(rows) != P or any(len(r) != P for r in rows):
            raise ValueError(f"host_split must be [P, P] = [{P}, {P}], got {len(rows)} rows")
        return rows

    def _fail(self, phase: str, e: Exception) -> CollectiveError:
        how = "all-to-all" if self.transport == "a2a" else "point-to-point exchange"
        return CollectiveError(f"rank {self.rank}: {phase} {how} over {self.size} ranks failed: {e}")

    def _wait_all(self, works, phase: str) -> None:
        try:
            for work in works:
                if self.timeout is None:
                    work.wait()
                else:
                    work.wait(self.timeout)
        except Exception as e:
            raise self._fail(phase, e) from e

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int],
                  phase: str):
        """Start the all-to-all-v; returns the function that waits for it (for p2p: for the receives,
        the sends are then kept in flight, see ``wait_sends``)."""
        self._reap()
        try:
            if self.transport == "a2a":
                recvs = [dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=self.process_group,
                                                async_op=True)]
                sends = []
            else:
                recvs, sends = self._p2p(out, inp, out_sizes, in_sizes)
        except Exception as e:
            raise self._fail(phase, e) from e
        retain(out, inp)  # freed by Python later, never by a gloo worker thread (groupcomm._retain)
        if sends:
            # kept from the start, not from this call's wait(): a later call's _reap drops the send
            # buffer once its sends are done, though this call's receives are not yet waited for (a
            # layer issues every sub-stage's cast up front and waits for cast s at sub-stage s)
            self._sends.append((phase, sends, inp))
        del inp

        def wait() -> None:
            self._wait_all(recvs, phase)

        return wait

    def _reap(self) -> None:
        """Drop the kept sends that have completed (their buffers go back); a failed one raises.
        Each handle is waited exactly once: a second wait on a gloo send waits for another send."""
        keep = []
        for phase, works, inp in self._sends:
            if all(w.is_completed() for w in works):
                self._wait_all(works, phase)  # done: returns at once, or raises the send's error
            else:
                keep.append((phase, works, inp))
        self._sends = keep

    def drop_landed_sends(self) -> None:
        """Let go of the buffers of kept sends that have completed (every call does so first); a
        caller about to allocate calls it so that those buffers are free for it. Never waits."""
        self._reap()

    def wait_sends(self) -> None:
        """Wait for every send still in flight (p2p: ``wait()`` waits for receives only); a layer calls
        it at the end of each pass. Raises ``CollectiveError`` naming the phase of a failed send."""
        sends, self._sends = self._sends, []
        for phase, works, _ in sends:
            self._wait_all(works, phase)

    def __del__(self):
        # a gloo send is only handed to the wire once its peer posts the receive, and it is dropped
        # with its handle: a group let go with sends in flight would leave that peer waiting forever
        sends = getattr(self, "_sends", None)
        if sends:
            try:
                self.wait_sends()
            except CollectiveError as e:
                warnings.warn(f"TorchGroup dropped with sends in flight that failed: {e}", RuntimeWarning)

    def sends_in_flight(self) -> int:
        """How many calls' sends are kept, not yet waited for."""
        return len(self._sends)

    def _p2p(self, out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int]):
        """One isend / irecv per peer with rows (the all-to-all-v's layout: segments by peer rank):
        (receive handles, send handles). A backend that returns one handle for the whole batch
        (NCCL coalesces it) gives it as the receive handle: waiting for it covers the sends too."""
        ops = []
        o_off = i_off = 0
        for peer in range(self.size):
            n_out, n_in = out_sizes[peer], in_sizes[peer]
            if peer == self.rank:  # rows to itself (none in a plan's routing) are a local copy
                out[o_off:o_off + n_out].copy_(inp[i_off:i_off + n_in])
            else:
                g = peer if self.process_group is None else dist.get_global_rank(self.process_group, peer)
                if n_in:
                    ops.append(dist.P2POp(dist.isend, inp[i_off:i_off + n_in], g, group=self.process_group))
                if n_out:
                    ops.append(dist.P2POp(dist.irecv, out[o_off:o_off + n_out], g, group=self.process_group))
            o_off += n_out
            i_off += n_in
        if not ops:
            return [], []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):
            return list(works), []
        return ([w for op, w in zip(ops, works) if op.op is dist.irecv],
                [w for op, w in zip(ops, works) if op.op is dist.isend])

    def _sizes(self, rows: list[list[int]], send_cap: int, recv_capacity: int, what: str):
        r = self.rank
        for s_, row in enumerate(rows):
            if min(row) < 0:
                raise ValueError(f"rank {r}: split row {s_} has a negative entry {min(row)}")
        send = list(rows[r])
        recv = [rows[s][r] for s in range(self.size)]
        if sum(send) > send_cap:
            raise ValueError(f"rank {r}: split row {r} sends {sum(send)} rows, more than send_index holds "
                             f"({send_cap})")
        if sum(recv) > recv_capacity:
            raise ValueError(f"rank {r}: split column {r} receives {sum(recv)} rows, more than {what} "
                             f"({recv_capacity})")
        return send, recv

    def _cast(self, tensors, send_index, split, recv_capacity, phase, host_split):
        rows = self._host_matrix(split, host_split)
        send, recv = self._sizes(rows, send_index.shape[0], recv_capacity, "recv_capacity")
        n_send, n_recv, self_rows = sum(send), sum(recv), rows[self.rank][self.rank]
        layout = row_layout(tensors, 0)
        # clamped: an index past the local rows is flagged on the device (group_cast), never read
        idx = send_index[:n_send].clamp(0, max(tensors[0].shape[0] - 1, 0))
        inp = pack([t.index_select(0, idx) for t in tensors], 0)
        out = torch.zeros(recv_capacity, layout.row_bytes, dtype=torch.uint8, device=tensors[0].device)
        wait = self._exchange(out[:n_recv], inp, recv, send, phase)
        self._traffic.add(phase, (n_send - self_rows) * layout.row_bytes, (n_recv - self_rows) * layout.row_bytes)

        def finish():
            wait()
            return unpack(out, layout)
        return Work(finish)

    def _cast_into(self, tensors, send_index, split, out, recv_offset, phase, host_split, host_recv_offset):
        """Each tensor's rows in an exchange of its own, straight into ``out`` from this rank's offset
        (no packed staging buffer: nothing but ``out`` holds the received rows)."""
        R = out[0].shape[0]
        if host_recv_offset is None:
            host_recv_offset = int(recv_offset[self.rank])  # a sync; the layer passes a host copy
        start = host_recv_offset.get() if hasattr(host_recv_offset, "get") else int(host_recv_offset)
        rows = self._host_matrix(split, host_split)
        send, recv = self._sizes(rows, send_index.shape[0], R - start, f"recv_capacity minus recv_offset {start}")
        n_send, n_recv, self_rows = sum(send), sum(recv), rows[self.rank][self.rank]
        for i, o in enumerate(out):
            if not o.is_contiguous():
                raise ValueError(f"TorchGroup: out[{i}] must be contiguous, got strides {tuple(o.stride())}")
        idx = send_index[:n_send].clamp(0, max(tensors[0].shape[0] - 1, 0))
        # as bytes (what gloo moves for every dtype); a contiguous out's rows are a view, so they land in place
        waits = [self._exchange(as_bytes(o.narrow(0, start, n_recv), 0), as_bytes(t.index_select(0, idx), 0), recv,
                                send, phase) for t, o in zip(tensors, out)]
        row_bytes = row_layout(tensors, 0).row_bytes
        self._traffic.add(phase, (n_send - self_rows) * row_bytes, (n_recv - self_rows) * row_bytes)

        def finish():
            for wait in waits:
                wait()
            return list(out)
        return Work(finish)

    def _reduce(self, partials, send_index, split, acc, op, phase, host_split, deterministic, inplace=False,
                owned=False, recv_capacity=None):
        """Starts the exchange; the first ``wait()`` merges the rows that came back (``inplace``:
        into acc's tensors, then: they must not be written in between). ``recv_capacity``: the
        cast's receive capacity when the partials hold only the first rows of the buffer."""
        rows = self._host_matrix(split, host_split)
        capacity = partials[0].shape[0] if recv_capacity is None else recv_capacity
        send, recv = self._sizes(rows, send_index.shape[0], capacity, "the partials' rows")
        n_send, n_recv, self_rows = sum(send), sum(recv), rows[self.rank][self.rank]
        if n_recv > partials[0].shape[0]:
            raise ValueError(f"rank {self.rank}: {phase} returns the {n_recv} rows it received, but the "
                             f"partials hold {partials[0].shape[0]}")
        layout = row_layout(partials, 0)
        # the way back: each filled receive row returns to its source, in buffer order. The buffer holds
        # the rows really returned (host-known here), not the send list's capacity: reduces in flight at
        # once (a layer's sub-stages) then hold no more than one send list between them
        sent = [p[:n_recv] for p in partials]
        base = packed_base(sent)  # partials gathered into one packed buffer: sent as they are, no copy
        inp = pack(sent, 0) if base is None else base
        del sent
        if self.transport == "p2p" and n_recv and not owned and inp.untyped_storage().data_ptr() == \
                partials[0].untyped_storage().data_ptr():
            # p2p sends outlive wait(): they must not read the caller's partials, unless handed over
            inp = inp.clone()
        partials.clear()  # the call's own list: what is sent is in inp now (group_reduce(consume=True))
        back = torch.zeros(n_send, layout.row_bytes, dtype=torch.uint8, device=acc[0].device)
        wait = self._exchange(back, inp, send, recv, phase)
        self._traffic.add(phase, (n_recv - self_rows) * layout.row_bytes, (n_send - self_rows) * layout.row_bytes)

        def finish():
            ranks = torch.full((1,), self.rank, dtype=torch.int64, device=split.device)
            dest, _ = put_targets(split, send_index[None], ranks, capacity)
            wait()
            # the positions past the rows sent are padding (dest -1, summed into scratch rows only): the
            # reduce reads the first n_send, so the return buffer is never padded to a second copy
            ret = [t[None] for t in unpack(back, layout, views=True)]
            targets = list(acc)
            mine = [a[None] for a in acc]  # in place: views of acc's tensors, written through
            acc.clear()
            out = reduce_rows(mine, ret, send_index[None, :n_send], dest[:, :n_send], op, self.size, deterministic,
                              inplace)
            return targets if inplace else [t[0] for t in out]
        return Work(finish)

    def traffic(self, phase: str) -> tuple[int, int]:
        """(sent, recv) bytes this rank moved to / from other ranks in ``phase``."""
        return self._traffic.get(phase)

    def reset_traffic(self) -> None:
        self._traffic.reset()
