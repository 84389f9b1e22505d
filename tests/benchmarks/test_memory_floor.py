"""benchmarks/memory_floor.py: the plan's buffers at capacity equal plan.memory(), at fill they hold the rows moved."""
import torch

from tests.benchmarks._load import load_bench


def _load():
    return load_bench("memory_floor.py")


def test_floor_at_capacity_is_plan_memory_and_fill_is_what_moves(tmp_path, capsys):
    mod = _load()
    from gpusolver import SolverConfig, block_areas
    from gpusolver.plan.build import build_plan
    from gpusolver.solve import solve_assignment

    P, c = 4, 64
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2, head_dim=16, dtype=torch.float32)
    mask = mod.make_mask("causal-seq", P, 0, c)  # one causal sequence: the last ranks must offload
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    plan = build_plan(mask, areas, solve_assignment(areas, config, impl="torch"), config)
    row = mod.floor_row(plan, config, c)
    mem = plan.memory(config, keep_forward_buffers=True)  # at capacity, everything kept
    assert row["cap_fwd_mb"] * mod.MB == mem.fwd_peak and row["cap_bwd_mb"] * mod.MB == mem.bwd_peak
    fill = mod.fill_rows(plan.comm)
    assert fill.qo_recv == int(plan.comm.qo_recv_rows.max()) and fill.kv_send == int(plan.comm.kv_split.sum(1).max())
    assert fill.qo_recv > 0 and fill.kv_recv > 0  # this mask moves both kinds, so the floor is not empty
    assert 0 < row["fill_fwd_mb"] <= row["cap_fwd_mb"] and 0 < row["fill_bwd_mb"] <= row["cap_bwd_mb"]
    assert row["own_mb"] * mod.MB == c * 2 * (8 + 2) * 16 * 4  # q, k, v, out in fp32

    md = tmp_path / "floor.md"
    rows = mod.main(["--P", "4", "--kinds", "full", "--tokens-per-rank", "64", "--md", str(md)])
    assert len(rows) == 1 and rows[0]["fill_own"] <= rows[0]["cap_own"]
    assert "at fill" in md.read_text() and "Largest peak / own at fill" in capsys.readouterr().out
