"""draw_plan writes a valid PNG for plain, tiled, many-group and many-rank plans."""
from __future__ import annotations

import warnings

import pytest
import torch

from gpusolver import SolverConfig, solve
from gpusolver.masks import packed_documents
from gpusolver.viz import draw_plan
from tests.gpusolver.test_cli import assert_png


@pytest.mark.parametrize("P, tiles, heads, tokens", [(4, 1, (8, 2), 128), (2, 2, (8, 8), 64), (12, 1, (8, 1), 16)],
                         ids=["P4-G2", "P2-tiles2-G8", "P12-G1"])
def test_draw_plan_writes_a_png(tmp_path, P, tiles, heads, tokens):
    config = SolverConfig(cp_size=P, num_heads_q=heads[0], num_heads_kv=heads[1], head_dim=32,
                          dtype=torch.float32, chunk_tiles=tiles)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = solve(packed_documents(P * tokens, seed=1), config, solver="reference")  # fast at any P
    path = draw_plan(plan, config, tmp_path / "plan.png", title="test")
    assert_png(path)


def test_draw_plan_refuses_a_config_of_another_size(tmp_path):
    config = SolverConfig(cp_size=2, num_heads_q=4, num_heads_kv=2, head_dim=32)
    plan = solve(packed_documents(128, seed=0), config)
    with pytest.raises(ValueError, match="P = 2"):
        draw_plan(plan, SolverConfig(cp_size=4), tmp_path / "x.png")


@pytest.mark.parametrize("P", [3, 12, 40])
def test_one_distinct_colour_per_rank(P):
    from gpusolver.viz import _rank_colours

    cmap = _rank_colours(P)
    assert len({tuple(cmap(r)) for r in range(P)}) == P
