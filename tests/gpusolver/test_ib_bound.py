"""``bounds.ib_lower_bound``: exact where it can be worked by hand, below the best whole-task
placement over the nodes (brute force) and below the solver's plan."""
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from gpusolver import SolverConfig, block_areas
from gpusolver.bounds import ib_lower_bound
from gpusolver.masks import causal_mask, full_mask, varlen_causal_mask
from gpusolver.plan.build import build_plan
from gpusolver.solve import solve_assignment
from gpusolver.topology import Topology


def _config(P):
    return SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2, head_dim=16, dtype=torch.float32)


def _ib_fwd(pair: torch.Tensor, L: int) -> int:
    """The largest per-GPU max(sent, received) over pairs on different nodes."""
    node = torch.arange(pair.shape[0]) // L
    m = torch.where(node[:, None] != node[None, :], pair, 0)
    return int(torch.maximum(m.sum(1), m.sum(0)).max())


def test_one_full_sequence_bound_is_the_other_nodes_keys():
    """Full attention over one sequence, P = 4 on two nodes of 2: owner-computes is balanced, and the
    cheapest way to run a query unit's blocks with another node's keys is to bring those keys (a K, V
    token costs less than a Q token plus its O back). So each node receives the other node's two
    chunks of K, V and sends its own: 2 c tokens each way over its two NICs."""
    P, L, c = 4, 2, 32
    config = _config(P)
    areas = block_areas(full_mask(P * c), P, config.head_groups, impl="torch")
    cost = config.cost()
    assert cost.kv_fwd < cost.q_fwd + cost.o_fwd  # the premise: keys are the cheaper side
    fwd = ib_lower_bound(areas, cost, L)
    assert fwd == pytest.approx(2 * c * config.head_groups * cost.kv_fwd / L, rel=1e-6)
    assert ib_lower_bound(areas, cost, L, direction="step") >= fwd
    assert ib_lower_bound(areas, cost, P) == pytest.approx(0.0, abs=1e-3)  # one node: nothing crosses


def _whole_task_min(areas, cost, L, mu):
    """The least largest-node forward IB bytes / L over every placement of whole tasks on nodes
    within mu * L * mean (each (unit, node) paying its largest need once): brute force."""
    P = areas.cp_size
    N, G = P // L, areas.head_groups
    area = areas.area.sum(0).numpy()
    qlen = (areas.q_need[0, ..., 1] - areas.q_need[0, ..., 0]).numpy()
    klen = (areas.k_need[0, ..., 1] - areas.k_need[0, ..., 0]).numpy()
    node = np.arange(P) // L
    tasks = [(i, j) for i in range(P) for j in range(P) if area[i, j] > 0]
    cap = mu * L * area.sum() / P
    best = None
    for place in itertools.product(range(N), repeat=len(tasks)):
        load = np.zeros(N)
        yq, yk = np.zeros((P, N)), np.zeros((P, N))
        for (i, j), n in zip(tasks, place):
            load[n] += area[i, j]
            if n != node[i]:
                yq[i, n] = max(yq[i, n], qlen[i, j])
            if n != node[j]:
                yk[j, n] = max(yk[j, n], klen[i, j])
        if (load > cap * (1 + 1e-12)).any():
            continue
        out, into = np.zeros(N), np.zeros(N)
        for u in range(P):
            for n in range(N):
                q, k = yq[u, n] * G, yk[u, n] * G
                out[node[u]] += q * cost.q_fwd + k * cost.kv_fwd
                into[n] += q * cost.q_fwd + k * cost.kv_fwd
                into[node[u]] += q * cost.o_fwd
                out[n] += q * cost.o_fwd
        z = max(out.max(), into.max()) / L
        best = z if best is None else min(best, z)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bound_is_below_every_whole_task_placement_and_the_solved_plan(seed):
    """Packed causal documents, P = 4 on two nodes, one long document on node 0: the bound is at most
    the brute-force best placement of whole tasks, which is at most what the solver's plan moves
    (``plan.pair_bytes``, direct transport); all above zero, so the comparison is not between zeros."""
    P, L, c = 4, 2, 16
    config = _config(P)
    gen = torch.Generator().manual_seed(seed)
    tail = torch.randint(2, 9, (P * c,), generator=gen).tolist()
    lengths = [P * c // 2 + 4]
    while sum(lengths) + tail[len(lengths)] < P * c:
        lengths.append(tail[len(lengths)])
    lengths.append(P * c - sum(lengths))
    mask = varlen_causal_mask(lengths)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    bound = ib_lower_bound(areas, config.cost(), L, config.imbalance_tol)
    brute = _whole_task_min(areas, config.cost(), L, config.imbalance_tol)
    assert 0 < bound <= brute * (1 + 1e-6)

    topology = Topology(ranks_per_node=L, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=500.0, name="two nodes")
    solved = replace(config, topology=topology)
    plan = build_plan(mask, areas, solve_assignment(areas, solved, impl="torch"), replace(solved, ib_relay=False))
    assert _ib_fwd(plan.pair_bytes("fwd"), L) >= brute * (1 - 1e-6)


def test_bad_arguments_are_named():
    config = _config(4)
    areas = block_areas(causal_mask(4 * 32), 4, config.head_groups, impl="torch")
    with pytest.raises(ValueError, match="ranks_per_node"):
        ib_lower_bound(areas, config.cost(), 3)
    with pytest.raises(ValueError, match="mu"):
        ib_lower_bound(areas, config.cost(), 2, mu=0.9)
    with pytest.raises(ValueError, match="direction"):
        ib_lower_bound(areas, config.cost(), 2, direction="sideways")
    tiled = block_areas(causal_mask(4 * 32), 4, config.head_groups, tiles=2, impl="torch")
    with pytest.raises(ValueError, match="tiles"):
        ib_lower_bound(tiled, config.cost(), 2)
