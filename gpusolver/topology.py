"""The cluster a CP group runs on, as plain data: links, NICs and attention throughput.

A ``Topology`` says which ranks share a node (and so an NVLink domain), how
fast each GPU's NVLink and each node's InfiniBand NICs move bytes per
direction, what one collective call costs before its first byte, and how fast
a GPU computes attention. It knows nothing of plans or solvers: the
simulator (``gpusolver.sim``) and the topology-aware solver both read it.

Rank layout: rank r sits on node ``r // ranks_per_node`` at local index
``r % ranks_per_node`` (torchrun's order). A node's GPUs share its
``nics_per_node`` NICs evenly, local index l using NIC
``l * nics_per_node // ranks_per_node`` of its node.

Units: bandwidths in GB/s (1e9 bytes per second) per direction; throughput in
TFLOP/s (1e12); latency in microseconds. Attention FLOPs are ``4 * D`` per
valid (q, k) entry per query head forward (two matmuls of 2 FLOPs per
multiply-add), and ``bwd_flops_ratio`` times that backward.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

__all__ = ["Topology", "PRESETS", "h100_hgx", "h200_hgx", "gb200_nvl72", "single_node"]


def _positive(name: str, value, *, integer: bool = False) -> None:
    if integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class Topology:
    """A cluster of nodes of ``ranks_per_node`` GPUs.

    ranks_per_node:   GPUs per NVLink domain (8 for an HGX box, 72 for an NVL72 rack).
    nvlink_gbps:      NVLink bandwidth per GPU per direction, GB/s.
    ib_gbps:          InfiniBand bandwidth per NIC per direction, GB/s.
    attn_tflops:      forward attention throughput per GPU, TFLOP/s.
    bwd_flops_ratio:  backward FLOPs / forward FLOPs of attention (dQ, dK, dV and the recompute of P).
    nics_per_node:    InfiniBand NICs per node (None: one per GPU).
    bwd_attn_tflops:  backward attention throughput per GPU, TFLOP/s (None: ``attn_tflops``).
    nvlink_latency_us: fixed cost of one collective or transfer inside a node, microseconds.
    ib_latency_us:    fixed cost of one collective or transfer that crosses nodes, microseconds.
    max_nodes:        nodes available (None: as many as a group needs).
    name:             a label for reports.
    rail_routing:     how a transfer across nodes reaches the network (``link_sides``). False: through
                      the source GPU's own NIC. True: over NVLink to the GPU of the source's node at
                      the destination's local index, then through that GPU's NIC, so it stays on the
                      destination's rail; NCCL routes point-to-point sends this way on rail-optimised
                      clusters (its PXN, since NCCL 2.12), which all-to-all-v and ``batch_isend_irecv``
                      on a ``TorchGroup`` over NCCL use.
    """

    ranks_per_node: int
    nvlink_gbps: float
    ib_gbps: float
    attn_tflops: float
    bwd_flops_ratio: float = 2.5
    nics_per_node: int | None = None
    bwd_attn_tflops: float | None = None
    nvlink_latency_us: float = 0.0
    ib_latency_us: float = 0.0
    max_nodes: int | None = None
    name: str = "custom"
    rail_routing: bool = False

    def __post_init__(self) -> None:
        _positive("ranks_per_node", self.ranks_per_node, integer=True)
        _positive("nvlink_gbps", self.nvlink_gbps)
        _positive("ib_gbps", self.ib_gbps)
        _positive("attn_tflops", self.attn_tflops)
        _positive("bwd_flops_ratio", self.bwd_flops_ratio)
        if self.nics_per_node is None:
            object.__setattr__(self, "nics_per_node", self.ranks_per_node)
        _positive("nics_per_node", self.nics_per_node, integer=True)
        if self.ranks_per_node % self.nics_per_node:
            raise ValueError(f"nics_per_node = {self.nics_per_node} must divide ranks_per_node = "
                             f"{self.ranks_per_node} (the GPUs share the NICs evenly)")
        if self.bwd_attn_tflops is None:
            object.__setattr__(self, "bwd_attn_tflops", self.attn_tflops)
        _positive("bwd_attn_tflops", self.bwd_attn_tflops)
        for name in ("nvlink_latency_us", "ib_latency_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be >= 0 and finite, got {value!r}")
        if self.max_nodes is not None:
            _positive("max_nodes", self.max_nodes, integer=True)
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.rail_routing, bool):
            raise TypeError(f"rail_routing must be a bool, got {type(self.rail_routing).__name__} "
                            f"{self.rail_routing!r}")

    # --- layout -------------------------------------------------------------------------------------------------

    def check_group(self, cp_size: int) -> None:
        """Raise ValueError unless a group of ``cp_size`` ranks fits: within one node, or whole nodes."""
        _positive("cp_size", cp_size, integer=True)
        n = self.ranks_per_node
        if cp_size > n and cp_size % n:
            raise ValueError(f"cp_size = {cp_size} must be at most ranks_per_node = {n} or a multiple of it "
                             f"(whole nodes) on topology {self.name!r}")
        if self.max_nodes is not None and self.nodes(cp_size) > self.max_nodes:
            raise ValueError(f"cp_size = {cp_size} needs {self.nodes(cp_size)} nodes of {n}; topology "
                             f"{self.name!r} has {self.max_nodes}")

    def nodes(self, cp_size: int) -> int:
        """Nodes a group of ``cp_size`` ranks spans."""
        return -(-cp_size // self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return a // self.ranks_per_node == b // self.ranks_per_node

    def relay_rank(self, host: int, node: int) -> int:
        """The rank of ``node`` that receives, over InfiniBand, what ``host`` sends to that node.

        Rail-aligned: the rank at ``host``'s local index, so every host's inter-node bytes leave
        through its own NIC and land on one NIC per remote node, and a node's hosts spread their
        traffic over all of its NICs. On ``host``'s own node it is ``host`` itself (no relay).
        This is the rule the solver prices; a relay plan may move a host's
        crossing to another rail of its node (egress and relay both at that local index, the
        host's rows brought to the egress over NVLink) when that spreads the bytes of the
        node's NICs better (``plan.relay.matched_rails``, ``RelayMeta.rails``).
        """
        return node * self.ranks_per_node + host % self.ranks_per_node

    def nic_of(self, rank: int) -> int:
        """Global index of the NIC rank ``rank`` sends and receives through (node-major)."""
        local = rank % self.ranks_per_node
        per_nic = self.ranks_per_node // self.nics_per_node
        return self.node_of(rank) * self.nics_per_node + local // per_nic

    def link_sides(self, src: int, dst: int) -> tuple[tuple[str, int, int], ...]:
        """The link sides a transfer from ``src`` to ``dst`` (``src != dst``) goes through, in order, as
        (side, index, rank): side "nvlink send" / "nvlink recv" (index: the GPU) or "ib send" /
        "ib recv" (index: the NIC, ``nic_of``); rank is the GPU that side serves (where a timeline
        draws it). Inside a node: the source's NVLink send side and the destination's receive side.
        Across nodes: the NICs' send and receive sides, the send side the source's own NIC, or with
        ``rail_routing`` the NIC of the source node's GPU at the destination's local index, reached
        over NVLink first when that GPU is not the source."""
        if self.same_node(src, dst):
            return ("nvlink send", src, src), ("nvlink recv", dst, dst)
        # on the destination's rail: the GPU of the source's node at the destination's local index,
        # the rail-aligned rank ``relay_rank`` names
        via = self.relay_rank(dst, self.node_of(src)) if self.rail_routing else src
        hop = (("nvlink send", src, src), ("nvlink recv", via, via)) if via != src else ()
        return hop + (("ib send", self.nic_of(via), via), ("ib recv", self.nic_of(dst), dst))

    # --- prices -------------------------------------------------------------------------------------------------

    def attn_flops(self, entries: float, q_heads: int, head_dim: int, phase: str = "fwd") -> float:
        """FLOPs of attention over ``entries`` valid (q, k) entries of ``q_heads`` query heads each."""
        if phase not in ("fwd", "bwd"):
            raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        flops = 4.0 * head_dim * q_heads * float(entries)
        return flops * self.bwd_flops_ratio if phase == "bwd" else flops

    def attn_seconds(self, entries: float, q_heads: int, head_dim: int, phase: str = "fwd") -> float:
        """Seconds one GPU spends on that attention."""
        tflops = self.bwd_attn_tflops if phase == "bwd" else self.attn_tflops
        return self.attn_flops(entries, q_heads, head_dim, phase) / (tflops * 1e12)

    def link_seconds(self, nbytes: float, *, inter_node: bool) -> float:
        """Seconds to push ``nbytes`` through one NIC (inter-node) or one GPU's NVLink, no latency."""
        return float(nbytes) / ((self.ib_gbps if inter_node else self.nvlink_gbps) * 1e9)

    def latency_seconds(self, *, inter_node: bool) -> float:
        return (self.ib_latency_us if inter_node else self.nvlink_latency_us) * 1e-6

    # --- construction -------------------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> "Topology":
        """One of ``PRESETS`` by name."""
        if name not in PRESETS:
            raise ValueError(f"unknown topology {name!r}; presets: {', '.join(sorted(PRESETS))}")
        return PRESETS[name]

    @classmethod
    def from_env(cls, base: "Topology | str" = "h200_hgx", env=None) -> "Topology":
        """``base`` with ``ranks_per_node`` from torchrun's ``LOCAL_WORLD_SIZE``.

        ``WORLD_SIZE`` (when set) must be whole nodes of ``LOCAL_WORLD_SIZE``.
        Link and compute figures come from ``base`` (a preset name or a
        Topology): the environment says how ranks are laid out, not how fast
        the hardware is. NICs per node follow the GPUs (one each) unless
        ``base`` has fewer NICs than GPUs, in which case their ratio is kept.
        """
        env = os.environ if env is None else env
        base = cls.preset(base) if isinstance(base, str) else base
        if not isinstance(base, Topology):
            raise TypeError(f"base must be a Topology or a preset name, got {type(base).__name__}")
        raw = env.get("LOCAL_WORLD_SIZE")
        if raw is None:
            raise ValueError("LOCAL_WORLD_SIZE is not set: Topology.from_env needs torchrun's environment "
                             "(or build a Topology / use a preset)")
        local = _env_int("LOCAL_WORLD_SIZE", raw)
        world_raw = env.get("WORLD_SIZE")
        if world_raw is not None:
            world = _env_int("WORLD_SIZE", world_raw)
            if world % local:
                raise ValueError(f"WORLD_SIZE = {world} is not a multiple of LOCAL_WORLD_SIZE = {local}")
        gpus_per_nic = base.ranks_per_node // base.nics_per_node
        nics = local // gpus_per_nic if local % gpus_per_nic == 0 else local
        return replace(base, ranks_per_node=local, nics_per_node=nics, max_nodes=None,
                       name=f"{base.name} (env: {local} per node)")


def _env_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} = {raw!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


# Public figures of the parts, per GPU per direction. H100 and H200 share the
# compute die (only HBM differs), so attention throughput is the same; 400
# TFLOP/s is a sustained flash-attention rate in bf16, well under the dense
# peak. NVLink 4 is 900 GB/s both directions per GPU; one ConnectX-7 NIC
# (400 Gb/s) per GPU. GB200: NVLink 5 at 1.8 TB/s both directions across a
# 72-GPU rack, the same NIC per GPU. Latencies are the order of an NCCL
# collective's launch and first byte, inside a node and across nodes. Rail routing: NCCL's
# point-to-point (all-to-all-v and batched send/receive alike) leaves a node through the NIC on
# the destination's rail by default (PXN, NCCL >= 2.12); a gloo group, or NCCL_P2P_PXN_LEVEL=0,
# sends through each GPU's own NIC: ``replace(preset, rail_routing=False)``.
h100_hgx = Topology(ranks_per_node=8, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0,
                    nvlink_latency_us=10.0, ib_latency_us=20.0, name="h100_hgx", rail_routing=True)
h200_hgx = Topology(ranks_per_node=8, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0,
                    nvlink_latency_us=10.0, ib_latency_us=20.0, name="h200_hgx", rail_routing=True)
gb200_nvl72 = Topology(ranks_per_node=72, nvlink_gbps=900.0, ib_gbps=50.0, attn_tflops=900.0,
                       nvlink_latency_us=10.0, ib_latency_us=20.0, name="gb200_nvl72", rail_routing=True)
# One H200 HGX box on its own: groups of up to 8 ranks, nothing crosses InfiniBand.
single_node = replace(h200_hgx, max_nodes=1, name="single_node")

PRESETS: dict[str, Topology] = {t.name: t for t in (h100_hgx, h200_hgx, gb200_nvl72, single_node)}
