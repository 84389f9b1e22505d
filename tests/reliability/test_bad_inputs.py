"""The bad-input table (README, "Reliability"): one test per row.

Validation mode (``validate=True``, the default for CPU tensors) must raise a
ValueError at once that names the argument and the value. Sync-free mode
(``validate=False``, the GPU default) must not read the device: value errors
become device flags that one ``check_errors()`` reports, with the op, the
argument and the row; the call itself returns without touching memory
outside its tensors. Shape, dtype, device and configuration errors are
host metadata: they raise at once in both modes (no sync needed). Never a
crash deep in a kernel, a hang, or a quietly wrong result.
"""
import pytest
import torch

from attn_kernels import flex_attn, flex_attn_backward, merge_out_lse, merge_out_lse_, row_delta
from gpusolver import SolverConfig, block_areas, check_errors, errors, solve
from gpusolver.__main__ import main as cli_main
from gpusolver.masks import causal_mask, varlen_causal_mask
from gpusolver.masks.sparse import BlockSparseMask, TokenTopKMask
from gpusolver.masks.validation import validate_slices
from gpusolver.runtime import DynamicCPAttention, dist_attn, shard
from groupcomm import LocalGroup, group_cast, group_reduce
from tests._testing import assert_close
from tests.reliability._cases import D, clean_flags, flagged, qkv, quiet, slices


@pytest.fixture(autouse=True)
def _flags():
    with clean_flags():
        yield


def _ranges(rows):
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


# ------------------------------------------------------------------ wrong dtype, rank, shape, device


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.randn(8, 2, D, dtype=torch.float64)), r"q must be fp16, bf16 or fp32, got torch.float64"),
    (dict(v=torch.randn(8, 1, D).half()), r"v is torch.float16 on cpu; q is torch.float32"),
    (dict(q_ranges=torch.zeros(1, 2)), r"q_ranges must be int32 \(or int64\), got torch.float32"),
    (dict(q=torch.randn(8, 2 * D)), r"q must be \[T, H, D\], got shape \(8, 64\)"),
    (dict(k=torch.randn(8, 1, D), v=torch.randn(9, 1, D)), r"k \(8, 1, 32\) and v \(9, 1, 32\)"),
    (dict(attn_type=torch.zeros(2, dtype=torch.int32)), r"attn_type must be \[R\] = \[1\], got \(2,\)"),
    (dict(k_ranges=torch.zeros(1, 3, dtype=torch.int32)), r"k_ranges shape \(1, 3\) must equal"),
], ids=["dtype-q", "dtype-mixed", "dtype-ranges", "rank-q", "shape-kv", "shape-type", "shape-ranges"])
@pytest.mark.parametrize("validate", [True, False], ids=["validate", "sync-free"])
def test_wrong_dtype_rank_shape(change, match, validate):
    args = dict(zip(("q", "k", "v"), qkv(8, 8)))
    args.update(zip(("q_ranges", "k_ranges", "attn_type"), _ranges([(0, 8, 0, 8, 1)])))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        flex_attn(**args, validate=validate)


@pytest.mark.parametrize("what", ["q", "k", "v", "ranges"])
def test_inputs_on_different_devices(what):
    """q, k, v (and the ranges) on different devices: 'meta' stands in for a second device here."""
    q, k, v = qkv(8, 8)
    qr, kr, t = _ranges([(0, 8, 0, 8, 1)])
    if what == "ranges":
        kr = kr.to("meta")
        match = r"k_ranges is on meta but q is on cpu"
    else:
        moved = {"q": q, "k": k, "v": v}[what].to("meta")
        q, k, v = (moved if name == what else x for name, x in zip("qkv", (q, k, v)))
        match = r"(k|v) is torch.float32 on (meta|cpu); q is torch.float32 on (cpu|meta): they must match"
    with pytest.raises(ValueError, match=match):
        flex_attn(q, k, v, qr, kr, t)


def test_layer_inputs_checked_against_the_plan():
    """dist_attn: shapes against the plan, dtypes and devices against q (host metadata only)."""
    P, c = 2, 16
    config = SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=2, head_dim=D, dtype=torch.float32)
    with quiet():
        plan = solve(causal_mask(P * c), config, solver="reference")
    group = LocalGroup(P)
    q, k, v = (shard(x, group) for x in qkv(P * c, P * c, 4, 2))
    with pytest.raises(ValueError, match=r"q holds 8 tokens per rank but the plan has c = S / P = 16"):
        dist_attn(q[:, :8], k[:, :8], v[:, :8], plan, group)
    with pytest.raises(ValueError, match=r"k \(2, 16, 2, 32\) and v \(2, 16, 2, 16\)"):
        dist_attn(q, k, v[..., :16], plan, group)
    with pytest.raises(ValueError, match="v is bfloat16 on cpu but q is float32 on cpu: q, k and v must share dtype and device"):
        dist_attn(q, k, v.bfloat16(), plan, group)
    with pytest.raises(ValueError, match=r"the plan is for P = 2 ranks but the group has 4"):
        dist_attn(q, k, v, plan, LocalGroup(4))
    with pytest.raises(ValueError, match=r"q must be \[P, c, H, D\] with P = 2"):
        dist_attn(q[0], k, v, plan, group)


def test_layer_config_checked_at_the_call():
    """DynamicCPAttention: the head dim at construction, head counts against q and k at the call,
    each naming the config field and both values; dist_attn names the sparse entry points."""
    P, c = 2, 16
    group = LocalGroup(P)
    with pytest.raises(ValueError, match=r"config.head_dim=48 is not a head dim of the attention kernels "
                                         r"\(16, 32, 64, 128\)"):
        DynamicCPAttention(group, SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=2, head_dim=48))
    q, k, v = (shard(x, group) for x in qkv(P * c, P * c, 4, 2))  # a 4:2 model
    for hq, hkv, match in ((8, 2, r"q has 4 heads but config.num_heads_q=8"),
                           (4, 1, r"k has 2 heads but config.num_heads_kv=1")):
        layer = DynamicCPAttention(group, SolverConfig(cp_size=P, num_heads_q=hq, num_heads_kv=hkv, head_dim=D,
                                                       dtype=torch.float32), solver="reference")
        with pytest.raises(ValueError, match=match):
            layer(q, k, v, causal_mask(P * c))
    sparse_mask = TokenTopKMask(torch.tensor([[0, -1]] * (P * c), dtype=torch.int32), P * c)
    from gpusolver.runtime.sparse_attn import solve_sparse_sharded

    with quiet():
        sparse_plan = solve_sparse_sharded(sparse_mask, SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=2,
                                                                     head_dim=D), group, solver="reference")
    with pytest.raises(TypeError, match=r"plan must be a Plan .*got SparsePlan .*sparse_dist_attn or "
                                        r"DynamicCPAttention"):
        dist_attn(q, k, v, sparse_plan, group)
    with pytest.raises(TypeError, match=r"group must be a groupcomm group .* or a torch.distributed "
                                        r"ProcessGroup, got str"):
        DynamicCPAttention("world", SolverConfig(cp_size=P, num_heads_q=4, num_heads_kv=2, head_dim=D))


def _process_group_rank(rank, P):
    """A plain torch.distributed group (the world) in place of a groupcomm one: same result as TorchGroup."""
    import torch.distributed as torch_dist
    from groupcomm import TorchGroup

    c = 8
    config = SolverConfig(cp_size=P, num_heads_q=2, num_heads_kv=1, head_dim=D, dtype=torch.float32)
    mask = varlen_causal_mask([5, 7, 4])
    q, k, v = (x[rank * c:(rank + 1) * c] for x in qkv(P * c, P * c))
    with quiet():
        plan = solve(mask, config, solver="reference")
    plain = DynamicCPAttention(torch_dist.group.WORLD, config)(q, k, v, plan=plan)
    wrapped = DynamicCPAttention(TorchGroup(), config)(q, k, v, plan=plan)
    direct, _ = dist_attn(q, k, v, plan, torch_dist.group.WORLD)
    return torch.equal(plain, wrapped) and torch.equal(direct, wrapped)


def test_plain_process_group_is_accepted():
    from tests._dist import run_ranks

    assert run_ranks(_process_group_rank, 2) == [True, True]


def test_mask_tensors_dtype_shape_device():
    good = torch.tensor([[0, 8]], dtype=torch.int32)
    from gpusolver.masks import AttnSlices
    with pytest.raises(ValueError, match="q_ranges must be int32 or int64, got torch.float32"):
        AttnSlices(good.float(), good, torch.zeros(1, dtype=torch.int32), 8, 8)
    with pytest.raises(ValueError, match=r"attn_type shape \(2,\) must be q_ranges.shape\[:-1\] = \(1,\)"):
        AttnSlices(good, good, torch.zeros(2, dtype=torch.int32), 8, 8)
    with pytest.raises(ValueError, match="must share a device"):
        AttnSlices(good, good.to("meta"), torch.zeros(1, dtype=torch.int32), 8, 8)
    with pytest.raises(ValueError, match="total_seqlen_k must be a positive int, got 0"):
        AttnSlices(good, good, torch.zeros(1, dtype=torch.int32), 8, 0)


# ------------------------------------------------------------------ non-contiguous inputs


def test_non_contiguous_inputs_give_the_contiguous_result():
    """Non-contiguous q, k, v and ranges are accepted and give the same bits (copied, not misread)."""
    q, k, v = qkv(16, 16, 2, 2)
    qr, kr, t = _ranges([(0, 16, 0, 16, 1), (0, 0, 0, 0, 0)])
    ref = flex_attn(q, k, v, qr, kr, t)
    qn = q.transpose(0, 1).contiguous().transpose(0, 1)               # same values, other strides
    kn = torch.cat([k, k], dim=2)[:, :, :D]                           # a strided slice
    vn = v.transpose(1, 2).contiguous().transpose(1, 2)
    table = torch.cat([qr, kr], 1).t().contiguous().t()               # [R, 4], column-major
    assert not (qn.is_contiguous() or kn.is_contiguous() or vn.is_contiguous() or table[:, :2].is_contiguous())
    got = flex_attn(qn, kn, vn, table[:, :2], table[:, 2:], t[::1])
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    # the collectives: non-contiguous rows travel like contiguous ones
    P = 2
    split = torch.tensor([[1, 2], [3, 0]])
    index = torch.tensor([[0, 1, 2, -1], [0, 1, 3, -1]])
    rows = torch.randn(P, 4, 3, 2)
    (a,) = group_cast([rows], index, split, 4, LocalGroup(P))
    (b,) = group_cast([rows.transpose(2, 3).contiguous().transpose(2, 3)], index, split, 4, LocalGroup(P))
    assert torch.equal(a, b)
    # an in-place merge cannot write through a non-contiguous accumulator: refused by name
    out, lse = torch.randn(4, 2, D), torch.randn(4, 2)
    with pytest.raises(ValueError, match="out_acc and lse_acc must be contiguous"):
        merge_out_lse_(out.transpose(0, 1).contiguous().transpose(0, 1), lse, out, lse)


# ------------------------------------------------------------------ ranges reversed, negative or past S; bad types


BAD_RANGES = [
    ([(0, 8, 0, 8, 1), (5, 3, 0, 8, 0)], r"q_ranges\[1\] = \[5, 3\)"),
    ([(0, 8, -2, 8, 0)], r"k_ranges\[0\] = \[-2, 8\)"),
    ([(0, 8, 0, 99, 0)], r"k_ranges\[0\] = \[0, 99\) must satisfy 0 <= start <= end <= (Tk = )?64"),
    ([(0, 70, 0, 8, 0)], r"q_ranges\[0\] = \[0, 70\) must satisfy 0 <= start <= end <= (Tq = )?64"),
    ([(0, 8, 0, 8, 1), (8, 16, 8, 16, 7)], r"attn_type\[1\] = 7 must be 0 FULL"),
    ([(0, 8, 0, 8, -1)], r"attn_type\[0\] = -1 must be 0 FULL"),
]
RANGE_IDS = ["reversed", "negative", "past-Tk", "past-Tq", "type-7", "type-neg"]


@pytest.mark.parametrize("rows,match", BAD_RANGES, ids=RANGE_IDS)
def test_kernel_ranges_and_types(rows, match):
    q, k, v = qkv(64, 64)
    sl = _ranges(rows)
    with pytest.raises(ValueError, match=match):             # validation: at once, row-precise
        flex_attn(q, k, v, *sl, validate=True)
    out, lse = flex_attn(q, k, v, *sl, validate=False)        # sync-free: returns, bounded, flags
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    msg = flagged(r"flex_attn: " + match)
    assert "device error flag" in msg
    # the backward too
    dout, delta = torch.randn_like(q), torch.zeros(64, 2)
    with pytest.raises(ValueError, match=match):
        flex_attn_backward(dout, q, k, v, lse, delta, *sl, validate=True)
    flex_attn_backward(dout, q, k, v, lse, delta, *sl, validate=False)
    flagged(r"flex_attn_backward: " + match)


SOLVE_BAD = [
    ([(0, 8, 0, 8, 1), (12, 9, 8, 16, 1)], r"q_ranges row 1: start 12 > end 9"),
    ([(0, 8, 0, 8, 1), (8, 16, -1, 16, 0)], r"k_ranges row 1: \[-1, 16\) is outside \[0, total_seqlen_k=16\)"),
    ([(0, 8, 0, 8, 1), (8, 16, 8, 17, 1)], r"k_ranges row 1: \[8, 17\) is outside \[0, total_seqlen_k=16\)"),
    ([(0, 8, 0, 8, 1), (8, 16, 8, 16, 4)], r"attn_type row 1: code 4 is not one of 0 FULL"),
]


@pytest.mark.parametrize("rows,match", SOLVE_BAD, ids=["reversed", "negative", "past-S", "type-4"])
def test_solve_ranges_and_types(rows, match):
    mask = slices(rows, 16)
    config = SolverConfig(cp_size=2, num_heads_q=2, num_heads_kv=1, head_dim=D)
    with pytest.raises(ValueError, match=match):
        mask.validate()
    with pytest.raises(ValueError, match=match):                # solve validates CPU masks by default
        solve(mask, config)
    with quiet():
        plan = solve(mask, config, validate=False)                 # sync-free: the flags name the row
    flagged("block_areas: " + match)
    with pytest.raises(ValueError, match="INVALID_MASK"):          # the plan's status carries it too
        check_errors(plan)


def test_grouped_mask_row_names_the_group():
    rows = torch.tensor([[[0, 8, 0, 8, 1], [8, 16, 8, 16, 1]], [[0, 8, 0, 8, 1], [8, 16, 8, 20, 1]]])
    from gpusolver.masks import AttnSlices
    mask = AttnSlices(rows[..., 0:2], rows[..., 2:4], rows[..., 4], 16, 16)
    with pytest.raises(ValueError, match=r"k_ranges \[group 1\] row 1: \[8, 20\)"):
        mask.validate()
    block_areas(mask, 2, 2)
    flagged(r"block_areas: k_ranges \[group 1\] row 1: \[8, 20\) is outside")


# ------------------------------------------------------------------ overlapping slices


@pytest.mark.parametrize("rows,match", [
    ([(0, 8, 0, 8, 1), (0, 8, 0, 8, 2)], r"row 1 .*covers entry \(q=0, k=0\) already covered by row 0"),
    ([(0, 4, 0, 4, 1), (4, 8, 0, 8, 1), (2, 3, 1, 3, 0)], r"row 2 .*covers entry \(q=2, k=1\) already covered by row 0"),
    ([(0, 1 << 20, 0, 1 << 20, 1), ((1 << 20) - 1, 1 << 20, 5, 6, 0)],
     r"row 1 .*covers entry \(q=1048575, k=5\) already covered by row 0"),
], ids=["causal-vs-inv", "inside-causal", "million-tokens"])
def test_overlapping_slices(rows, match):
    S = max(r[1] for r in rows)
    mask = slices(rows, S)
    with pytest.raises(ValueError, match=match):     # exact at any S: pairwise, no dense map
        validate_slices(mask)
    errors.record_slices("solve", mask, overlap=True)  # sync-free: a debug flag (O(R^2) pairs)
    flagged("solve: q_ranges/k_ranges " + match.split(" .*")[0] + r" covers entry")


def test_touching_slices_are_not_an_overlap():
    mask = slices([(0, 6, 0, 6, 1), (0, 6, 1, 7, 2)], 6, 7)     # k <= q and k >= q + 1
    validate_slices(mask)
    mask = slices([(0, 6, 0, 6, 1), (0, 6, 1, 7, 2)], 7, 7)
    errors.record_slices("solve", mask, overlap=True)
    check_errors()


def test_overlap_flag_in_the_module_debug_mode():
    P = 2
    config = SolverConfig(cp_size=P, num_heads_q=2, num_heads_kv=1, head_dim=D, dtype=torch.float32)
    attn = DynamicCPAttention(LocalGroup(P), config, validate=False, solver="reference", debug_digest=True)
    mask = slices([(0, 16, 0, 16, 1), (4, 8, 0, 4, 0)], 16)
    q, k, v = (shard(x, attn.group) for x in qkv(16, 16))
    with quiet():
        attn(q, k, v, mask)
    flagged(r"DynamicCPAttention: q_ranges/k_ranges row 1 covers entry \(q=4, k=0\) already covered by row 0")


# ------------------------------------------------------------------ configuration: S, heads, head dims


def test_sequence_not_divisible_by_P():
    config = SolverConfig(cp_size=3, num_heads_q=2, num_heads_kv=1, head_dim=D)
    for validate in (True, False):
        with pytest.raises(ValueError, match=r"total_seqlen=16 must be divisible by cp_size=3"):
            solve(causal_mask(16), config, validate=validate)
    with pytest.raises(ValueError, match=r"total_seqlen_q=16 must be divisible by cp_size=3"):
        validate_slices(causal_mask(16), cp_size=3)
    with pytest.raises(ValueError, match=r"x.shape\[0\] = 16 must be divisible by the group size P = 3"):
        shard(torch.zeros(16), LocalGroup(3))


def test_heads_not_a_multiple():
    with pytest.raises(ValueError, match=r"num_heads_q=6 must be a multiple of num_heads_kv=4"):
        SolverConfig(cp_size=2, num_heads_q=6, num_heads_kv=4)
    q, k, v = qkv(8, 8, 6, 4)
    with pytest.raises(ValueError, match=r"Hq=6 must be a multiple of Hkv=4"):
        flex_attn(q, k, v, *_ranges([(0, 8, 0, 8, 1)]))


@pytest.mark.parametrize("head_dim", [8, 48, 256])
def test_unsupported_head_dims(head_dim):
    q = torch.randn(8, 2, head_dim)
    k = v = torch.randn(8, 1, head_dim)
    with pytest.raises(ValueError, match=rf"head dim D must be one of \(16, 32, 64, 128\) .* got q D={head_dim}"):
        flex_attn(q, k, v, *_ranges([(0, 8, 0, 8, 1)]))
    with pytest.raises(ValueError, match=r"MAX_HEAD_DIM"):
        SolverConfig(cp_size=2, head_dim=2048)


# ------------------------------------------------------------------ capacities too small


def _tight(**kw):
    return SolverConfig(cp_size=4, num_heads_q=2, num_heads_kv=1, head_dim=D, dtype=torch.float32, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(max_recv_rows=1), r"BUFFER_OVERFLOW: rank \d receives \d+ (QO|KV) rows, receive capacity 1"),
    (dict(max_stage_slices=1), r"CALC_OVERFLOW: rank \d stage \d needs \d+ slice rows, capacity 1"),
], ids=["receive", "stage"])
@pytest.mark.parametrize("stages", [1, "auto"])
def test_capacities_too_small(kw, match, stages):
    """One remote stage and the default sub-stages (whose reduce buffers once indexed past an
    overflowed receive buffer: an IndexError instead of a flag)."""
    kw = dict(kw, num_stages=stages)
    mask = varlen_causal_mask([40, 8, 16])
    with pytest.raises(ValueError, match=match):                  # validation: solve names rank and count
        with quiet():
            solve(mask, _tight(**kw), solver="reference")
    with quiet():
        plan = solve(mask, _tight(**kw), solver="reference", validate=False)
    group = LocalGroup(4)
    q, k, v = (shard(x, group) for x in qkv(64, 64))
    out, _ = dist_attn(q, k, v, plan, group, validate=False)      # sync-free: runs bounded, flags
    assert out.shape == q.shape
    flagged(r"dist_attn: plan status " + match.split(":")[0])


def test_collective_capacity_and_index_flags():
    """group_cast / group_reduce on a sync-free backend: a routing they cannot honour is flagged;
    rows that do not fit are dropped, never written out of bounds."""
    P = 2
    rows = torch.randn(P, 3, 4)
    split = torch.tensor([[0, 3], [1, 0]])
    index = torch.tensor([[0, 1, 2], [0, -1, -1]])
    (buf,) = group_cast([rows], index, split, 2, LocalGroup(P), phase="fwd.test")
    assert buf.shape == (P, 2, 4)
    flagged(r"group_cast \(fwd.test\): split column 1 sends 3 rows to rank 1, more than recv_capacity 2")
    group_cast([rows], torch.tensor([[0, 1, 5], [0, -1, -1]]), split, 4, LocalGroup(P))
    flagged(r"send_index of rank 0 holds 5, outside \[-1, 3\)")
    group_cast([rows], index, torch.tensor([[0, -3], [1, 0]]), 4, LocalGroup(P))
    flagged(r"split has a negative entry -3 in row 0")
    group_reduce([torch.randn(P, 2, 4)], index, split, [rows], LocalGroup(P), op="sum")
    flagged(r"group_reduce \(reduce\): split column 1 sends 3 rows")


# ------------------------------------------------------------------ sparse indices


def test_sparse_indices_out_of_range_or_duplicated():
    T, S = 8, 8
    ti = torch.arange(T)[:, None].repeat(1, 2).int()     # row t selects key t twice
    with pytest.raises(ValueError, match=r"topk_indices\[0, 1\] = 0 selects key 0 twice in row 0"):
        TokenTopKMask(ti, S).validate()
    ti = torch.tensor([[0, 9]] * T, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"topk_indices\[0, 1\] = 9 is outside \[-1, total_seqlen_k=8\)"):
        TokenTopKMask(ti, S).validate()
    bi = torch.tensor([[[0, 3]]] * T, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_indices\[0, 0, 1\] = 3 is outside \[-1, 2\)"):
        BlockSparseMask(bi, 4, S).validate()
    # sync-free: the module flags the mask before the solve (on a LocalGroup, every rank's rows)
    P, Hq, Hkv = 2, 2, 1
    config = SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32)
    attn = DynamicCPAttention(LocalGroup(P), config, validate=False, solver="reference")
    bad = TokenTopKMask(torch.tensor([[0, 99]] * (2 * S), dtype=torch.int32), 2 * S)
    q, k, v = (shard(x, attn.group) for x in qkv(2 * S, 2 * S, Hq, Hkv))
    with quiet():
        try:
            attn(q, k, v, bad)
        except ValueError as e:  # a later check may refuse the plan on the host as well
            assert "topk" in str(e) or "mask" in str(e).lower(), e
    flagged(r"DynamicCPAttention: TokenTopKMask holds a selection index outside its range")


# ------------------------------------------------------------------ the merge and the row delta


def test_merge_and_delta_arguments():
    out, lse = torch.randn(4, 2, D), torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"lse_b must be fp32, got torch.float16"):
        merge_out_lse(out, lse, out, lse.half())
    with pytest.raises(ValueError, match=r"out_b shape \(4, 2, 16\) must equal out_a shape"):
        merge_out_lse(out, lse, out[..., :16], lse)
    with pytest.raises(ValueError, match=r"out_b is torch.float16 but out_a is torch.float32"):
        merge_out_lse(out, lse, out.half(), lse)
    with pytest.raises(ValueError, match=r"out must match dout"):
        row_delta(out, out[:2])
    got = merge_out_lse(out, lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert_close("merge with an empty part", out, got[0])


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize("argv,match", [
    (["demo", "-P", "0"], "argument -P/--cp-size: must be >= 1, got 0"),
    (["solve", "-P", "300"], "cp_size=300 is past the supported MAX_CP_SIZE = 256"),
    (["demo", "--heads", "8:3"], "Hq=8 must be a multiple of Hkv=3"),
    (["demo", "--head-dim", "48"], "argument --head-dim: invalid choice: 48"),
    (["demo", "--tokens-per-rank", "0"], "argument --tokens-per-rank: must be >= 1, got 0"),
    (["solve", "--tokens-per-rank", "100000000"], "past the supported MAX_SEQLEN"),
    (["solve", "--tiles", "100"], "chunk_tiles=100 is past the supported MAX_CHUNK_TILES"),
    (["solve", "-P", "8", "--tokens-per-rank", "7", "--tiles", "2"], "must be divisible by cp_size \\* chunk_tiles"),
    (["demo", "--layers", "0"], "argument --layers: must be >= 1, got 0"),
    (["demo", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["demo", "--dtype", "float64"], "argument --dtype: dtype must be one of"),
    (["demo", "--device", "tpu"], "argument --device: not a torch device: 'tpu'"),
    (["demo", "-P", "8", "--tokens-per-rank", "4000"], "keep S <= 16384 or pass --no-check"),
    (["solve", "--save", "/nonexistent-folder/x.pt"], "--save /nonexistent-folder/x.pt: the folder"),
    (["show", "--plan", "/nonexistent-folder/p.pt"], "--plan /nonexistent-folder/p.pt: no such file"),
    (["quality", "--head-dim", "5000"], "head_dim=5000 is past the supported MAX_HEAD_DIM"),
    (["bench", "--timeout", "0"], "argument --timeout: must be >= 1, got 0"),
    # 0 and 40 were a traceback from SolverConfig; abc a one-line error with exit status 1, not argparse's 2
    (["simulate", "--stages", "0"], "argument --stages: must be >= 1 or 'auto', got 0"),
    (["simulate", "--stages", "abc"], "argument --stages: expected a positive integer or 'auto', got 'abc'"),
    (["simulate", "--stages", "40"], "num_stages=40 is past the supported MAX_NUM_STAGES = 32"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_cli_arguments_out_of_range(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    import re
    assert re.search(match, err[-1]), err[-1]


def test_cli_plan_file_that_is_not_a_plan(tmp_path):
    path = tmp_path / "not_a_plan.pt"
    path.write_text("hello")
    with pytest.raises(SystemExit, match=r"--plan .*not_a_plan.pt is not a saved plan"):
        cli_main(["show", "--plan", str(path), "--out", str(tmp_path / "p.png")])
