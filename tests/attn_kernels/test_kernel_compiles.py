"""The slice-attention kernels compile for sm_90 as they are launched, without spills.

The interpreter does not type-check like the compiler does (loop-carried
types, constexpr use), so the real front end and ptxas run here, in a
subprocess with the interpreter off. The records come from the launchers
themselves (``kernel.record_launches``): the launch configs, the constexprs
and the 16-byte divisibility hints a real launch on a GPU gets.
"""
import pytest
import torch

from attn_kernels.flex_attn import kernel, worklist_kernel
from tests._sm90 import capture_launches, compile_sm90

FORWARD_INTERIOR_MAX = 400  # SASS instructions per interior-block iteration of the forward (D = 128, bf16)


def test_records_carry_real_launch_conditions():
    records = kernel.gpu_launch_records(8192, 64, 8, 128)
    assert [r["name"] for r in records] == ["_flex_fwd_kernel", "_flex_bwd_dq_kernel", "_flex_bwd_dkdv_kernel",
                                            "_row_delta_kernel"]
    for rec in records[:3]:
        kind = rec["kind"]
        cfg, tune = kernel._gpu_configs(kind, False)
        assert rec["options"] == dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        block, inner = ("BLOCK_K", "BLOCK_Q") if kind == "dkdv" else ("BLOCK_Q", "BLOCK_K")
        assert (rec["constexprs"][block], rec["constexprs"][inner]) == (cfg.block, cfg.inner)
        # every pointer gets the 16-byte hint, as a CUDA allocation does
        pointers = [n for n, t in rec["signature"].items() if t.startswith("*")]
        assert pointers and all(n in rec["attrs"] for n in pointers)
        assert rec["signature"]["p_cnt"] == "constexpr" and rec["constexprs"]["COUNT"] is False
        # the work list is built for the program block, so autotune keeps it
        assert all(c.block == cfg.block for c in tune) and len(rec["autotune"]) == len(tune)
    assert records[0]["grid"] == [64, 8192 // 128]
    # the accumulating forward and backward: the same kernels, fp32 running results and sums as outputs
    acc = kernel.gpu_launch_records(8192, 64, 8, 128, accumulate=True)
    for rec in acc[:3]:
        assert rec["constexprs"]["ACCUMULATE"] is True
        assert all(rec["signature"][p] == "*fp32" for p in ("p_o", "p_lse", "p_dq", "p_dk", "p_dv")
                   if p in rec["signature"])
    assert all(rec["constexprs"]["ACCUMULATE"] is False for rec in records[:3])


def _work_list_records() -> list[dict]:
    """The work-list build kernels, captured from an interpreted build (specialised as on a GPU)."""
    g = torch.Generator().manual_seed(0)
    ends = torch.randint(0, 1024, (64, 2, 2), generator=g, dtype=torch.int32).sort(-1).values
    with capture_launches(specialize=True) as records:
        worklist_kernel.build(ends[:, 0].contiguous(), ends[:, 1].contiguous(),
                              torch.randint(0, 4, (64,), generator=g, dtype=torch.int32), 1024, 1024, 128, 128,
                              lanes=worklist_kernel.GPU_LANES)
    for rec in records:
        rec.setdefault("options", {}).setdefault("num_warps", 4)
    return records


@pytest.mark.slow
def test_launch_configs_compile_without_spills():
    records = kernel.gpu_launch_records(8192, 64, 8, 128)
    records.append(kernel.gpu_launch_records(8192, 64, 8, 128, softcap=30.0)[1])  # dQ has its own softcap config
    split = kernel.gpu_launch_records(8192, 8, 1, 128)[2]  # GQA 8:1: dK/dV split over query heads
    assert split["constexprs"]["SPLIT"] == 8 and split["grid"] == [8, 64]
    acc = kernel.gpu_launch_records(8192, 64, 8, 128, accumulate=True)[:3]  # into fp32 running results, sums
    records += [split] + acc + _work_list_records()
    results = compile_sm90(records, stats=True, jobs=2)
    if any(r["error"] and "ptxas" in r["error"] and "not found" in r["error"].lower() for r in results):
        pytest.skip("no ptxas in this Triton install")
    for rec, res in zip(records, results):
        what = f"{rec['name']} softcap={rec['constexprs'].get('USE_SOFTCAP')}"
        assert res["error"] is None, f"{what}: {res['error']}"
        assert res["spill_stores"] == res["spill_loads"] == res["stack"] == 0, f"{what} spills: {res}"
        if rec["name"].startswith("_flex"):
            assert len(res["mma_loops"]) == 3, f"{what}: masked, interior, masked loops expected: {res}"
    fwd = results[0]
    assert min(fwd["mma_loops"]) <= FORWARD_INTERIOR_MAX, f"forward interior loop: {fwd['mma_loops']}"
