"""One torch thread per reliability test (small ops on a shared 2-core machine run faster so),
restored afterwards so the rest of the suite keeps its setting; and the benchmarks' launch and
host-read counter, loaded from benchmarks/_common.py (not a package)."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def counter():
    """``LaunchCounter`` of benchmarks/_common.py."""
    spec = importlib.util.spec_from_file_location("_reliability_common", _BENCH / "_common.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod.LaunchCounter
    sys.modules.pop(spec.name, None)
