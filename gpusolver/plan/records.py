"""The plan file format: dataclass records as plain containers, behind a header.

A file is one ``torch.save`` of plain containers: every tensor of a record
(moved to the host) and its host ints and floats, nested records as dicts,
with the format name and version, and optionally the ``SolverConfig`` the plan
was solved with (as strings and numbers). It loads with
``torch.load(weights_only=True)``: no pickled classes, so a file from elsewhere
cannot run code.

This module knows no plan class: ``Plan.save`` / ``Plan.load`` (in
``plan.meta``) and ``plan.io`` name the classes, so the dataclasses and the
functions that save them need not import each other.
"""
from __future__ import annotations

import dataclasses
import os
import reprlib

import torch

FORMAT = "gpusolver.plan"
VERSION = 2  # 2: four buffer capacities (QO / KV receive and send) instead of one receive and one send


def to_plain(obj) -> dict:
    """A dataclass's fields as plain values (tensors to the host; nested dataclasses to dicts)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            out[f.name] = v.detach().cpu()
        elif dataclasses.is_dataclass(v):
            out[f.name] = to_plain(v)
        elif isinstance(v, (bool, int, float, str)) or v is None:
            out[f.name] = v
        else:
            raise TypeError(f"save_plan: field {type(obj).__name__}.{f.name} of type {type(v).__name__} "
                            "is not a tensor, a number or a dataclass")
    return out


def from_plain(cls, values: dict, nested: dict):
    """``cls`` rebuilt from ``to_plain`` values; ``nested`` maps a field name to its rebuilder."""
    # a field with a default may be absent from a file that predates it
    names = {f.name for f in dataclasses.fields(cls)
             if f.name in values or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)}
    missing = names - set(values)
    if missing:
        raise ValueError(f"saved {cls.__name__} lacks fields {sorted(missing)}")
    kw = {k: (nested[k](values[k]) if k in nested else values[k]) for k in names}
    return cls(**kw)


def config_dict(config) -> dict:
    d = dataclasses.asdict(config)
    d["dtype"] = str(config.dtype).replace("torch.", "")
    return d


def write(record, path: str | os.PathLike, config=None) -> None:
    """Write ``record`` (a dataclass) and ``config`` (a ``SolverConfig`` or None) to ``path``."""
    if config is not None and not (dataclasses.is_dataclass(config) and not isinstance(config, type)):
        # this module names no config class; dataclasses.asdict below would say only "dataclass instances"
        raise TypeError(f"config must be a SolverConfig or None, got {type(config).__name__} {reprlib.repr(config)}")
    payload = {"format": FORMAT, "version": VERSION, "plan": to_plain(record),
               "config": None if config is None else config_dict(config)}
    torch.save(payload, path)


def read(path: str | os.PathLike, map_location) -> dict:
    """The payload at ``path`` after its header is checked: ``{"plan": ..., "config": ...}``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    if isinstance(map_location, str):  # checked apart: torch.load's failure on it would read as a bad file
        try:
            torch.device(map_location)
        except RuntimeError:
            raise ValueError(f"map_location={map_location!r} is not a torch device") from None
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:  # a missing file, a folder, no permission: the OS's own error names the path
        raise
    except Exception as e:  # any other file: the unpickler fails in many ways (KeyError, EOFError, ...)
        why = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{path} is not a saved gpusolver plan (torch.load failed: {type(e).__name__}: {why})") \
            from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a saved gpusolver plan (no '{FORMAT}' header)")
    if payload.get("version") != VERSION:
        raise ValueError(f"{path} is a plan of format version {payload.get('version')}; "
                         f"this gpusolver reads version {VERSION}")
    return payload
