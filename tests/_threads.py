"""A module-scoped one-thread fixture: the solver's tensors are small, and two threads fighting
for two cores only add overhead. Import it into a test module to use it there."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
