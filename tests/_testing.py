"""One comparison helper for every test: reports absolute and relative error."""
import torch


def assert_close(name: str, ref: torch.Tensor, tri: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-4):
    """Exact for integer/bool tensors; tolerance-based for floats (inf and nan must match)."""
    assert ref.shape == tri.shape, f"{name}: shape {tuple(ref.shape)} != {tuple(tri.shape)}"
    if not ref.dtype.is_floating_point:
        diff = (ref != tri).nonzero()
        assert diff.numel() == 0, f"{name}: {diff.shape[0]} integer mismatches, first at {diff[0].tolist()}: " \
            f"ref={ref[tuple(diff[0])].item()} tri={tri[tuple(diff[0])].item()}"
        return
    ref64, tri64 = ref.double(), tri.double()
    same_nonfinite = (~torch.isfinite(ref64)) | (~torch.isfinite(tri64))
    assert torch.equal(ref64[same_nonfinite].nan_to_num(0.0), tri64[same_nonfinite].nan_to_num(0.0)), \
        f"{name}: non-finite entries differ"
    fin = ~same_nonfinite
    abs_err = (ref64[fin] - tri64[fin]).abs().max().item() if fin.any() else 0.0
    rel_err = abs_err / max(ref64[fin].abs().max().item(), 1e-12) if fin.any() else 0.0
    assert abs_err <= atol + rtol * (ref64[fin].abs().max().item() if fin.any() else 0.0), \
        f"{name}: abs err {abs_err:.3e}, rel err {rel_err:.3e} (atol {atol}, rtol {rtol})"
