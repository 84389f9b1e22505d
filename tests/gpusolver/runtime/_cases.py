"""Shared cases of the runtime tests: masks, inputs, and the single-process oracle.

Shape legend: S tokens, P ranks, c = S / P, Hq / Hkv heads, D head dim.
Everything is seeded and host-side, so a forked gloo rank rebuilds the very
same global tensors as the parent and takes its shard.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import pytest
import torch

from attn_kernels.reference import dense_attn
from gpusolver import SolverConfig, block_areas, solve
from gpusolver.masks import AttnSlices, sliding_window_mask, varlen_causal_mask, varlen_full_mask
from gpusolver.plan import IMBALANCED
from gpusolver.plan.build import build_plan
from gpusolver.runtime.pipelined import counter_phases
from tests.attn_kernels._slices import random_slices

D = 32  # the smallest supported head dim
PHASES_FWD = ("fwd.qo", "fwd.kv", "fwd.o")
PHASES_BWD = ("bwd.qo", "bwd.kv", "bwd.dq", "bwd.dkv")
ATOL = RTOL = 1e-5
# Rounds of the device solve inside the layer-on-meta tests (``few_solve_rounds``).
META_SOLVE_ROUNDS = 2


@pytest.fixture
def few_solve_rounds(monkeypatch):
    """The layer's device solve runs ``META_SOLVE_ROUNDS`` rounds instead of the default 24.

    For the layer-on-meta tests: they check that the layer (solve, stages, casts, reduces,
    backward) reads nothing from the host and gives the right shapes; on meta every round is the
    same ops again, at about a quarter second each through the meta kernels. The default solve's
    every round on meta stays in the fast tier: tests/gpusolver/test_device_solver.py
    (test_whole_solve_runs_on_meta, test_runs_on_meta_and_shapes_depend_only_on_config) and
    tests/reliability/test_host_reads.py::test_every_path_runs_on_meta (the layer on meta)."""
    from gpusolver.solver import device

    monkeypatch.setattr(device, "solve_device", functools.partial(device.solve_device, rounds=META_SOLVE_ROUNDS))


def random_slice_mask(S: int, seed: int) -> AttnSlices:
    """A non-overlapping random slice mask holding all four attention types, dummy rows and rows
    without keys (``random_slices``, first seed from ``seed`` on that has every type)."""
    for s in range(seed, seed + 1000):
        q, k, t = random_slices(S, S, s)
        live = (q[:, 1] > q[:, 0]) & (k[:, 1] > k[:, 0])
        if set(t[live].tolist()) == {0, 1, 2, 3}:
            return AttnSlices(q, k, t, S, S)
    raise AssertionError(f"no seed in [{seed}, {seed + 1000}) gives all four attention types at S = {S}")


def doc_lengths(S: int, seed: int) -> list[int]:
    """Random document lengths summing to S (random cut points, so boundaries fall inside chunks)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, S, (max(2, S // 24),), generator=g).tolist()))
    bounds = [0, *cuts, S]
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


def make_mask(name: str, S: int, seed: int = 0) -> AttnSlices:
    """``random`` slices, packed documents (``docs-causal``, ``docs-full``) or a causal ``window``."""
    if name == "random":
        return random_slice_mask(S, seed)
    if name == "docs-causal":
        return varlen_causal_mask(doc_lengths(S, seed))
    if name == "docs-full":
        return varlen_full_mask(doc_lengths(S, seed))
    if name == "window":
        return sliding_window_mask(S, S // 5 + 3)
    raise ValueError(f"unknown mask {name!r}")


def make_config(P: int, Hq: int, Hkv: int, flatten: bool = True, tiles: int = 1, **kw) -> SolverConfig:
    return SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32,
                        head_group_flatten=flatten, chunk_tiles=tiles, **kw)


def make_inputs(S: int, Hq: int, Hkv: int, seed: int = 0):
    """Global fp32 ``q [S, Hq, D]``, ``k, v [S, Hkv, D]`` and upstream grads ``d_out [S, Hq, D]``,
    ``d_lse [S, Hq]`` (the lse grad exercises the ``- dlse`` term of the row delta)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, Hq, D, generator=g)
    k = torch.randn(S, Hkv, D, generator=g)
    v = torch.randn(S, Hkv, D, generator=g)
    d_out = torch.randn(S, Hq, D, generator=g)
    d_lse = torch.randn(S, Hq, generator=g)
    return q, k, v, d_out, d_lse


def reference(mask: AttnSlices, q, k, v, d_out, d_lse) -> dict[str, torch.Tensor]:
    """Dense attention over the whole sequence in fp64 (``attn_kernels.reference``): out, lse and
    the grads of q, k, v for upstream ``(d_out, d_lse)``, all fp32."""
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = dense_attn(qq, kk, vv, mask.to_dense())
    dq, dk, dv = torch.autograd.grad((out, lse), (qq, kk, vv), (d_out.double(), d_lse))
    return {"out": out.float(), "lse": lse, "dq": dq.float(), "dk": dk.float(), "dv": dv.float()}


def traffic_sums(group, phases, num_stages: int = 1) -> tuple:
    """(sent, recv) summed over ``phases`` of a group's byte counters; a layer of ``num_stages``
    S > 1 counts each phase per sub-stage (``counter_phases``), and those are summed."""
    sent = recv = 0
    for ph in counter_phases(phases, num_stages):
        s, r = group.traffic(ph)
        sent, recv = sent + s, recv + r
    return sent, recv


def tight_plan(mask: AttnSlices, config: SolverConfig, solver: str = "reference"):
    """``solve(mask, config)`` with receive buffers and stage slices sized to what this mask needs.

    The default capacities are the worst case (``G * c * (P - 1)`` rows), and the torch
    attention twin builds a dense ``[slices, rows, rows]`` mask per stage, so tight
    capacities keep the CPU runs short. Capacities do not steer the assignment, so the
    plan rebuilt from it equals ``solve(mask, tight_config)``. Returns (plan, tight_config).
    """
    with warnings.catch_warnings():  # an imbalanced plan is slow, not wrong
        warnings.simplefilter("ignore")
        plan = solve(mask, config, solver=solver)
    comm, calc = plan.comm, plan.calc
    # receive rows per rank (one buffer per kind, shared by the sub-stages); sends are per rank in total
    recv = max(int(getattr(comm, f"{kind}_recv_rows").max()) for kind in ("qo", "kv"))
    rows = max([recv] + [int(s.sum(1).max()) for s in (comm.qo_split, comm.kv_split)])
    live = (calc.q_ranges[..., 1] > calc.q_ranges[..., 0]) & (calc.k_ranges[..., 1] > calc.k_ranges[..., 0])
    last = torch.where(live, torch.arange(live.shape[-1]) + 1, 0).amax()
    tight = replace(config, max_recv_rows=rows + 2, max_stage_slices=max(int(last), 1))
    areas = block_areas(mask, config.cp_size, config.head_groups, impl="torch", tiles=config.chunk_tiles)
    return build_plan(mask, areas, plan.assignment, tight).validate(ignore=IMBALANCED), tight


def meta_layer_step(layer, P: int, c: int, Hq: int, Hkv: int, head_dim: int = D) -> None:
    """``layer`` (a ``DynamicCPAttention`` on ``LocalGroup(P)``) forward and backward on ``device="meta"``
    over causal packed documents: no host read anywhere, outputs and grads of the layer's shapes."""
    mask = varlen_causal_mask(doc_lengths(P * c, 0), device="meta")
    q = torch.empty(P, c, Hq, head_dim, device="meta", requires_grad=True)
    k = torch.empty(P, c, Hkv, head_dim, device="meta", requires_grad=True)
    v = torch.empty(P, c, Hkv, head_dim, device="meta", requires_grad=True)
    out, lse = layer(q, k, v, mask, return_lse=True)
    assert out.shape == (P, c, Hq, head_dim) and out.device.type == "meta"
    (out.sum() + lse.sum()).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "meta"
