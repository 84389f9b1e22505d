"""Baseline volume formulas against hand-computed cases and each other."""
import pytest
import torch

from gpusolver.baselines import (
    BaselineVolumes, all_gather_kv, baseline_table, owner_computes, ring_attention, ulysses_degree, usp,
)
from gpusolver.config import SolverConfig
from gpusolver.problem import CommCost
from tests.gpusolver.test_metrics import areas_from_dense


def dims(S, P, Hq, Hkv, D=2, b=2):
    return dict(seqlen=S, cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype_bytes=b)


def test_ring_hand_case():
    # P=2, S=8 -> c=4; kv = 2 * 1 * 2 * 2 = 8 bytes per token; one shard of 4 tokens moves
    v = ring_attention(**dims(8, 2, 2, 1))
    assert v.fwd_bottleneck == 32 and v.bwd_bottleneck == 64
    assert v.fwd_send == v.fwd_recv == [32, 32] and v.bwd_send == v.bwd_recv == [64, 64]
    # P=4, S=16 -> c=4, 3 shards
    v = ring_attention(**dims(16, 4, 2, 1))
    assert (v.fwd_bottleneck, v.bwd_bottleneck) == (96, 192)
    assert ring_attention(**dims(8, 1, 2, 1)).fwd_bottleneck == 0


@pytest.mark.parametrize("S,P,Hq,Hkv", [(8, 2, 2, 1), (48, 6, 8, 4), (64, 16, 64, 8), (7, 7, 3, 3)])
def test_ring_equals_all_gather(S, P, Hq, Hkv):
    assert ring_attention(**dims(S, P, Hq, Hkv)) == all_gather_kv(**dims(S, P, Hq, Hkv))


def test_ulysses_degree():
    assert ulysses_degree(8, 16) == 8
    assert ulysses_degree(8, 4) == 4
    assert ulysses_degree(8, 12) == 4
    assert ulysses_degree(12, 8) == 4
    assert ulysses_degree(6, 8) == 2
    assert ulysses_degree(1, 8) == 1
    assert ulysses_degree(16, 64) == 8


def test_usp_hand_cases():
    # Hq=4, Hkv=2, D=2, b=2, P=2, S=8: u=2, r=1, c=4; q = 16, kv = 16 bytes per token
    # fwd = 1/2 * 4 * (16 + 16 + 16) = 96, no ring; bwd = 1/2 * 4 * (dO + dQ + dK dV) = 96
    v = usp(**dims(8, 2, 4, 2))
    assert (v.fwd_bottleneck, v.bwd_bottleneck) == (96, 96)
    # Hq=16, Hkv=8, D=1, b=1, P=16, S=32: u=8, r=2, c=2; q = 16, kv = 16
    # a2a = 7/8 * 2 * (16 + 16 + 16) = 84; ring = 1 * 2 * 16 = 32
    v = usp(**dims(32, 16, 16, 8, D=1, b=1))
    assert (v.fwd_bottleneck, v.bwd_bottleneck) == (84 + 32, 84 + 64)
    assert v.fwd_send == [116] * 16


@pytest.mark.parametrize("S,P,Hq,Hkv", [(16, 4, 4, 1), (60, 6, 6, 3), (64, 8, 8, 8)])
def test_usp_degree_one_is_ring(S, P, Hq, Hkv):
    assert usp(**dims(S, P, Hq, Hkv), degree=1) == ring_attention(**dims(S, P, Hq, Hkv))


def test_usp_bad_degree():
    with pytest.raises(ValueError, match="degree=3"):
        usp(**dims(16, 4, 8, 4), degree=3)
    with pytest.raises(ValueError, match="divisible"):
        ring_attention(**dims(10, 4, 8, 4))


@pytest.mark.parametrize("G", [1, 2])
def test_owner_computes_full_mask_vs_ring(G):
    # a full mask needs every KV chunk everywhere: owner-computes moves what ring moves forward;
    # backward, re-cast K, V make it ring's bytes, kept K, V leave only dK, dV (half of them)
    S, P, Hq, Hkv, D = 12, 3, 4, 2, 2
    areas = areas_from_dense(torch.ones(G, S, S, dtype=torch.bool), P)
    ring = ring_attention(**dims(S, P, Hq, Hkv, D))
    assert owner_computes(areas, CommCost(Hq, Hkv, D, 2, G, keep_forward_buffers=False)) == ring
    oc = owner_computes(areas, CommCost(Hq, Hkv, D, 2, G))
    assert (oc.fwd_send, oc.fwd_recv, oc.fwd_bottleneck) == (ring.fwd_send, ring.fwd_recv, ring.fwd_bottleneck)
    assert oc.bwd_send == oc.bwd_recv == ring.fwd_send and 2 * oc.bwd_bottleneck == ring.bwd_bottleneck


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recast"])
def test_owner_computes_causal_hand_case(keep):
    # causal, P=2, c=4, G=1: rank 1 needs all of KV chunk 0; rank 0 needs nothing remote
    S, P = 8, 2
    areas = areas_from_dense(torch.ones(1, S, S, dtype=torch.bool).tril(), P)
    oc = owner_computes(areas, CommCost(2, 1, 2, 2, 1, keep_forward_buffers=keep))  # kv_fwd = 8
    assert oc.fwd_send == [32, 0] and oc.fwd_recv == [0, 32]
    if keep:  # dK, dV of 4 tokens back 1 -> 0, nothing out
        assert oc.bwd_send == [0, 32] and oc.bwd_recv == [32, 0]
    else:  # K, V out again as well
        assert oc.bwd_send == [32, 32] and oc.bwd_recv == [32, 32]
    assert (oc.fwd_bottleneck, oc.bwd_bottleneck) == (32, 32)


def test_baseline_table():
    P, S = 4, 32
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2, head_dim=4, dtype=torch.float16)
    areas = areas_from_dense(torch.ones(config.head_groups, S, S, dtype=torch.bool).tril(), P)
    table = baseline_table(areas, config)
    assert set(table) == {"owner_computes", "ring", "all_gather_kv", "usp"}
    for name, row in table.items():
        assert isinstance(row["fwd_bottleneck"], int) and isinstance(row["bwd_bottleneck"], int), name
        assert len(row["fwd_send"]) == P, name
    kv = 2 * 2 * 4 * 2
    assert table["ring"]["fwd_bottleneck"] == 3 * 8 * kv
    assert table["usp"] == usp(**dims(S, P, 8, 2, D=4, b=2)).to_dict()
    # causal owner-computes: the last rank receives the 3 earlier KV chunks, like ring
    assert table["owner_computes"]["fwd_bottleneck"] == table["ring"]["fwd_bottleneck"]
    assert table["owner_computes"]["fwd_recv"] == [0, 8 * kv, 16 * kv, 24 * kv]
    # kept buffers (default): owner-computes moves dK, dV back only; the last rank sends 24 chunks' worth
    assert table["owner_computes"]["bwd_send"] == [0, 8 * kv, 16 * kv, 24 * kv]
    assert table["owner_computes"]["bwd_recv"] == [24 * kv, 16 * kv, 8 * kv, 0]
    # re-cast: K, V out again; the closed-form schemes keep their own protocols
    recast = baseline_table(areas, SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2, head_dim=4,
                                                dtype=torch.float16, keep_forward_buffers=False))
    assert recast["owner_computes"]["bwd_send"] == [24 * kv, 24 * kv, 24 * kv, 24 * kv]
    assert {k: v for k, v in recast.items() if k != "owner_computes"} == \
        {k: v for k, v in table.items() if k != "owner_computes"}
    with pytest.raises(ValueError, match="cp_size"):
        baseline_table(areas, SolverConfig(cp_size=2, num_heads_q=8, num_heads_kv=2))
    with pytest.raises(ValueError, match="keep_forward_buffers"):
        SolverConfig(cp_size=P, keep_forward_buffers=None)


def test_uniform():
    v = BaselineVolumes.uniform(3, 5, 7)
    assert v.to_dict()["bwd_recv"] == [7, 7, 7] and v.fwd_bottleneck == 5
