"""One comparison helper for every test: reports absolute and relative error."""
import torch


def _where(mask: torch.Tensor) -> str:
    idx = mask.nonzero()
    return f"{idx.shape[0]} entries, first at {idx[0].tolist()}"


def assert_close(name: str, ref: torch.Tensor, tri: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-4):
    """Exact for integer/bool tensors; element-wise ``|tri - ref| <= atol + rtol * |ref|`` for floats.

    The NaN, +inf and -inf masks of ``ref`` and ``tri`` must be equal exactly:
    a NaN never passes as 0, and an infinity is never compared by tolerance.
    The message gives the largest absolute error, the largest relative error
    (against each element's own magnitude) and the first failing index.
    """
    assert ref.shape == tri.shape, f"{name}: shape {tuple(ref.shape)} != {tuple(tri.shape)}"
    if not ref.dtype.is_floating_point and not tri.dtype.is_floating_point:
        diff = (ref != tri).nonzero()
        assert diff.numel() == 0, f"{name}: {diff.shape[0]} integer mismatches, first at {diff[0].tolist()}: " \
            f"ref={ref[tuple(diff[0])].item()} tri={tri[tuple(diff[0])].item()}"
        return
    ref64, tri64 = ref.detach().double().cpu(), tri.detach().double().cpu()
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        a, b = test(ref64), test(tri64)
        if not torch.equal(a, b):
            raise AssertionError(f"{name}: {what} masks differ: ref only at {_where(a & ~b) if (a & ~b).any() else '-'}"
                                 f"; tri only at {_where(b & ~a) if (b & ~a).any() else '-'}")
    fin = torch.isfinite(ref64)
    r, t = ref64[fin], tri64[fin]
    if r.numel() == 0:
        return
    err = (r - t).abs()
    bound = atol + rtol * r.abs()
    bad = err > bound
    if bad.any():
        rel = err / r.abs().clamp_min(1e-12)
        first = fin.nonzero()[bad.nonzero()[0, 0]].tolist()
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {r.numel()} elements outside atol {atol} + rtol {rtol} * |ref|; "
            f"max abs err {err.max().item():.3e}, max rel err {rel.max().item():.3e}; first at {first}: "
            f"ref={ref64[tuple(first)].item():.6g} tri={tri64[tuple(first)].item():.6g}")
