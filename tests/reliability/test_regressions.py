"""One test per bug the reliability work found (README, "Reliability"), each failing before its fix."""
import torch

from groupcomm import LocalGroup, group_cast, group_reduce
from groupcomm._pack import pack, row_layout, unpack


def test_pack_rows_whose_last_dim_is_one_with_any_stride():
    """An lse of one head per row ([n, 1], stride (1, n): MHA with head-group flattening) counts as
    contiguous, and viewing it as bytes failed on TorchGroup's reduce."""
    lse = torch.randn(1, 50).t()
    assert lse.is_contiguous() and lse.stride() == (1, 50)
    buf = pack([lse], 0)
    assert buf.shape == (50, 4)
    (back,) = unpack(buf, row_layout([lse], 0))
    assert torch.equal(back, lse)
    # the same through a reduce on the simulated group (leading rank dim)
    P = 2
    split = torch.tensor([[0, 2], [1, 0]])
    index = torch.tensor([[0, 1, -1], [2, -1, -1]])
    out = torch.randn(P, 3, 1, 4)
    lse_p = torch.randn(P, 1, 3).transpose(1, 2)                       # [P, 3, 1], last-dim stride 3
    acc = [torch.randn(P, 3, 1, 4), torch.randn(P, 3, 1)]
    ref = group_reduce([out, lse_p.contiguous().clone()], index, split, acc, LocalGroup(P), op="lse")
    got = group_reduce([out, lse_p], index, split, acc, LocalGroup(P), op="lse")
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    (cast,) = group_cast([lse_p], index, split, 3, LocalGroup(P))
    assert cast.shape == (P, 3, 1)


def test_put_kernel_launcher_on_meta():
    """LocalGroup(impl="triton") ran the put kernel on meta tensors and failed ("cannot copy out of
    meta tensor"): the layer could not be traced on meta with the Triton collectives."""
    P = 2
    rows = torch.empty(P, 3, 4, device="meta")
    split = torch.tensor([[0, 2], [1, 0]], device="meta")
    index = torch.tensor([[0, 1, -1], [2, -1, -1]], device="meta")
    (buf,) = group_cast([rows], index, split, 3, LocalGroup(P, impl="triton"))
    assert buf.shape == (P, 3, 4) and buf.device.type == "meta"
