"""The sub-stage pass (``gpusolver.plan.stages``) and the per-stage metas it feeds.

The runtime tests (``tests/gpusolver/runtime/test_stages.py``) show the plans
compute the right attention; these check the pass itself: arrival order,
balance, S = 1 unchanged, determinism, meta, and that per-stage routing adds
up to the whole plan.
"""
from dataclasses import replace

import pytest
import torch

from gpusolver import SolverConfig, block_areas, solve
from gpusolver.config import AUTO_STAGES
from gpusolver.plan.build import build_plan
from gpusolver.plan.stages import assign_stages, landing_time, stage_shares
from gpusolver.topology import Topology, h200_hgx
from tests.gpusolver.runtime._cases import make_config, make_mask


def _solved(P=8, c=16, S=4, tiles=1, name="docs-causal", seed=1, **kw):
    config = make_config(P, 4, 2, True, tiles, num_stages=S, **kw)
    mask = make_mask(name, P * c, seed=seed)
    plan = solve(mask, config, solver="reference", validate=False)
    areas = block_areas(mask, P, config.head_groups, impl="torch", tiles=tiles)
    return mask, areas, plan, config


def test_config_num_stages_is_checked():
    for bad in (0, -1, True, 1.5, 33, "four"):
        with pytest.raises(ValueError, match="num_stages"):
            SolverConfig(cp_size=4, num_stages=bad)
    default = SolverConfig(cp_size=4)  # "auto" by default (2026-12-03), 1 the two-stage layer
    assert default.num_stages == AUTO_STAGES and default.auto_stages
    assert default == SolverConfig(cp_size=4, num_stages="auto")
    one = SolverConfig(cp_size=4, num_stages=1)
    assert one.num_stages == 1 and not one.auto_stages and one.for_sparse() is one
    auto = SolverConfig(cp_size=4, num_stages="auto")
    assert auto.num_stages == AUTO_STAGES == 4 and auto.auto_stages  # the measured best
    assert auto.replaced(imbalance_tol=1.2).auto_stages
    # sparse selections: sub-stages inside one node, one remote stage across nodes
    assert auto.for_sparse().num_stages == AUTO_STAGES  # P = 4: one node without a topology
    assert SolverConfig(cp_size=16).for_sparse().num_stages == 1  # more ranks than SPARSE_NODE_RANKS
    assert SolverConfig(cp_size=8).for_sparse().num_stages == AUTO_STAGES
    assert SolverConfig(cp_size=16, topology=h200_hgx).for_sparse().num_stages == 1  # two nodes of 8
    wide = replace(h200_hgx, ranks_per_node=16)
    assert SolverConfig(cp_size=16, topology=wide).for_sparse().num_stages == AUTO_STAGES  # one node of 16
    assert SolverConfig(cp_size=16, num_stages=4).for_sparse().num_stages == 4  # the caller's S stays
    assert SolverConfig(cp_size=4, num_stages="auto", kept_kv_rows=8).num_stages == AUTO_STAGES  # one shared buffer
    explicit = replace(auto, num_stages=2)  # dataclasses.replace names S: it is the caller's
    assert explicit.num_stages == 2 and not explicit.auto_stages and explicit.for_sparse() is explicit
    assert not SolverConfig(cp_size=4, num_stages=4).auto_stages


def test_landing_time_by_hand():
    """Fair share at each receiver: 1 and 3 bytes into rank 0 finish at 2 and 4 (bandwidth 1)."""
    pair = torch.tensor([[0, 5, 0], [1, 0, 2], [3, 2, 0]])
    inter, t = landing_time(pair)
    assert not inter.any()
    # into 0: sources 1 (1 byte) and 2 (3 bytes): 1 finishes at 1 * 2, then 2 at 1 + 3
    assert t[1, 0].item() == 2.0 and t[2, 0].item() == 4.0
    # into 2: only source 1 sends (rank 0 sends 0 bytes, which finishes at 0)
    assert t[1, 2].item() == 2.0 and t[0, 2].item() == 0.0
    # two nodes of 2 ranks: the cross-node pair is in the other class, priced by IB
    topo = Topology(ranks_per_node=2, nvlink_gbps=4e-9, ib_gbps=1e-9, attn_tflops=1.0)
    inter, t = landing_time(pair, topo)
    assert inter[2, 0] and not inter[1, 0]
    assert t[1, 0].item() == pytest.approx(1 / 4) and t[2, 0].item() == pytest.approx(3 / 1)


def test_stages_cover_remote_work_in_order_and_balanced():
    _, areas, plan, _ = _solved(S=4)
    st = plan.task_stage
    P, S = 8, 4
    a = plan.assignment.long()
    host = areas.unit_host()
    live = (a >= 0) & (areas.area > 0)
    local = live & (host.view(1, -1, 1) == a) & (host.view(1, 1, -1) == a)
    # local tasks in stage 0 or the local tail S + 1 (``local_tail``), remote ones in 1..S
    assert torch.equal((st == 0) | (st == S + 1), local) and torch.equal(st < 0, ~live)
    assert bool(((st >= 1) & (st <= S) | ~live | local).all())
    # shares: every stage's work is within one task of its share of W (1, 2, 2, 1 sixths)
    shares = stage_shares(S)
    assert shares == [1, 2, 2, 1]
    for r in range(P):
        mine = live & ~local & (a == r)
        w = torch.stack([areas.area[mine & (st == s)].sum() for s in range(1, S + 1)])
        total, biggest = int(w.sum()), int(areas.area[mine].max()) if mine.any() else 0
        assert all(abs(int(x) - total * f / sum(shares)) <= biggest for x, f in zip(w, shares)), (r, w.tolist())
        assert int(w.sum()) == int(areas.area[mine].sum())


def test_intra_node_sources_first_with_a_topology():
    """Two nodes of 4: on every rank, no task that needs a cross-node source sits in an earlier
    sub-stage than a task that needs only intra-node sources."""
    P = 8
    _, areas, plan, config = _solved(P=P, S=4, name="docs-full", seed=3)
    topo = Topology(ranks_per_node=4, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0)
    st = assign_stages(areas, plan.assignment, 4, cost=config.cost(), topology=topo)
    a = plan.assignment.long()
    node = areas.unit_host() // 4
    rnode = a.clamp(min=0) // 4
    cross = (node.view(1, -1, 1) != rnode) | (node.view(1, 1, -1) != rnode)
    checked = 0
    for r in range(P):
        mine = (a == r) & (st >= 1)
        if (mine & cross).any() and (mine & ~cross).any():
            assert int(st[mine & ~cross].max()) <= int(st[mine & cross].min()), r
            checked += 1
    assert checked > 0  # some rank had both kinds


def test_one_stage_is_the_two_stage_plan():
    mask, areas, plan, config = _solved(S=1)
    st = plan.task_stage
    assert plan.calc.q_ranges.shape[1] == 2 and plan.comm.qo_stage is None
    a = plan.assignment.long()
    host = areas.unit_host()
    remote = (host.view(1, -1, 1) != a) | (host.view(1, 1, -1) != a)
    live = (a >= 0) & (areas.area > 0)
    assert torch.equal(st, torch.where(live, remote.int(), -1).int())


@pytest.mark.parametrize("tiles", [1, 2])
def test_per_stage_routing_adds_up(tiles):
    # whole buffers kept: a part-kept KV buffer casts again the rows past its kept ones, which are
    # not the same rows in the one-stage and the sub-stage layouts
    mask, areas, plan, config = _solved(S=4, tiles=tiles, memory_budget=None)
    one = build_plan(mask, areas, plan.assignment, make_config(8, 4, 2, True, tiles, num_stages=1, memory_budget=None))
    comm = plan.comm
    for kind in ("qo", "kv"):
        total = getattr(comm, f"{kind}_split")
        assert torch.equal(total, getattr(one.comm, f"{kind}_split"))  # the same bytes travel
        for which in ("cast", "return"):
            assert torch.equal(comm.stage_split(kind, which).sum(0), total), (kind, which)
        first, last = getattr(comm, f"{kind}_stage").unbind(-1)
        moved = getattr(comm, f"{kind}_range")[..., 1] > getattr(comm, f"{kind}_range")[..., 0]
        assert torch.equal(first > 0, moved) and bool((last >= first).all())
        for r in range(8):  # each stage's send list holds exactly that stage's rows, all of them once
            rows = torch.cat([comm.send_index(kind, r, s) for s in range(1, comm.num_stages + 1)])
            rows = rows[rows >= 0].sort().values
            allrows = comm.send_index(kind, r)
            assert torch.equal(rows, allrows[allrows >= 0].sort().values)
    # the stages' slice rows are the remote stage's, dealt out; stage 0's and the local tail's (stage
    # S + 1, ``local_tail``) are the one-stage plan's local rows
    assert comm.num_stages == 5
    assert torch.equal(plan.calc.needed_rows[:, 0] + plan.calc.needed_rows[:, 5], one.calc.needed_rows[:, 0])
    assert int(plan.calc.needed_rows[:, 5].sum()) > 0
    assert torch.equal(plan.calc.needed_rows[:, 1:5].sum(1), one.calc.needed_rows[:, 1])
    for phase in ("fwd", "bwd"):  # pair_bytes per stage sums to the whole; the tail moves nothing
        whole = plan.pair_bytes(phase)
        assert torch.equal(sum(plan.pair_bytes(phase, stage=s) for s in range(1, 5)), whole)
        assert int(plan.pair_bytes(phase, stage=5).sum()) == 0
        assert torch.equal(whole, one.pair_bytes(phase))


@pytest.mark.parametrize("S,tiles", [(1, 1), (4, 1), (3, 2)])
def test_batched_send_lists_are_the_per_stage_ones(S, tiles):
    """``CommMeta.stage_send_index`` (every rank and sub-stage in one batch, what the runtime builds)
    equals ``send_index`` called per (rank, sub-stage), element for element, -1 padding included."""
    _, _, plan, config = _solved(S=S, tiles=tiles)
    comm = plan.comm
    S = config.plan_stages  # and the local tail: its lists are all padding
    assert int(comm.qo_split.sum()) > 0 and int(comm.kv_split.sum()) > 0
    for kind in ("qo", "kv"):
        for which in ("cast", "return"):
            for ranks in ((0, 1, 2, 3, 4, 5, 6, 7), (5,), (6, 2)):
                got = comm.stage_send_index(kind, ranks, which)
                assert got.shape == (len(ranks), S, comm.buffers.send(kind)) and got.dtype == torch.int64
                for i, r in enumerate(ranks):
                    for s in range(1, S + 1):
                        assert torch.equal(got[i, s - 1], comm.send_index(kind, r, s, which)), (kind, which, r, s)
    for bad in ((), (8,), (-1,), (0.5,)):
        with pytest.raises(ValueError, match="ranks must be"):
            comm.stage_send_index("qo", bad)


def test_send_lists_and_gathers_cut_to_a_capacity_are_their_first_positions():
    """``capacity=``: the first positions of the whole lists and gathers (what a TorchGroup backward
    builds, as long as the most rows a sub-stage holds); bad capacities are refused by name."""
    _, _, plan, _ = _solved(S=4, tiles=1)
    comm = plan.comm
    ranks = tuple(range(comm.cp_size))
    for kind in ("qo", "kv"):
        for which in ("cast", "return"):
            whole = comm.stage_send_index(kind, ranks, which)
            longest = int((whole >= 0).sum(-1).max())
            assert 0 < longest < whole.shape[-1]  # the lists hold padding to cut
            cut = comm.stage_send_index(kind, ranks, which, capacity=longest)
            assert torch.equal(cut, whole[..., :longest])
        for r in (0, 5):
            whole = comm.return_gather(kind, r)
            for cap in (0, 3, int((whole >= 0).sum(-1).max())):
                assert torch.equal(comm.return_gather(kind, r, capacity=cap), whole[..., :cap])
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="capacity must be"):
            comm.stage_send_index("qo", ranks, capacity=bad)
        with pytest.raises(ValueError, match="capacity must be"):
            comm.return_gather("kv", 0, capacity=bad)


def test_stage_pass_deterministic_and_on_meta():
    _, areas, plan, config = _solved(S=8)
    again = assign_stages(areas, plan.assignment, 8, cost=config.cost(), local_tail=config.local_tail)
    assert torch.equal(again, plan.task_stage)
    meta_areas = type(areas)(*(t.to("meta") if isinstance(t, torch.Tensor) else t
                               for t in (areas.area, areas.q_need, areas.k_need, areas.chunk, areas.tiles)))
    out = assign_stages(meta_areas, plan.assignment.to("meta"), 8, cost=config.cost(), topology=h200_hgx,
                        local_tail=config.local_tail)
    assert out.device.type == "meta" and out.shape == plan.task_stage.shape and out.dtype == torch.int32


def test_sparse_plans_take_sub_stages_nsa_layer_masks_too():
    """A top-k plan and an NSA layer mask (two output branches) solve into S = 2 sub-stages (the layers:
    tests/gpusolver/sparse/test_stages.py); the window branch's slices get the same sub-stages, and
    ``num_stages="auto"`` gives sparse masks sub-stages inside one node, one remote stage across nodes."""
    from gpusolver.masks.sparse import BlockSparseMask, NSALayerMask, TokenTopKMask

    P, c = 4, 16
    topk = (torch.arange(P * c)[:, None] - torch.arange(4)).clamp(min=-1)
    plan = solve(TokenTopKMask(topk.to(torch.int32), P * c), make_config(P, 4, 2, num_stages=2))
    assert plan.num_stages == 2 and plan.task_stage.shape == plan.assignment.shape
    blocks = (torch.arange(P * c)[:, None, None] // 8 - torch.arange(2)).clamp(min=-1).expand(P * c, 2, 2)
    layer = NSALayerMask(BlockSparseMask(blocks.to(torch.int32).contiguous(), 8, P * c), 4)
    plan = solve(layer, make_config(P, 4, 2, num_stages=2))
    assert plan.num_stages == 2 and plan.window_calc.q_ranges.shape[:2] == (P, 3)  # stage 0 and sub-stages 1, 2
    assert solve(layer, make_config(P, 4, 2, num_stages="auto")).num_stages == AUTO_STAGES  # one node
    two_nodes = Topology(ranks_per_node=2, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0)
    across = make_config(P, 4, 2, num_stages="auto", topology=two_nodes)
    assert solve(layer, across).num_stages == 1


@pytest.mark.parametrize("tiles", [1, 2])
def test_sub_stages_share_one_receive_buffer(tiles):
    """Cast s's rows lie at [stage_base[s - 1], + its rows) of each rank's one buffer per kind, after
    casts 1..s-1's, each transfer inside its own stage's range: the buffer holds the one-stage fill."""
    mask, areas, plan, config = _solved(S=4, tiles=tiles)
    one = build_plan(mask, areas, plan.assignment, make_config(8, 4, 2, True, tiles, num_stages=1))
    comm = plan.comm
    for kind in ("qo", "kv"):
        rows = comm.stage_split(kind).sum(1)                                  # [S, P] rows of each cast
        base = comm.stage_base(kind)
        assert torch.equal(base, rows.cumsum(0) - rows)
        assert torch.equal(rows.sum(0), getattr(one.comm, f"{kind}_recv_rows"))
        rng = getattr(comm, f"{kind}_range")
        length = rng[..., 1] - rng[..., 0]
        first = getattr(comm, f"{kind}_stage")[..., 0]
        off = getattr(comm, f"{kind}_recv_offset")
        for r in range(8):
            moved = length[:, :, r] > 0
            s_ = first[:, :, r][moved] - 1
            lo, hi = off[:, :, r][moved], off[:, :, r][moved] + length[:, :, r][moved]
            assert bool((lo >= base[s_, r]).all() and (hi <= base[s_, r] + rows[s_, r]).all()), (kind, r)
            # the transfers tile the fill exactly once
            cover = torch.zeros(int(rows[:, r].sum()), dtype=torch.int64)
            for a, b in zip(lo.tolist(), hi.tolist()):
                cover[a:b] += 1
            assert bool((cover == 1).all()), (kind, r)


def test_overflow_counts_the_whole_fill():
    """One buffer per kind for all sub-stages: a capacity that holds every single cast but not a rank's
    whole fill is BUFFER_OVERFLOW, named with the whole fill; the one-stage capacity is enough."""
    mask, areas, plan, config = _solved(S=2)
    fill = plan.comm.kv_recv_rows
    per = plan.comm.stage_split("kv").sum(1)
    cap = int(fill.max()) - 1
    assert cap >= int(per.max())  # every cast alone would fit
    small = build_plan(mask, areas, plan.assignment, config, buffers=replace(plan.comm.buffers, kv_recv=cap))
    with pytest.raises(ValueError, match=rf"BUFFER_OVERFLOW: rank \d+ receives {int(fill.max())} KV rows, "
                                         rf"receive capacity {cap}"):
        small.validate(ignore=1)
    exact = build_plan(mask, areas, plan.assignment, config, buffers=replace(plan.comm.buffers, kv_recv=cap + 1,
                                                                              qo_recv=int(plan.comm.qo_recv_rows.max())))
    exact.validate(ignore=1)


@pytest.mark.parametrize("comm", ["a2a", "p2p"])
def test_simulated_sub_stages_respect_the_bound_and_the_bytes(comm):
    """The simulator prices the sub-stage op lists: never below the ideal bound, and the bytes it
    moves per pass are the plan's ``pair_bytes`` (the per-stage splits summed)."""
    from gpusolver.sim import simulate

    topo = Topology(ranks_per_node=4, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0)
    for S in (1, 4):
        mask, areas, plan, config = _solved(S=S)
        plan = build_plan(mask, areas, plan.assignment, config, topology=topo)
        t = simulate(plan, topo, comm=comm)
        assert t.step_ms >= t.ideal_ms * (1 - 1e-9)
        for phase, pt in (("fwd", t.fwd), ("bwd", t.bwd)):
            assert pt.pair_bytes == plan.pair_bytes(phase).tolist(), (S, phase)


def test_stage_shares_halve_the_first_and_last_sub_stage():
    assert [stage_shares(S) for S in (1, 2, 3, 4, 8)] == [
        [1], [1, 1], [1, 2, 1], [1, 2, 2, 1], [1, 2, 2, 2, 2, 2, 2, 1]]


def test_stage_boundaries_by_hand():
    """One rank helps with four equal tasks of another's queries (no topology, equal landing): at
    S = 3 the shares 1, 2, 1 put the task with 0 / 4 of the work before it in stage 1, those with
    1 / 4 and 2 / 4 in stage 2 (boundary at 1 / 4) and the one with 3 / 4 in stage 3 (boundary at 3 / 4)."""
    from gpusolver.problem import BlockAreas
    U, G, c = 2, 4, 4
    area = torch.zeros(G, U, U, dtype=torch.int64)
    area[:, 1, 1] = 10                                       # four head groups of unit (1, 1), hosted on 1
    need = torch.zeros(G, U, U, 2, dtype=torch.int64)
    need[:, 1, 1] = torch.tensor([0, c])
    areas = BlockAreas(area=area, q_need=need, k_need=need.clone(), chunk=c)
    asg = torch.full((G, U, U), -1, dtype=torch.int64)
    asg[:, 1, 1] = 0                                         # all computed by rank 0: remote
    st = assign_stages(areas, asg, 3)
    assert st[:, 1, 1].tolist() == [1, 2, 2, 3]
    assert st[:, 0].eq(-1).all() and st[:, :, 0].eq(-1).all()
    # equal shares at S = 2: boundary at 2 / 4
    assert assign_stages(areas, asg, 2)[:, 1, 1].tolist() == [1, 1, 2, 2]


def test_local_tail_by_hand():
    """Rank 0 hosts four equal local tasks and helps with two of rank 1's: ``local_tail`` moves the
    local tasks at and past 1 - share of its local work (in task order) to sub-stage S + 1 and leaves
    the remote ones where they were; S = 1 takes no tail."""
    from gpusolver.config import sub_stages
    from gpusolver.problem import BlockAreas
    U, G, c = 2, 4, 4
    area = torch.zeros(G, U, U, dtype=torch.int64)
    area[:, 0, 0] = 10                                       # four head groups of unit (0, 0), local to rank 0
    area[:2, 1, 1] = 10                                      # two of unit (1, 1), hosted on rank 1
    need = torch.zeros(G, U, U, 2, dtype=torch.int64)
    need[:, 0, 0] = need[:, 1, 1] = torch.tensor([0, c])
    areas = BlockAreas(area=area, q_need=need, k_need=need.clone(), chunk=c)
    asg = torch.full((G, U, U), -1, dtype=torch.int64)
    asg[:, 0, 0] = 0
    asg[:2, 1, 1] = 0                                        # computed by rank 0: remote
    none = assign_stages(areas, asg, 2)
    assert none[:, 0, 0].tolist() == [0, 0, 0, 0] and none[:2, 1, 1].tolist() == [1, 2]
    for share, local in ((0.5, [0, 0, 3, 3]), (0.25, [0, 0, 0, 3]), (1, [3, 3, 3, 3]), (0.74, [0, 3, 3, 3]),
                         (0.01, [0, 0, 0, 0])):             # 0.01 rounds to 0 sixteenths: no tail
        st = assign_stages(areas, asg, 2, local_tail=share)
        assert st[:, 0, 0].tolist() == local, share
        assert torch.equal(st[:2, 1, 1], none[:2, 1, 1]) and bool((st[2:, 1, 1] == -1).all())
        assert sub_stages(2, share) == (3 if share >= 1 / 32 else 2)
    assert torch.equal(assign_stages(areas, asg, 1, local_tail=0.5), assign_stages(areas, asg, 1))
    assert sub_stages(1, 0.5) == 1


def test_local_tail_config():
    """``local_tail`` is checked by name; relay transport takes no tail (``SolverConfig.tail``), and
    ``plan_stages`` is the sub-stages a plan of the config runs."""
    for bad in (True, -0.1, 1.5, "half", None):
        with pytest.raises(ValueError, match="local_tail"):
            SolverConfig(cp_size=4, local_tail=bad)
    default = SolverConfig(cp_size=4)
    assert default.local_tail == 0.5 and default.tail == 0.5 and default.plan_stages == AUTO_STAGES + 1
    assert SolverConfig(cp_size=4, local_tail=0).plan_stages == AUTO_STAGES
    assert SolverConfig(cp_size=4, num_stages=1).plan_stages == 1
    relayed = SolverConfig(cp_size=16, topology=h200_hgx, ib_relay=True)
    assert relayed.relays and relayed.tail == 0.0 and relayed.plan_stages == AUTO_STAGES
    assert SolverConfig(cp_size=16, topology=h200_hgx).plan_stages == AUTO_STAGES + 1  # direct with sub-stages


def test_local_tail_simulated_moves_no_bytes():
    """The tail's casts and reduces are empty: the simulated passes move the same bytes as the plan
    without a tail, and the tail's sub-stage computes only the local work stage 0 gave up."""
    from gpusolver.plan.schedule import stage_area
    from gpusolver.sim import simulate

    mask, areas, solved, config = _solved(S=4)
    plan = build_plan(mask, areas, solved.assignment, config)
    flat = build_plan(mask, areas, solved.assignment, replace(config, local_tail=0))
    assert plan.num_stages == 5 and flat.num_stages == 4
    topo = Topology(ranks_per_node=4, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0)
    for comm in ("a2a", "p2p"):
        with_tail, without = simulate(plan, topo, comm=comm), simulate(flat, topo, comm=comm)
        assert with_tail.fwd.pair_bytes == without.fwd.pair_bytes
        assert with_tail.bwd.pair_bytes == without.bwd.pair_bytes
        assert with_tail.ideal_ms == pytest.approx(without.ideal_ms)
    tail, flat_area = stage_area(plan, 6), stage_area(flat, 5)
    assert torch.equal(tail[:, 0] + tail[:, 5], flat_area[:, 0]) and torch.equal(tail[:, 1:5], flat_area[:, 1:5])
    assert bool((tail[:, 5] > 0).any())
