"""The solver on a CUDA device with compiled Triton kernels (skipped elsewhere).

Run on a GPU machine with the interpreter off:

    TRITON_INTERPRET=0 python -m pytest tests/gpu

Every path (torch ops on CUDA, the per-round Triton kernels, the persistent
kernel with one worker and with the default number of workers) must give the
CPU torch path's assignment exactly, without a host synchronisation, and
replay identically from a CUDA graph.
"""
import os

import pytest
import torch

from gpusolver import solve
from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import packed_documents
from gpusolver.solver.device import solve_device
from tests._testing import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA device and TRITON_INTERPRET=0")

# (impl, workers): workers None = the device default (one program per SM for all variants)
CUDA_PATHS = (("torch", None), ("triton", None), ("persistent", 1), ("persistent", None))


@pytest.mark.parametrize("P", [8, 16, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_every_path_equals_the_cpu_torch_path(P, causal):
    config = SolverConfig(cp_size=P)
    areas = block_areas(packed_documents(8192 * P, causal=causal), P, config.head_groups, impl="torch")
    ref = solve_device(areas, config, impl="torch")
    cuda_mask = packed_documents(8192 * P, causal=causal, device="cuda")
    cuda_areas = block_areas(cuda_mask, P, config.head_groups, impl="triton")
    for name in ("area", "q_need", "k_need"):
        assert_close(f"areas.{name}", getattr(areas, name), getattr(cuda_areas, name).cpu())
    for impl, workers in CUDA_PATHS:
        res = solve_device(cuda_areas, config, impl=impl, workers=workers)
        for name in ("assignment", "balanced", "fwd_bottleneck", "variant"):
            assert_close(f"{impl}/{workers} {name}", getattr(ref, name), getattr(res, name).cpu())


@pytest.mark.parametrize("P,tiles", [(8, 4), (16, 2)])
def test_tiled_solve_every_path_equals_the_cpu_torch_path(P, tiles):
    config = SolverConfig(cp_size=P, chunk_tiles=tiles)
    areas = block_areas(packed_documents(8192 * P), P, config.head_groups, impl="torch", tiles=tiles)
    ref = solve_device(areas, config, impl="torch")
    cuda_areas = block_areas(packed_documents(8192 * P, device="cuda"), P, config.head_groups, impl="triton",
                             tiles=tiles)
    for impl, workers in CUDA_PATHS:
        res = solve_device(cuda_areas, config, impl=impl, workers=workers)
        assert_close(f"{impl}/{workers} assignment", ref.assignment, res.assignment.cpu())


def _cuda_mask(P: int):
    mask = packed_documents(8192 * P, seed=1, device="cuda")
    return SolverConfig(cp_size=P), mask


@pytest.mark.parametrize("impl,workers", [("triton", None), ("persistent", None)])
def test_layer_solve_never_syncs(impl, workers):
    config, mask = _cuda_mask(16)
    solve(mask, config, impl=impl, validate=False)  # compile and warm the allocator first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = solve(mask, config, impl=impl, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert plan.assignment.is_cuda


@pytest.mark.parametrize("impl", ["triton", "persistent"])
def test_cuda_graph_replay_equals_eager(impl):
    config, mask = _cuda_mask(16)
    areas = block_areas(mask, config.cp_size, config.head_groups, impl="triton")
    eager = solve_device(areas, config, impl=impl)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as graph capture asks
        solve_device(areas, config, impl=impl)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = solve_device(areas, config, impl=impl)
    graph.replay()
    torch.cuda.synchronize()
    assert_close("assignment", eager.assignment, captured.assignment)
