"""Test set-up: the Triton interpreter must be on before any kernel is decorated."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
