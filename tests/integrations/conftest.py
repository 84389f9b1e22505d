"""One torch thread for these tests: their ops are tiny, and on a shared CPU the intra-op
thread pool costs more than it gives (a LocalGroup training step ran several times slower
with two threads than with one here)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
