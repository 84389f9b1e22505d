"""The solver's Triton kernels compile for an sm_90 target (H100/H200) without a GPU.

The launches of a small interpreted solve are recorded (argument types,
constexprs, options) and compiled by the real front end and ptxas in a
subprocess with the interpreter off: the interpreter accepts code the
compiler rejects. The persistent kernel is also compiled with several
workers per variant, as a cooperative launch, and its barrier is checked in
the PTX: a release add and an acquire poll at GPU scope (that record also
runs 2 sub-chunk tiles per rank from a given start: one compile of the
persistent kernel, the slowest, covers both). The transposed start's kernel
is compiled too. The biggest kernels are also
compiled with the tiles of large P, and the kernels that depend on sub-chunk
tiles with 2 and 3 tiles per rank.
"""
import copy

import pytest

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import packed_documents
from gpusolver.solver.device import Strategy, solve_device
from tests._sm90 import capture_launches, compile_sm90

_BARRIER_PTX = ("atom.global.gpu.release.add", "ld.global.gpu.acquire")
# the persistent kernel's blocks at G = 2, P = 4 with 2 tiles per rank (U = 8, T = 128)
_TILED_ROUNDS = {"TILES": 2, "BLOCK_M": 8, "BLOCK_TL": 2, "BLOCK_D": 4, "BLOCK_T": 128, "BLOCK_GP": 16,
                 "BLOCK_U": 16, "BLOCK_JU": 8, "BLOCK_C": 256}


@pytest.mark.slow
def test_solver_kernels_compile_for_sm90():
    P = 4
    config = SolverConfig(cp_size=P, num_heads_q=8, num_heads_kv=2)
    mask = packed_documents(512 * P, seed=0)
    strategies = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),)
    with capture_launches() as records:
        areas = block_areas(mask, P, config.head_groups, impl="triton")
        solve_device(areas, config, rounds=1, strategies=strategies, impl="triton")
        solve_device(areas, config, rounds=1, strategies=strategies, impl="persistent")
    names = sorted(r["name"] for r in records)
    # the training objective runs the portfolio under the training rule and again under the forward
    # rule: the kernels that price or accept moves are compiled once per rule (TRAINING constexpr)
    per_rule = ["_bundle_kernel", "_accept_kernel", "_track_kernel", "_rounds_kernel"]
    assert names == sorted(["_block_areas_kernel", "_state_kernel", "_state_bytes_kernel", "_offers_kernel"]
                           + 2 * per_rule), names
    for name in per_rule:
        assert sorted(r["constexprs"]["TRAINING"] for r in records if r["name"] == name) == [False, True], name
    # the transposed start's kernel (a portfolio with a transposed variant runs it once per solve)
    with capture_launches() as started:
        solve_device(areas, config, rounds=0, impl="persistent",
                     strategies=strategies + (Strategy((float("inf"),), 1, 2, start="transpose"),))
    records += [r for r in started if r["name"] == "_transpose_start_kernel"]
    assert len(records) == len(names) + 1, [r["name"] for r in started]
    persistent = next(r for r in records if r["name"] == "_rounds_kernel")
    assert persistent["constexprs"]["W"] == 1
    cooperative = copy.deepcopy(persistent)
    cooperative["constexprs"]["W"] = 8
    cooperative["options"]["launch_cooperative_grid"] = True
    cooperative["constexprs"].update(HAS_START=True, **_TILED_ROUNDS)
    cooperative["expect_ptx"] = list(_BARRIER_PTX)
    persistent["expect_ptx"] = list(_BARRIER_PTX)

    # the same kernels with 32 ranks per block: the first size where a 1-D form of the bundle body
    # broke the compiler's layout pass (P = 4 alone would not show it)
    wide = []
    for name, blocks in (("_bundle_kernel", {"BLOCK_P": 32}), ("_rounds_kernel", {"BLOCK_P": 32}),
                         ("_block_areas_kernel", {"BLOCK_J": 64})):  # block_areas_triton's tile at P = 64
        record = copy.deepcopy(next(r for r in records if r["name"] == name))
        record["constexprs"].update(blocks)
        record.pop("expect_ptx", None)
        wide.append(record)

    # sub-chunk tiles: U = TILES * P task slots per unit, key-host-major slots padded to BLOCK_TL
    tiled = []
    for name, blocks in (("_state_kernel", {"TILES": 2, "BLOCK_T": 128}), ("_state_bytes_kernel", {"TILES": 2}),
                         ("_bundle_kernel", {"TILES": 2, "BLOCK_M": 8, "BLOCK_TL": 2, "BLOCK_D": 4}),
                         ("_bundle_kernel", {"TILES": 3, "BLOCK_P": 32, "BLOCK_M": 128, "BLOCK_TL": 4, "BLOCK_D": 2})):
        record = copy.deepcopy(next(r for r in records if r["name"] == name))
        assert record["constexprs"]["TILES"] == 1
        record["constexprs"].update(blocks)
        record.pop("expect_ptx", None)
        tiled.append(record)

    results = compile_sm90(records + wide + tiled + [cooperative])
    failed = [f"{r['name']}: {r['error']}" for r in results if r["error"]]
    assert not failed, "\n".join(failed)
    single, multi = results[records.index(persistent)], results[-1]
    assert all(multi["ptx"].values()), f"the W=8 barrier is missing from the PTX: {multi['ptx']}"
    assert not any(single["ptx"].values()), f"W=1 needs no grid barrier: {single['ptx']}"
