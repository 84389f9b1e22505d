"""One torch thread per reliability test (small ops on a shared 2-core machine run faster so),
restored afterwards so the rest of the suite keeps its setting."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
