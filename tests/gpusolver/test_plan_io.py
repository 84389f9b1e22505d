"""Plan.save / Plan.load: a saved plan loads bit for bit, with its config, and still executes."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from gpusolver import SolverConfig, solve
from gpusolver.masks import packed_documents, sliding_window_mask
from gpusolver.plan import Plan
from gpusolver.plan.io import FORMAT, load_plan, load_plan_config, save_plan
from gpusolver.runtime import dist_attn, shard, unshard
from groupcomm import LocalGroup


def _config(P: int, tiles: int = 1, **kw) -> SolverConfig:
    return SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2, head_dim=32, dtype=torch.float32,
                        chunk_tiles=tiles, **kw)


def _assert_same(a, b, where: str = "plan") -> None:
    assert type(a) is type(b), where
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        name = f"{where}.{f.name}"
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
        elif dataclasses.is_dataclass(x):
            _assert_same(x, y, name)
        else:
            assert x == y, name


@pytest.mark.parametrize("P, tiles, S", [(4, 1, 512), (3, 2, 384)])
def test_round_trip_is_exact(tmp_path, P, tiles, S):
    config = _config(P, tiles)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an imbalanced plan saves like any other
        plan = solve(packed_documents(S, seed=2), config)
    path = tmp_path / "plan.pt"
    plan.save(path, config=config)
    loaded = Plan.load(path)
    _assert_same(plan, loaded)
    assert load_plan_config(path) == config
    assert loaded.summary() == plan.summary()


def test_saved_config_keeps_num_stages_auto(tmp_path):
    """The default num_stages="auto" loads as "auto" (``auto_stages`` is no constructor argument, so
    a field-by-field copy lost it), an explicit S of the same value as explicit, and 1 as 1."""
    from gpusolver.config import AUTO_STAGES

    plan = solve(packed_documents(256, seed=2), _config(4))
    for stages, auto in (("auto", True), (AUTO_STAGES, False), (1, False)):
        config = _config(4, num_stages=stages)
        save_plan(plan, tmp_path / "p.pt", config=config)
        loaded = load_plan_config(tmp_path / "p.pt")
        assert loaded == config and loaded.auto_stages is auto
        assert loaded.num_stages == (AUTO_STAGES if stages == "auto" else stages)
        assert loaded.replaced(imbalance_tol=1.2).auto_stages is auto


def test_loaded_plan_executes_like_the_original(tmp_path):
    P, S = 2, 128
    config = _config(P, max_recv_rows=128, max_stage_slices=16)  # small buffers: short CPU attention
    plan = solve(sliding_window_mask(S, 40), config)
    save_plan(plan, tmp_path / "p.pt")  # without a config
    assert load_plan_config(tmp_path / "p.pt") is None
    loaded = load_plan(tmp_path / "p.pt")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, h, 32, generator=g) for h in (8, 2, 2))
    group = LocalGroup(P)
    outs = [unshard(dist_attn(*(shard(x, group) for x in (q, k, v)), p, group)[0], group) for p in (plan, loaded)]
    assert torch.equal(outs[0], outs[1])


def test_refuses_files_that_are_not_plans(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match=FORMAT):
        load_plan(path)
    torch.save({"format": FORMAT, "version": 99, "plan": {}, "config": None}, path)
    with pytest.raises(ValueError, match="version 99"):
        load_plan(path)

