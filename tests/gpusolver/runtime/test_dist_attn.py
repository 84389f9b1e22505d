"""dist_attn over a LocalGroup (P simulated ranks in one process) against dense attention on the whole sequence.

Plans come from the CPU reference solver unless a case says otherwise: the
runtime executes any valid plan, and the device solver on CPU costs seconds
per solve at P >= 8. The device solver's plans run in the cases that go
through ``DynamicCPAttention`` (meta, compile, the empty-rank case).
"""
import pytest
import torch
from torch import nn

from gpusolver import solve
from gpusolver.config import AUTO_STAGES
from gpusolver.masks import AttnSlices, causal_mask, varlen_causal_mask
from gpusolver.plan import BUFFER_OVERFLOW
from gpusolver.runtime import DynamicCPAttention, PlanCache, dist_attn, shard, unshard
from groupcomm import LocalGroup
from tests._testing import assert_close
from tests.gpusolver.runtime._cases import (ATOL, D, PHASES_BWD, PHASES_FWD, RTOL, doc_lengths, make_config,
                                            make_inputs, make_mask, reference, tight_plan, traffic_sums)
from tests.gpusolver.runtime._cases import few_solve_rounds  # noqa: F401 - fixture

KEYS = ("out", "lse", "dq", "dk", "dv")


def _run(plan, P, q, k, v, d_out, d_lse, group=None, **kw):
    """dist_attn on a LocalGroup from global tensors; every result unsharded to ``[S, ...]``."""
    group = LocalGroup(P) if group is None else group
    qs, ks, vs = (shard(x, group).requires_grad_() for x in (q, k, v))
    out, lse = dist_attn(qs, ks, vs, plan, group, **kw)
    torch.autograd.backward((out, lse), (shard(d_out, group), shard(d_lse, group)))
    got = (out, lse, qs.grad, ks.grad, vs.grad)
    return {key: unshard(t.detach(), group) for key, t in zip(KEYS, got)}


def _assert_all_close(ref, got, where=""):
    for key in KEYS:
        assert_close(f"{where}{key}", ref[key], got[key], atol=ATOL, rtol=RTOL)


# (mask, P, c, Hq, Hkv, flatten, tiles): GQA and MHA, flattening on and off, 1 and 2 tiles over P = 8 and 16
CASES = [
    ("random", 8, 16, 4, 2, True, 1),
    ("random", 16, 16, 2, 2, False, 2),
    ("docs-causal", 8, 32, 4, 2, False, 2),
    ("docs-full", 16, 16, 2, 2, True, 1),
    ("window", 16, 16, 4, 1, True, 2),
]


@pytest.mark.parametrize("name,P,c,Hq,Hkv,flatten,tiles", CASES,
                         ids=[f"{m}-P{P}-c{c}-Hq{hq}-Hkv{hkv}-{'flat' if f else 'G1'}-n{n}"
                              for m, P, c, hq, hkv, f, n in CASES])
def test_equals_reference(name, P, c, Hq, Hkv, flatten, tiles):
    S = P * c
    mask = make_mask(name, S, seed=P)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, flatten, tiles))
    # the plan moves query rows and key rows, so both exchanges and the reduce run
    assert int(plan.comm.qo_split.sum()) > 0 and int(plan.comm.kv_split.sum()) > 0
    inputs = make_inputs(S, Hq, Hkv, seed=P)
    _assert_all_close(reference(mask, *inputs), _run(plan, P, *inputs))


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "recast"])
def test_bytes_equal_plan_metrics(keep):
    P, c, Hq, Hkv = 8, 16, 4, 2
    S = P * c
    mask = make_mask("docs-causal", S, seed=1)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv, keep_forward_buffers=keep))
    group = LocalGroup(P)
    _run(plan, P, *make_inputs(S, Hq, Hkv), group=group, keep_forward_buffers=keep)
    m = plan.metrics
    S = plan.num_stages
    assert S == AUTO_STAGES + 1  # the default layer: its collectives count per sub-stage (and its local tail)
    for phases, send, recv in ((PHASES_FWD, m.fwd_send, m.fwd_recv), (PHASES_BWD, m.bwd_send, m.bwd_recv)):
        sent, got = traffic_sums(group, phases, S)
        assert torch.equal(sent, send), (phases, sent.tolist(), send.tolist())
        assert torch.equal(got, recv), (phases, got.tolist(), recv.tolist())
    assert int(m.bwd_send.sum()) > 0
    kv_again = traffic_sums(group, ("bwd.kv",), S)[0]
    assert bool((kv_again > 0).any()) != keep  # K and V travel again only when not kept


def _make_layer(group, config, cache=None):
    return DynamicCPAttention(group, config, plan_cache=PlanCache() if cache is None else cache)


@pytest.mark.usefixtures("few_solve_rounds")
@pytest.mark.parametrize("fused", [None, True], ids=["default-reduce", "fused-reduce"])
def test_layer_on_meta(fused):
    """Solve, metas, casts, both stages, reduce and backward with no host read: the whole layer on meta
    (the reduces through the torch path, or groupcomm's fused merge as on a GPU)."""
    from groupcomm._merge import fused_reduce

    P, c, Hq, Hkv = 4, 16, 4, 2
    S = P * c
    mask = varlen_causal_mask(doc_lengths(S, 0), device="meta")
    layer = _make_layer(LocalGroup(P), make_config(P, Hq, Hkv))
    q = torch.empty(P, c, Hq, D, device="meta", requires_grad=True)
    k = torch.empty(P, c, Hkv, D, device="meta", requires_grad=True)
    v = torch.empty(P, c, Hkv, D, device="meta", requires_grad=True)
    with fused_reduce(fused):
        out, lse = layer(q, k, v, mask, return_lse=True)
        (out.sum() + lse.sum()).backward()
    assert out.shape == (P, c, Hq, D) and lse.shape == (P, c, Hq) and lse.dtype == torch.float32
    assert out.device.type == "meta"
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "meta"


class _Block(nn.Module):
    """QKV projection, dynamic CP attention, output projection (per-rank tensors ``[P, c, hidden]``)."""

    def __init__(self, group, config, hidden):
        super().__init__()
        self.hq, self.hkv = config.num_heads_q, config.num_heads_kv
        self.qkv = nn.Linear(hidden, (self.hq + 2 * self.hkv) * D, bias=False)
        self.proj = nn.Linear(self.hq * D, hidden, bias=False)
        self.attn = _make_layer(group, config)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).split([self.hq * D, self.hkv * D, self.hkv * D], dim=-1)
        out = self.attn(q.unflatten(-1, (self.hq, D)), k.unflatten(-1, (self.hkv, D)),
                        v.unflatten(-1, (self.hkv, D)), mask)
        return self.proj(out.flatten(-2))


@pytest.mark.parametrize("fused", [None, True], ids=["default-reduce", "fused-reduce"])
def test_compiled_block_equals_eager(fused):
    """fullgraph compile of a block; fused: the reduces through groupcomm's fused merge ops (opaque
    custom ops in the graph, their kernels under the interpreter)."""
    from groupcomm._merge import fused_reduce

    with fused_reduce(fused):
        _compiled_block_equals_eager()


def _compiled_block_equals_eager():
    P, c, Hq, Hkv, hidden = 2, 16, 4, 2, 64  # P = 2: tracing unrolls the LocalGroup's loop over ranks
    S = P * c
    mask = varlen_causal_mask(doc_lengths(S, 2))
    config = make_config(P, Hq, Hkv)
    torch.manual_seed(1)
    eager = _Block(LocalGroup(P), config, hidden)
    compiled_block = _Block(LocalGroup(P), config, hidden)
    compiled_block.load_state_dict(eager.state_dict())
    # fullgraph=True raises on any graph break; an empty cache puts the solve in the graph
    compiled = torch.compile(compiled_block, fullgraph=True, backend="aot_eager")
    x = torch.randn(P, c, hidden)
    ref, got = eager(x, mask), compiled(x, mask)
    assert_close("out", ref, got, atol=ATOL, rtol=RTOL)
    ref.square().sum().backward()
    got.square().sum().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled_block.parameters()):
        assert_close(f"grad {name}", a.grad, b.grad, atol=ATOL, rtol=RTOL)


@pytest.mark.filterwarnings("ignore:imbalance_tol")
def test_plan_cache_shares_solves():
    P, c, Hq, Hkv = 4, 16, 4, 2
    S = P * c
    config = make_config(P, Hq, Hkv)
    cache = PlanCache()
    group = LocalGroup(P)
    first = DynamicCPAttention(group, config, solver="reference", plan_cache=cache)
    second = DynamicCPAttention(group, config, solver="reference", plan_cache=cache)
    q, k, v, _, _ = (shard(x, group) for x in make_inputs(S, Hq, Hkv))
    docs, window = make_mask("docs-causal", S), make_mask("window", S)
    a = first(q, k, v, docs)
    b = second(q, k, v, docs)
    assert cache.solves == 1 and torch.equal(a, b)  # same mask object: one solve for both layers
    assert first.plan_for(docs, q.device) is second.plan_for(docs, q.device)
    same_values = AttnSlices(docs.q_ranges.clone(), docs.k_ranges.clone(), docs.attn_type.clone(), S, S)
    plan = second.plan_for(same_values, q.device)  # the lookup forward makes
    assert cache.solves == 2  # a new mask object solves again (identity, never a host compare)
    for _ in range(2):  # window and global layers alternate without evicting each other
        first.plan_for(window, q.device, mask_name="window")
        assert second.plan_for(same_values, q.device) is plan
    assert cache.solves == 3


def test_deterministic_is_bit_identical():
    P, c, Hq, Hkv = 4, 16, 4, 2
    S = P * c
    mask = make_mask("random", S, seed=5)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv))
    assert int(plan.comm.qo_split.sum()) > 0  # partial outputs are reduced on their hosts
    inputs = make_inputs(S, Hq, Hkv, seed=5)
    first, second = (_run(plan, P, *inputs, deterministic=True) for _ in range(2))
    for key in KEYS:
        assert torch.equal(first[key], second[key]), key
    _assert_all_close(first, _run(plan, P, *inputs, deterministic=False), "deterministic=False ")


def test_errors_name_the_problem():
    P, c, Hq, Hkv = 4, 16, 4, 2
    S = P * c
    plan, _ = tight_plan(make_mask("docs-causal", S), make_config(P, Hq, Hkv))
    group = LocalGroup(P)
    q, k, v = torch.zeros(P, c, Hq, D), torch.zeros(P, c, Hkv, D), torch.zeros(P, c, Hkv, D)
    with pytest.raises(ValueError, match=r"q holds 17 tokens per rank but the plan has c = S / P = 16"):
        dist_attn(torch.zeros(P, c + 1, Hq, D), k, v, plan, group)
    with pytest.raises(ValueError, match=r"q has 3 heads, not a multiple of the plan's G = 2"):
        dist_attn(torch.zeros(P, c, 3, D), k, v, plan, group)
    with pytest.raises(ValueError, match=r"the plan is for P = 4 ranks but the group has 2"):
        dist_attn(q, k, v, plan, LocalGroup(2))
    with pytest.raises(ValueError, match=r"cp_size=4 but the group has 2 ranks"):
        DynamicCPAttention(LocalGroup(2), make_config(P, Hq, Hkv))
    # causal: the last rank needs every earlier chunk's K and V, far past 2 rows
    small = solve(causal_mask(S), make_config(P, Hq, Hkv, max_recv_rows=2), validate=False)
    assert int(small.status) & BUFFER_OVERFLOW
    with pytest.raises(ValueError, match=r"BUFFER_OVERFLOW: rank \d receives \d+ KV rows, receive capacity 2"):
        dist_attn(q, k, v, small, group)  # validates on CPU by default


def test_rank_without_work():
    """Only tokens [0, 4) attend (to each other): ranks 2 and 3 compute nothing and host no valid row."""
    P, c, Hq, Hkv = 4, 16, 4, 2
    S = P * c
    one = torch.tensor([[0, 4]], dtype=torch.int32)
    mask = AttnSlices(one, one.clone(), torch.tensor([0], dtype=torch.int32), S, S)
    plan, _ = tight_plan(mask, make_config(P, Hq, Hkv), solver="device")
    assert plan.metrics.load[2:].eq(0).all()
    inputs = make_inputs(S, Hq, Hkv, seed=3)
    got = _run(plan, P, *inputs)
    for key in KEYS:
        assert not got[key].isnan().any(), key
    assert got["out"][4:].eq(0).all() and got["lse"][4:].eq(float("-inf")).all()
    for key in ("dq", "dk", "dv"):
        assert got[key][4:].eq(0).all(), key
    _assert_all_close(reference(mask, *inputs), got)
