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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
