"""The sizes gpusolver supports, in one place, and the checks that refuse the rest.

Every integer in the solve is int64 (areas, loads, bytes, scaled costs) except
a few int32 fast paths over token positions. The limits below keep every
intermediate below 2^62 with margin, so a plan is never quietly wrong from an
overflow; past a limit the entry points raise a ValueError that names it.

    MAX_SEQLEN        S <= 2^25 tokens (33.5M). Areas and loads are at most
                      G * S^2 <= 2^57; mu * total, computed split (``balanced_load_cap``),
                      stays below 2^60; token positions fit the int32 paths (2^30).
    MAX_CP_SIZE       P <= 256 ranks (balance is tested to P = 128 at S = 2^24).
    MAX_HEAD_GROUPS   G <= 128 (Hkv <= 128 with head-group flattening).
    MAX_CHUNK_TILES   n <= 16 sub-chunk tiles per rank (the task count G * (n P)^2 sets memory).
    MAX_NUM_STAGES    S <= 32 remote sub-stages (each has its own collectives; they share the receive buffers).
    MAX_HEADS_Q       Hq <= 1024, MAX_HEAD_DIM D <= 1024: bytes per token stay below 2^24,
                      so per-rank volumes stay below 2^50.
    MAX_IMBALANCE_TOL mu <= 4.
    MAX_LINK_WEIGHT   a topology-aware solve prices an InfiniBand byte at most 64 NVLink bytes
                      (``SolverConfig.link_weights``), so link-weighted volumes stay below 2^56
                      and a step's (forward plus backward) below 2^57, under the keys' 2^59.
    MAX_PLAN_ROWS     CalcMeta row coordinates are int32: a rank's local rows plus its receive
                      buffer, G * c + recv_capacity, must stay below 2^31 (``build_plan``
                      refuses more; the default capacity G * c * (P - 1) makes it G * S).

The attention kernels take head dims 32, 64 and 128 (``attn_kernels``); the
solver only prices bytes and takes any D up to MAX_HEAD_DIM.

Checked at these limits (tests/gpusolver/test_scale.py runs S = 2^24): block
areas in closed form (products of order S^2 <= 2^51, sentinels 2^40), loads
and their prefix sums (<= 2^57), forward and backward bytes (< 2^51, exact in
the fp64 thresholds and limits), the solver's sentinels (``_BIG = 2^60``, the
unbalanced key ``_BIG // 2 + max load`` < 2^60), its top-k key (guarded,
sort fallback), the int32 hull paths (positions <= 2^25 < 2^30, bundle sums
<= S < 2^31), and the Triton kernels' offsets (int64 from the program ids).
Two int32 products of launch arguments, ``B * G * U * P`` cells of a state
table, reach 2^31 only when that table needs more than 100 GB.
"""
from __future__ import annotations

from fractions import Fraction

MAX_SEQLEN = 1 << 25
MAX_CP_SIZE = 256
MAX_HEAD_GROUPS = 128
MAX_NUM_STAGES = 32  # remote sub-stages: one collective per phase each
MAX_CHUNK_TILES = 16
MAX_HEADS_Q = 1024
MAX_HEAD_DIM = 1024
MAX_IMBALANCE_TOL = 4.0
MAX_PLAN_ROWS = (1 << 31) - 1
MAX_LINK_WEIGHT = 64

# what each SolverConfig field may be at most, with the limit's name for the message
CONFIG_LIMITS = {
    "cp_size": ("MAX_CP_SIZE", MAX_CP_SIZE),
    "num_heads_q": ("MAX_HEADS_Q", MAX_HEADS_Q),
    "num_heads_kv": ("MAX_HEAD_GROUPS", MAX_HEAD_GROUPS),
    "head_dim": ("MAX_HEAD_DIM", MAX_HEAD_DIM),
    "chunk_tiles": ("MAX_CHUNK_TILES", MAX_CHUNK_TILES),
    "num_stages": ("MAX_NUM_STAGES", MAX_NUM_STAGES),
}


def check_seqlen_limit(name: str, seqlen: int) -> None:
    """Raise when a sequence of ``seqlen`` tokens is past MAX_SEQLEN."""
    if seqlen > MAX_SEQLEN:
        raise ValueError(f"{name}={seqlen} tokens is past the supported MAX_SEQLEN = {MAX_SEQLEN} (2^25) "
                         "(see gpusolver.limits)")


def check_problem_limits(seqlen: int, cp_size: int, head_groups: int, tiles: int) -> None:
    """Raise when a problem (block areas) is past a supported limit; host ints only."""
    check_seqlen_limit("sequence length S", seqlen)
    for name, value, limit_name, limit in (("cp_size P", cp_size, "MAX_CP_SIZE", MAX_CP_SIZE),
                                           ("head groups G", head_groups, "MAX_HEAD_GROUPS", MAX_HEAD_GROUPS),
                                           ("chunk tiles n", tiles, "MAX_CHUNK_TILES", MAX_CHUNK_TILES)):
        if value > limit:
            raise ValueError(f"{name}={value} is past the supported {limit_name} = {limit} (see gpusolver.limits)")


def check_plan_rows(head_groups: int, chunk: int, recv_capacity: int) -> None:
    """Raise when a plan's int32 row coordinates (local rows plus the receive buffer, which the
    sub-stages share) could wrap."""
    rows = head_groups * chunk + recv_capacity
    if rows > MAX_PLAN_ROWS:
        raise ValueError(f"G * c + recv_capacity = {head_groups} * {chunk} + {recv_capacity} = {rows} rows is past "
                         f"the supported MAX_PLAN_ROWS = {MAX_PLAN_ROWS} (int32 CalcMeta rows; see "
                         "gpusolver.limits): set SolverConfig.max_recv_rows to the rows a rank really receives")


def imbalance_fraction(imbalance_tol: float, scale: int = 1 << 20) -> tuple[int, int]:
    """mu as (numerator, denominator): the fraction nearest to it with a denominator <= ``scale``.

    A decimal mu is then exact (1.10 -> 11 / 10), so a load at the cap never
    reads above mu, as it would with mu rounded to ``scale`` parts
    (round(1.1 * 2^20) / 2^20 = 1.1000004).
    """
    f = Fraction(imbalance_tol).limit_denominator(scale)
    return f.numerator, f.denominator


def balanced_load_cap(total, imbalance_tol: float, cp_size: int, scale: int = 1 << 20):
    """The largest balanced load ``floor(mu * total / P)``, exact in integer arithmetic.

    ``total`` is the summed area (a 0-dim int64 tensor or a Python int); mu is
    ``imbalance_fraction(imbalance_tol, scale)``. ``mu * total`` itself passes
    2^63 on long sequences (a 2M-token causal sequence over 8 head groups sums
    to about 2^44, times mu in 2^20 parts), so the product is split as
    ``(q * den + r) * num / den`` with ``r < den``: each term stays below
    2^60 within the limits above (q * num <= mu * total, r * num < 2^50).
    """
    num, den = imbalance_fraction(imbalance_tol, scale)
    den *= cp_size
    q, r = total // den, total % den
    return q * num + (r * num) // den
