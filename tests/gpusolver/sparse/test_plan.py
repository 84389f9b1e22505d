"""Sparse plans: every stage's key windows point at the buffer rows that hold those keys, and the
kept entries of all ranks and stages are the mask, once (loads equal); prices; status; the sharded
solve equals the whole-mask solve."""
import pytest
import torch

from attn_kernels.sparse_attn.ref import selected_rows
from gpusolver.metrics import evaluate
from gpusolver.plan import BUFFER_OVERFLOW, UNASSIGNED
from gpusolver.plan.sparse import SelectionSpec, SparseCommCost, build_sparse_plan, sparse_config
from gpusolver.runtime.sparse_attn import gather_sparse_areas, solve_sparse_sharded
from gpusolver.sparse_solve import solve_sparse
from groupcomm import LocalGroup
from tests.gpusolver.sparse._cases import make_config, make_mask, scatter_plan

torch.set_num_threads(1)


def _global_selection(mask, G):
    """[G, S, hs, w] selection rows per group (token top-k repeated for each group)."""
    from gpusolver.runtime.sparse_attn import _selection

    sel = _selection(mask).long()
    if sel.dim() == 2:
        return sel[None, :, None, :].expand(G, -1, 1, -1)
    S, Hkv, w = sel.shape
    return sel.view(S, G, Hkv // G, w).permute(1, 0, 2, 3)


def _key_ids(plan, rank, G):
    """[G * c + cap] global key held at each key-buffer row of ``rank`` (-1 unused), group of each row."""
    comm = plan.comm
    c, n, cap = comm.chunk, comm.tiles, comm.kv_recv_capacity
    kb = plan.kv_blocks
    rng, off, n = (comm.kv_range, comm.kv_recv_offset, n) if kb is None else \
        (kb.kv_range, kb.kv_recv_offset, kb.blocks_per_rank)
    key = torch.full((G * c + cap,), -1, dtype=torch.int64)
    grp = torch.full((G * c + cap,), -1, dtype=torch.int64)
    for g in range(G):
        key[g * c:(g + 1) * c] = rank * c + torch.arange(c)
        grp[g * c:(g + 1) * c] = g
        for u in range(rng.shape[1]):  # units (hulls) or key blocks
            lo, hi = rng[g, u, rank].tolist()
            at = G * c + int(off[g, u, rank])
            key[at:at + hi - lo] = (u // n) * c + torch.arange(lo, hi)
            grp[at:at + hi - lo] = g
    return key, grp


@pytest.mark.parametrize("kind,P,c,Hkv,flatten,tiles,kv_block", [
    ("dsa", 4, 12, 2, True, 1, None), ("nsa", 4, 16, 2, True, 2, None), ("nsa", 4, 16, 4, False, 1, None),
    ("dsa", 4, 12, 2, True, 1, 3), ("nsa", 4, 16, 2, True, 2, 8), ("nsa", 4, 16, 4, False, 1, 4)])
def test_stages_cover_the_mask_once(kind, P, c, Hkv, flatten, tiles, kv_block):
    S = P * c
    mask = make_mask(kind, S, Hkv, seed=5)
    config = make_config(P, 2 * Hkv, Hkv, flatten, tiles)
    G = config.head_groups
    plan = scatter_plan(mask, config, LocalGroup(P), kv_block)
    sel = _global_selection(mask, G)  # [G, S, hs, w]
    spec = plan.spec
    total = torch.zeros((), dtype=torch.int64)
    for r in range(P):
        key_id, key_grp = _key_ids(plan, r, G)
        kept_r = 0
        for s in (0, 1):
            st = plan.stage(r, s)
            pos, cls = st.q_pos.long(), st.q_class.long()
            g = cls // plan.num_units
            rows_sel = sel[g, pos.clamp(min=0)]  # each query row's selection, as it travels with Q
            rows, ok = selected_rows(rows_sel, st.q_pos, st.q_class, st.kv_windows, spec.block_size, st.window,
                                     key_id.numel())
            keys = (rows_sel[..., None] * spec.block_size + torch.arange(spec.block_size)).flatten(-2)
            # a kept key sits at the buffer row its window points to, in the row's own group
            assert torch.equal(key_id[rows[ok]], keys[ok])
            assert torch.equal(key_grp[rows[ok]], g[:, None, None].expand_as(ok)[ok])
            kept_r += int(ok.sum())
        assert kept_r == int(plan.metrics.load[r]), f"rank {r}: kept {kept_r} != load {int(plan.metrics.load[r])}"
        total += kept_r
    assert int(total) == int(plan.area.sum())


def test_prices_include_selection_bytes():
    cost = SparseCommCost(8, 2, 64, 2, 2, True, selection_bytes=3 * 16, branches=2)
    assert cost.q_fwd == 4 * 64 * 2 + 48 and cost.o_fwd == 2 * 4 * (64 * 2 + 4)
    assert cost.q_bwd == 2 * 4 * (64 * 2 + 8) and cost.dq_bwd == 4 * 64 * 2 and cost.kv_fwd == 2 * 64 * 2
    recast = SparseCommCost(8, 2, 64, 2, 2, False, selection_bytes=48)
    assert recast.q_bwd == 4 * (64 * 2 + 8) + 4 * 64 * 2 + 48
    mask = make_mask("dsa", 32, 2)
    spec = SelectionSpec.of(mask, 2)
    assert spec.row_bytes == 12 * 4 and sparse_config(make_config(4, 4, 2), spec).cost().q_fwd == 2 * 32 * 4 + 48


def test_sharded_solve_equals_whole_solve():
    P, c, Hkv = 4, 16, 2
    mask = make_mask("nsa", P * c, Hkv, seed=2)
    config = make_config(P, 4, Hkv)
    whole = solve_sparse(mask, config)
    sharded = solve_sparse_sharded(mask, config, LocalGroup(P))
    assert torch.equal(whole.assignment, sharded.assignment)
    assert torch.equal(whole.metrics.fwd_send, sharded.metrics.fwd_send)


@pytest.mark.parametrize("kind", ["dsa", "nsa"])
def test_compiled_solve_prices_the_topology(kind):
    """Under ``torch.compile`` the sparse device solve is one op: it must carry the topology (and every
    option the eager solve reads), or a compiled layer on a cluster gets a plan priced for one node."""
    from dataclasses import replace

    from gpusolver.areas.sparse import sparse_areas
    from gpusolver.sparse_solve import sparse_assignment
    from gpusolver.topology import Topology

    P, c, Hq, Hkv = 8, 32, 8, 2
    mask = make_mask(kind, P * c, Hkv, seed=0)
    topo = Topology(ranks_per_node=2, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0, name="nodes of 2")
    config = replace(make_config(P, Hq, Hkv), topology=topo).for_sparse()
    priced = sparse_config(config, SelectionSpec.of(mask, config.head_groups))
    areas = sparse_areas(mask, P, config.head_groups, tiles=config.chunk_tiles)
    eager = sparse_assignment(areas, priced, impl="torch")
    one_node = sparse_assignment(areas, replace(priced, topology=None), impl="torch")
    assert not torch.equal(eager, one_node)  # the case is one where the topology decides the plan
    torch._dynamo.reset()
    compiled = torch.compile(lambda: sparse_assignment(areas, priced, impl="torch"), fullgraph=True,
                             backend="eager")()
    assert torch.equal(compiled.to(eager.dtype), eager)


def test_status_names_the_problem():
    P, c, Hkv = 4, 8, 2
    mask = make_mask("dsa", P * c, Hkv)
    config = make_config(P, 2, Hkv)
    areas, _, _ = gather_sparse_areas(mask, config, LocalGroup(P))
    spec = SelectionSpec.of(mask, config.head_groups)
    bad = torch.where(areas.area > 0, -1, -1)
    plan = build_sparse_plan(areas, bad, config, spec, P * c)
    assert int(plan.status) & UNASSIGNED
    with pytest.raises(ValueError, match="UNASSIGNED: task"):
        plan.validate()
    moved = torch.where(areas.area > 0, (torch.arange(P)[None, :, None] + 1) % P, -1)
    plan = build_sparse_plan(areas, moved, config, spec, P * c, recv_capacity=3)
    assert int(plan.status) & BUFFER_OVERFLOW
    with pytest.raises(ValueError, match="BUFFER_OVERFLOW: rank"):
        plan.validate()


def _first_blocks_mask(P, c, Hkv, l):
    """Every row selects blocks 0 and 2 and its own block: unit 0 travels with a hole (block 1)."""
    from gpusolver.masks.sparse import BlockSparseMask

    t = torch.arange(P * c)
    own = t // l
    bi = torch.stack((torch.zeros_like(t), torch.full_like(t, 2), torch.where((own == 0) | (own == 2), -1, own)), -1)
    return BlockSparseMask(bi[:, None, :].expand(P * c, Hkv, 3).to(torch.int32).contiguous(), l, P * c)


@pytest.mark.parametrize("kind,kv_block", [("nsa", 4), ("dsa", 4)])
def test_key_blocks_stay_inside_the_hulls_rounded_to_blocks(kind, kv_block):
    P, c, Hkv = 4, 16, 2
    mask = _first_blocks_mask(P, c, Hkv, 4) if kind == "nsa" else make_mask(kind, P * c, Hkv, seed=3)
    config = make_config(P, 4, Hkv)
    hulls = scatter_plan(mask, config, LocalGroup(P))
    blocks = scatter_plan(mask, config, LocalGroup(P), kv_block)
    assert torch.equal(hulls.assignment, blocks.assignment)
    G = config.head_groups
    rng = hulls.comm.kv_range  # [G, U, P, 2] chunk-local
    moved = rng[..., 1] > rng[..., 0]
    rounded = torch.where(moved, (-(-rng[..., 1] // kv_block) - rng[..., 0] // kv_block) * kv_block, 0)
    sent = blocks.kv_blocks.need.long().view(G, P, -1, P).sum(2) * kv_block  # [G, U, P]
    assert (sent <= rounded).all()
    if kind == "nsa":  # the hole in unit 0 stays home
        assert int(sent.sum()) < int(hulls.comm.kv_split.sum())
        assert int(blocks.metrics.fwd_recv.sum()) < int(hulls.metrics.fwd_recv.sum())
    with pytest.raises(ValueError, match="kv_block=5 needs used_blocks and must divide the unit size 16"):
        scatter_plan(mask, config, LocalGroup(P), 5)


@pytest.mark.parametrize("kv_block", [None, 8])
def test_owner_computes_wins_when_balanced_and_cheaper(kv_block):
    from dataclasses import replace

    from gpusolver.metrics import owner_computes_assignment
    from gpusolver.plan.sparse import no_worse_than_owner, step_bytes

    P, c, Hkv = 4, 16, 2
    mask = make_mask("nsa", P * c, Hkv, seed=4)
    loose = replace(make_config(P, 4, Hkv), imbalance_tol=4.0)  # owner-computes counts as balanced
    areas, _, used = gather_sparse_areas(mask, loose, LocalGroup(P), kv_block)
    scattered = scatter_plan(mask, loose, LocalGroup(P), kv_block).assignment  # moves a lot
    spec = SelectionSpec.of(mask, loose.head_groups)
    owner = owner_computes_assignment(areas)
    assert step_bytes(areas, owner, loose, spec, used, kv_block)[1] < \
        step_bytes(areas, scattered, loose, spec, used, kv_block)[1]
    assert torch.equal(no_worse_than_owner(areas, scattered, loose, spec, used, kv_block), owner)
    tight = replace(loose, imbalance_tol=1.0)  # owner-computes is not balanced: the solver's plan stays
    assert not bool(step_bytes(areas, owner, tight, spec, used, kv_block)[0])
    assert torch.equal(no_worse_than_owner(areas, scattered, tight, spec, used, kv_block), scattered)


def _rates(P, attn_tflops, ranks_per_node=None):
    from gpusolver.topology import Topology

    return Topology(ranks_per_node=ranks_per_node or P, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=attn_tflops)


@pytest.mark.parametrize("kind,kv_block,per_node", [("dsa", None, None), ("nsa", 8, None), ("nsa", 8, 2)])
def test_modelled_step_is_busiest_attention_plus_class_bottlenecks(kind, kv_block, per_node):
    """The key is the step model's weights times the busiest rank's entries and the forward plus
    backward bottleneck bytes, each phase the larger link class times its weight; the bytes are the
    built plan's own per (source, destination), summed per rank here."""
    from dataclasses import replace

    from gpusolver.plan.sparse import modelled_step
    from gpusolver.solve import solve_assignment
    from gpusolver.step_model import time_weights

    P, c = 4, 32
    mask = make_mask(kind, P * c, 2, seed=0)
    config = replace(make_config(P, 8, 2), imbalance_tol=1.5, topology=_rates(P, 400.0, per_node))
    areas, _, used = gather_sparse_areas(mask, config, LocalGroup(P), kv_block)
    spec = SelectionSpec.of(mask, config.head_groups)
    priced = sparse_config(config, spec)
    asg = solve_assignment(areas, priced)
    plan = build_sparse_plan(areas, asg, config, spec, P * c, used_blocks=used, kv_block=kv_block)
    node = torch.arange(P) // (per_node or P)
    inter = node[:, None] != node[None, :]
    weights = (1, 1) if per_node is None else priced.link_weights[1:]
    phases = 0
    for phase in ("fwd", "bwd"):
        pair = plan.pair_bytes(phase)
        worst = 0
        for cls, w in ((~inter, weights[0]), (inter, weights[1])):
            b = torch.where(cls, pair, 0)
            worst = max(worst, int(torch.maximum(b.sum(1), b.sum(0)).max()) * w)
        phases += worst
    load = int(torch.zeros(P, dtype=torch.int64).scatter_add_(
        0, asg.long().clamp(min=0).reshape(-1), torch.where(asg >= 0, areas.area, 0).reshape(-1)).max())
    w_area, w_byte, shift = time_weights(priced, P * c)
    assert shift == 0
    balanced, key = modelled_step(areas, asg, config, spec, used, kv_block)
    assert bool(balanced) and int(key) == w_area * load + w_byte * phases


def test_owner_computes_wins_on_time_not_bytes():
    """The solver's DSA plan moves fewer bytes than owner-computes but loads its busiest rank more:
    with attention dear owner-computes is the plan, with attention free the solver's stays."""
    from dataclasses import replace

    from gpusolver.metrics import owner_computes_assignment
    from gpusolver.plan.sparse import RATES_WITHOUT_TOPOLOGY, modelled_step, no_worse_than_owner, step_bytes
    from gpusolver.solve import solve_assignment

    P, c = 4, 32
    mask = make_mask("dsa", P * c, 2, seed=0)
    config = replace(make_config(P, 8, 2), imbalance_tol=1.5)
    areas, _, _ = gather_sparse_areas(mask, config, LocalGroup(P), None)
    spec = SelectionSpec.of(mask, config.head_groups)
    solver = solve_assignment(areas, sparse_config(config, spec))
    owner = owner_computes_assignment(areas)
    busiest = lambda a: int(evaluate(areas, a, config.cost()).load.max())  # noqa: E731
    # the case: fewer bytes, more attention on the busiest rank, both balanced within mu
    assert int(step_bytes(areas, solver, config, spec)[1]) < int(step_bytes(areas, owner, config, spec)[1])
    assert busiest(solver) > busiest(owner)
    dear, free = (replace(config, topology=_rates(P, t)) for t in (1e-3, 1e9))
    assert torch.equal(no_worse_than_owner(areas, solver, dear, spec), owner)
    assert torch.equal(no_worse_than_owner(areas, solver, free, spec), solver)
    # no topology: the rates of RATES_WITHOUT_TOPOLOGY, the same keys as that topology named
    named = replace(config, topology=RATES_WITHOUT_TOPOLOGY)
    for a in (solver, owner):
        assert torch.equal(modelled_step(areas, a, config, spec)[1], modelled_step(areas, a, named, spec)[1])


@pytest.mark.parametrize("kind", ["dsa", "nsa", "nsa-layer"])
def test_solve_routes_sparse_masks(kind):
    """gpusolver.solve takes a sparse mask and gives the SparsePlan of solve_sparse, which runs."""
    from gpusolver import solve
    from gpusolver.plan.sparse import SparsePlan
    from gpusolver.runtime import shard, unshard
    from gpusolver.runtime.sparse_attn import _selection, local_selection, sparse_dist_attn
    from tests._testing import assert_close
    from tests.gpusolver.sparse._cases import make_inputs, reference

    P, c, Hkv = 4, 16, 2
    mask = make_mask(kind, P * c, Hkv, seed=6)
    config = make_config(P, 4, Hkv)
    plan = solve(mask, config)
    whole = solve_sparse(mask, config)
    assert isinstance(plan, SparsePlan) and torch.equal(plan.assignment, whole.assignment)
    assert torch.equal(plan.metrics.fwd_send, whole.metrics.fwd_send) and int(plan.status) == int(whole.status)
    assert (plan.kv_blocks is None) == (kind != "nsa")  # NSA selections move key blocks, the rest hulls
    group = LocalGroup(P)
    q, k, v, d_out, d_lse = make_inputs(P * c, 4, Hkv, seed=6)
    res = sparse_dist_attn(*(shard(x, group) for x in (q, k, v)), local_selection(mask, group), plan, group)
    out = unshard((res[0] if kind == "nsa-layer" else res)[0], group)
    assert_close("out", reference(mask, q, k, v, d_out, d_lse)[0][0], out, atol=2e-5, rtol=1e-4)
    with pytest.raises(TypeError, match="mask must be an AttnSlices, BlockSparseMask, TokenTopKMask or NSALayerMask"):
        solve(_selection(mask), config)
