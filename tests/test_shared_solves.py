"""The tests' shared solves (``tests/_solves.py``): one plan per distinct input, equal to a fresh solve."""
import torch

from gpusolver import SolverConfig, solve
from gpusolver.masks import causal_mask
from tests._solves import shared_solve


def test_equal_inputs_share_one_plan_and_others_do_not():
    config = SolverConfig(cp_size=2, num_heads_q=4, num_heads_kv=2, head_dim=32, dtype=torch.float32)
    mask = causal_mask(64)
    plan = shared_solve(mask, config)
    assert shared_solve(causal_mask(64), config) is plan  # an equal mask built again
    assert torch.equal(plan.assignment, solve(mask, config).assignment)
    assert shared_solve(causal_mask(64), config, solver="reference") is not plan
    assert shared_solve(causal_mask(128), config) is not plan
    wider = SolverConfig(cp_size=2, num_heads_q=4, num_heads_kv=2, head_dim=64, dtype=torch.float32)
    assert shared_solve(mask, wider) is not plan
