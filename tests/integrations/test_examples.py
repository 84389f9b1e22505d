"""The examples run on CPU (gloo ranks on 127.0.0.1) and match one process within 1e-5."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch._dynamo  # noqa: F401  DDP imports it: once here, not in every forked rank

from tests._dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5


def _example(name):
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _check(records, steps=3):
    assert len(records) == steps
    for step, r in enumerate(records):
        for what in ("loss_err", "logits_err", "grads_err"):
            assert r[what] <= TOL, f"step {step}: {what} = {r[what]:.3e} > {TOL}"
    assert len({round(r["loss"], 6) for r in records}) == steps  # new batches, moving weights


def test_torchtitan_style_cp2():
    for records in run_ranks(_example("torchtitan_style").train, 2, timeout=240):
        _check(records)


def test_dp_cp_mesh_2x2():
    results = run_ranks(_example("dp_cp_mesh").train, 4, timeout=240)
    for records in results:
        _check(records)
    # the global loss is the same number on every rank
    assert len({tuple(round(s["loss"], 7) for s in records) for records in results}) == 1


@pytest.mark.slow
def test_torchtitan_style_cp4():
    for records in run_ranks(_example("torchtitan_style").train, 4, timeout=600):
        _check(records)


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [("torchtitan_style.py", ["--nproc", "2"]), ("dp_cp_mesh.py", [])])
def test_scripts_run(script, args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3, out.stdout
