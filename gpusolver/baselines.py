"""Per-rank communication volumes of the classic context-parallel schemes.

Full-model dims: ``Hq`` query heads, ``Hkv`` KV heads, head dim ``D``, ``b``
bytes per activation element, ``S`` tokens, ``P`` ranks, chunk ``c = S / P``.
Bytes per token over all heads:

    q  = Hq * D * b        (Q, O, dO and dQ each)
    kv = 2 * Hkv * D * b   (K and V together; dK and dV together)

All volumes are bytes per rank. The closed-form schemes (ring, all-gather,
USP) are mask-unaware: they move whole chunks whatever the mask, so on a
causal mask they still send every shard (no causal skipping is modelled).
Owner-computes is mask-aware: it is ``evaluate`` of the assignment that puts
every task on its query host, so only the needed KV tokens travel.

Backward: each scheme is priced under its own protocol, as implementations
run it. dQ, dK and dV are the size of Q, K and V (activation dtype) and go
back to their owners; what a scheme keeps from its forward does not travel
again, and nothing is counted as kept that a real implementation re-sends:

- owner-computes follows the runtime's protocol (``CommCost``): a rank keeps
  the K, V it received in the forward (``keep_forward_buffers``, default), so
  only dK, dV travel back; with ``keep_forward_buffers=False`` K, V travel
  again as well.
- ring re-circulates K, V: a rank holds one remote shard at a time, so there
  is no forward buffer to keep; each shard goes round again with its dK, dV.
- all-gather KV re-gathers K, V (as TransformerEngine's KV all-gather CP
  does) rather than hold the whole sequence's K, V between the passes, then
  reduce-scatters dK, dV.
- USP keeps its head-sharded Q, K, V, O and lse (the attention's own saved
  inputs and outputs), so only dO goes out and dQ, dK, dV come back through
  the all-to-all; its ring part re-circulates K, V as ring attention does.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from gpusolver.config import SolverConfig
from gpusolver.metrics import evaluate, owner_computes_assignment
from gpusolver.problem import BlockAreas, CommCost

__all__ = [
    "BaselineVolumes", "ring_attention", "all_gather_kv", "ulysses_degree", "usp", "owner_computes",
    "baseline_table",
]


@dataclass(frozen=True)
class BaselineVolumes:
    """Host ints: per-rank bytes (lists of length P) and the bottlenecks.

    fwd_send, fwd_recv, bwd_send, bwd_recv: list[int], bytes per rank.
    fwd_bottleneck, bwd_bottleneck: int, max over ranks of max(send, recv).
    step_bottleneck: int (property), their sum: a training step's bytes.
    """

    fwd_send: list
    fwd_recv: list
    bwd_send: list
    bwd_recv: list
    fwd_bottleneck: int
    bwd_bottleneck: int

    @classmethod
    def uniform(cls, cp_size: int, fwd: int, bwd: int) -> "BaselineVolumes":
        """Every rank sends and receives ``fwd`` bytes forward and ``bwd`` backward."""
        return cls([fwd] * cp_size, [fwd] * cp_size, [bwd] * cp_size, [bwd] * cp_size, fwd, bwd)

    @property
    def step_bottleneck(self) -> int:
        return self.fwd_bottleneck + self.bwd_bottleneck

    def to_dict(self) -> dict:
        return {**asdict(self), "step_bottleneck": self.step_bottleneck}


def _chunk(seqlen: int, cp_size: int) -> int:
    if cp_size <= 0 or seqlen <= 0:
        raise ValueError(f"seqlen and cp_size must be positive, got seqlen={seqlen}, cp_size={cp_size}")
    if seqlen % cp_size:
        raise ValueError(f"seqlen={seqlen} must be divisible by cp_size={cp_size}")
    return seqlen // cp_size


def ring_attention(*, seqlen: int, cp_size: int, num_heads_kv: int, head_dim: int, dtype_bytes: int,
                   **_unused) -> BaselineVolumes:
    """Ring attention: each KV shard makes P - 1 hops around the ring.

    Forward: every rank sends and receives P - 1 shards of c tokens of K, V:

        fwd = (P - 1) * c * kv

    Backward: K, V go around the ring again (a rank held one remote shard at
    a time, so none was kept), and each shard's partial dK, dV travels with
    it and returns to its owner (P - 1 hops in all when the accumulator
    starts at the first remote rank):

        bwd = 2 * (P - 1) * c * kv

    Q and O never leave their rank.
    """
    c = _chunk(seqlen, cp_size)
    kv = 2 * num_heads_kv * head_dim * dtype_bytes
    fwd = (cp_size - 1) * c * kv
    return BaselineVolumes.uniform(cp_size, fwd, 2 * fwd)


def all_gather_kv(*, seqlen: int, cp_size: int, num_heads_kv: int, head_dim: int, dtype_bytes: int,
                  **_unused) -> BaselineVolumes:
    """All-gather KV: every rank gathers the whole K, V before attention.

    Forward: a bandwidth-optimal all-gather has each rank receive the P - 1
    shards it lacks and send its own P - 1 times (or forward as many):

        fwd = (P - 1) * c * kv

    Backward: re-gather K, V (the gathered copy is not kept between the
    passes: it would hold the whole sequence's K, V per layer), then
    reduce-scatter dK, dV (each rank sends P - 1 partial shards of c tokens
    and receives P - 1 for its own):

        bwd = 2 * (P - 1) * c * kv

    The same bytes as ring attention; only the schedule differs.
    """
    c = _chunk(seqlen, cp_size)
    kv = 2 * num_heads_kv * head_dim * dtype_bytes
    fwd = (cp_size - 1) * c * kv
    return BaselineVolumes.uniform(cp_size, fwd, 2 * fwd)


def ulysses_degree(num_heads_kv: int, cp_size: int, max_degree: int = 8) -> int:
    """USP's Ulysses degree u: the largest divisor of both Hkv and P that is <= min(8, Hkv).

    ``u = min(8, Hkv)`` whenever that divides P (the usual case: P a multiple
    of 8, Hkv in {1, 2, 4, 8, 16, ...}).
    """
    for u in range(min(max_degree, num_heads_kv, cp_size), 0, -1):
        if num_heads_kv % u == 0 and cp_size % u == 0:
            return u
    return 1


def usp(*, seqlen: int, cp_size: int, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype_bytes: int,
        degree: int | None = None) -> BaselineVolumes:
    """USP: Ulysses all-to-all over u ranks times a ring over P / u ranks.

    With u = ``degree`` (default ``ulysses_degree(Hkv, P)``) and ring degree
    r = P / u. An all-to-all inside a Ulysses group keeps 1/u of each local
    chunk and sends the other (u - 1)/u out (and receives as much). After it a
    rank holds Hq/u query heads and Hkv/u KV heads for u * c tokens, so one
    ring shard is c * u tokens of Hkv/u heads = c * kv bytes.

    Forward: all-to-all of Q, K, V in and O back (O only; the lse merge of the
    ring is local), then r - 1 ring hops of K, V:

        fwd = (u - 1)/u * c * (q + kv + q) + (r - 1) * c * kv

    Backward (Q, K, V, O, lse kept head-sharded from the forward, so the
    row delta is local): all-to-all of dO in, ring of K, V and of dK, dV (as
    ``ring_attention`` over r ranks: the ring keeps no K, V), all-to-all of
    dQ, dK, dV back:

        bwd = (u - 1)/u * c * (q + q + kv) + 2 * (r - 1) * c * kv

    Integer exact: Hq and Hkv are multiples of u.
    """
    c = _chunk(seqlen, cp_size)
    u = ulysses_degree(num_heads_kv, cp_size) if degree is None else degree
    if u <= 0 or cp_size % u or num_heads_kv % u:
        raise ValueError(f"degree={u} must divide cp_size={cp_size} and num_heads_kv={num_heads_kv}")
    if num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q={num_heads_q} must be a multiple of num_heads_kv={num_heads_kv}")
    r = cp_size // u
    q_part = (num_heads_q // u) * head_dim * dtype_bytes  # q / u
    kv_part = 2 * (num_heads_kv // u) * head_dim * dtype_bytes  # kv / u
    kv = kv_part * u
    a2a = (u - 1) * c * (2 * q_part + kv_part)  # (u-1)/u * c * (2q + kv); the same mix both passes
    ring = (r - 1) * c * kv
    return BaselineVolumes.uniform(cp_size, a2a + ring, a2a + 2 * ring)


def owner_computes(areas: BlockAreas, cost: CommCost) -> BaselineVolumes:
    """Owner-computes: each task on its query host; only needed KV tokens travel.

    The volumes are ``evaluate(areas, owner_computes_assignment(areas), cost)``
    (host-side copy): for each KV unit (g, j) and each rank r != j whose tasks
    need it, the hull of the needed columns travels j -> r; forward
    ``kv_fwd`` per token; backward ``dkv_bwd`` (dK, dV) back r -> j, plus
    ``kv_bwd`` (K, V again) out only when ``cost.keep_forward_buffers`` is
    False. No Q/O travels in either pass.
    """
    m = evaluate(areas, owner_computes_assignment(areas), cost).to_dict()
    return BaselineVolumes(m["fwd_send"], m["fwd_recv"], m["bwd_send"], m["bwd_recv"],
                           m["fwd_bottleneck"], m["bwd_bottleneck"])


def baseline_table(areas: BlockAreas, config: SolverConfig) -> dict[str, dict]:
    """Forward / backward bytes of every baseline for this mask and config (host-side).

    areas:  BlockAreas of the mask (G may be 1 or ``config.num_heads_kv``);
            S = P * areas.chunk.
    config: SolverConfig giving P, Hq, Hkv, D, the dtype and whether helpers
            keep their forward buffers (owner-computes only; the other
            schemes keep what their own protocol keeps).

    Returns ``{name: BaselineVolumes.to_dict()}`` for ``owner_computes``,
    ``ring``, ``all_gather_kv`` and ``usp``; each dict has ``fwd_bottleneck``
    and ``bwd_bottleneck`` (int bytes), their sum ``step_bottleneck`` and the per-rank
    send / recv lists. Tiled areas give the same figures as whole chunks.
    """
    if areas.cp_size != config.cp_size:
        raise ValueError(f"areas has P={areas.cp_size} but config.cp_size={config.cp_size}")
    dims = dict(seqlen=areas.cp_size * areas.rank_tokens, cp_size=config.cp_size, num_heads_q=config.num_heads_q,
                num_heads_kv=config.num_heads_kv, head_dim=config.head_dim, dtype_bytes=config.dtype_bytes)
    cost = CommCost(config.num_heads_q, config.num_heads_kv, config.head_dim, config.dtype_bytes,
                    areas.head_groups, config.keep_forward_buffers)
    return {
        "owner_computes": owner_computes(areas, cost).to_dict(),
        "ring": ring_attention(**dims).to_dict(),
        "all_gather_kv": all_gather_kv(**dims).to_dict(),
        "usp": usp(**dims).to_dict(),
    }
