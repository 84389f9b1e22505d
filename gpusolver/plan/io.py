"""Plans on disk: ``save_plan`` / ``load_plan`` (also ``Plan.save`` / ``Plan.load``).

The format is ``plan.records``'s: every tensor of the plan (assignment,
metrics, CommMeta, CalcMeta, status, areas) and its host ints and floats,
with the format name and version, and optionally the ``SolverConfig`` the
plan was solved with. It loads with ``torch.load(weights_only=True)``: no
pickled classes, so a file from elsewhere cannot run code.

The tensors are written from the host and loaded onto ``map_location``
(default CPU). Nothing else is stored: a loaded plan is the saved one, bit for
bit, and ``dist_attn`` can execute it.
"""
from __future__ import annotations

import os

import torch

from gpusolver.config import AUTO_STAGES, CONFIG_ARGS, SolverConfig
from gpusolver.plan import records
from gpusolver.plan.meta import Plan
from gpusolver.plan.records import FORMAT, VERSION

__all__ = ["save_plan", "load_plan", "load_plan_config", "FORMAT", "VERSION"]


def save_plan(plan, path: str | os.PathLike, *, config=None) -> None:
    """Write ``plan`` to ``path`` (and ``config``, a ``SolverConfig``, when given). Host-side."""
    records.write(plan, path, config)


def load_plan(path: str | os.PathLike, *, map_location="cpu"):
    """The ``Plan`` saved at ``path``, its tensors on ``map_location``."""
    return Plan.load(path, map_location=map_location)


def load_plan_config(path: str | os.PathLike):
    """The ``SolverConfig`` saved with the plan at ``path``, or None if none was saved."""
    d = records.read(path, "cpu")["config"]
    if d is None:
        return None
    d = dict(d)
    dtype = getattr(torch, str(d["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{path}: unknown dtype {d['dtype']!r} in the saved config")
    d["dtype"] = dtype
    if isinstance(d.get("topology"), dict):
        from gpusolver.topology import Topology

        d["topology"] = Topology(**d["topology"])
    # auto_stages is not a constructor argument: a config saved with num_stages="auto" (the default)
    # comes back as "auto" where the saved S is what "auto" resolves to today; a plan saved when
    # "auto" meant another S keeps that S, explicit, as its plan was cut into it
    if d.get("auto_stages") and d.get("num_stages") == AUTO_STAGES:
        d["num_stages"] = "auto"
    config = SolverConfig(**{k: v for k, v in d.items() if k in CONFIG_ARGS})
    # auto_mu likewise: "auto" again where it resolves to the saved mu, else the saved mu, explicit
    if d.get("auto_mu") and not config.auto_mu:
        auto = config.replaced(imbalance_tol="auto")
        if auto.imbalance_tol == config.imbalance_tol:
            return auto
    return config
