"""The tensors handed to a gloo collective stay referenced from Python after it returns
(``groupcomm._retain``): a gloo worker thread then never frees a Python object, which it
cannot do while the interpreter shuts down."""
import torch

from groupcomm import TorchGroup, group_cast, retain
from groupcomm import _retain
from tests._dist import run_ranks
from tests.groupcomm._cases import random_routing


def test_retain_keeps_cpu_tensors_of_the_last_collectives():
    _retain.release()
    tensors = [torch.zeros(2) for _ in range(_retain.RECENT + 3)]
    for t in tensors:
        retain(t, torch.zeros(1, device="meta"))  # meta (like device memory) is not held

    def kept(x):
        return any(y is x for entry in _retain._held for y in entry)

    assert _retain.held() == _retain.RECENT  # bounded: the oldest are dropped
    assert kept(tensors[-1]) and kept(tensors[-_retain.RECENT]) and not kept(tensors[-_retain.RECENT - 1])
    assert all(len(entry) == 1 for entry in _retain._held)
    _retain.release()
    assert _retain.held() == 0 and not kept(tensors[-1])


def _rank_cast(rank, P):
    r = random_routing(P, 5, 0)
    rows = torch.randn(P, r.N, 3)[rank]
    _retain.release()
    (recv,) = group_cast([rows], r.send_index[rank], r.split, r.recv_capacity, TorchGroup(), phase="fwd")
    held = _retain._held[-1]
    # the exact receive view and packed input gloo was given: the receive buffer's storage among them
    return _retain.held(), any(t.untyped_storage().data_ptr() == recv.untyped_storage().data_ptr() for t in held)


def test_torch_group_cast_holds_its_buffers():
    assert run_ranks(_rank_cast, 2, timeout=60) == [(1, True), (1, True)]
