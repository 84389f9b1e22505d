"""Arguments of the wrong kind at the public entry points (docs/api.md): each is refused at the
boundary with a TypeError or ValueError naming the argument and the value, where it once ended in
an AttributeError, an IndexError or a failure inside torch.load or float().

The companion of test_bad_inputs.py (shapes, dtypes, ranges, capacities) and
tests/gpusolver/test_config.py (SolverConfig's fields).
"""
import pytest
import torch

from attn_kernels import flex_attn, merge_out_lse
from gpusolver import SolverConfig, block_areas, solve, solve_assignment
from gpusolver.masks import causal_mask, varlen_causal_mask
from gpusolver.masks.sparse import TokenTopKMask
from gpusolver.packing import document_mask, pack
from gpusolver.plan import Plan
from gpusolver.runtime import DynamicCPAttention, dist_attn, shard, unshard
from gpusolver.runtime.sparse_attn import solve_sparse_sharded, sparse_dist_attn
from groupcomm import LocalGroup
from tests.reliability._cases import D, qkv, quiet

P, c = 2, 16


def _named(info, *parts) -> None:
    msg = str(info.value)
    for part in parts:
        assert part in msg, (part, msg)


@pytest.fixture(scope="module")
def layer_case():
    """A 4:2 layer at P = 2, c = 16: config, plan, group and the q, k, v shards."""
    config = SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=2, head_dim=D, dtype=torch.float32)
    with quiet():
        plan = solve(causal_mask(P * c), config, solver="reference")
    group = LocalGroup(P)
    q, k, v = (shard(x, group) for x in qkv(P * c, P * c, 4, 2))
    return config, plan, group, q, k, v


@pytest.mark.parametrize("bad", [None, {"cp_size": 2}, 2], ids=["None", "dict", "int"])
def test_config_of_the_wrong_type(bad, layer_case):
    config, plan, group, *_ = layer_case
    mask = causal_mask(P * c)
    sparse = TokenTopKMask(torch.tensor([[0, -1]] * (P * c), dtype=torch.int32), P * c)
    calls = [lambda: solve(mask, bad), lambda: solve_assignment(block_areas(mask, P, 2), bad),
             lambda: solve_sparse_sharded(sparse, bad, group), lambda: DynamicCPAttention(group, bad),
             lambda: plan.memory(bad)]
    for call in calls:
        with pytest.raises(TypeError) as info:
            call()
        _named(info, "config must be a gpusolver.SolverConfig", type(bad).__name__, repr(bad))
    with pytest.raises(TypeError) as info:
        solve_assignment(None, config)
    _named(info, "areas must be a BlockAreas", "NoneType")


def test_layer_inputs_that_are_not_tensors(layer_case):
    config, plan, group, q, k, v = layer_case
    for args, name in (((None, k, v), "q"), ((q, k.tolist(), v), "k"), ((q, k, "v"), "v")):
        with pytest.raises(TypeError) as info:
            dist_attn(*args, plan, group)
        _named(info, f"{name} must be a torch.Tensor", type(args["qkv".index(name)]).__name__)
    layer = DynamicCPAttention(group, config, solver="reference")
    with pytest.raises(TypeError) as info:
        layer(None, k, v, causal_mask(P * c))
    _named(info, "q must be a torch.Tensor, got NoneType")
    sparse = TokenTopKMask(torch.tensor([[0, -1]] * (P * c), dtype=torch.int32), P * c)
    with quiet():
        sparse_plan = solve_sparse_sharded(sparse, config, group, solver="reference")
    with pytest.raises(TypeError) as info:
        sparse_dist_attn(q, k, v, None, sparse_plan, group)
    _named(info, "sel must be a torch.Tensor, got NoneType")
    # the kernels' own entry points
    q0, k0, v0 = qkv(8, 8)
    ranges = torch.tensor([[0, 8]], dtype=torch.int32)
    with pytest.raises(TypeError) as info:
        flex_attn(q0, k0, v0, [[0, 8]], ranges, torch.ones(1, dtype=torch.int32))
    _named(info, "q_ranges must be a torch.Tensor, got list")
    with pytest.raises(TypeError) as info:
        merge_out_lse(None, None, q0, q0[..., 0])
    _named(info, "out_a must be a torch.Tensor, got NoneType")


def test_layer_rank_is_checked_before_the_heads(layer_case):
    """[P, c, H] (D dropped) once read as "q has 16 heads"."""
    config, _, group, q, k, v = layer_case
    layer = DynamicCPAttention(group, config, solver="reference")
    with pytest.raises(ValueError) as info:
        layer(q[..., 0], k, v, causal_mask(P * c))
    _named(info, "q must be [P, c, H, D]", "(2, 16, 4)")


@pytest.mark.parametrize("scale", ["x", [0.1], float("inf")], ids=["str", "list", "inf"])
def test_softmax_scale_is_named(scale, layer_case):
    config, plan, group, q, k, v = layer_case
    calls = [lambda: dist_attn(q, k, v, plan, group, softmax_scale=scale),
             lambda: DynamicCPAttention(group, config, softmax_scale=scale),  # at construction
             lambda: flex_attn(*qkv(8, 8), torch.tensor([[0, 8]], dtype=torch.int32),
                               torch.tensor([[0, 8]], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                               softmax_scale=scale)]
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        _named(info, "softmax_scale must be > 0", repr(scale))


@pytest.mark.parametrize("kw,error,parts", [
    (dict(solver="fast"), ValueError, ("solver must be one of", "'fast'")),
    (dict(impl="cuda"), ValueError, ("impl must be one of", "'cuda'")),
    (dict(plan_cache=3), TypeError, ("plan_cache must be a PlanCache or None", "int")),
], ids=["solver", "impl", "plan_cache"])
def test_layer_options_checked_at_construction(kw, error, parts, layer_case):
    """Once accepted, then failing at the first forward (plan_cache: an AttributeError there)."""
    config, _, group, *_ = layer_case
    with pytest.raises(error) as info:
        DynamicCPAttention(group, config, **kw)
    _named(info, *parts)


def test_layer_mask_and_plan_types(layer_case):
    config, _, group, q, k, v = layer_case
    layer = DynamicCPAttention(group, config, solver="reference")
    with pytest.raises(TypeError) as info:
        layer(q, k, v, [16, 16])
    _named(info, "mask must be an AttnSlices", "got list")
    with pytest.raises(TypeError) as info:
        layer(q, k, v, plan="plan.pt")
    _named(info, "plan must be a Plan", "got str")


def test_shard_and_unshard_arguments():
    group = LocalGroup(P)
    x = torch.zeros(8, 3)
    with pytest.raises(TypeError) as info:
        shard([1, 2], group)
    _named(info, "shard: x must be a torch.Tensor, got list")
    with pytest.raises(ValueError) as info:
        shard(x, group, dim=5)
    _named(info, "shard: dim=5 must be an int in [-2, 2)", "(8, 3)")
    with pytest.raises(ValueError) as info:
        unshard(shard(x, group), group, dim=2)   # [P, 4, 3]: dim indexes the [4, 3] chunk
    _named(info, "unshard: dim=2 must be an int in [-2, 2)", "(2, 4, 3)")
    assert torch.equal(unshard(shard(x, group, dim=-2), group, dim=-2), x)   # negative dims stay valid


def test_plan_files_and_plan_methods(tmp_path, layer_case):
    config, plan, *_ = layer_case
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(ValueError) as info:        # was a KeyError from inside torch's unpickler
        Plan.load(text)
    _named(info, str(text), "is not a saved gpusolver plan")
    with pytest.raises(TypeError) as info:
        Plan.load(None)
    _named(info, "path must be a str or os.PathLike", "None")
    plan.save(tmp_path / "p.pt", config=config)
    with pytest.raises(ValueError) as info:
        Plan.load(tmp_path / "p.pt", map_location="tpu")
    _named(info, "map_location='tpu' is not a torch device")
    with pytest.raises(FileNotFoundError, match="missing.pt"):   # the OS's error, naming the path
        Plan.load(tmp_path / "missing.pt")
    with pytest.raises(TypeError) as info:
        plan.save(tmp_path / "q.pt", config="config")
    _named(info, "config must be a SolverConfig or None", "'config'")
    with pytest.raises(TypeError) as info:
        plan.for_rank("0")
    _named(info, "rank must be an int", "'0'")
    assert plan.for_rank(torch.tensor(1)).rank == 1
    with pytest.raises(TypeError) as info:
        plan.validate(ignore="IMBALANCED")
    _named(info, "ignore must be an int", "'IMBALANCED'")


@pytest.mark.parametrize("bad", [None, 8], ids=["None", "int"])
def test_document_lengths_that_are_not_a_sequence(bad):
    calls = [lambda: varlen_causal_mask(bad), lambda: document_mask(bad)]
    if bad is not None:  # pack(doc_lengths=None) is "pass exactly one of doc_lengths= and cu_seqlens="
        calls.append(lambda: pack(torch.arange(8), bad, group=LocalGroup(P)))
    for call in calls:
        with pytest.raises(TypeError) as info:
            call()
        _named(info, "doc_lengths must be a sequence of positive ints", repr(bad))


def test_document_mask_takes_a_tensor_as_varlen_causal_mask_does():
    """list() of a tensor gave 0-dim tensors, refused as 'doc_lengths[0] = tensor(5) must be a positive int'."""
    got = document_mask(torch.tensor([5, 3]))
    assert torch.equal(got.q_ranges, varlen_causal_mask([5, 3]).q_ranges)
