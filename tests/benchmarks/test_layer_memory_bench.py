"""benchmarks/layer_memory.py on meta: the fused merge's own peak is its outputs (and the slot table),
the torch path's is more; the rest of the layer's figures do not depend on the merge."""
import pytest
import torch

from gpusolver.capacity import buffer_rows
from tests.benchmarks._load import load_bench


def _load():
    return load_bench("layer_memory.py")


def test_fused_merge_allocates_its_outputs_only():
    lm = _load()
    P, c, Hq, Hkv, D = 4, 512, 16, 4, 64
    shapes = {"tokens_per_rank": c, "num_heads_q": Hq, "num_heads_kv": Hkv, "head_dim": D, "dtype": torch.bfloat16}
    rows = {fused: lm.measure("causal", P, shapes, "meta", fused=fused) for fused in (False, True)}
    config = lm.make_config(P, shapes)
    G = config.head_groups
    N, h = G * c, Hq // G                                   # host rows of a rank, query heads per group
    slots = (P * N * P + 1) * 4 / P                         # the int32 slot table, per rank
    out, lse = N * h * D * 2, N * h * 4                     # the merged O (bf16) and lse (fp32), per rank
    assert rows[True]["fwd_reduce"] == out + lse + slots
    assert rows[True]["bwd_reduce"] == out + slots          # dQ; dK, dV (fewer heads) are smaller
    assert rows[False]["fwd_reduce"] > rows[True]["fwd_reduce"]
    assert rows[False]["bwd_reduce"] > rows[True]["bwd_reduce"]
    for key in ("kept", "plan_kept", "plan_fwd", "plan_bwd"):
        assert rows[False][key] == rows[True][key], key
    assert (rows[False]["fused"], rows[True]["fused"]) == ("no", "yes")


def test_sub_stage_attention_merges_in_its_kernel(monkeypatch):
    """With S > 1 sub-stages the forward's slice kernel merges each stage's result into the fp32
    running out in place (``flex_attn(accumulate=...)``, whose fake on meta allocates nothing): a
    stage kernel that made its out over the operand's rows for a merge to read (the path of a custom
    stage kernel) would raise the peak inside the remote stages by at least that out, one rank's at
    a time under LocalGroup.
    (The peak inside the remote stages, that is: the forward's own peak is in a reduce.)"""
    import gpusolver.runtime.pipelined as pipelined
    from attn_kernels import flex_attn

    lm = _load()
    P, c, Hq, Hkv, D = 4, 512, 16, 4, 64
    shapes = {"tokens_per_rank": c, "num_heads_q": Hq, "num_heads_kv": Hkv, "head_dim": D, "dtype": torch.bfloat16}
    config = lm.make_config(P, shapes, stages=4)
    assert config.num_stages == 4
    fused = lm.measure("causal", P, shapes, "meta", stages=4, breakdown=True)
    monkeypatch.setattr(pipelined, "MERGE_PIECES", 1)
    one_window = lm.measure("causal", P, shapes, "meta", stages=4, breakdown=True)

    def separate(plan, scale, ranks, batched, s, into, *tensors):  # out made, then merged in place
        for r in ranks:
            o, lse = flex_attn(*(t[r] for t in tensors), *pipelined._slices(plan, r, s), scale, validate=False,
                               flag_errors=False)
            pipelined.merge_out_lse_(*(t[r] for t in into), o, lse)
            del o, lse
    monkeypatch.setattr(pipelined, "_flex_into", separate)
    unfused = lm.measure("causal", P, shapes, "meta", stages=4, breakdown=True)

    def merging(row):  # the peak inside the remote stages' attention, all ranks
        return max(v for k, v in row["fwd_ops"].items() if k.startswith("attn/fwd stage") and k != "attn/fwd stage0")
    G = config.head_groups
    rows = G * c + buffer_rows(config, c).recv("qo")       # local and received Q rows of a rank
    assert fused["kept"] == unfused["kept"] and fused["plan_fwd"] == unfused["plan_fwd"]
    # the reduces' gathers of the partials (``_gather_remote``) are windowed by MERGE_PIECES: one window
    # can only raise the forward's peak
    assert fused["fwd_peak"] <= one_window["fwd_peak"]
    assert merging(unfused) - merging(fused) >= rows * (Hq // G) * D * 2


def test_relay_rows_price_the_relay_buffers():
    """``--relay``: the plan.memory columns are ``plan.memory()``'s of the relay plan, which counts the
    hops' buffers (the direct formula of the same plan's buffers counts less), and the layer measured
    allocates at least that much at its forward peak."""
    from gpusolver.capacity import keep_for_budget
    from gpusolver.plan.memory import buffer_memory

    lm = _load()
    P, c, Hq, Hkv, D = 16, 256, 16, 4, 64
    shapes = {"tokens_per_rank": c, "num_heads_q": Hq, "num_heads_kv": Hkv, "head_dim": D, "dtype": torch.bfloat16}
    topology = lm.parse_args([]).topology
    row = lm.measure("causal", P, shapes, "meta", relay=topology)
    config = keep_for_budget(lm.make_config(P, shapes, relay=topology), c)
    plan = lm.shape_plan(lm.make_mask("causal", P, 0, c), config)
    assert row["transport"] == "relay" and plan.relay is not None
    m = plan.memory(config)
    assert (row["plan_kept"], row["plan_fwd"], row["plan_bwd"]) == (m.kept, m.fwd_peak, m.bwd_peak)
    direct = buffer_memory(plan.comm, Hq, Hkv, D, torch.bfloat16, config.keep_forward_buffers)
    assert m.fwd_peak > direct.fwd_peak and m.bwd_peak > direct.bwd_peak and m.kept == direct.kept
    assert row["fwd_peak"] >= m.fwd_peak


def test_cluster_rows_run_the_cluster_defaults():
    """``--cluster``: the layer is built on the topology with the transport and buffers a cluster user
    gets there (direct with sub-stages, capacities sized per P across nodes, smaller than without a
    topology), and the plan.memory columns are that plan's."""
    lm = _load()
    P, c, Hq, Hkv, D = 16, 256, 16, 4, 64
    shapes = {"tokens_per_rank": c, "num_heads_q": Hq, "num_heads_kv": Hkv, "head_dim": D, "dtype": torch.bfloat16}
    topology = lm.parse_args([]).topology
    row = lm.measure("causal", P, shapes, "meta", stages="auto", cluster=topology)
    plain = lm.measure("causal", P, shapes, "meta", stages="auto")
    cfg, cfg_plain = lm.make_config(P, shapes, stages="auto", cluster=topology), lm.make_config(P, shapes, stages="auto")
    assert cfg.topology is not None and not cfg.relays and cfg_plain.topology is None
    assert buffer_rows(cfg, c).as_tuple() != buffer_rows(cfg_plain, c).as_tuple()
    assert row["transport"] == "direct" and row["S"] == plain["S"] > 1
    assert row["plan_fwd"] < plain["plan_fwd"] and row["fwd_peak"] < plain["fwd_peak"]
    assert row["fwd_peak"] >= row["plan_fwd"] and row["bwd_peak"] >= row["plan_bwd"]


def test_one_topology_at_a_time():
    lm = _load()
    shapes = {"tokens_per_rank": 64, "num_heads_q": 4, "num_heads_kv": 2, "head_dim": 16, "dtype": torch.float32}
    with pytest.raises(ValueError, match="one topology at a time"):
        lm.make_config(16, shapes, relay="h200_hgx", cluster="h200_hgx")
