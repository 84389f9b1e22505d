"""Plans: CommMeta / CalcMeta against a dense oracle and a simulated all-to-all."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusolver.areas import block_areas
from gpusolver.config import AUTO_STAGES, SolverConfig
from gpusolver.masks import causal_mask, slices_to_dense, sliding_window_mask, varlen_causal_mask, varlen_full_mask
from gpusolver.masks.slices import AttnSlices
from gpusolver.metrics import evaluate, owner_computes_assignment
from gpusolver.plan import (BUFFER_OVERFLOW, CALC_OVERFLOW, IMBALANCED, NEED_MISMATCH, UNASSIGNED, Plan,
                            build_plan, default_stage_capacity, slice_pieces, status_names)
from gpusolver.problem import BlockAreas
from tests._testing import assert_close

# ---------------------------------------------------------------- oracles


def _slice_dense(qs, qe, ks, ke, t, S):
    """bool [S, S] of one slice, straight from the definition."""
    q = torch.arange(S)[:, None]
    k = torch.arange(S)[None, :]
    m = (q >= qs) & (q < qe) & (k >= ks) & (k < ke)
    if t in (1, 3):
        m &= k <= q + (ke - qe)
    if t in (2, 3):
        m &= k >= q + (ks - qs)
    return m


def _mask_counts(mask: AttnSlices, G: int) -> torch.Tensor:
    """int64 [G, S, S]: how many slices cover each entry (overlaps count twice)."""
    q, k, t = (x.cpu() for x in mask.per_group(G))
    S = mask.total_seqlen_q
    out = torch.zeros(G, S, S, dtype=torch.long)
    for g in range(G):
        for r in range(q.shape[1]):
            out[g] += _slice_dense(*q[g, r].tolist(), *k[g, r].tolist(), int(t[g, r]), S).long()
    return out


def _config(P, G, **kw):
    return SolverConfig(cp_size=P, num_heads_q=2 * G, num_heads_kv=G, head_dim=4, **kw)


def _random_assignment(areas: BlockAreas, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    G, P, U = areas.head_groups, areas.cp_size, areas.num_units
    r = torch.randint(0, P, (G, U, U), generator=gen, dtype=torch.int32)
    return torch.where(areas.area > 0, r, -1).to(torch.int32)


def _simulate_buffers(plan: Plan, kind: str, G: int, P: int, c: int, S: int):
    """Run the all-to-all-v casts the CommMeta describes on codes g * S + token.

    Returns per rank the codes of concat(local group-major rows, receive buffer),
    length G*c + the kind's receive capacity, -1 where the buffer is unfilled, and next to
    them the cast (1..S sub-stages; 0 local or unfilled) that brought each row. Each of the
    S casts writes its rows from its stage base on (``stage_base``: after casts 1..s-1's
    rows); asserts the send lists, splits and offsets along the way (buffer order: cast
    stage, then host, g, tile).
    """
    m = plan.comm
    n, NS = m.tiles, m.num_stages
    splits, base = m.stage_split(kind), m.stage_base(kind)
    assert torch.equal(splits.sum(0), getattr(m, f"{kind}_split")), "the casts' splits do not add up"
    rng, off = getattr(m, f"{kind}_range"), getattr(m, f"{kind}_recv_offset")
    recv_rows = getattr(m, f"{kind}_recv_rows")
    cap = m.buffers.recv(kind)
    g_of_row = torch.arange(G * c) // c
    local = [g_of_row * S + s * c + torch.arange(G * c) % c for s in range(P)]
    got = [torch.full((cap,), -1, dtype=torch.long) for _ in range(P)]
    cast_of = [torch.zeros(cap, dtype=torch.long) for _ in range(P)]
    for st_ in range(1, NS + 1):
        pieces = [[None] * P for _ in range(P)]
        for s in range(P):
            total = int(splits[st_ - 1, s].sum())
            idx = m.send_index(kind, s, st_)
            assert (idx[total:] == -1).all(), f"{kind} send_index[{s}] cast {st_} not -1 padded after {total} rows"
            assert ((idx[:total] >= 0) & (idx[:total] < G * c)).all()
            pieces[s] = list(torch.split(local[s][idx[:total]], splits[st_ - 1, s].tolist()))
        for d in range(P):
            buf = torch.cat([pieces[s][d] for s in range(P)])
            start = int(base[st_ - 1, d])
            assert start == int(splits[:st_ - 1, :, d].sum()), f"{kind} cast {st_} on rank {d} starts at {start}"
            assert (got[d][start:start + buf.numel()] == -1).all(), f"{kind} cast {st_} overwrites rows"
            got[d][start:start + buf.numel()] = buf
            cast_of[d][start:start + buf.numel()] = st_
    out, casts = [], []
    for d in range(P):
        assert int((got[d] >= 0).sum()) == int(recv_rows[d])
        expect = torch.full((cap,), -1, dtype=torch.long)
        for u in range(P * n):
            for g in range(G):
                lo, hi = rng[g, u, d].tolist()
                o = int(off[g, u, d])
                expect[o:o + hi - lo] = g * S + (u // n) * c + torch.arange(lo, hi)
        assert_close(f"{kind} recv buffer of rank {d}", expect, got[d])
        out.append(torch.cat([local[d], got[d]]))
        casts.append(torch.cat([torch.zeros(G * c, dtype=torch.long), cast_of[d]]))
    return out, casts


def _calc_counts(plan: Plan, G: int, P: int, c: int, S: int) -> torch.Tensor:
    """int64 [P, G, S, S]: entries each rank's CalcMeta pieces cover, in global coordinates."""
    qbuf, qcast = _simulate_buffers(plan, "qo", G, P, c, S)
    kbuf, kcast = _simulate_buffers(plan, "kv", G, P, c, S)
    cal = plan.calc
    cap = cal.capacity
    out = torch.zeros(P, G, S, S, dtype=torch.long)
    # the local tail (``SolverConfig.local_tail``): the last of S > 1 sub-stages when it holds a local task
    n_units = plan.assignment.shape[1]
    host = torch.arange(n_units) // (n_units // P)
    a = plan.assignment.long()
    local_task = (a == host.view(1, -1, 1)) & (a == host.view(1, 1, -1))
    tail = cal.num_stages if cal.num_stages > 1 and bool(((plan.task_stage == cal.num_stages) & local_task).any()) \
        else None
    for r in range(P):
        for stage in range(cal.num_stages + 1):
            n = int(cal.num_rows[r, stage])
            assert n == min(int(cal.needed_rows[r, stage]), cap)
            qr, kr, ty = cal.q_ranges[r, stage], cal.k_ranges[r, stage], cal.attn_type[r, stage]
            assert (qr[n:] == 0).all() and (kr[n:] == 0).all() and (ty[n:] == 0).all(), "padding rows not dummies"
            q_limit = G * c if stage == 0 else G * c + plan.comm.qo_recv_capacity
            k_limit = G * c if stage == 0 else G * c + plan.comm.kv_recv_capacity
            limit = max(q_limit, k_limit)
            for row in range(n):
                (a, b), (k0, k1), t = qr[row].tolist(), kr[row].tolist(), int(ty[row])
                assert 0 <= a < b <= q_limit and 0 <= k0 < k1 <= k_limit, \
                    f"rank {r} stage {stage} row {row} out of buffer"
                d = _slice_dense(a, b, k0, k1, t, limit)
                qi, ki = d.nonzero(as_tuple=True)
                assert qi.numel() > 0, f"rank {r} stage {stage} row {row} is an empty piece"
                qc, kc = qbuf[r][qi], kbuf[r][ki]
                assert (qc >= 0).all() and (kc >= 0).all(), "piece reads unfilled buffer rows"
                # the pipeline: sub-stage s reads only what casts 1..s brought (never waits for a later one)
                assert (qcast[r][qi] <= stage).all() and (kcast[r][ki] <= stage).all(), \
                    f"rank {r} stage {stage} row {row} reads rows of a later cast"
                g = qc // S
                assert (g == kc // S).all(), "piece mixes head groups"
                qt, kt = qc % S, kc % S
                if stage in (0, tail):
                    assert ((qt // c == r) & (kt // c == r)).all(), f"stage {stage} piece not local"
                else:
                    assert (~((qt // c == r) & (kt // c == r))).all(), f"stage {stage} piece is local"
                out[r].index_put_((g, qt, kt), torch.ones_like(qt), accumulate=True)
    return out


def _check_plan(mask: AttnSlices, areas: BlockAreas, asg: torch.Tensor, plan: Plan):
    G, P, n, cu = areas.head_groups, areas.cp_size, areas.tiles, areas.chunk
    c = areas.rank_tokens
    S = mask.total_seqlen_q
    assert int(plan.status) & ~IMBALANCED == 0, status_names(int(plan.status))
    m = plan.comm
    # every task on r != host has its needed rows inside the transferred (chunk-local) range
    for g, i, j in (areas.area > 0).nonzero().tolist():
        r = int(asg[g, i, j])
        if r != i // n:
            lo, hi = m.qo_range[g, i, r].tolist()
            qlo, qhi = (x + (i % n) * cu for x in areas.q_need[g, i, j].tolist())
            assert lo <= qlo and qhi <= hi, f"task {(g, i, j)} on {r}: q need {(qlo, qhi)} not in {(lo, hi)}"
        if r != j // n:
            lo, hi = m.kv_range[g, j, r].tolist()
            klo, khi = (x + (j % n) * cu for x in areas.k_need[g, i, j].tolist())
            assert lo <= klo and khi <= hi, f"task {(g, i, j)} on {r}: k need {(klo, khi)} not in {(lo, hi)}"
    # offsets are exclusive prefix sums over (cast stage, host, g, tile); splits are sums over g and tiles.
    # One remote stage: every transfer is in cast 1 (an empty one too: its offset is the running sum);
    # S > 1: a transfer is in the cast of the first sub-stage using it (CommMeta.*_stage), empty ones in none
    for kind in ("qo", "kv"):
        rng, off = getattr(m, f"{kind}_range"), getattr(m, f"{kind}_recv_offset")
        ln = rng[..., 1] - rng[..., 0]
        first = getattr(m, f"{kind}_stage")[..., 0] if m.num_stages > 1 else torch.ones_like(ln)
        assert bool(((first > 0) == (ln > 0)).all()) or m.num_stages == 1, f"{kind}: a cast stage of no rows"
        for d in range(P):
            acc = 0
            for s_ in range(1, m.num_stages + 1):
                for h in range(P):
                    for g in range(G):
                        for t in range(n):
                            if int(first[g, h * n + t, d]) != s_:
                                continue
                            assert int(off[g, h * n + t, d]) == acc
                            acc += int(ln[g, h * n + t, d])
            assert int(getattr(m, f"{kind}_recv_rows")[d]) == acc
        assert_close(f"{kind}_split", ln.sum(0).view(P, n, P).sum(1), getattr(m, f"{kind}_split"))
        hosts = torch.arange(P * n) // n
        assert (ln[:, torch.arange(P * n), hosts] == 0).all(), "a unit travels to its own host"
        inside = (rng[..., 0] >= (torch.arange(P * n) % n * cu).view(1, -1, 1)) \
            & (rng[..., 1] <= (torch.arange(P * n) % n * cu + cu).view(1, -1, 1))
        assert (inside | (ln == 0)).all(), "a range leaves its unit's tile"
    # the metrics count exactly the rows the CommMeta moves
    cost = _config(P, G).cost()
    qo_sent = m.qo_split.sum(1)
    fwd_recv = qo_sent * cost.o_fwd + m.qo_recv_rows * cost.q_fwd + m.kv_recv_rows * cost.kv_fwd
    assert_close("fwd_recv from CommMeta", plan.metrics.fwd_recv, fwd_recv)
    # backward under both protocols: dO, lse, delta (plus Q, K, V when re-cast) out; dQ, dK, dV back
    kv_sent = m.kv_split.sum(1)
    for keep in (True, False):
        cost = _config(P, G, keep_forward_buffers=keep).cost()
        got = plan.metrics if keep else evaluate(areas, asg, cost)
        bwd_send = qo_sent * cost.q_bwd + m.qo_recv_rows * cost.dq_bwd \
            + kv_sent * cost.kv_bwd + m.kv_recv_rows * cost.dkv_bwd
        bwd_recv = qo_sent * cost.dq_bwd + m.qo_recv_rows * cost.q_bwd \
            + kv_sent * cost.dkv_bwd + m.kv_recv_rows * cost.kv_bwd
        assert_close(f"bwd_send from CommMeta (keep={keep})", got.bwd_send, bwd_send)
        assert_close(f"bwd_recv from CommMeta (keep={keep})", got.bwd_recv, bwd_recv)
    # CalcMeta: per rank exactly the mask restricted to its tasks; all ranks: the mask once
    counts = _calc_counts(plan, G, P, c, S)
    oracle = _mask_counts(mask, G)
    blk = torch.arange(S) // cu
    owner = asg.long()[:, blk][:, :, blk]  # [G, S, S] rank of each entry's task
    for r in range(P):
        assert_close(f"rank {r} pieces vs mask on its tasks", torch.where(owner == r, oracle, 0), counts[r])
    assert_close("pieces of all ranks vs mask", oracle, counts.sum(0))


# ---------------------------------------------------------------- decomposition


@settings(max_examples=40, deadline=None)
@given(data=st.data(), S=st.integers(4, 14), P=st.sampled_from([1, 2]))
def test_slice_pieces_partition_slice_in_block(data, S, P):
    S = S - S % P
    c = S // P
    qs = data.draw(st.integers(0, S)); qe = data.draw(st.integers(qs, S))
    ks = data.draw(st.integers(0, S)); ke = data.draw(st.integers(ks, S))
    t = data.draw(st.integers(0, 3))
    T = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    for i in range(P):
        for j in range(P):
            q0, q1, k0, k1, pt, ok = slice_pieces(T(qs), T(qe), T(ks), T(ke), T(t), T(i), T(j), c)
            got = torch.zeros(S, S, dtype=torch.long)
            for p in range(3):
                if ok[p]:
                    piece = _slice_dense(int(q0[p]), int(q1[p]), int(k0[p]), int(k1[p]), int(pt[p]), S)
                    rows = piece.any(1).nonzero().flatten()
                    assert rows.numel() == int(q1[p] - q0[p]), "piece has rows without a valid col"
                    assert piece.any(0).nonzero().flatten().tolist() == list(range(int(k0[p]), int(k1[p]))), \
                        "piece k range is not tight"
                    got += piece.long()
            ref = _slice_dense(qs, qe, ks, ke, t, S).long()
            inblock = torch.zeros(S, S, dtype=torch.long)
            inblock[i * c:(i + 1) * c, j * c:(j + 1) * c] = 1
            assert_close(f"slice {(qs, qe, ks, ke, t)} block {(i, j)}", ref * inblock, got)


def test_slice_pieces_three_way_split():
    """Band q [2, 10) x k [0, 10) BI_CAUSAL (k in [q-2, q]): CAUSAL, BI_CAUSAL, INV_CAUSAL pieces."""
    T = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    q0, q1, k0, k1, pt, ok = slice_pieces(T(2), T(10), T(0), T(10), T(3), T(0), T(0), 10)
    got = [(int(a), int(b), int(x), int(y), int(t)) for a, b, x, y, t, v in zip(q0, q1, k0, k1, pt, ok) if v]
    assert got == [(2, 3, 0, 3, 1), (3, 9, 1, 9, 3), (9, 10, 7, 10, 2)]


# ---------------------------------------------------------------- whole plans


def _random_mask(data, S, G, grouped):
    R = data.draw(st.integers(1, 4))
    shape_g = G if grouped else 1
    rows = []
    for _ in range(shape_g * R):
        qs = data.draw(st.integers(0, S)); qe = data.draw(st.integers(qs, S))
        ks = data.draw(st.integers(0, S)); ke = data.draw(st.integers(ks, S))
        rows.append((qs, qe, ks, ke, data.draw(st.integers(0, 3))))
    tab = torch.tensor(rows, dtype=torch.int32).view(shape_g, R, 5)
    if not grouped:
        tab = tab[0]
    return AttnSlices(tab[..., 0:2].contiguous(), tab[..., 2:4].contiguous(), tab[..., 4].contiguous(), S, S)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), P=st.integers(2, 4), c=st.integers(2, 5), G=st.integers(1, 2), grouped=st.booleans(),
       owner=st.booleans(), seed=st.integers(0, 1000), tiles=st.sampled_from([1, 1, 2, 3]),
       stages=st.sampled_from([1, "auto", 2]))
def test_plan_random_slices(data, P, c, G, grouped, owner, seed, tiles, stages):
    S = P * c * tiles
    mask = _random_mask(data, S, G, grouped)
    areas = block_areas(mask, P, G, impl="torch", tiles=tiles)
    asg = owner_computes_assignment(areas) if owner else _random_assignment(areas, seed)
    plan = build_plan(mask, areas, asg, _config(P, G, chunk_tiles=tiles, num_stages=stages))
    _check_plan(mask, areas, asg, plan)


@pytest.mark.parametrize("stages", [1, "auto"])  # the two-stage layer, and the default's S = 4 sub-stages
@pytest.mark.parametrize("name", ["varlen_causal", "varlen_full", "causal", "window"])
@pytest.mark.parametrize("P,G,tiles", [(3, 2, 1), (4, 1, 1), (2, 2, 2), (2, 1, 4)])
def test_plan_constructor_masks(name, P, G, tiles, stages):
    S = 12 * P // 3 if P == 3 else 16
    mask = {
        "varlen_causal": lambda: varlen_causal_mask([3, 7, 1, S - 11]),
        "varlen_full": lambda: varlen_full_mask([5, S - 9, 4]),
        "causal": lambda: causal_mask(S),
        "window": lambda: sliding_window_mask(S, 3, band_rows=5),
    }[name]()
    # the oracle of this file agrees with the package's own dense rebuild
    assert_close("dense oracle", slices_to_dense(mask).long(), _mask_counts(mask, 1)[0])
    areas = block_areas(mask, P, G, impl="torch", tiles=tiles)
    for asg in (owner_computes_assignment(areas), _random_assignment(areas, 7)):
        plan = build_plan(mask, areas, asg, _config(P, G, chunk_tiles=tiles, num_stages=stages))
        assert plan.num_stages == (1 if stages == 1 else AUTO_STAGES + 1)  # S = 4 and the local tail
        _check_plan(mask, areas, asg, plan)


def test_for_rank_views():
    mask = varlen_causal_mask([5, 9, 2])
    areas = block_areas(mask, 4, 2, impl="torch")
    plan = build_plan(mask, areas, _random_assignment(areas, 3), _config(4, 2))
    v = plan.for_rank(2)
    assert_close("q_ranges", plan.calc.q_ranges[2], v.q_ranges)
    assert_close("send split", plan.comm.qo_split[2], v.qo_send_split)
    assert_close("recv split", plan.comm.kv_split[:, 2], v.kv_recv_split)
    assert_close("send index", plan.comm.send_index("kv", 2), v.kv_send_index)
    with pytest.raises(ValueError, match="kind must be"):
        plan.comm.send_index("q", 0)
    with pytest.raises(ValueError, match="rank must be in"):
        plan.for_rank(4)


# ---------------------------------------------------------------- static shapes, meta device


def _shapes(plan: Plan) -> dict:
    out = {"assignment": plan.assignment.shape, "status": plan.status.shape}
    for part in ("comm", "calc", "metrics"):
        obj = getattr(plan, part)
        for k, v in vars(obj).items():
            if isinstance(v, torch.Tensor):
                out[f"{part}.{k}"] = (v.shape, v.dtype)
    return out


def test_shapes_depend_only_on_config():
    P, G, S = 4, 2, 24
    a = varlen_causal_mask([3, 10, 11], pad_to=5)
    b = varlen_full_mask([1, 2, 3, 4, 14])
    plans = []
    for mask in (a, b):
        areas = block_areas(mask, P, G, impl="torch")
        plans.append(build_plan(mask, areas, _random_assignment(areas, 1), _config(P, G)))
    assert _shapes(plans[0]) == _shapes(plans[1])
    cap = default_stage_capacity(5, G, P)
    assert plans[0].calc.q_ranges.shape == (P, AUTO_STAGES + 2, cap, 2)  # local stage, S = 4 sub-stages, local tail
    worst = G * (S // P) * (P - 1)  # below P = 17 the default capacity is the worst case
    assert plans[0].comm.buffers.as_tuple() == (min(worst, 2 * G * (S // P)), worst, worst, worst)
    for kind in ("qo", "kv"):
        assert plans[0].comm.send_index(kind, 1).shape == (plans[0].comm.buffers.send(kind),)


def test_build_plan_on_meta():
    P, G, c = 4, 2, 6
    mask = varlen_causal_mask([5, 9, 10])
    areas = block_areas(mask, P, G, impl="torch")
    asg = _random_assignment(areas, 0)
    ref = build_plan(mask, areas, asg, _config(P, G))
    meta = lambda t: t.to("meta")  # noqa: E731
    mask_m = AttnSlices(meta(mask.q_ranges), meta(mask.k_ranges), meta(mask.attn_type), 24, 24)
    areas_m = BlockAreas(meta(areas.area), meta(areas.q_need), meta(areas.k_need), c)
    plan = build_plan(mask_m, areas_m, meta(asg), _config(P, G))
    assert plan.status.device.type == "meta"
    assert _shapes(plan) == _shapes(ref)


def test_build_plan_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    P, G, c = 4, 2, 6
    mask = varlen_causal_mask([5, 9, 10])
    areas = block_areas(mask, P, G, impl="torch")
    asg = _random_assignment(areas, 0)
    ref = build_plan(mask, areas, asg, _config(P, G))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor
        mask_f = AttnSlices(fake(mask.q_ranges), fake(mask.k_ranges), fake(mask.attn_type), 24, 24)
        areas_f = BlockAreas(fake(areas.area), fake(areas.q_need), fake(areas.k_need), c)
        plan = build_plan(mask_f, areas_f, fake(asg), _config(P, G))
        assert _shapes(plan) == _shapes(ref)


# ---------------------------------------------------------------- status bits and validate()


def _owner_plan(mask, P, G, **kw):
    areas = block_areas(mask, P, G, impl="torch")
    asg = owner_computes_assignment(areas)
    return areas, asg, build_plan(mask, areas, asg, _config(P, G, **kw.pop("config", {})), **kw)


def test_status_ok_and_imbalanced():
    _, _, plan = _owner_plan(varlen_full_mask([4, 4, 4, 4]), 4, 1)
    assert int(plan.status) == 0
    assert plan.validate() is plan
    assert "status: OK" in plan.summary()
    _, _, plan = _owner_plan(causal_mask(16), 4, 1)
    assert int(plan.status) == IMBALANCED
    with pytest.raises(ValueError, match=r"IMBALANCED: rank 3 .* above imbalance_tol 1.1"):
        plan.validate()
    plan.validate(ignore=IMBALANCED)
    assert "IMBALANCED" in plan.summary()
    _, _, plan = _owner_plan(causal_mask(16), 4, 1, imbalance_tol=2.0)
    assert int(plan.status) == 0


def test_calc_overflow():
    mask = varlen_causal_mask([3, 7, 1, 5])
    areas, asg, plan = _owner_plan(mask, 4, 2, config={"max_stage_slices": 2})
    assert int(plan.status) & CALC_OVERFLOW
    need = plan.calc.needed_rows
    assert (plan.calc.num_rows <= need.clamp(max=2)).all()
    r, s = (need > 2).nonzero()[0].tolist()
    with pytest.raises(ValueError, match=rf"rank {r} stage {s} needs {int(need[r, s])} slice rows, capacity 2: "
                                         r"raise SolverConfig.max_stage_slices"):
        plan.validate(ignore=IMBALANCED)
    # what is kept is still correct: a subset of the full plan's rows
    full = build_plan(mask, areas, asg, _config(4, 2))
    assert (full.calc.needed_rows == need).all() and int(full.status) & CALC_OVERFLOW == 0

    def rows(p, r, s):
        c = p.calc
        n = int(c.num_rows[r, s])
        return set(map(tuple, torch.cat([c.q_ranges[r, s, :n], c.k_ranges[r, s, :n],
                                         c.attn_type[r, s, :n, None]], dim=1).tolist()))
    for r in range(4):
        for s in range(plan.num_stages + 1):
            assert rows(plan, r, s) <= rows(full, r, s)
            assert len(rows(full, r, s)) == int(need[r, s])


def test_buffer_overflow_never_out_of_bounds():
    mask = causal_mask(16)
    areas = block_areas(mask, 4, 2, impl="torch")
    asg = _random_assignment(areas, 5)
    plan = build_plan(mask, areas, asg, _config(4, 2), recv_capacity=3, send_capacity=2)
    assert int(plan.status) & BUFFER_OVERFLOW
    for r in range(4):
        assert plan.comm.send_index("qo", r).shape == (2,)
        assert (plan.comm.send_index("kv", r) < 2 * 4).all()
    limit = 2 * 4 + 3
    assert (plan.calc.q_ranges <= limit).all() and (plan.calc.k_ranges <= limit).all()
    with pytest.raises(ValueError, match=r"BUFFER_OVERFLOW: rank \d receives \d+ (QO|KV) rows, receive capacity 3"):
        plan.validate(ignore=IMBALANCED)


def test_unassigned_and_mismatch():
    mask = varlen_causal_mask([6, 10])
    areas = block_areas(mask, 4, 1, impl="torch")
    asg = owner_computes_assignment(areas).clone()
    asg[0, 2, 1] = -1
    plan = build_plan(mask, areas, asg, _config(4, 1))
    assert int(plan.status) & UNASSIGNED
    with pytest.raises(ValueError, match=r"UNASSIGNED: task \(g=0, i=2, j=1\) has area \d+ but assignment -1"):
        plan.validate(ignore=IMBALANCED)
    # areas of a different mask: pieces fall outside the needs
    other = block_areas(varlen_causal_mask([8, 8]), 4, 1, impl="torch")
    plan = build_plan(mask, other, _random_assignment(other, 2), _config(4, 1))
    assert int(plan.status) & NEED_MISMATCH
    with pytest.raises(ValueError, match="NEED_MISMATCH"):
        plan.validate(ignore=IMBALANCED)


def test_bad_arguments():
    mask = causal_mask(16)
    areas = block_areas(mask, 4, 2, impl="torch")
    asg = owner_computes_assignment(areas)
    with pytest.raises(ValueError, match="assignment must be"):
        build_plan(mask, areas, asg[:1], _config(4, 2))
    with pytest.raises(ValueError, match="config has head_groups=1"):
        build_plan(mask, areas, asg, _config(4, 1))
    with pytest.raises(ValueError, match="max_stage_slices must be a positive int"):
        build_plan(mask, areas, asg, _config(4, 2, max_stage_slices=0))
