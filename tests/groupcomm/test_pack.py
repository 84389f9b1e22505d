"""``groupcomm._pack``: tensors made by ``packed_rows`` are the byte columns of one buffer, which
``packed_base`` gives back (a reduce sends it without packing a copy); anything else is packed."""
import pytest
import torch

from groupcomm import packed_rows
from groupcomm._pack import pack, packed_base

SHAPES = [(4, 8), (4,)]            # an out row (h heads of D) and an lse row (h heads), as a reduce's partials
DTYPES = [torch.bfloat16, torch.float32]


def _filled(n, seed=0):
    parts = packed_rows(n, SHAPES, DTYPES, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for p in parts:
        p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return parts


@pytest.mark.parametrize("rows", [None, 5, 1], ids=["all", "first-5", "first-1"])
def test_packed_rows_give_their_buffer_back(rows):
    parts = _filled(7)
    if rows is not None:  # the rows a reduce really returns: the first of the buffer
        parts = [p[:rows] for p in parts]
    base = packed_base(parts)
    assert base is not None and base.dtype == torch.uint8
    assert torch.equal(base, pack(parts, 0))                               # the bytes pack would make
    assert base.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr()  # without the copy
    assert base.shape == (parts[0].shape[0], 4 * 8 * 2 + 4 * 4)


def test_other_tensors_are_packed():
    parts = _filled(6)
    assert packed_base(parts[::-1]) is None                                 # not in the buffer's order
    assert packed_base(parts[:1]) is None                                   # one tensor: pack views it anyway
    assert packed_base([p.clone() for p in parts]) is None                  # separate allocations
    assert packed_base([parts[0], parts[0].float()[:, 0]]) is None          # a foreign second tensor
    assert packed_base([p[::2] for p in parts]) is None                     # every other row: not the buffer's rows
    three = packed_rows(3, [(2,), (2,), (2,)], [torch.float32] * 3, torch.device("cpu"))
    assert packed_base([three[0], three[2]]) is None                        # a gap of columns between them
    assert packed_base(three) is not None
    assert packed_base([p[:0] for p in parts]) is None                      # no rows: nothing to copy


def test_unaligned_columns_fall_back_to_a_copy():
    """A column block that cannot be viewed in its dtype (an fp32 after 3 bytes) is a copy, and the
    tensors are then packed as any others."""
    parts = packed_rows(4, [(3,), (2,)], [torch.uint8, torch.float32], torch.device("cpu"))
    parts[0].copy_(torch.arange(12, dtype=torch.uint8).view(4, 3))
    parts[1].copy_(torch.randn(4, 2))
    assert packed_base(parts) is None
    assert pack(parts, 0).shape == (4, 3 + 8)
