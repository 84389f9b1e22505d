"""Plans on disk: ``save_plan`` / ``load_plan`` (also ``Plan.save`` / ``Plan.load``).

A file is one ``torch.save`` of plain containers: every tensor of the plan
(assignment, metrics, CommMeta, CalcMeta, status, areas) and its host ints
and floats, with the format name and version, and optionally the
``SolverConfig`` the plan was solved with (as strings and numbers). It loads
with ``torch.load(weights_only=True)``: no pickled classes, so a file from
elsewhere cannot run code.

The tensors are written from the host and loaded onto ``map_location``
(default CPU). Nothing else is stored: a loaded plan is the saved one, bit for
bit, and ``dist_attn`` can execute it.
"""
from __future__ import annotations

import dataclasses
import os

import torch

FORMAT = "gpusolver.plan"
VERSION = 2  # 2: four buffer capacities (QO / KV receive and send) instead of one receive and one send

__all__ = ["save_plan", "load_plan", "load_plan_config", "FORMAT", "VERSION"]


def _fields(obj) -> dict:
    """A dataclass's fields as plain values (tensors to the host; nested dataclasses to dicts)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            out[f.name] = v.detach().cpu()
        elif dataclasses.is_dataclass(v):
            out[f.name] = _fields(v)
        elif isinstance(v, (bool, int, float, str)) or v is None:
            out[f.name] = v
        else:
            raise TypeError(f"save_plan: field {type(obj).__name__}.{f.name} of type {type(v).__name__} "
                            "is not a tensor, a number or a dataclass")
    return out


def _config_dict(config) -> dict:
    d = dataclasses.asdict(config)
    d["dtype"] = str(config.dtype).replace("torch.", "")
    return d


def save_plan(plan, path: str | os.PathLike, *, config=None) -> None:
    """Write ``plan`` to ``path`` (and ``config``, a ``SolverConfig``, when given). Host-side."""
    payload = {"format": FORMAT, "version": VERSION, "plan": _fields(plan),
               "config": None if config is None else _config_dict(config)}
    torch.save(payload, path)


def _read(path, map_location) -> dict:
    payload = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a saved gpusolver plan (no '{FORMAT}' header)")
    if payload.get("version") != VERSION:
        raise ValueError(f"{path} is a plan of format version {payload.get('version')}; "
                         f"this gpusolver reads version {VERSION}")
    return payload


def _build(cls, values: dict, nested: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    missing = names - set(values)
    if missing:
        raise ValueError(f"saved {cls.__name__} lacks fields {sorted(missing)}")
    kw = {k: (nested[k](values[k]) if k in nested else values[k]) for k in names}
    return cls(**kw)


def load_plan(path: str | os.PathLike, *, map_location="cpu"):
    """The ``Plan`` saved at ``path``, its tensors on ``map_location``."""
    from gpusolver.metrics import PlanMetrics
    from gpusolver.plan.meta import CalcMeta, CommMeta, Plan

    p = _read(path, map_location)["plan"]
    return _build(Plan, p, {
        "metrics": lambda d: _build(PlanMetrics, d, {}),
        "comm": lambda d: _build(CommMeta, d, {}),
        "calc": lambda d: _build(CalcMeta, d, {}),
    })


def load_plan_config(path: str | os.PathLike):
    """The ``SolverConfig`` saved with the plan at ``path``, or None if none was saved."""
    from gpusolver.config import SolverConfig

    d = _read(path, "cpu")["config"]
    if d is None:
        return None
    d = dict(d)
    dtype = getattr(torch, str(d["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{path}: unknown dtype {d['dtype']!r} in the saved config")
    d["dtype"] = dtype
    known = {f.name for f in dataclasses.fields(SolverConfig)}
    return SolverConfig(**{k: v for k, v in d.items() if k in known})
