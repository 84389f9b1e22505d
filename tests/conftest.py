"""Test set-up: the Triton interpreter must be on before any kernel is decorated.

Hypothesis profiles: ``ci`` (loaded by default) derandomizes every property
test, so a CI run draws the same cases each time and a failure reproduces;
``fuzz`` (``make fuzz``, ``--hypothesis-profile=fuzz``) draws fresh cases and
lets ``tests/reliability`` scale its searches up (``tests/reliability/_fuzz.py``).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")

torch.manual_seed(0)

# Under xdist each worker gets its share of the cores: torch's default of one thread per core in
# every worker oversubscribes them, and its threads then wait on each other (small ops most of all).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(_WORKERS, 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_pending_error_flags():
    # device error flags are process-wide: a test that leaves one raised (a deliberately bad
    # input read with validate=False) must not fail whichever test next calls check_errors
    from gpusolver import errors
    errors.reset()


# The slow tier (``make test-slow``, ``-m slow``): the tests named in tests/slow_tier.txt get the
# ``slow`` marker here, so re-tiering is one list rather than edits across the test modules.
_SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow_tier.txt")


def _slow_entries() -> list[str]:
    with open(_SLOW_LIST) as f:
        return [ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()]


def _names(entry: str, nodeid: str) -> bool:
    """An entry names a module, a test (all its parameters) or one parametrized case."""
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    entries = _slow_entries()
    used = set()
    for item in items:
        for entry in entries:
            if _names(entry, item.nodeid):
                item.add_marker(pytest.mark.slow)
                used.add(entry)
    # an entry whose module was collected but that names no test there is stale (a renamed test
    # would silently fall back into the fast tier): refuse it
    modules = {item.nodeid.split("::", 1)[0] for item in items}
    # (only when whole modules were asked for: no `::` ids, no -k, no --deselect)
    if any("::" in a for a in config.args) or config.getoption("keyword") or config.getoption("deselect"):
        return
    stale = [e for e in entries if e not in used and e.split("::", 1)[0] in modules]
    if stale:
        raise pytest.UsageError(f"tests/slow_tier.txt names tests that do not exist: {stale}")


# GPUSOLVER_TEST_TIMES=path: each test's phase times appended as they finish (nodeid, phase,
# seconds; tab-separated), so a run cut short still leaves its times (scripts/test_times.py reads them)
# (written by the main process only: xdist hands it every worker's reports)
_TIMES = None if "PYTEST_XDIST_WORKER" in os.environ else os.environ.get("GPUSOLVER_TEST_TIMES")


def pytest_runtest_logreport(report):
    if _TIMES:
        with open(_TIMES, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t{report.outcome}\n")
