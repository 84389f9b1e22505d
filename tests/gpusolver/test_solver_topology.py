"""The topology-aware solve: bytes priced by the link they cross, on every path alike.

With a topology spanning several nodes the solver's state and its move prices
count each token at the weight of its link (``SolverConfig.link_weights``);
the Triton twins equal the torch ones exactly, and without a topology (or
inside one node) the plans are those of a plain solve.
"""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpusolver.areas import block_areas
from gpusolver.config import CLUSTER_IMBALANCE_TOL, DEFAULT_IMBALANCE_TOL, SolverConfig
from gpusolver.masks import packed_documents
from gpusolver.solver import core
from gpusolver.limits import balanced_load_cap
from gpusolver.solver.device import Strategy, node_start, solve_device
from gpusolver.solver.strategies import NODES_STRATEGY
from gpusolver.solver.state import ref as state_ref
from gpusolver.solver.state.kernel import state_triton
from gpusolver.topology import Topology, h200_hgx
from tests._threads import one_torch_thread  # noqa: F401 - autouse, module scope
from tests.gpusolver.test_solver_kernels import _bundle_case, _check_state, _config, _random_areas, \
    _random_assignments


def _nodes(per_node, ib_gbps=50.0, nics=None):
    return Topology(ranks_per_node=per_node, nvlink_gbps=450.0, ib_gbps=ib_gbps, attn_tflops=400.0,
                    nics_per_node=nics)


def test_link_weights():
    assert SolverConfig(cp_size=16).link_weights is None
    assert SolverConfig(cp_size=8, topology=h200_hgx).link_weights is None  # one node: plain bytes
    assert SolverConfig(cp_size=16, topology=h200_hgx).link_weights == (8, 1, 9)
    # two GPUs share each NIC: half its bandwidth each, twice the price
    assert SolverConfig(cp_size=16, topology=_nodes(8, nics=4)).link_weights == (8, 1, 18)
    assert SolverConfig(cp_size=16, topology=_nodes(8, ib_gbps=1.0)).link_weights == (8, 1, 64)  # capped
    with pytest.raises(TypeError, match="topology"):
        SolverConfig(cp_size=16, topology="h200_hgx")
    with pytest.raises(ValueError, match="whole nodes"):
        SolverConfig(cp_size=12, topology=h200_hgx)


def test_state_prices_tokens_by_link():
    """Each rank's bytes equal a per-pair count: the tokens of every (unit, rank) cell that
    travels, at the weight of the link from the unit's host to that rank."""
    P, G, per_node = 6, 2, 3
    gen = torch.Generator().manual_seed(3)
    areas = _random_areas(gen, P, G)
    config = _config(P, G, topology=_nodes(per_node), ib_relay=False)  # direct transport (relays: test_solver_relay)
    tasks, plain = core.Tasks(areas, config), core.Tasks(areas, dataclasses.replace(config, topology=None))
    A = _random_assignments(gen, tasks, 2)
    st_, st0 = state_ref.state(tasks, A), state_ref.state(plain, A)
    for name in ("qlen", "klen", "q_out", "q_in", "k_out", "k_in", "load"):  # rows are not priced
        assert torch.equal(getattr(st_, name), getattr(st0, name)), name
    send = torch.zeros_like(st_.send)
    recv = torch.zeros_like(st_.recv)
    for u in range(G * P):
        h = u % P
        for d in range(P):
            w = 1 if h // per_node == d // per_node else 9
            q, k = st_.qlen[:, u, d] * w, st_.klen[:, u, d] * w
            send[:, h] += q * tasks.q + k * tasks.kv
            recv[:, h] += q * tasks.o
            send[:, d] += q * tasks.o
            recv[:, d] += q * tasks.q + k * tasks.kv
    assert torch.equal(st_.send, send) and torch.equal(st_.recv, recv)
    assert (st_.bottleneck > st0.bottleneck).all()  # some token crosses nodes


@settings(max_examples=4, deadline=None)
@given(shape=st.sampled_from([(4, 2), (6, 3), (6, 2), (8, 4)]), G=st.integers(1, 2), tiles=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31 - 1))
def test_state_matches_torch_with_topology(shape, G, tiles, seed):
    P, per_node = shape
    gen = torch.Generator().manual_seed(seed)
    areas = _random_areas(gen, P, G, **({} if tiles == 1 else {"chunk": 8, "tiles": tiles}))
    # one remote stage: relay transport, priced (the direct state's twin: ib_relay=False below)
    tasks = core.Tasks(areas, _config(P, G, tiles, topology=_nodes(per_node), num_stages=1))
    A = _random_assignments(gen, tasks, 2)
    _check_state(state_ref.state(tasks, A), state_triton(tasks, A))


def test_bundle_proposals_match_torch_with_topology_small():
    """One fixed small round (the default tier's check; the sweeps below are slow)."""
    _bundle_case(4, 1, 2, 1, 2, True, 16, 3, states=("triton",), topology=_nodes(2), ib_relay=True)
    _bundle_case(4, 1, 2, 1, 2, True, 16, 3, states=("triton",), topology=_nodes(2))  # S = 4: priced direct


@pytest.mark.slow
@settings(max_examples=2, deadline=None)
@given(shape=st.sampled_from([(4, 2), (6, 3), (6, 2)]), G=st.integers(1, 2), K=st.integers(1, 3),
       D=st.integers(1, 6), sideways=st.booleans(), singles=st.booleans(), tile=st.sampled_from([2, 16]),
       objective=st.sampled_from(["training", "forward"]), rows=st.sampled_from([None, 6]),
       seed=st.integers(0, 2**31 - 1))
def test_bundle_proposals_match_torch_with_topology(shape, G, K, D, sideways, singles, tile, objective, rows, seed):
    P, per_node = shape
    _bundle_case(P, G, 2, K, D, sideways, tile, seed, singles=singles, objective=objective, rows=rows,
                 topology=_nodes(per_node), ib_relay=True)


@pytest.mark.slow
@settings(max_examples=2, deadline=None)
@given(K=st.integers(1, 3), D=st.integers(1, 3), objective=st.sampled_from(["training", "forward"]),
       rows=st.sampled_from([None, 4]), seed=st.integers(0, 2**31 - 1))
def test_bundle_proposals_match_torch_with_topology_tiled(K, D, objective, rows, seed):
    _bundle_case(4, 1, 2, K, D, True, 4, seed, tiles=2, states=("triton",), objective=objective, rows=rows,
                 topology=_nodes(2), ib_relay=True)


_SMALL = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),
          Strategy((float("inf"),), units_per_rank=1, bundle_dests=2, task_order="rows", start="transpose"),
          NODES_STRATEGY)


def _case(P, G, tokens, topology, seed=1, **kw):
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, head_dim=8, dtype=torch.float16,
                          chunk_tiles=1, topology=topology, **kw)
    return block_areas(packed_documents(tokens * P, seed=seed, causal=True), P, G, impl="torch"), config


@pytest.mark.slow
def test_solve_triton_equals_torch_with_topology():
    areas, config = _case(4, 2, 64, _nodes(2), num_stages=1)  # relay priced
    kw = dict(rounds=3, strategies=_SMALL, restart_every=2)
    ref, tri = solve_device(areas, config, impl="torch", **kw), solve_device(areas, config, impl="triton", **kw)
    for f in dataclasses.fields(ref):
        a, b = getattr(ref, f.name), getattr(tri, f.name)
        if a is None or b is None:  # a field only some modes fill (imbalance_tol: imbalance_auto)
            assert a is None and b is None, f.name
        else:
            assert torch.equal(a, b), f.name


def test_persistent_path_refuses_topology():
    areas, config = _case(4, 2, 64, _nodes(2))
    with pytest.raises(ValueError, match="persistent"):
        solve_device(areas, config, impl="persistent", rounds=1, strategies=_SMALL)


def test_one_node_topology_gives_the_plain_plan():
    areas, config = _case(8, 2, 64, h200_hgx)
    kw = dict(rounds=3, strategies=_SMALL, restart_every=2)
    plain = solve_device(areas, dataclasses.replace(config, topology=None), impl="torch", **kw)
    one_node = solve_device(areas, config, impl="torch", **kw)
    assert torch.equal(plain.assignment, one_node.assignment)
    assert torch.equal(plain.objective, one_node.objective)


def test_topology_meta_device():
    """No host reads: the topology-aware solve runs on meta tensors."""
    areas, config = _case(4, 2, 64, _nodes(2))
    meta = dataclasses.replace(areas, **{f: getattr(areas, f).to("meta") for f in ("area", "q_need", "k_need")})
    res = solve_device(meta, config, impl="torch", rounds=1, strategies=_SMALL)
    assert res.assignment.device.type == "meta"


def test_saved_config_keeps_its_topology(tmp_path):
    """The topology, and the default mu across nodes ("auto", 1.05) or an explicit 1.05, come back."""
    from gpusolver.plan.io import load_plan_config, save_plan
    from gpusolver.solve import solve

    config = SolverConfig(cp_size=4, num_heads_q=8, num_heads_kv=2, head_dim=8, dtype=torch.float16,
                          chunk_tiles=1, topology=_nodes(2))
    plan = solve(packed_documents(4 * 64, seed=0, causal=True), config, impl="torch")
    for saved in (config, config.replaced(imbalance_tol=CLUSTER_IMBALANCE_TOL)):
        save_plan(plan, tmp_path / "plan.pt", config=saved)
        loaded = load_plan_config(tmp_path / "plan.pt")
        assert loaded == saved and loaded.imbalance_tol == CLUSTER_IMBALANCE_TOL
        assert loaded.auto_mu is saved.auto_mu and loaded.replaced(cp_size=2).imbalance_tol == (
            DEFAULT_IMBALANCE_TOL if saved.auto_mu else CLUSTER_IMBALANCE_TOL)


def test_default_mu_is_tighter_across_nodes():
    """imbalance_tol="auto": 1.05 for a slice-mask group spanning nodes, 1.10 inside one node, without a
    topology, with ``imbalance_auto`` (its upper bound) and for sparse selections; explicit values stay."""
    from gpusolver.plan.sparse import SelectionSpec, SparseSolverConfig, sparse_config

    across = SolverConfig(cp_size=16, topology=h200_hgx)
    assert across.imbalance_tol == CLUSTER_IMBALANCE_TOL == 1.05 and across.auto_mu
    for config in (SolverConfig(cp_size=16), SolverConfig(cp_size=8, topology=h200_hgx),
                   SolverConfig(cp_size=16, topology=h200_hgx, imbalance_auto=True),
                   SparseSolverConfig(cp_size=16, topology=h200_hgx)):
        assert config.imbalance_tol == DEFAULT_IMBALANCE_TOL == 1.10 and config.auto_mu, config
    # a sparse layer's config made from the dense one: the sparse default, unless mu was explicit
    spec = SelectionSpec(block_size=64, heads=1, width=4, window_size=0)
    assert sparse_config(across, spec).imbalance_tol == DEFAULT_IMBALANCE_TOL
    assert across.for_sparse().imbalance_tol == DEFAULT_IMBALANCE_TOL  # what sparse plans are judged at
    assert sparse_config(across.for_sparse(), spec).imbalance_tol == DEFAULT_IMBALANCE_TOL
    assert sparse_config(across.replaced(imbalance_tol=1.07), spec).imbalance_tol == 1.07
    explicit = SolverConfig(cp_size=16, topology=h200_hgx, imbalance_tol=1.10)
    assert explicit.imbalance_tol == 1.10 and not explicit.auto_mu
    # replaced() keeps "auto" (a group inside one node is back at 1.10); an explicit mu stays
    assert across.replaced(cp_size=8).imbalance_tol == 1.10 and across.replaced(cp_size=32).imbalance_tol == 1.05
    assert explicit.replaced(cp_size=32).imbalance_tol == 1.10
    for bad in ("x", True, None, 0.9):
        with pytest.raises(ValueError, match="imbalance_tol"):
            SolverConfig(cp_size=16, imbalance_tol=bad)


def test_node_start_balances_the_nodes():
    """The two-level start: node loads within mu (the solve over the nodes), each task on a rank
    of its node, on its query host whenever that host is in the node."""
    P, G, per_node = 8, 2, 4
    areas, config = _case(P, G, 128, _nodes(per_node), seed=2)
    tasks = core.Tasks(areas, config)
    start = node_start(tasks, 6)
    assert node_start(tasks, 6) is start  # made once per solve
    area = torch.where(tasks.valid, tasks.area, 0)
    load = torch.zeros(P, dtype=torch.int64).scatter_add(0, start.clamp(max=P - 1), area)
    node_load = load.view(P // per_node, per_node).sum(1)
    assert node_load.max() <= balanced_load_cap(tasks.area.sum(), config.imbalance_tol, P // per_node)
    # owner-computes leaves the nodes further apart on this mask
    home = torch.zeros(P, dtype=torch.int64).scatter_add(0, tasks.q_host, area)
    assert home.view(P // per_node, per_node).sum(1).max() > node_load.max()
    assert (start[~tasks.valid] == P).all() and (start[tasks.valid] < P).all()
    node_of = start // per_node
    at_home = tasks.valid & (tasks.q_host // per_node == node_of)
    assert torch.equal(start[at_home], tasks.q_host[at_home])


def test_compile_op_carries_the_topology():
    """The custom op ``solve`` uses under torch.compile solves with the config's topology and the
    transport its plan runs (``SolverConfig.relays``): relay with one remote stage, direct with the
    default sub-stages or ``ib_relay=False``; the two transports' plans differ here."""
    from gpusolver.ops import solve_assignment_op, solve_op_options

    got = {}
    for name, kw in (("direct, S = 4", {}), ("relay, S = 1", {"num_stages": 1}),
                     ("direct, S = 1", {"num_stages": 1, "ib_relay": False})):
        areas, config = _case(4, 2, 128, _nodes(2), seed=3, **kw)
        op = solve_assignment_op(areas.area, areas.q_need, areas.k_need, areas.chunk, 4, 1, 8, 2, 8, torch.float16,
                                 config.imbalance_tol, "torch", *solve_op_options(config))
        assert torch.equal(op, solve_device(areas, config, impl="torch").assignment), name
        got[name] = op
    assert torch.equal(got["direct, S = 4"], got["direct, S = 1"])
    assert not torch.equal(got["relay, S = 1"], got["direct, S = 1"])
