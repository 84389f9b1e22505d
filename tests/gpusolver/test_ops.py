"""The solve as custom ops: same result as the eager functions, compiles whole, fakes match."""
import inspect

import torch

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import packed_documents
from gpusolver.ops import (_block_areas_fake, _solve_assignment_fake, block_areas_op, solve_assignment_compiled,
                           solve_assignment_op)
from gpusolver.solver.device import solve_device
from tests._testing import assert_close


def test_fakes_match_op_signatures():
    for op, fake in ((block_areas_op, _block_areas_fake), (solve_assignment_op, _solve_assignment_fake)):
        assert list(inspect.signature(op._init_fn).parameters) == list(inspect.signature(fake).parameters)


def test_ops_equal_eager_and_compile_fullgraph():
    P = 4
    config = SolverConfig(cp_size=P)
    mask = packed_documents(1024 * P, seed=2, pad_to=48)
    eager = solve_device(block_areas(mask, P, config.head_groups, impl="torch"), config).assignment
    via_ops = solve_assignment_compiled(mask, config, impl="torch")
    assert_close("assignment via ops", eager, via_ops)

    def layer(q_ranges, k_ranges, attn_type):
        m = type(mask)(q_ranges, k_ranges, attn_type, mask.total_seqlen_q, mask.total_seqlen_k)
        return solve_assignment_compiled(m, config, impl="torch")

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close("assignment compiled", eager, compiled(mask.q_ranges, mask.k_ranges, mask.attn_type))


def test_ops_on_meta():
    P = 4
    config = SolverConfig(cp_size=P)
    mask = packed_documents(1024 * P, seed=2)
    meta = type(mask)(mask.q_ranges.to("meta"), mask.k_ranges.to("meta"), mask.attn_type.to("meta"),
                      mask.total_seqlen_q, mask.total_seqlen_k)
    out = solve_assignment_compiled(meta, config, impl="torch")
    assert out.device.type == "meta" and out.shape == (config.head_groups, P, P) and out.dtype == torch.int32
