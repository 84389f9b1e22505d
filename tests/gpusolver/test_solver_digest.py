"""Plan digests: the device solver's assignments on a fixed set of masks, pinned.

A relayout (or a speed-up) must leave every plan as it was. Forward-only
solves (``SolverConfig(objective="forward")``) and the training-step objective
have their own constants. The torch cases run the default portfolio and
rounds; the Triton and persistent cases, interpreted, a small portfolio with a
restart (the paths equal the torch one bit for bit, which the twin tests check
step by step). Why each constant last changed: CHANGELOG.md, "Plan digests".

Regenerate (only when plans change on purpose, saying why in the commit):
``TRITON_INTERPRET=1 python -m tests.gpusolver.test_solver_digest``.
"""
import hashlib

import pytest
import torch

from gpusolver.areas import block_areas
from gpusolver.config import SolverConfig
from gpusolver.masks import causal_mask, packed_documents, sliding_window_mask
from gpusolver.solver.device import Strategy, solve_device
from tests._threads import one_torch_thread  # noqa: F401 - autouse, module scope

_SMALL = (Strategy((3.0, float("inf")), units_per_rank=2, bundle_dests=4),
          Strategy((float("inf"),), units_per_rank=1, bundle_dests=2, task_order="rows", start="transpose"))

# id: (P, G, mask, tokens per rank, seed, tiles, impl, small portfolio)
_CASES = {
    "p4-g2-causal-docs": (4, 2, "causal_docs", 2048, 4, 1, "torch", False),
    "p8-g8-full-docs": (8, 8, "full_docs", 1024, 0, 1, "torch", False),
    "p8-g8-causal-docs-t2": (8, 8, "causal_docs", 512, 1, 2, "torch", False),
    "p6-g4-causal": (6, 4, "causal", 256, 0, 1, "torch", False),
    "p8-g2-window-t3": (8, 2, "window", 384, 0, 3, "torch", False),
    "p16-g8-causal-docs": (16, 8, "causal_docs", 512, 2, 1, "torch", False),
    "p32-g8-full-docs": (32, 8, "full_docs", 256, 3, 1, "torch", False),
    "p3-g2-causal-triton": (3, 2, "causal", 64, 0, 1, "triton", True),
    "p2-g1-causal-t2-persistent": (2, 1, "causal", 64, 0, 2, "persistent", True),
}


def _mask(kind, S, seed):
    if kind == "causal":
        return causal_mask(S)
    if kind == "window":
        return sliding_window_mask(S, S // 5)
    return packed_documents(S, seed=seed, causal=kind == "causal_docs")


def _digest(case, **config_kw) -> str:
    P, G, kind, tokens, seed, tiles, impl, small = _CASES[case]
    config = SolverConfig(cp_size=P, num_heads_q=4 * G, num_heads_kv=G, chunk_tiles=tiles, **config_kw)
    areas = block_areas(_mask(kind, tokens * P, seed), P, G, impl="torch", tiles=tiles)
    kw = dict(rounds=3, strategies=_SMALL, restart_every=2) if small else {}
    res = solve_device(areas, config, impl=impl, **kw)
    h = hashlib.sha256(res.assignment.to(torch.int32).contiguous().numpy().tobytes())
    h.update(f"{bool(res.balanced)}:{int(res.variant)}".encode())
    return h.hexdigest()[:20]


FORWARD_DIGESTS = {
    "p4-g2-causal-docs": "0db056904342e172c3b4",
    "p8-g8-full-docs": "e171ba2cd5af7bebf955",
    "p8-g8-causal-docs-t2": "617d6c3f3799cd92b3a0",
    "p6-g4-causal": "20fc5fb35f68c79681eb",
    "p8-g2-window-t3": "e305d9311369ef35629c",
    "p16-g8-causal-docs": "ed1605d9c24c1a904729",
    "p32-g8-full-docs": "7435b4090e7c96c38060",
    "p3-g2-causal-triton": "26cc2ad3c6fb8289017d",
    "p2-g1-causal-t2-persistent": "b26f55a1defa0268e407",
}


# the training-step objective's plans (SolverConfig(objective="training"), the default): the better
# step of the portfolio run under the training rule and under the forward rule (p16: the forward
# rule's, so its digest is the forward one)
TRAINING_DIGESTS = {
    "p4-g2-causal-docs": "0db056904342e172c3b4",
    "p8-g8-full-docs": "fa81a329f1fb0ed5c736",
    "p8-g8-causal-docs-t2": "617d6c3f3799cd92b3a0",
    "p6-g4-causal": "20fc5fb35f68c79681eb",
    "p8-g2-window-t3": "e305d9311369ef35629c",
    "p16-g8-causal-docs": "ed1605d9c24c1a904729",  # the forward rule's plan wins the step here
    "p32-g8-full-docs": "7435b4090e7c96c38060",
    "p3-g2-causal-triton": "26cc2ad3c6fb8289017d",
    "p2-g1-causal-t2-persistent": "b26f55a1defa0268e407",
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_forward_plans_are_pinned(case):
    assert _digest(case, objective="forward") == FORWARD_DIGESTS[case]


@pytest.mark.parametrize("case", sorted(_CASES))
def test_training_plans_are_pinned(case):
    assert _digest(case, objective="training") == TRAINING_DIGESTS[case]


if __name__ == "__main__":
    torch.set_num_threads(1)
    for objective in ("forward", "training"):
        print(objective)
        for case in _CASES:
            print(f"    {case!r}: {_digest(case, objective=objective)!r},", flush=True)
