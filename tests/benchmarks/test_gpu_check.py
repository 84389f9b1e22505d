"""scripts/gpu_check.py without a GPU: it runs nothing, says why on stderr, writes the summary and fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check runs for real")
def test_fails_loudly_without_a_gpu(tmp_path):
    out = tmp_path / "summary" / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "gpu-check FAILED: no CUDA GPU" in proc.stderr and "nothing was run" in proc.stderr
    summary = json.loads(out.read_text())
    assert summary["ok"] is False and summary["steps"] == {} and "torch.cuda.is_available()" in summary["error"]
