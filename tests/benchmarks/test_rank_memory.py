"""benchmarks/rank_memory.py: one rank of a cluster layer on ``TorchGroup`` through a fake process group.

The kept bytes are checked exactly against the plan: a rank keeps its out and lse, its local Q, K, V
rows and the received rows its share of the budget's room holds (``kept_per_rank``: its Q rows up to
the room, then its K, V rows in what is left), at this rank's fill (what it received), not at the
capacity."""
import torch
import torch.distributed as dist

from dataclasses import replace

from gpusolver.problem import split_kept_room
from gpusolver.topology import h200_hgx
from tests.benchmarks._load import load_bench

SHAPES = {"tokens_per_rank": 256, "num_heads_q": 16, "num_heads_kv": 4, "head_dim": 64, "dtype": torch.bfloat16}


def test_a_rank_keeps_its_fill_and_the_fakes_are_undone():
    rm = load_bench("rank_memory.py")
    import gpusolver.runtime.pipelined as pipelined

    P = 8  # two nodes of 4: the layer a cluster user runs, at a solve this test can afford
    plan, config = rm.solved_plan("causal", P, 0, SHAPES, replace(h200_hgx, ranks_per_node=4, nics_per_node=4, name="nodes of 4"))
    assert config.topology is not None and plan.relay is None and config.num_stages > 1  # the cluster default
    assert config.keep_forward_buffers is True and config.kept_q_rows > 0 and config.kept_kv_rows == 0  # the budget's
    assert config.kept_per_rank  # one room, split per rank
    ranks = rm.busiest_ranks(plan, 2)
    received = plan.pair_bytes("fwd").sum(0)
    assert received[ranks[0]] == received.max() and len(set(ranks)) == 2
    c, Hq, Hkv, D, b = 256, 16, 4, 64, 2
    G = config.head_groups
    n = G * c
    cap = plan.comm.buffers.recv("kv")
    for rank in ranks:
        fill = int(plan.comm.kv_split[:, rank].sum())           # KV rows this rank receives, all casts
        fill_q = int(plan.comm.qo_split[:, rank].sum())         # and Q rows
        assert 0 < fill <= cap and fill_q > 0
        row = rm.measure_rank(plan, config, SHAPES, rank)
        # the local rows, and the received rows this rank's share of the room keeps, at most its fill
        q_row, kv_row = (Hq // G) * D * b, 2 * (Hkv // G) * D * b
        room = config.kept_q_rows * q_row + config.kept_kv_rows * kv_row
        kq, kk = split_kept_room(fill_q, fill, room, q_row, kv_row)
        own = c * Hq * D * b + c * Hq * 4                       # out, lse
        want = own + n * (q_row + kv_row) + kq * q_row + kk * kv_row
        assert row["kept"] == want, (rank, row["kept"], want)
        # beside what autograd saves the forward leaves alive only the group's host copy of the
        # 4 S split matrices ([4 S, P, P] int64, CPU; S the plan's sub-stages, the local tail's too) and the
        # room's [P] row counts
        S = plan.num_stages
        assert 0 < row["unsaved"] <= 4 * S * P * P * 8 + 2 * P * 8, row["unsaved"]
        assert row["fwd_peak"] > 0 and row["bwd_peak"] > 0
        # sends that land by the next collective are dropped then: the same kept bytes, never a
        # higher transient peak, and a lower one in at least one pass (held, every send buffer of
        # the pass is live at its end)
        landed = rm.measure_rank(plan, config, SHAPES, rank, sends="landed")
        assert landed["kept"] == row["kept"]
        assert landed["fwd_peak"] <= row["fwd_peak"] and landed["bwd_peak"] <= row["bwd_peak"]
        assert landed["fwd_peak"] + landed["bwd_peak"] < row["fwd_peak"] + row["bwd_peak"], (row, landed)
    assert not dist.is_initialized()
    assert pipelined.flex_attn.__name__ == "flex_attn"  # the fakes are gone
    assert dist.batch_isend_irecv.__name__ == "batch_isend_irecv"
    try:
        with rm.fake_rank(0, P, sends="soon"):
            raise AssertionError("unreachable")
    except ValueError as e:
        assert "sends" in str(e) and "'soon'" in str(e)
    assert not dist.is_initialized()


def test_other_executors_are_refused_by_name():
    """The fakes stand in for the sub-stage executor's kernels: a one-stage plan would run the real
    kernels at real shapes, so it is refused with the offending value."""
    import pytest

    from gpusolver import SolverConfig, solve
    from gpusolver.masks import causal_mask

    rm = load_bench("rank_memory.py")
    config = SolverConfig(cp_size=4, num_heads_q=8, num_heads_kv=2, head_dim=32, dtype=torch.bfloat16, num_stages=1)
    plan = solve(causal_mask(4 * 32), config)
    with pytest.raises(ValueError, match="num_stages = 1"):
        rm.measure_rank(plan, config, dict(SHAPES, tokens_per_rank=32, num_heads_q=8, num_heads_kv=2, head_dim=32), 0)
    assert not dist.is_initialized()
