"""The torch twin's slice mask: equal to the broadcast definition, and its cost follows the real slices."""
import pytest
import torch

from attn_kernels import flex_attn
from attn_kernels.flex_attn import ref
from tests.attn_kernels._slices import random_slices


def _broadcast_mask(q_ranges, k_ranges, attn_type, Tq, Tk):
    """The mask straight from the slice definition, one [R, Tq, Tk] comparison per bound."""
    qs, qe = q_ranges[:, 0, None, None].long(), q_ranges[:, 1, None, None].long()
    ks, ke = k_ranges[:, 0, None, None].long(), k_ranges[:, 1, None, None].long()
    t = attn_type[:, None, None]
    o_q = torch.arange(Tq)[None, :, None]
    o_k = torch.arange(Tk)[None, None, :]
    m = (o_q >= qs) & (o_q < qe) & (o_k >= ks) & (o_k < ke)
    m &= (o_k <= o_q + (ke - qe)) | ~((t == 1) | (t == 3))
    m &= (o_k >= o_q + (ks - qs)) | ~((t == 2) | (t == 3))
    return m.any(0)


def _wild_slices(Tq, Tk, R, seed):
    """Any ranges at all: past the tensors, negative, reversed, overlapping; every type."""
    g = torch.Generator().manual_seed(seed)
    qr = torch.randint(-8, Tq + 9, (R, 2), generator=g, dtype=torch.int32)
    kr = torch.randint(-8, Tk + 9, (R, 2), generator=g, dtype=torch.int32)
    return qr, kr, torch.randint(0, 4, (R,), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("Tq,Tk", [(1, 1), (7, 30), (40, 9), (33, 33)])
@pytest.mark.parametrize("seed", range(4))
def test_mask_equals_definition(Tq, Tk, seed):
    for qr, kr, t in (random_slices(Tq, Tk, seed, num_pad=3) if min(Tq, Tk) > 1 else _wild_slices(Tq, Tk, 5, seed),
                      _wild_slices(Tq, Tk, 12, seed)):
        assert torch.equal(ref.slices_mask(qr, kr, t, Tq, Tk), _broadcast_mask(qr, kr, t, Tq, Tk))


def test_mask_of_no_slices_and_empty_axes():
    z2, z1 = torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    assert not ref.slices_mask(z2, z2, z1, 5, 6).any() and ref.slices_mask(z2, z2, z1, 5, 6).shape == (5, 6)
    qr, kr, t = _wild_slices(4, 4, 6, 0)
    assert ref.slices_mask(qr, kr, t, 0, 4).shape == (0, 4)
    assert ref.slices_mask(qr, kr, t, 4, 0).shape == (4, 0)


def test_padding_rows_change_nothing():
    """The same real slices padded to 16 and to 4,096 rows: equal outputs and gradients, bit for bit."""
    Tq = Tk = 64
    qr, kr, t = random_slices(Tq, Tk, seed=3, num_pad=0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, H, 32, generator=g) for T, H in ((Tq, 4), (Tk, 2), (Tk, 2)))

    def run(R):
        n = R - qr.shape[0]
        pad = torch.full((n, 2), 5, dtype=torch.int32)
        args = (torch.cat([qr, pad]), torch.cat([kr, pad]), torch.cat([t, torch.full((n,), 3, dtype=torch.int32)]))
        x = [a.clone().requires_grad_() for a in (q, k, v)]
        out, lse = flex_attn(*x, *args, backend="torch")
        (out.square().sum() + lse.sum()).backward()
        return [out, lse] + [a.grad for a in x]

    for a, b in zip(run(16), run(4096)):
        assert torch.equal(a, b)
