"""Load a script of ``benchmarks/`` as a module, the way its tests call it."""
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_bench(script: str, name: str | None = None):
    """``benchmarks/<script>`` as a fresh module, registered in ``sys.modules`` under ``name``
    (default ``_bench_<stem>``: dataclasses look their module up by name). The scripts put
    ``benchmarks/`` on ``sys.path`` themselves, for ``_common``."""
    name = name or f"_bench_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
