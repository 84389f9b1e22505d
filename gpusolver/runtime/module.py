"""``DynamicCPAttention``: the attention of a model layer over a CP group, solved per mask.

Model code keeps ordinary sequential shards (``shard``): rank p holds tokens
``[p * c, (p + 1) * c)`` in natural order, so RoPE positions, the label
shift and the loss need no permutation. Each layer passes its q, k, v
shards and the layer's mask (the whole sequence's slices: small metadata
that every rank holds); the module solves the mask on the device and runs
``dist_attn``.

Masks are solved once per step and name: layers that pass the same mask
object under the same ``mask_name`` share one solve (a model with sliding-
window and global layers names the two masks, so they do not evict each
other). A new mask object under a name solves again, and so does the same
object once one of its tensors was written in place (the entry keeps the
tensors' version counters).

Under ``torch.compile`` the cache is not used at all: a compiled graph keeps
what it read while tracing, so a cached plan inside a graph would be reused
for every later mask. Each layer solves inside the graph instead (the solve
is sync-free), which makes a compiled layer correct for any sequence of
masks of one shape with no recompile per mask. A compiled model that wants
one solve per step for several layers solves once (``layer.plan_for``)
and passes ``plan=`` to each layer (docs/debugging.md, "torch.compile").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from gpusolver import errors
from gpusolver.capacity import keep_for_budget
from gpusolver.config import SolverConfig, check_config
from gpusolver.masks.slices import AttnSlices
from gpusolver.masks.sparse import NSALayerMask
from gpusolver.nvtx import nvtx_range
from gpusolver.plan import Plan
from gpusolver.runtime.dist_attn import config_digest, dist_attn
from gpusolver.runtime.sparse_attn import (SPARSE_MASKS, local_selection, mask_on_device, solve_sparse_sharded,
                                           sparse_dist_attn)
from gpusolver.solve import SOLVERS, solve
from gpusolver.support import HEAD_DIMS, check_tensors, softmax_scale_of
from groupcomm import as_group


def mask_tensors(mask) -> tuple[torch.Tensor, ...]:
    """Every tensor of a mask (a slice or sparse mask dataclass, nested ones included)."""
    out = []
    for f in dataclasses.fields(mask):
        x = getattr(mask, f.name)
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif dataclasses.is_dataclass(x):
            out.extend(mask_tensors(x))
    return tuple(out)


def _versions(mask) -> tuple[int, ...] | None:
    """The version counters of the mask's tensors (each moves on every in-place write: host
    metadata, no host read); None when one has none (an inference tensor): never cached."""
    tensors = mask_tensors(mask)
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


@dataclass
class _Entry:
    mask: AttnSlices
    versions: tuple[int, ...]
    config: SolverConfig
    plan: Plan


class PlanCache:
    """The last plan solved for each mask name (shared by the layers of a model).

    ``get(name, mask, config)`` returns the cached plan when ``mask`` is the very
    object it was solved for (identity, no host read), none of its tensors was
    written since (version counters) and the config is the same; else None.

    Inside a ``torch.compile`` trace ``get`` answers None and ``put`` stores
    nothing: a hit would be baked into the graph and replayed for every later
    mask, and a store would make the next call recompile. Compiled layers
    solve in the graph or take ``plan=``.
    """

    def __init__(self):
        self._entries: dict[str, _Entry] = {}
        self.solves = 0  # how many plans were solved through this cache (eager calls)

    def get(self, name: str, mask: AttnSlices, config: SolverConfig) -> Plan | None:
        if torch.compiler.is_compiling():
            return None
        e = self._entries.get(name)
        if e is None or e.mask is not mask or e.config != config or e.versions != _versions(mask):
            return None
        return e.plan

    def put(self, name: str, mask: AttnSlices, config: SolverConfig, plan: Plan) -> None:
        if torch.compiler.is_compiling():
            return
        self.solves += 1
        versions = _versions(mask)
        if versions is None:  # no version counter: a later in-place write could not be seen
            self._entries.pop(name, None)
            return
        self._entries[name] = _Entry(mask, versions, config, plan)

    def clear(self) -> None:
        self._entries.clear()


_DEFAULT_CACHE = PlanCache()
_SPARSE_MESSAGE = "holds a selection index outside its range or selected twice (mask.validate() names the row)"
for _kind in SPARSE_MASKS:
    errors.register("DynamicCPAttention", _kind.__name__, _SPARSE_MESSAGE)


def _on_device(mask: AttnSlices, device: torch.device) -> AttnSlices:
    """The mask on the activations' device (the solve runs where the attention runs)."""
    if mask.device == device:
        return mask
    return AttnSlices(mask.q_ranges.to(device), mask.k_ranges.to(device), mask.attn_type.to(device),
                      mask.total_seqlen_q, mask.total_seqlen_k)


def default_plan_cache() -> PlanCache:
    """The process-wide cache every ``DynamicCPAttention`` uses unless given its own."""
    return _DEFAULT_CACHE


class DynamicCPAttention(nn.Module):
    """Attention over a CP group with a plan solved per layer mask.

    Args:
        group: ``groupcomm`` group (``LocalGroup(P)``, ``TorchGroup``, ``SymmMemGroup``;
            ``groupcomm.default_group()`` picks one), or a ``torch.distributed`` process group,
            wrapped as ``default_group`` does.
        config: ``SolverConfig`` (P, heads, D, dtype, mu, capacities,
            ``keep_forward_buffers``); ``cp_size`` must equal the group's size.
        solver, impl: as in ``gpusolver.solve``.
        softmax_scale, deterministic: as in ``dist_attn``.
        plan_cache: shared ``PlanCache`` (default: the process-wide one).
        validate: host-side checks of the mask and the plan (default: on for CPU tensors, off
            under ``torch.compile``). Off, the same checks are device error flags.
        check_every: read the device error flags (``gpusolver.check_errors()``, one host read)
            every N forward calls of this module and raise on the first error; None never
            (call ``check_errors()`` yourself, e.g. at the end of a step).
        debug_digest: all-gather a digest of every rank's config and plan each call and raise
            (validation) or flag (sync-free) when the ranks hold different masks or configs; in
            sync-free mode also flag overlapping slices (pairwise, O(G * R^2), at each solve).
    """

    def __init__(self, group, config: SolverConfig, *, solver: str = "device", impl: str = "auto",
                 softmax_scale: float | None = None, deterministic: bool = True,
                 plan_cache: PlanCache | None = None, validate: bool | None = None,
                 check_every: int | None = None, debug_digest: bool = False):
        super().__init__()
        group = as_group(group)
        check_config(config)
        if config.head_dim not in HEAD_DIMS:  # the kernels' list: fail here, not after the first solve
            raise ValueError(f"config.head_dim={config.head_dim} is not a head dim of the attention kernels "
                             f"{HEAD_DIMS}")
        if config.cp_size != group.size:
            raise ValueError(f"config.cp_size={config.cp_size} but the group has {group.size} ranks")
        if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, int)
                                        or check_every < 1):
            raise ValueError(f"check_every must be a positive int (forward calls) or None, got {check_every!r}")
        # refused here rather than at the first forward, where they fail inside the solve or the layer
        from gpusolver.solver.device import IMPLS

        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        softmax_scale_of(softmax_scale, config.head_dim)
        if plan_cache is not None and not isinstance(plan_cache, PlanCache):
            raise TypeError(f"plan_cache must be a PlanCache or None, got {type(plan_cache).__name__}")
        self.check_every, self.debug_digest = check_every, bool(debug_digest)
        self._calls = 0
        self.group = group
        self.config = config
        self.solver, self.impl = solver, impl
        self.softmax_scale, self.deterministic = softmax_scale, deterministic
        self.plan_cache = default_plan_cache() if plan_cache is None else plan_cache
        self.validate = validate

    def plan_for(self, mask: AttnSlices, device: torch.device, mask_name: str = "default") -> Plan:
        """The plan of ``mask`` (solved on ``device``, or taken from the cache)."""
        plan = self.plan_cache.get(mask_name, mask, self.config)
        if plan is None:
            # host checks read values: a graph break under torch.compile, so off there by default
            validate = (device.type == "cpu" and not torch.compiler.is_compiling()) if self.validate is None \
                else self.validate
            if isinstance(mask, SPARSE_MASKS):  # sharded indexer flow: local area rows, all-gather, solve
                if not validate:
                    errors.record("DynamicCPAttention", type(mask).__name__, _SPARSE_MESSAGE,
                                  mask_on_device(mask, device).value_error())
                plan = solve_sparse_sharded(mask_on_device(mask, device), self.config, self.group,
                                            solver=self.solver, impl=self.impl, validate=validate)
            else:
                here = _on_device(mask, device)
                if self.debug_digest and not validate:  # the pairwise overlap flag is a debug check
                    errors.record_slices("DynamicCPAttention", here, overlap=True)
                plan = solve(here, self.config, solver=self.solver, impl=self.impl, validate=validate)
            self.plan_cache.put(mask_name, mask, self.config, plan)
        return plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnSlices | None = None, *,
                plan: Plan | None = None, mask_name: str = "default", return_lse: bool = False):
        """q ``[c, Hq, D]``, k / v ``[c, Hkv, D]`` (this rank's shards; ``[P, ...]`` on a
        ``LocalGroup``) and the layer's mask (or a precomputed ``plan``) -> out ``[c, Hq, D]``
        (and lse ``[c, Hq]`` fp32 with ``return_lse``).

        Sparse masks (``BlockSparseMask``, ``TokenTopKMask``, ``NSALayerMask``) hold the query rows
        this process runs (every rank's on a ``LocalGroup``, else this rank's c rows at
        ``query_offset = rank * c``) and must be passed as ``mask``; an ``NSALayerMask`` gives
        ``(out_sel, out_win)`` (with lse: ``((out, lse), (out, lse))``)."""
        if (mask is None) == (plan is None):
            raise ValueError("pass exactly one of mask= and plan=")
        if mask is not None and not isinstance(mask, (AttnSlices, *SPARSE_MASKS)):
            raise TypeError(f"mask must be an AttnSlices, BlockSparseMask, TokenTopKMask or NSALayerMask, got "
                            f"{type(mask).__name__} (gpusolver.masks builds them, e.g. varlen_causal_mask(lengths))")
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be a Plan (gpusolver.solve or layer.plan_for), got {type(plan).__name__}; "
                            "a sparse mask's plan is solved per call: pass the mask")
        self._check_heads(q, k, v)
        if not torch.compiler.is_compiling():
            errors.arm(q.device)  # the flag table exists before a compiled call records into it
        res = self._forward(q, k, v, mask, plan, mask_name, return_lse)
        # under torch.compile the read would break the graph: call check_errors() outside it
        if self.check_every is not None and not torch.compiler.is_compiling():
            self._calls += 1
            if self._calls % self.check_every == 0:
                errors.check_errors()
        return res

    def _check_heads(self, q, k, v) -> None:
        """q, k, v heads and head dim against the config the plans are solved for (host metadata)."""
        c = self.config
        check_tensors(q=q, k=k, v=v)
        # the rank first: a [P, c, H] tensor (D dropped) would otherwise read as "c heads"
        rank, want = (4, "[P, c, H, D]") if getattr(self.group, "batched", False) else (3, "[c, H, D]")
        for name, t, heads in (("q", q, c.num_heads_q), ("k", k, c.num_heads_kv), ("v", v, c.num_heads_kv)):
            if t.dim() != rank:
                raise ValueError(f"{name} must be {want} (the {type(self.group).__name__}'s layout), got shape "
                                 f"{tuple(t.shape)}")
            if t.shape[-2] != heads:
                field = "num_heads_q" if name == "q" else "num_heads_kv"
                raise ValueError(f"{name} has {t.shape[-2]} heads but config.{field}={heads}")
            if t.shape[-1] != c.head_dim:
                raise ValueError(f"{name} has head dim {t.shape[-1]} but config.head_dim={c.head_dim}")

    def _forward(self, q, k, v, mask, plan, mask_name: str, return_lse: bool):
        if isinstance(mask, SPARSE_MASKS):
            # the rank's own selection rows travel with its queries; an NSALayerMask gives one
            # (out, lse) per branch (selection, window)
            with nvtx_range(f"layer/{mask_name}"):
                plan = self.plan_for(mask, q.device, mask_name)
                res = sparse_dist_attn(q, k, v, local_selection(mask_on_device(mask, q.device), self.group), plan,
                                       self.group, softmax_scale=self.softmax_scale, deterministic=self.deterministic,
                                       keep_forward_buffers=self.config.keep_forward_buffers, validate=self.validate)
            if isinstance(mask, NSALayerMask):
                return res if return_lse else (res[0][0], res[1][0])
            return res if return_lse else res[0]
        with nvtx_range(f"layer/{mask_name}"):
            if plan is None:
                plan = self.plan_for(mask, q.device, mask_name)
            # what the plan's solve priced: the kinds the memory budget keeps (capacity.keep_for_budget)
            kept = keep_for_budget(self.config, plan.comm.chunk)  # and the Q and KV rows it keeps
            out, lse = dist_attn(q, k, v, plan, self.group, softmax_scale=self.softmax_scale,
                                 deterministic=self.deterministic, keep_forward_buffers=kept.keep_forward_buffers,
                                 kept_kv_rows=kept.kept_kv_rows, kept_q_rows=kept.kept_q_rows,
                                 kept_per_rank=kept.kept_per_rank,
                                 validate=self.validate,
                                 debug_digest=self.debug_digest,
                                 config_key=config_digest(self.config) if self.debug_digest else None)
        return (out, lse) if return_lse else out

    def extra_repr(self) -> str:
        c = self.config
        return f"P={c.cp_size}, Hq={c.num_heads_q}, Hkv={c.num_heads_kv}, D={c.head_dim}, solver={self.solver}"

