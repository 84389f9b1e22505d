"""The fuzz harness over the layer's options and groups: on ``LocalGroup`` and on forked gloo ranks
(``TorchGroup``) the dense and the sparse layers equal dense attention.

``test_fuzz.py`` runs the layer on ``LocalGroup`` with the default options. A real rank's group is
``TorchGroup``, which sizes every buffer and send list at this rank's fill from the host copy of
the splits, cuts each sub-stage's lists to the rows it holds, sends packed partials as their
buffer and keeps a share of the received rows per rank: paths a capacity-sized group never takes.
Here each example draws a mask, a random assignment (any assignment is a valid plan), P, the
sub-stages, tiles per chunk, deterministic or not, what the backward keeps, the transport and the
nodes (one, or two with inter-node rows direct or by relay), runs forward and backward and compares
out, lse and the gradients with the dense reference: on P forked gloo ranks, and on ``LocalGroup``
(buffers at the plan's capacities, torch or Triton collectives). The sparse selections (DSA, NSA,
an NSA layer) likewise, with key blocks or hulls. A gloo example forks P ranks (a few seconds), so
CI runs a few examples and ``make fuzz`` hundreds (``_cases.budget``).
"""
from dataclasses import replace

import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from gpusolver import SolverConfig, block_areas
from gpusolver.plan import build_plan
from gpusolver.runtime import dist_attn, shard, unshard
from gpusolver.topology import Topology
from groupcomm import LocalGroup, TorchGroup
from tests._dist import run_ranks
from tests._testing import assert_close
from tests.reliability._cases import D, budget
from tests.reliability._fuzz import dense_layer_reference, make_mask, masks

SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
KEEPS = ("all", "none", "q-only", "kv-part", "q-part", "per-rank")
PARTS = ("kv-part", "q-part", "per-rank")
KEYS = ("out", "lse", "dq", "dk", "dv")


def _case(m, P, c, Hkv, S, seed, net, tiles):
    """The mask, config, plan (a random assignment) and inputs of one example, the same on every rank.
    net: "one" (no topology), "direct" or "relay" (two nodes of P / 2 ranks, inter-node rows direct or
    by relay); tiles: units per chunk."""
    T = P * c
    mask = make_mask(S=T, **m)
    G = 2 if mask.grouped else Hkv
    # buffers at the worst case: a random assignment may move every row anywhere
    config = SolverConfig(cp_size=P, num_heads_q=2 * G, num_heads_kv=G, head_dim=D, dtype=torch.float32,
                          num_stages=S, chunk_tiles=tiles, max_recv_rows=G * c * (P - 1))
    if net != "one":
        topology = Topology(ranks_per_node=P // 2, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0, name="fuzz")
        config = replace(config, topology=topology, ib_relay=net == "relay")
    areas = block_areas(mask, P, G, tiles=tiles)
    g = torch.Generator().manual_seed(seed)
    assignment = torch.where(areas.area > 0, torch.randint(0, P, areas.area.shape, generator=g), -1).to(torch.int32)
    plan = build_plan(mask, areas, assignment, config)
    inputs = [torch.randn(T, h, D, generator=g) for h in (2 * G, G, G, 2 * G)]  # q, k, v, d_out
    return mask, G, plan, inputs


def _keep_kwargs(plan, keep: str) -> dict:
    """dist_attn's keep options for ``keep``: rows of the largest fills, so kept parts cut casts."""
    q_fill, kv_fill = int(plan.comm.qo_recv_rows.max()), int(plan.comm.kv_recv_rows.max())
    return {"all": dict(keep_forward_buffers=True),
            "none": dict(keep_forward_buffers=False),
            "q-only": dict(keep_forward_buffers="qo"),
            "kv-part": dict(keep_forward_buffers=True, kept_kv_rows=kv_fill // 3),
            "q-part": dict(keep_forward_buffers=True, kept_q_rows=q_fill // 2),
            "per-rank": dict(keep_forward_buffers=True, kept_q_rows=q_fill // 2, kept_kv_rows=kv_fill // 4,
                             kept_per_rank=True)}[keep]


def _rank(rank, P, m, c, Hkv, S, seed, keep, transport, net, tiles, deterministic):
    _, _, plan, (q, k, v, d_out) = _case(m, P, c, Hkv, S, seed, net, tiles)
    group = TorchGroup(transport=transport)
    qs, ks, vs = (shard(x, group).clone().requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group, deterministic=deterministic, **_keep_kwargs(plan, keep))
    out.backward(shard(d_out, group))
    group.wait_sends()
    return [t.detach() for t in (out, lse, qs.grad, ks.grad, vs.grad)]


def _draws(P, c, net, keep, tiles):
    """The draws as run: two nodes need an even P; relay transport keeps whole kinds (a clear error
    otherwise); tiles divide the chunk."""
    net = net if P % 2 == 0 else "one"
    return net, "all" if net == "relay" and keep in PARTS else keep, tiles if c % tiles == 0 else 1


LAYER_DRAWS = dict(m=masks(max_s=48), P=st.integers(2, 4), c=st.integers(2, 10), Hkv=st.sampled_from([1, 2]),
                   S=st.sampled_from([1, 2, 3, 4]), keep=st.sampled_from(KEEPS),
                   net=st.sampled_from(["one", "direct", "relay"]), tiles=st.sampled_from([1, 2]),
                   deterministic=st.booleans(), seed=st.integers(0, 2 ** 16))


@settings(max_examples=budget(2, 150), deadline=None, suppress_health_check=SLOW)
@given(transport=st.sampled_from(["p2p", "a2a"]), **LAYER_DRAWS)
def test_layer_on_gloo_equals_dense_attention(m, P, c, Hkv, S, keep, transport, net, tiles, deterministic, seed):
    net, keep, tiles = _draws(P, c, net, keep, tiles)
    mask, G, _, (q, k, v, d_out) = _case(m, P, c, Hkv, S, seed, net, tiles)
    got = run_ranks(_rank, P, m, c, Hkv, S, seed, keep, transport, net, tiles, deterministic, timeout=120)
    ref = dense_layer_reference(mask, G, q, k, v, d_out)
    for rank, outs in enumerate(got):
        rows = slice(rank * c, (rank + 1) * c)
        for name, want, have in zip(KEYS, ref, outs):
            assert_close(f"rank {rank} {name} ({keep}, S={S}, {transport}, {net}, tiles={tiles})", want[rows], have,
                         atol=2e-5, rtol=1e-4)


@settings(max_examples=budget(4, 400), deadline=None, suppress_health_check=SLOW)
@given(impl=st.sampled_from(["torch", "triton"]), **LAYER_DRAWS)
# found here: relay sub-stages on nodes of one rank send a list of no positions, which the torch put crashed on
@example(m={"kind": "empty", "seed": 0, "groups": 0, "pad": 0, "shuffle": False}, P=2, c=2, Hkv=1, S=2, keep="all",
         net="relay", tiles=1, deterministic=True, seed=0, impl="torch")
def test_layer_on_local_group_equals_dense_attention(m, P, c, Hkv, S, keep, net, tiles, deterministic, seed, impl):
    net, keep, tiles = _draws(P, c, net, keep, tiles)
    mask, G, plan, (q, k, v, d_out) = _case(m, P, c, Hkv, S, seed, net, tiles)
    group = LocalGroup(P, impl=impl)
    leaves = [shard(x, group).requires_grad_() for x in (q, k, v)]
    out, lse = dist_attn(*leaves, plan, group, deterministic=deterministic, **_keep_kwargs(plan, keep))
    out.backward(shard(d_out, group))
    got = [unshard(t.detach(), group) for t in (out, lse, *(x.grad for x in leaves))]
    for name, want, have in zip(KEYS, dense_layer_reference(mask, G, q, k, v, d_out), got):
        assert_close(f"{name} ({keep}, S={S}, {net}, tiles={tiles}, {impl})", want, have, atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------ sparse selections (DSA, NSA)


def _sparse_run(rows, P, Hkv, S, keep, kv_block, seed, group):
    """The sparse layer of a random assignment (``scatter_plan(seed=)``, worst-case buffers) on
    ``group`` for ``rows`` (this rank's rows of the mask, or all of them on ``LocalGroup``): each
    branch's (out, lse) and the q, k, v leaves after the backward."""
    from gpusolver.runtime.sparse_attn import local_selection, sparse_dist_attn
    from tests.gpusolver.sparse._cases import branches, loss, make_config, make_inputs, scatter_plan

    T = rows.total_seqlen_k
    plan = scatter_plan(rows, make_config(P, 2 * Hkv, Hkv, keep=keep, num_stages=S), group, kv_block, seed=seed)
    q, k, v, d_out, d_lse = make_inputs(T, 2 * Hkv, Hkv, seed=seed)
    leaves = [shard(x, group).clone().requires_grad_() for x in (q, k, v)]
    res = branches(sparse_dist_attn(*leaves, local_selection(rows, group), plan, group))
    loss([o for o, _ in res], [x for _, x in res], shard(d_out, group), shard(d_lse, group)).backward()
    return res, leaves


def _sparse_rank(rank, P, kind, c, Hkv, S, keep, kv_block, transport, seed):
    from tests.gpusolver.sparse._cases import make_mask as sparse_mask

    mask = sparse_mask(kind, P * c, Hkv, seed=seed)
    group = TorchGroup(transport=transport)
    res, leaves = _sparse_run(mask.rows(rank * c, (rank + 1) * c), P, Hkv, S, keep, kv_block, seed, group)
    group.wait_sends()
    return [o.detach() for o, _ in res], [x.detach() for _, x in res], [x.grad for x in leaves]


def _sparse_reference(kind, P, c, Hkv, seed):
    from tests.gpusolver.sparse._cases import make_inputs, make_mask as sparse_mask, reference

    mask = sparse_mask(kind, P * c, Hkv, seed=seed)
    return mask, reference(mask, *make_inputs(P * c, 2 * Hkv, Hkv, seed=seed))


SPARSE_DRAWS = dict(kind=st.sampled_from(["dsa", "nsa", "nsa-layer"]), P=st.integers(2, 4), c=st.sampled_from([8, 16]),
                    Hkv=st.sampled_from([1, 2]), S=st.sampled_from([1, 2, 4]), keep=st.booleans(),
                    kv_block=st.sampled_from([None, 4, 8]), seed=st.integers(0, 2 ** 16))


@settings(max_examples=budget(1, 60), deadline=None, suppress_health_check=SLOW)
@given(transport=st.sampled_from(["p2p", "a2a"]), **SPARSE_DRAWS)
def test_sparse_layer_on_gloo_equals_dense_attention(kind, P, c, Hkv, S, keep, kv_block, transport, seed):
    from tests.gpusolver.sparse._cases import check_branches

    kv_block = None if kind == "nsa-layer" else kv_block  # its window branch travels as hulls (else a clear error)
    _, ref = _sparse_reference(kind, P, c, Hkv, seed)
    got = run_ranks(_sparse_rank, P, kind, c, Hkv, S, keep, kv_block, transport, seed, timeout=120)
    outs, lses, grads = ([torch.cat(parts) for parts in zip(*(r[i] for r in got))] for i in range(3))  # ranks joined
    check_branches(ref, outs, lses, grads, where=f"({kind}, S={S}, keep={keep}, kv_block={kv_block}, {transport}) ")


@settings(max_examples=budget(2, 200), deadline=None, suppress_health_check=SLOW)
@given(**SPARSE_DRAWS)
def test_sparse_layer_on_local_group_equals_dense_attention(kind, P, c, Hkv, S, keep, kv_block, seed):
    from tests.gpusolver.sparse._cases import check_branches

    kv_block = None if kind == "nsa-layer" else kv_block  # its window branch travels as hulls (else a clear error)
    mask, ref = _sparse_reference(kind, P, c, Hkv, seed)
    group = LocalGroup(P)
    res, leaves = _sparse_run(mask, P, Hkv, S, keep, kv_block, seed, group)
    check_branches(ref, [unshard(o, group) for o, _ in res], [unshard(x, group) for _, x in res],
                   [unshard(x.grad, group) for x in leaves],
                   where=f"({kind}, S={S}, keep={keep}, kv_block={kv_block}) ")
