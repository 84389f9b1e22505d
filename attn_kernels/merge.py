"""The one out/lse merge: combine two partial attention results over disjoint keys.

Shapes: out_* [T, H, D] (fp16/bf16/fp32), lse_* [T, H] fp32 natural log,
-inf where a part saw no key.

Derivation. A part over key set K_a has lse_a = log Σ_{j∈K_a} e^{s_j} and
out_a = Σ_{j∈K_a} e^{s_j - lse_a} v_j. Over K_a ∪ K_b (disjoint):

    lse = log(e^{lse_a} + e^{lse_b}) = mx + log1p(e^{mn - mx}),
          mx = max(lse_a, lse_b), mn = min(lse_a, lse_b)
    out = Σ_j e^{s_j - lse} v_j = e^{lse_a - lse} out_a + e^{lse_b - lse} out_b

The max/min form never exponentiates a positive number (no overflow).
-inf safety: mn = -inf gives log1p(0) = 0 and that part's weight e^{-inf} = 0;
mx = -inf (both empty) would give -inf - -inf = NaN, so lse is set to -inf and
both weights to 0 explicitly (out = 0). Everything is accumulated in fp32.

``merge_out_lse`` returns new tensors and is differentiable:
d out_a = w_a dout, d lse_a = w_a (dlse + Σ_D dout·(out_a - out)), same for b.
``merge_out_lse_`` accumulates part b into (out_acc, lse_acc) in place.
Both dispatch like ``flex_attn``: Triton on CUDA (or with backend="triton"
under the interpreter), the torch twin ``merge_out_lse_ref`` elsewhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_kernels.flex_attn.kernel import _interpreting


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """(lse [T, H], w_a [T, H], w_b [T, H]) fp32, see the module docstring."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    mx, mn = torch.maximum(lse_a, lse_b), torch.minimum(lse_a, lse_b)
    empty = mx == float("-inf")
    mx_safe = torch.where(empty, torch.zeros_like(mx), mx)
    lse = torch.where(empty, mx, mx_safe + torch.log1p(torch.exp(mn - mx_safe)))
    lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
    w_a = torch.where(empty, torch.zeros_like(lse), torch.exp(lse_a - lse_safe))
    w_b = torch.where(empty, torch.zeros_like(lse), torch.exp(lse_b - lse_safe))
    return lse, w_a, w_b


def merge_out_lse_ref(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``merge_out_lse_triton``: (out [T, H, D] in out_a's dtype, lse [T, H] fp32)."""
    lse, w_a, w_b = _weights(lse_a, lse_b)
    out = w_a[..., None] * out_a.float() + w_b[..., None] * out_b.float()
    return out.to(out_a.dtype), lse


@triton.jit
def _merge_kernel(p_oa, p_la, p_ob, p_lb, p_o, p_l, N, D,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # N = T*H rows of length D; p_o/p_l may alias p_oa/p_la (each element is
    # read before it is written, by the same program).
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < N
    m_nd = m_n[:, None] & (o_d[None, :] < D)
    # [BLOCK_N]
    b_la = tl.load(p_la + o_n, mask=m_n, other=float("-inf"))
    b_lb = tl.load(p_lb + o_n, mask=m_n, other=float("-inf"))
    o_nd = o_n.to(tl.int64)[:, None] * D + o_d[None, :]
    # [BLOCK_N, BLOCK_D]
    b_oa = tl.load(p_oa + o_nd, mask=m_nd, other=0.0).to(tl.float32)
    b_ob = tl.load(p_ob + o_nd, mask=m_nd, other=0.0).to(tl.float32)
    b_mx = tl.maximum(b_la, b_lb)
    b_mn = tl.minimum(b_la, b_lb)
    m_empty = b_mx == float("-inf")
    b_mx_safe = tl.where(m_empty, 0.0, b_mx)
    b_lse = b_mx_safe + tl.log(1.0 + tl.exp(b_mn - b_mx_safe))  # log1p: no libdevice in the interpreter
    b_lse_safe = tl.where(m_empty, 0.0, b_lse)
    b_wa = tl.where(m_empty, 0.0, tl.exp(b_la - b_lse_safe))
    b_wb = tl.where(m_empty, 0.0, tl.exp(b_lb - b_lse_safe))
    b_o = b_wa[:, None] * b_oa + b_wb[:, None] * b_ob
    tl.store(p_o + o_nd, b_o.to(p_o.dtype.element_ty), mask=m_nd)
    tl.store(p_l + o_n, tl.where(m_empty, float("-inf"), b_lse), mask=m_n)


def _launch_merge(out_a, lse_a, out_b, lse_b, out, lse) -> None:
    T, H, D = out_a.shape
    N = T * H
    if N == 0:
        return
    BLOCK_N = 64 if _interpreting() else 16
    _merge_kernel[(triton.cdiv(N, BLOCK_N),)](
        out_a, lse_a, out_b, lse_b, out, lse, N, D, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(D))


def merge_out_lse_triton(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                         lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton merge: (out [T, H, D] in out_a's dtype, lse [T, H] fp32)."""
    out_a, lse_a, out_b, lse_b = (x.contiguous() for x in (out_a, lse_a, out_b, lse_b))
    out = torch.empty_like(out_a)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)
    _launch_merge(out_a, lse_a, out_b, lse_b, out, lse)
    return out, lse


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not t.is_cuda and not _interpreting():
        raise ValueError(f"backend='triton' on {t.device} needs TRITON_INTERPRET=1; use 'auto' or 'torch'")
    return backend == "triton" or (backend == "auto" and t.is_cuda)


@torch.library.custom_op("attn_kernels::merge_out_lse", mutates_args=())
def merge_out_lse_op(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                     use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out_*: [T, H, D], lse_*: [T, H] fp32 -> merged (out [T, H, D], lse [T, H] fp32)."""
    if use_triton:
        return merge_out_lse_triton(out_a, lse_a, out_b, lse_b)
    return merge_out_lse_ref(out_a, lse_a, out_b, lse_b)


@merge_out_lse_op.register_fake
def merge_out_lse_fake(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                       use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(out_a), torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)


def _merge_setup(ctx, inputs, output):
    out_a, lse_a, out_b, lse_b, _ = inputs
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b, output[0], output[1])


def _merge_backward(ctx, dout, dlse):
    out_a, lse_a, out_b, lse_b, out, lse = ctx.saved_tensors
    _, w_a, w_b = _weights(lse_a, lse_b)
    dout = torch.zeros_like(out, dtype=torch.float32) if dout is None else dout.float()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.float()
    d_oa = (w_a[..., None] * dout).to(out_a.dtype)
    d_ob = (w_b[..., None] * dout).to(out_b.dtype)
    d_la = w_a * (dlse + (dout * (out_a.float() - out.float())).sum(-1))
    d_lb = w_b * (dlse + (dout * (out_b.float() - out.float())).sum(-1))
    return d_oa, d_la.to(lse_a.dtype), d_ob, d_lb.to(lse_b.dtype), None


merge_out_lse_op.register_autograd(_merge_backward, setup_context=_merge_setup)


@torch.library.custom_op("attn_kernels::merge_out_lse_", mutates_args=("out_acc", "lse_acc"))
def merge_out_lse_inplace_op(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
                             lse_b: torch.Tensor, use_triton: bool) -> None:
    """Accumulate part b into out_acc [T, H, D] and lse_acc [T, H] fp32, in place."""
    if use_triton:
        _launch_merge(out_acc, lse_acc, out_b, lse_b, out_acc, lse_acc)
        return
    out, lse = merge_out_lse_ref(out_acc, lse_acc, out_b, lse_b)
    out_acc.copy_(out)
    lse_acc.copy_(lse)


@merge_out_lse_inplace_op.register_fake
def merge_out_lse_inplace_fake(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
                               lse_b: torch.Tensor, use_triton: bool) -> None:
    return None


def _check(out_a, lse_a, out_b, lse_b, names, any_b_dtype: bool = False) -> None:
    """any_b_dtype: out_b may be any floating dtype (an accumulator merging a part in its own
    dtype: every load is cast to fp32 in both paths)."""
    na, la, nb, lb = names
    for name, t in zip(names, (out_a, lse_a, out_b, lse_b)):
        if not isinstance(t, torch.Tensor):  # before .dim() below: an AttributeError would name nothing
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out_a.dim() != 3:
        raise ValueError(f"{na} must be [T, H, D], got {tuple(out_a.shape)}")
    if out_b.shape != out_a.shape:
        raise ValueError(f"{nb} shape {tuple(out_b.shape)} must equal {na} shape {tuple(out_a.shape)}")
    if not out_a.dtype.is_floating_point:
        raise ValueError(f"{na} must be fp16, bf16 or fp32, got {out_a.dtype}")
    if not out_b.dtype.is_floating_point:
        raise ValueError(f"{nb} must be fp16, bf16 or fp32, got {out_b.dtype}")
    if out_b.dtype != out_a.dtype and not any_b_dtype:
        raise ValueError(f"{nb} is {out_b.dtype} but {na} is {out_a.dtype}: they must match")
    for name, lse in ((la, lse_a), (lb, lse_b)):
        if tuple(lse.shape) != tuple(out_a.shape[:2]):
            raise ValueError(f"{name} must be [T, H] = {list(out_a.shape[:2])}, got {list(lse.shape)}")
        if lse.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32, got {lse.dtype}")
    for name, t in ((la, lse_a), (nb, out_b), (lb, lse_b)):
        if t.device != out_a.device:
            raise ValueError(f"{name} is on {t.device} but {na} is on {out_a.device}")


def merge_out_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                  *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results over disjoint key sets (differentiable).

    out_a, out_b: [T, H, D]; lse_a, lse_b: [T, H] fp32 (-inf = part saw no key).
    Returns out [T, H, D] in out_a's dtype and lse [T, H] fp32.
    """
    _check(out_a, lse_a, out_b, lse_b, ("out_a", "lse_a", "out_b", "lse_b"))
    return merge_out_lse_op(out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(), lse_b.contiguous(),
                            _use_triton(out_a, backend))


def merge_out_lse_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                   *, backend: str = "auto") -> None:
    """In place: (out_acc, lse_acc) <- merge((out_acc, lse_acc), (out_b, lse_b)); not differentiable.

    out_acc: [T, H, D] contiguous, lse_acc: [T, H] fp32 contiguous (both updated);
    out_b: [T, H, D] in any float dtype (a bf16 part into an fp32 accumulator: no fp32 copy of it),
    lse_b: [T, H] fp32. On the Triton path nothing is allocated.
    """
    _check(out_acc, lse_acc, out_b, lse_b, ("out_acc", "lse_acc", "out_b", "lse_b"), any_b_dtype=True)
    if not (out_acc.is_contiguous() and lse_acc.is_contiguous()):
        raise ValueError("out_acc and lse_acc must be contiguous (they are updated in place)")
    merge_out_lse_inplace_op(out_acc, lse_acc, out_b.contiguous(), lse_b.contiguous(),
                             _use_triton(out_acc, backend))
