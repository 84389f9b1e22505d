"""Shared sparse cases: masks from the generators, a dense reference built from the same indices,
the byte counters of a run summed per pass."""
import torch

from attn_kernels.reference import dense_attn
from gpusolver.plan.sparse import SelectionSpec, build_sparse_plan
from gpusolver.runtime.sparse_attn import gather_sparse_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import dsa_topk_indices, nsa_block_indices
from gpusolver.masks.sparse import BlockSparseMask, NSALayerMask, TokenTopKMask
from tests._testing import assert_close

PHASES_FWD = ("fwd.qo", "fwd.kv", "fwd.o")
PHASES_BWD = ("bwd.qo", "bwd.kv", "bwd.dq", "bwd.dkv")
D = 32
ATOL, RTOL = 2e-5, 1e-4


def make_mask(kind: str, S: int, Hkv: int, seed: int = 0):
    """'dsa' (top-k 12), 'nsa' (blocks of 8, top-3) or 'nsa-layer' (those blocks plus a window of 10)."""
    if kind == "dsa":
        return TokenTopKMask(dsa_topk_indices(S, 12, seed=seed), S)
    sel = BlockSparseMask(nsa_block_indices(S, Hkv, 8, 3, seed=seed), 8, S)
    return sel if kind == "nsa" else NSALayerMask(sel, 10)


def make_config(P, Hq, Hkv, flatten=True, tiles=1, keep=True, num_stages=1) -> SolverConfig:
    """One remote stage unless told (the sparse layout across nodes); ``num_stages="auto"`` gives a group
    this small sub-stages (``SolverConfig.for_sparse``), which tests/gpusolver/sparse/test_stages.py covers."""
    return SolverConfig(cp_size=P, num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, dtype=torch.float32,
                        head_group_flatten=flatten, chunk_tiles=tiles, keep_forward_buffers=keep,
                        num_stages=num_stages)


def make_inputs(S, Hq, Hkv, seed=0):
    """q, k, v and the output gradients (a weight on lse too) of one layer."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(S, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    return q, k, v, torch.randn(S, Hq, D, generator=g), torch.randn(S, Hq, generator=g)


def branch_masks(mask, head: int):
    """The dense [S, S] masks of a mask's branches for one KV head (selection, then window)."""
    if isinstance(mask, TokenTopKMask):
        return [mask.to_dense()]
    if isinstance(mask, BlockSparseMask):
        return [mask.to_dense(head)]
    return [mask.selection.to_dense(head), mask.window_dense()]


def reference(mask, q, k, v, d_out, d_lse):
    """Single-process dense attention per branch: (outs, lses, dq, dk, dv); the loss is
    sum over branches b of (out_b * d_out / (b + 1)).sum() + (lse_b * d_lse).sum() (finite lse)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    hg = Hq // Hkv
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    nb = len(branch_masks(mask, 0))
    outs, lses = [[] for _ in range(nb)], [[] for _ in range(nb)]
    for h in range(Hkv):
        for b, m in enumerate(branch_masks(mask, h)):
            o, lse = dense_attn(leaves[0][:, h * hg:(h + 1) * hg], leaves[1][:, h:h + 1], leaves[2][:, h:h + 1], m)
            outs[b].append(o)
            lses[b].append(lse)
    outs = [torch.cat(o, 1) for o in outs]
    lses = [torch.cat(x, 1) for x in lses]
    loss(outs, lses, d_out, d_lse).backward()
    return outs, lses, leaves[0].grad, leaves[1].grad, leaves[2].grad


def branches(res):
    """A sparse layer's results as a list of (out, lse), one per output branch."""
    return list(res) if isinstance(res[0], tuple) else [res]


def check_branches(ref, outs, lses, grads, where=""):
    """Every branch's out and lse and the gradients against ``reference``'s."""
    for b, (o, lse) in enumerate(zip(outs, lses)):
        assert_close(f"{where}out{b}", ref[0][b], o, atol=ATOL, rtol=RTOL)
        assert_close(f"{where}lse{b}", ref[1][b], lse, atol=ATOL, rtol=RTOL)
    for name, a, g in zip(("dq", "dk", "dv"), ref[2:], grads):
        assert_close(f"{where}{name}", a, g, atol=ATOL, rtol=RTOL)


def loss(outs, lses, d_out, d_lse):
    total = 0.0
    for b, (o, lse) in enumerate(zip(outs, lses)):
        total = total + (o * d_out).sum() / (b + 1) + (torch.where(torch.isinf(lse), 0.0, lse) * d_lse).sum()
    return total


def traffic_sums(group, phases):
    """(sent [P], recv [P]) bytes summed over phases (LocalGroup counters)."""
    sent = sum(group.traffic(p)[0] for p in phases)
    recv = sum(group.traffic(p)[1] for p in phases)
    return sent, recv


def scatter_plan(mask, config, group, kv_block=None, seed=None):
    """A plan through the sharded flow (area rows, all-gather) with a fixed assignment that mixes
    local tasks with moved query and key units, instead of a solve (seconds on this CPU): the
    runtime must execute any valid plan. seed: a random assignment of that seed instead (the same
    on every rank)."""
    areas, error, used = gather_sparse_areas(mask, config, group, kv_block)
    G, U, P, n = areas.head_groups, areas.num_units, config.cp_size, config.chunk_tiles
    dev = areas.area.device
    if seed is None:
        g, i, j = torch.meshgrid(*(torch.arange(n_, device=dev) for n_ in (G, U, U)), indexing="ij")
        host_i, host_j = i // n, j // n
        moved = (host_i + host_j + 1 + g) % P
        rank = torch.where((i + j + g) % 3 == 0, host_i, moved)
    else:
        rank = torch.randint(0, P, areas.area.shape, generator=torch.Generator().manual_seed(seed)).to(dev)
    assignment = torch.where(areas.area > 0, rank, -1)
    spec = SelectionSpec.of(mask, G)
    # a fixed assignment, not a solve, so nothing keeps it within the default buffers (sized from the
    # solver's plans): unless the config sets buffers, give it the worst case, which holds any plan
    worst = G * areas.rank_tokens * (P - 1)
    own = any(getattr(config, f) is not None for f in ("max_recv_rows", "max_qo_recv_rows", "max_kv_recv_rows",
                                                        "max_qo_send_rows", "max_kv_send_rows"))
    caps = {} if own else {"recv_capacity": worst, "send_capacity": worst}
    return build_sparse_plan(areas, assignment, config, spec, mask.total_seqlen_k, mask_error=error,
                             used_blocks=used, kv_block=kv_block, **caps)
