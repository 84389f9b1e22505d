"""What a plan's collective buffers take per rank: forward peak, backward peak, kept between them.

Host ints from static shapes only (the capacities, heads, head dim and dtype), so a plan on
any device, meta included, is priced the same. The buffers are what ``dist_attn`` receives
into (``group_cast``) and what partial results come back into (``group_reduce``), each at
its capacity's rows (``CommMeta.buffers``), group-major rows of ``hq = Hq / G`` query heads
and ``hkv = Hkv / G`` KV heads, activations of ``b`` bytes:

    forward   QO recv * Q (hq D b) + KV recv * (K, V) (2 hkv D b)
              + QO send * (partial O hq D b + fp32 lse 4 hq)         [all live at the reduce]
    backward  QO recv * (dO hq D b + fp32 lse and delta 8 hq)
              + QO recv * Q + KV recv * (K, V)                        [kept, or cast again]
              + QO send * dQ (hq D b) + KV send * (dK, dV) (2 hkv D b) [all live at the dK, dV reduce]
    kept      QO recv * Q if the helper keeps Q, + KV recv * (K, V) if it keeps K and V (of the
              KV buffer its first ``kept_kv_rows`` rows only, when given, and likewise
              ``kept_q_rows``; with ``kept_per_rank`` the one room of both: the rest is cast again
              into the whole buffer, which the kept rows are copied back into, so the backward
              peak counts a kind kept in part twice: its whole buffer and the kept copy beside it)

With S remote sub-stages (``num_stages``) the terms are the same: the S casts of a kind land
in one buffer at the plan's capacity, each at its own rows (``CommMeta.stage_base``), and the
S reduces in flight at once hold no more than one send list between them (``TorchGroup``
returns into buffers of the rows each reduce really returns; ``LocalGroup`` and
``SymmMemGroup`` finish each reduce before the next starts). ``TorchGroup`` also receives into
buffers of this rank's fill rather than the capacity (``runtime.pipelined.receive_rows`` with
sub-stages, ``runtime.dist_attn.LayerRoutes.recv_rows`` with one direct remote stage, and
``runtime.relayed.KindRoutes.rows`` for relay transport's hops): there these figures are an
upper bound.

Relay transport (``plan.relay``, ``relay_hop_rows``) adds each hop's buffers. Every cast of a
kind receives into one buffer per hop besides the buffer above (the rows in the plan's layout,
gathered out of them): the direct (hop 0) and fan-out (hop 2) buffers at the receive rows, the
relay buffer (hop 1) at ``relay_capacity`` and the egress buffer (hop 3) at ``egress_capacity``.
A reduce of a kind returns by its hops, each into buffers of its send list's rows: hop 2 to the
relays (``fan_capacity``), hop 0 home (the send rows), hop 1 to the egresses or the hosts
(``hop1_capacity``) and hop 3 home (the send rows, with an egress):

    R(kind)   2 * recv + relay_capacity + egress_capacity                [hop buffers, per cast row]
    hops      forward R(QO) * Q + R(KV) * (K, V); backward R(QO) * (dO, lse, delta), and
              R(QO) * Q unless Q is kept, R(KV) * (K, V) unless K and V are kept
    peak      the receive buffers in the plan's layout (the direct formula's, kept included), plus:

One remote stage (``runtime.relayed``): every cast lands before stage 1 runs, and a kind's hop
buffers go once its layout buffer is gathered; the schedule then waits for each hop of a reduce
before it starts the next, and for the dQ reduce before the dK, dV one, so one hop's return
buffers are in flight at a time: the peak is the larger of the hops and
T1(kind) = max(fan_capacity, send, hop1_capacity) rows of returned partials (forward
T1(QO) * (partial O, lse); backward T1(QO) * dQ or T1(KV) * (dK, dV)). The layout buffers are
counted whole beside the hops, an upper bound: each kind's is gathered once its hops have landed.

S > 1 sub-stages (``runtime.relay_stages``): one buffer per (pass, kind, hop) that the S casts
share, live to the pass's end while earlier sub-stages reduce, and a reduce's legs in flight
beside each other and the next sub-stage's (hop 0 until the pass's merge): the peak is the hops
plus T(kind) = fan_capacity + send + hop1_capacity (+ send with an egress), a reduce's four
return buffers, per kind (forward T(QO) * (partial O, lse); backward T(QO) * dQ + T(KV) * (dK, dV)).
On ``LocalGroup`` every hop finishes before the next starts; ``TorchGroup`` returns into buffers
of the rows each hop really returns. kept: as direct (relay transport keeps whole kinds only).

Not counted: the layer's own activations (its q, k, v, out and lse, which plain attention
keeps too) and the runtime's work around the buffers (the local rows that share stage 1's
operand tensor with each buffer, stage 1's outputs over those rows, the reduce's merge: its
outputs, and on the torch path its fp32 sums over the host's rows and a piece of a window of
returned rows), which ``benchmarks/layer_memory.py`` measures (``--fused-reduce``: the fused
merge of a GPU). With relay transport also: the copies the hops are assembled through (the
concatenation of the direct, fan-out and relay buffers each gather reads, and the local rows
hop 1 reads beside the egress rows: a copy per cast with one remote stage, rows of the egress
buffer with sub-stages), with one remote stage stage 1's operands (concatenated out of the local
rows and the layout buffers, which go once they are in), the partials each hop of a reduce sends
(gathered out of stage 1's outputs), a relay's merged partials (the relay buffer's rows) and an
egress's identity rows, and on ``LocalGroup`` the packed staging of each out-of-place cast.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpusolver.problem import kept_kinds

@dataclass(frozen=True)
class BufferMemory:
    """Bytes per rank of one layer's collective buffers (host ints).

    fwd_peak: receive buffers plus the buffer partial O and lse come back into (relay transport:
              plus every hop's receive buffers and return buffers; with one remote stage the
              larger of the two, the module docstring says why).
    bwd_peak: the backward's receive and return buffers, the kept ones included (relay: likewise).
    kept:     held from the layer's forward to its backward.
    """

    fwd_peak: int
    bwd_peak: int
    kept: int


def buffer_memory(comm, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype: torch.dtype,
                  keep=True, kept_kv_rows: int | None = None, relay=None,
                  kept_q_rows: int | None = None, kept_per_rank: bool = False) -> BufferMemory:
    """``BufferMemory`` of a ``CommMeta``'s buffers for the given heads, head dim and dtype;
    ``kept_kv_rows`` (``kept_q_rows``): of a kept KV (QO) buffer only its first rows (the rest is
    cast again); ``kept_per_rank``: the two sized one room, each rank's rows in it (all a copy);
    ``relay``: the plan's ``RelayMeta`` (``plan.relay``), whose hops' buffers are added."""
    G = comm.head_groups
    if num_heads_q % G or num_heads_kv % G:
        raise ValueError(f"num_heads_q={num_heads_q} and num_heads_kv={num_heads_kv} must be multiples of the "
                         f"plan's G = {G} head groups")
    hq, hkv = num_heads_q // G, num_heads_kv // G
    b = torch.empty((), dtype=dtype).element_size()
    q_row, kv_row = hq * head_dim * b, 2 * hkv * head_dim * b
    rows = comm.buffers
    q_buf, kv_buf = rows.qo_recv * q_row, rows.kv_recv * kv_row  # shared by the sub-stages
    # the receive buffers in the plan's layout (the backward's: kept, or cast again)
    layout_fwd, layout_bwd = q_buf + kv_buf, rows.qo_recv * (q_row + 8 * hq) + q_buf + kv_buf
    kinds = kept_kinds(keep)
    kv_kept = kv_buf if kept_kv_rows is None else min(kept_kv_rows, rows.kv_recv) * kv_row
    q_kept = q_buf if kept_q_rows is None else min(kept_q_rows, rows.qo_recv) * q_row
    kept = (q_kept if "qo" in kinds else 0) + (kv_kept if "kv" in kinds else 0)
    # a kind kept in part: its kept copy lives beside the whole buffer the backward builds from it
    beside = kept if kept_per_rank else sum(b for kind, b, whole in (("qo", q_kept, q_buf), ("kv", kv_kept, kv_buf))
                                            if kind in kinds and b < whole)
    if relay is None:
        return BufferMemory(fwd_peak=layout_fwd + rows.qo_send * (q_row + 4 * hq),
                            bwd_peak=layout_bwd + rows.qo_send * q_row + rows.kv_send * kv_row + beside,
                            kept=kept)
    for kind, name, v, whole in (("kv", "kept_kv_rows", kept_kv_rows, rows.kv_recv),
                                 ("qo", "kept_q_rows", kept_q_rows, rows.qo_recv)):
        if kind in kinds and v is not None and v < whole:
            raise ValueError(f"{name}={v} keeps part of the {kind.upper()} buffer, which relay transport "
                             f"does not run (relay is set): keep whole kinds")
    (r_q, t_q), (r_kv, t_kv) = relay_hop_rows(comm, relay, "qo"), relay_hop_rows(comm, relay, "kv")
    hops_fwd = r_q * q_row + r_kv * kv_row
    hops_bwd = (r_q * (q_row + 8 * hq) + (0 if "qo" in kinds else r_q * q_row)
                + (0 if "kv" in kinds else r_kv * kv_row))
    if relay.num_stages == 1:  # the hop buffers go before the reduces, whose hops run one at a time
        return BufferMemory(fwd_peak=layout_fwd + max(hops_fwd, t_q * (q_row + 4 * hq)),
                            bwd_peak=layout_bwd + max(hops_bwd, t_q * q_row, t_kv * kv_row), kept=kept)
    return BufferMemory(fwd_peak=layout_fwd + hops_fwd + t_q * (q_row + 4 * hq),
                        bwd_peak=layout_bwd + hops_bwd + t_q * q_row + t_kv * kv_row, kept=kept)


def relay_hop_rows(comm, relay, kind: str) -> tuple[int, int]:
    """(R, T) of one kind of a relay plan (host ints): the rows of the buffers each of its casts
    receives into besides the plan-layout one (direct and fan-out at the receive rows, relay,
    egress), and the rows of returned partials its reduce holds at most: with one remote stage
    one hop's at a time (T1), with sub-stages all four hops' (T). Every sub-stage's cast and
    reduce has the one-stage route's capacities (``plan.relay.stage_relay_routes``)."""
    cast, back = relay.stage(kind, 1, "cast"), relay.stage(kind, 1, "return")
    recv, send = comm.buffers.recv(kind), comm.buffers.send(kind)
    received = 2 * recv + cast.relay_capacity + cast.egress_capacity
    if relay.num_stages == 1:  # hop 3 returns into a send list's rows, as hop 0 does
        return received, max(back.fan_capacity, send, back.hop1_capacity)
    return received, back.fan_capacity + send + back.hop1_capacity + (send if relay.egress else 0)
