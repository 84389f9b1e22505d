"""The relay transport priced in the solve (``SolverConfig.relays``).

Each (unit, remote node) crosses InfiniBand once, host to ``Topology.relay_rank``, with the
hull of what that node's consumers need, then NVLink from the relay to the node's other
consumers; partial results come back the same two hops. The state's bytes per rank and link
class equal a per-hop count made here cell by cell; the Triton state equals the torch one;
``ib_relay=False`` keeps direct transport's prices. The solve prices the transport the plan runs
(``SolverConfig.relays`` is ``plan.build.relay_transport``'s answer): relay with one remote stage or
``ib_relay=True``, direct with the default sub-stages.
"""
import dataclasses

import pytest
import torch

from gpusolver.solver import core
from gpusolver.solver.state import ref as state_ref
from gpusolver.solver.state.relay import relay_tokens
from gpusolver.topology import Topology
from tests._threads import one_torch_thread  # noqa: F401 - autouse, module scope
from tests.gpusolver.test_solver_kernels import _config, _random_areas, _random_assignments


def _nodes(per_node):
    return Topology(ranks_per_node=per_node, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0)


def hop_tokens(tasks, length, lo, hi, per_node):
    """[B, 2(NVLink, InfiniBand), P(src), P(dst)] tokens of one kind moved towards the consumers,
    hop by hop, counted cell by cell (the relay rule, written out: a (unit, remote node) whose
    hull is longer than its consumers' rows together crosses directly, row by row)."""
    B, GU, P = length.shape
    out = torch.zeros((B, 2, P, P), dtype=torch.int64)
    for b in range(B):
        for u in range(GU):
            h = int(tasks.unit_host[u])
            for node in range(P // per_node):
                members = [r for r in range(node * per_node, (node + 1) * per_node) if r != h]
                need = [r for r in members if length[b, u, r] > 0]
                if not need:
                    continue
                if node == h // per_node:  # inside the host's node: direct
                    for r in need:
                        out[b, 0, h, r] += length[b, u, r]
                    continue
                relay = node * per_node + h % per_node
                hull = int(max(hi[b, u, r] for r in need) - min(lo[b, u, r] for r in need))
                if hull > sum(int(length[b, u, r]) for r in need):  # disjoint needs: each crosses directly
                    for r in need:
                        out[b, 1, h, r] += length[b, u, r]
                    continue
                out[b, 1, h, relay] += hull
                for r in need:
                    if r != relay:
                        out[b, 0, relay, r] += length[b, u, r]
    return out


def test_relay_tokens_equal_hop_count():
    P, G, per_node = 6, 2, 2
    gen = torch.Generator().manual_seed(5)
    areas = _random_areas(gen, P, G)
    tasks = core.Tasks(areas, _config(P, G, topology=_nodes(per_node), num_stages=1))
    assert tasks.relays
    A = _random_assignments(gen, tasks, 2)
    st = state_ref.state(tasks, A)
    for length, lo, hi in ((st.qlen, st.q_lo, st.q_hi), (st.klen, st.k_lo, st.k_hi)):
        (nv_out, nv_in, ib_out, ib_in), _ = relay_tokens(tasks, length, lo, hi)
        hops = hop_tokens(tasks, length, lo, hi, per_node)
        assert torch.equal(nv_out, hops[:, 0].sum(2)) and torch.equal(nv_in, hops[:, 0].sum(1))
        assert torch.equal(ib_out, hops[:, 1].sum(2)) and torch.equal(ib_in, hops[:, 1].sum(1))
        assert (ib_out.sum(1) > 0).all()  # something crosses nodes
    # the bytes: each direction's link-weighted tokens at the kind's prices
    qh, kh = (hop_tokens(tasks, *x, per_node) for x in ((st.qlen, st.q_lo, st.q_hi), (st.klen, st.k_lo, st.k_hi)))
    w = torch.tensor([1, 9]).view(1, 2, 1, 1)
    qw, kw = (qh * w).sum(1), (kh * w).sum(1)
    send = qw.sum(2) * tasks.q + qw.sum(1) * tasks.o + kw.sum(2) * tasks.kv
    recv = qw.sum(1) * tasks.q + qw.sum(2) * tasks.o + kw.sum(1) * tasks.kv
    assert torch.equal(st.send, send) and torch.equal(st.recv, recv)


def test_direct_transport_keeps_its_prices():
    """``ib_relay=False``: every consumer pulls its own copy; the state has no node tables."""
    P, G = 4, 1
    gen = torch.Generator().manual_seed(2)
    areas = _random_areas(gen, P, G)
    config = _config(P, G, topology=_nodes(2), ib_relay=False)
    tasks = core.Tasks(areas, config)
    assert not tasks.relays and tasks.links == (2, 1, 9)
    st = state_ref.state(tasks, _random_assignments(gen, tasks, 2))
    assert st.nodes is None


@pytest.mark.slow
def test_state_triton_equals_torch_with_relays():
    """(The default tier: ``test_solver_topology``'s state and bundle twins, relay priced.)
    Untiled and tiled, nodes of 2 and 3 (a node size that is not a power of two)."""
    from gpusolver.solver.state.kernel import state_triton
    from tests.gpusolver.test_solver_kernels import _check_state

    for P, per_node, G, tiles, seed in ((4, 2, 2, 1, 0), (6, 3, 1, 2, 1), (8, 2, 1, 1, 2)):
        gen = torch.Generator().manual_seed(seed)
        areas = _random_areas(gen, P, G, **({} if tiles == 1 else {"chunk": 8, "tiles": tiles}))
        tasks = core.Tasks(areas, _config(P, G, tiles, topology=_nodes(per_node), num_stages=1))
        A = _random_assignments(gen, tasks, 2)
        ref = state_ref.state(tasks, A)
        assert ref.nodes.shape == (6, 2, G * P * tiles, P // per_node)
        _check_state(ref, state_triton(tasks, A))


def test_relay_hops_equal_hop_count():
    from gpusolver.solver.state.relay import _routes, relay_hops

    P, G, per_node = 8, 2, 4
    gen = torch.Generator().manual_seed(8)
    areas = _random_areas(gen, P, G, chunk=8, tiles=2)
    tasks = core.Tasks(areas, _config(P, G, 2, topology=_nodes(per_node), num_stages=1))
    A = _random_assignments(gen, tasks, 2)
    st = state_ref.state(tasks, A)
    for x in ((st.qlen, st.q_lo, st.q_hi), (st.klen, st.k_lo, st.k_hi)):
        assert torch.equal(relay_hops(tasks, *x).transpose(0, 1), hop_tokens(tasks, *x, per_node))
        _, _, relayed, direct, *_ = _routes(tasks, *x)
        assert relayed.any() and direct.any()  # both routes occur


@pytest.mark.slow
def test_bundle_proposals_triton_equal_torch_with_relays():
    """Nodes of 4 and of 3 (not a power of two), both objectives, on the Triton state; the relay's
    prices are not direct transport's (some proposal's score differs)."""
    from tests.gpusolver.test_solver_kernels import _bundle_case

    for P, per_node, objective, tiles, seed in ((8, 4, "training", 1, 3), (6, 3, "forward", 1, 4),
                                                (4, 2, "training", 2, 5)):
        ref = _bundle_case(P, 1, 2, 2, 4, True, 4, seed, tiles=tiles, states=("triton",), objective=objective,
                           topology=_nodes(per_node), ib_relay=True)
        direct = _bundle_case(P, 1, 2, 2, 4, True, 4, seed, tiles=tiles, states=(), objective=objective,
                              topology=_nodes(per_node), ib_relay=False)
        assert ref.ok.any()
        assert not torch.equal(ref.score, direct.score), (P, per_node)


# Plans of the direct-priced topology solve, computed on the solver before it priced relays (main
# at dc1ce3e): ``ib_relay=False`` must keep them bit for bit, and so must the default sub-stages
# (S = 4 runs direct transport, so its solve prices direct), while the relay's plans differ.
_DIRECT_DIGESTS = {(8, 2, 256, 3): "2246ef51cda18b12d865", (16, 4, 256, 0): "59ef8ddc9dfe84ed1cbf"}


def _topology_digest(P, per_node, tokens, seed, **kw):
    import hashlib

    from gpusolver.areas import block_areas
    from gpusolver.config import SolverConfig
    from gpusolver.masks import packed_documents
    from gpusolver.solver.device import Strategy, solve_device

    small = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),
             Strategy((float("inf"),), units_per_rank=1, bundle_dests=2, task_order="rows", start="transpose"))
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2, head_dim=8, dtype=torch.float16, chunk_tiles=1,
                          topology=_nodes(per_node), **kw)
    areas = block_areas(packed_documents(tokens * P, seed=seed, causal=True), P, 2, impl="torch")
    res = solve_device(areas, config, impl="torch", rounds=4, strategies=small, restart_every=2)
    h = hashlib.sha256(res.assignment.to(torch.int32).contiguous().numpy().tobytes())
    h.update(f"{bool(res.balanced)}:{int(res.variant)}".encode())
    return h.hexdigest()[:20]


def test_direct_transport_keeps_its_plans():
    for case, digest in _DIRECT_DIGESTS.items():
        assert _topology_digest(*case, ib_relay=False) == digest, case
        assert _topology_digest(*case) == digest, case  # num_stages="auto" (S = 4): direct runs, direct priced
        relay = _topology_digest(*case, num_stages=1)
        assert relay != digest, case  # one remote stage: relay runs, relay priced: another plan
        assert _topology_digest(*case, ib_relay=True) == relay, case  # relay at S = 4 too: the same prices


@pytest.mark.parametrize("per_node,P", [(2, 8), (4, 16), (8, 8), (16, 8)], ids=lambda v: str(v))
def test_solver_prices_the_transport_that_runs(per_node, P):
    """``Tasks.relays`` (what the solve prices) is ``relay_transport`` (what the plan builder runs) for
    every S and ``ib_relay``; relay only where the group spans nodes, with S = 1 or ``ib_relay=True``;
    sparse plans (``SparseSolverConfig``) travel direct and price direct."""
    from gpusolver.config import SolverConfig
    from gpusolver.plan.build import relay_transport
    from gpusolver.plan.sparse import SelectionSpec, sparse_config

    gen = torch.Generator().manual_seed(P + per_node)
    areas = _random_areas(gen, P, 1)
    spans = per_node < P
    for S in ("auto", 1, 2, 4):
        for ib_relay in ((None, True, False) if spans else (None, False)):
            config = _config(P, 1, topology=_nodes(per_node), num_stages=S, ib_relay=ib_relay)
            tasks = core.Tasks(areas, config)
            want = spans and ib_relay is not False and (ib_relay is True or config.num_stages == 1)
            assert tasks.relays == relay_transport(config) == want, (S, ib_relay)
            assert (tasks.links is not None) == spans
            sparse = sparse_config(config.for_sparse(), SelectionSpec(1, 1, 4))
            if ib_relay is not True:  # ib_relay=True is refused for sparse plans (test_relay_bad_input)
                assert not core.Tasks(areas, sparse).relays and not relay_transport(config.for_sparse(), sparse=True)
    assert SolverConfig(cp_size=P, topology=_nodes(per_node)).num_stages == 4  # "auto": direct where it spans


def test_state_bytes_equal_the_transports_pair_bytes():
    """The relay transport's own per-hop bytes (``plan.pair_bytes(phase, hop=)``, what its
    groups count) against the solver's per-class pairs of the same assignment. Routed from each
    host (``build_relay_meta(egress=False)``) they are equal pair by pair: InfiniBand = hop 1 plus
    the direct rows across nodes, NVLink = hop 2 plus the direct rows inside a node, and every rank's
    link-weighted bytes are the state's. The default routes (crossings leave by an egress on a rail
    matched to spread the node's NICs) move the same InfiniBand bytes per pair of nodes and add
    NVLink only inside a node (the pre-hop, hop 3, and fan-outs from the matched relay), which the
    solve prices at the host: it prices InfiniBand by node exactly and NVLink approximately."""
    from gpusolver.areas import block_areas
    from gpusolver.config import SolverConfig
    from gpusolver.masks import packed_documents
    from gpusolver.solve import solve
    from gpusolver.capacity import relay_rows
    from gpusolver.plan.relay import build_relay_meta
    from gpusolver.solver.state.relay import relay_hops

    P, per_node, G = 8, 4, 2
    # one remote stage: relay is its default transport (sub-stages travel direct unless ib_relay=True)
    # memory_budget=None: the solver's Tasks below price the config as given, keeping everything
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=G, head_dim=8, dtype=torch.float16, chunk_tiles=1,
                          topology=_nodes(per_node), num_stages=1, memory_budget=None)
    mask = packed_documents(256 * P, seed=3, causal=False)
    default = solve(mask, config, impl="torch")
    assert default.relay is not None and default.relay.egress
    assert default.pair_bytes("fwd", hop=3).sum() > 0  # some crossings here leave by an egress: not a vacuous check
    areas = block_areas(mask, P, G, impl="torch")
    plan = dataclasses.replace(default, relay=build_relay_meta(
        default.comm, per_node, relay_rows(config, areas.rank_tokens, per_node), default.cost, egress=False))
    tasks = core.Tasks(areas, config)
    a = plan.assignment.long().reshape(-1)
    A = torch.cat((torch.where(a >= 0, a, P), torch.tensor([P]))).view(1, -1)
    st = state_ref.state(tasks, A)
    q = relay_hops(tasks, st.qlen, st.q_lo, st.q_hi)[:, 0]
    k = relay_hops(tasks, st.klen, st.k_lo, st.k_hi)[:, 0]
    node = torch.arange(P) // per_node
    cross = node[:, None] != node[None, :]
    for phase, down_q, down_k, up_q, up_k in (("fwd", tasks.q, tasks.kv, tasks.o, 0),
                                              ("bwd", tasks.qb, tasks.kvb, tasks.dqb, tasks.dkv)):
        ours = [q[c] * down_q + k[c] * down_k + q[c].T * up_q + k[c].T * up_k for c in (0, 1)]
        direct = plan.pair_bytes(phase, hop=0)
        ib = plan.pair_bytes(phase, hop=1) + torch.where(cross, direct, 0)
        nv = plan.pair_bytes(phase, hop=2) + torch.where(cross, 0, direct)
        assert torch.equal(ours[1], ib) and torch.equal(ours[0], nv), phase
        assert ib.sum() > 0 and plan.pair_bytes(phase, hop=2).sum() > 0  # both legs carry bytes
        by_node = lambda x: x.view(P // per_node, per_node, P // per_node, per_node).sum((1, 3))  # noqa: E731
        d_ib = default.pair_bytes(phase, hop=1) + torch.where(cross, default.pair_bytes(phase, hop=0), 0)
        assert torch.equal(by_node(d_ib), by_node(ib)), phase
        assert not torch.where(cross, default.pair_bytes(phase, hop=3), 0).any(), phase  # the pre-hop stays home
        weighted = ours[0] + 9 * ours[1]
        send, recv = (st.send, st.recv) if phase == "fwd" else (st.bsend, st.brecv)
        assert torch.equal(weighted.sum(1), send[0]) and torch.equal(weighted.sum(0), recv[0]), phase
