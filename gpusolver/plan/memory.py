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
              KV buffer its first ``kept_kv_rows`` rows only, when given: the rest is cast again
              into a buffer of the remaining rows, so the backward peak is the same)

With S remote sub-stages (``num_stages``) the terms are the same: the S casts of a kind land
in one buffer at the plan's capacity, each at its own rows (``CommMeta.stage_base``), and the
S reduces in flight at once hold no more than one send list between them (``TorchGroup``
returns into buffers of the rows each reduce really returns; ``LocalGroup`` and
``SymmMemGroup`` finish each reduce before the next starts).

Relay transport (``plan.relay``, ``relay_hop_rows``) adds each hop's buffers. Every cast of a
kind receives into one buffer per hop besides the buffer above (the rows in the plan's layout,
gathered out of them): the direct (hop 0) and fan-out (hop 2) buffers at the receive rows, the
relay buffer (hop 1) at ``relay_capacity`` and the egress buffer (hop 3) at ``egress_capacity``.
A reduce of a kind returns by its hops, each into a buffer of its send list's rows: hop 2 to the
relays (``fan_capacity``), hop 0 home (the send rows), hop 1 to the egresses or the hosts
(``hop1_capacity``) and hop 3 home (the send rows, with an egress); one reduce's four are
counted together, where the direct formula counts one send list:

    R(kind) = 2 * recv + relay_capacity + egress_capacity      [hop buffers, per cast row]
    T(kind) = fan_capacity + send + hop1_capacity (+ send)      [one reduce's return rows]
    hops      forward R(QO) * Q + R(KV) * (K, V); backward R(QO) * (dO, lse, delta), and
              R(QO) * Q unless Q is kept, R(KV) * (K, V) unless K and V are kept
    returns   forward T(QO) * (partial O, lse); backward T(QO) * dQ + T(KV) * (dK, dV)
    peak      the receive buffers in the plan's layout (the direct formula's, kept included)
              + the larger of hops and returns with one remote stage (``runtime.relayed`` lets
              a kind's hop buffers go once its layout buffer is gathered: every cast lands
              before stage 1 and the reduce run), their sum with S > 1 sub-stages
              (``runtime.relay_stages``: one buffer per (pass, kind, hop) that the S casts share,
              live to the pass's end, while earlier sub-stages reduce)
    kept      as direct (whole kinds only: relay transport keeps no part of a buffer)

With one remote stage the larger of the two is an upper bound at the casts: the layout buffers
are counted whole there, though each kind's is gathered only once its hops have landed.

T, a reduce's four return buffers together, is an upper bound too: ``LocalGroup`` finishes each
hop before the next starts, and ``TorchGroup`` returns into buffers of the rows each hop really
returns, with hops 2 and 0 of a reduce in flight together (and with sub-stages one sub-stage's
hop 1 beside the next one's hops 2 and 0).

Not counted: the layer's own activations (its q, k, v, out and lse, which plain attention
keeps too) and the runtime's work around the buffers (the local rows that share stage 1's
operand tensor with each buffer, stage 1's outputs over those rows, the reduce's merge: its
outputs, and on the torch path its fp32 sums over the host's rows and a piece of a window of
returned rows), which ``benchmarks/layer_memory.py`` measures (``--fused-reduce``: the fused
merge of a GPU). With relay transport also: the copies the hops are assembled through (the
concatenation of the direct, fan-out and relay buffers each gather reads, and the local rows
hop 1 reads beside the egress rows: a copy per cast with one remote stage, rows of the egress
buffer with sub-stages), a relay's merged partials (the relay buffer's rows) and an egress's
identity rows, and on ``LocalGroup`` the packed staging of each out-of-place cast.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpusolver.problem import kept_kinds

@dataclass(frozen=True)
class BufferMemory:
    """Bytes per rank of one layer's collective buffers (host ints).

    fwd_peak: receive buffers plus the buffer partial O and lse come back into (relay transport:
              plus every hop's receive buffers and return buffers, the larger of the two with
              one remote stage; the module docstring says which).
    bwd_peak: the backward's receive and return buffers, the kept ones included (relay: likewise).
    kept:     held from the layer's forward to its backward.
    """

    fwd_peak: int
    bwd_peak: int
    kept: int


def buffer_memory(comm, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype: torch.dtype,
                  keep=True, kept_kv_rows: int | None = None, relay=None) -> BufferMemory:
    """``BufferMemory`` of a ``CommMeta``'s buffers for the given heads, head dim and dtype;
    ``kept_kv_rows``: of a kept KV buffer only its first rows (the rest is cast again);
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
    kept = (q_buf if "qo" in kinds else 0) + (kv_kept if "kv" in kinds else 0)
    if relay is None:
        return BufferMemory(fwd_peak=layout_fwd + rows.qo_send * (q_row + 4 * hq),
                            bwd_peak=layout_bwd + rows.qo_send * q_row + rows.kv_send * kv_row, kept=kept)
    if "kv" in kinds and kept_kv_rows is not None and kept_kv_rows < rows.kv_recv:
        raise ValueError(f"kept_kv_rows={kept_kv_rows} keeps part of the KV buffer, which relay transport "
                         f"does not run (relay is set): keep whole kinds")
    (r_q, t_q), (r_kv, t_kv) = relay_hop_rows(comm, relay, "qo"), relay_hop_rows(comm, relay, "kv")
    hops_fwd, back_fwd = r_q * q_row + r_kv * kv_row, t_q * (q_row + 4 * hq)
    hops_bwd = (r_q * (q_row + 8 * hq) + (0 if "qo" in kinds else r_q * q_row)
                + (0 if "kv" in kinds else r_kv * kv_row))
    back_bwd = t_q * q_row + t_kv * kv_row
    # one remote stage: the hops' buffers go before the reduce starts; sub-stages: they live to the end
    both = max if relay.num_stages == 1 else (lambda a, b: a + b)
    return BufferMemory(fwd_peak=layout_fwd + both(hops_fwd, back_fwd),
                        bwd_peak=layout_bwd + both(hops_bwd, back_bwd), kept=kept)


def relay_hop_rows(comm, relay, kind: str) -> tuple[int, int]:
    """(R, T) of one kind of a relay plan (host ints): the rows of the buffers each of its casts
    receives into besides the plan-layout one (direct and fan-out at the receive rows, relay,
    egress), and the rows of the buffers one of its reduces returns into, over its hops (hop 2's
    fan-out list, hop 0's send list, hop 1's list, hop 3's send list with an egress). With S > 1
    sub-stages every cast and every reduce has the same capacities (``plan.relay.stage_relay_routes``)."""
    cast, back = relay.stage(kind, 1, "cast"), relay.stage(kind, 1, "return")
    recv, send = comm.buffers.recv(kind), comm.buffers.send(kind)
    received = 2 * recv + cast.relay_capacity + cast.egress_capacity
    returned = back.fan_capacity + send + back.hop1_capacity + (send if relay.egress else 0)
    return received, returned
