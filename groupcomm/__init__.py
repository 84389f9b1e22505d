"""Group collectives over a CP group: ``group_cast`` and ``group_reduce``.

They move rows between the P ranks of a context-parallel group. Routing is
plain tensors (no plan objects), identical in every backend:

- ``split [P(src), P(dst)]`` int64 device tensor: rows s sends to d (same
  matrix on every rank, diagonal 0).
- ``send_index [send_cap]`` int64: gather indices into the rank's local rows
  in send order (destination ascending), ``-1`` padding after the last row.
- ``recv_capacity`` host int: rows of each receive buffer. On rank r the rows
  from source s start at row ``sum(split[:s, r])``; rows past the fill are 0.

``tail_routing(split, send_index, ranks, first_row)`` restricts a cast to the receive
rows past ``first_row`` (what a rank that kept the first rows of a buffer needs again).

``group_reduce`` is the reverse: partials in the receive layout go back to
their source and are reduced (``sum``, or the log-sum-exp ``lse`` merge) into
the host's rows ``send_index[p]``. ``neutral_rows(like, value)`` is an accumulator
holding the identity (0 for ``sum``, -inf for an lse) that takes no memory until
the reduce makes its result: a reduce in flight holds none for it.
``packed_rows(n, shapes, dtypes, device)``: row tensors that share one packed buffer, which a
``TorchGroup`` reduce sends as it is (several partials otherwise are packed into a copy).

Backends, chosen by the group object:

- ``LocalGroup(P, impl="torch" | "triton")``: P simulated ranks in one
  process; every per-rank tensor has a leading rank dim ``[P, ...]``.
  Sync-free (runs on ``device="meta"``).
- ``TorchGroup(process_group, transport="p2p")``: ``torch.distributed``
  point-to-point sends and receives per peer (default; ``transport="a2a"``: one
  all-to-all-v per call), gloo on CPU, NCCL on GPU. Split sizes are host lists: ``host_splits(split)`` makes
  the one non-blocking copy that a layer's casts and reduces share.
- ``SymmMemGroup(process_group)``: sync-free on GPU; a Triton put kernel
  writes rows into the peers' symmetric-memory receive buffers.

``default_group()`` picks one. Every group counts the bytes it moves:
``group.traffic(phase) -> (sent, recv)``. A collective that cannot complete
raises ``CollectiveError`` naming the rank and phase.

Shape legend: P ranks, N local rows, ``*f`` trailing row shape (any dtype),
send_cap send positions, h heads, D head dim.
"""
from ._a2av import HostSplits, TorchGroup, host_splits
from ._api import as_group, default_group, group_cast, group_reduce
from ._base import CollectiveError, Work
from ._pack import packed_rows
from ._reduce import neutral_rows
from ._retain import retain
from ._routing import tail_routing, tail_split
from ._sim import LocalGroup
from ._symm_mem import SymmMemGroup

__all__ = [
    "group_cast", "group_reduce", "default_group", "as_group",
    "LocalGroup", "TorchGroup", "SymmMemGroup",
    "host_splits", "HostSplits", "CollectiveError", "Work", "retain", "tail_routing", "tail_split",
    "neutral_rows", "packed_rows",
]
