"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm transformer layer.

    rms_norm(x, weight, eps)                  -> weight * (x / rms(x))
    rms_norm(x, weight, eps, residual=r)      -> r += x (in place), then weight * (r / rms(r))

Same rounding as the torch model code (statistics in fp32, the normalized row cast to the input dtype
before the weight multiplies it, the residual sum rounded to the input dtype before it is normalized), so
bf16 results track the reference. One program per row; a row of up to 65,536 elements fits one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import ATTENTION_DTYPES, check_dtype, check_last_dim_contiguous, check_ndim
from kernels._checks import check_same_device

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, H]
    residual_ptr,  # [N, H], updated in place (HAS_RESIDUAL)
    weight_ptr,  # [H]
    out_ptr,  # [N, H] contiguous
    stride_x, stride_r, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # Arithmetic in fp32 with a rounding to the input dtype wherever torch rounds (torch's bf16/fp16 ops
    # compute in fp32 and round the result); it also keeps bf16 math away from Triton's interpreter, which
    # stores bf16 as uint16.
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x_low = (x + r).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x_low, mask=mask)
        x = x_low.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [N, H], becomes x + residual
) -> torch.Tensor:  # [N, H]
    check_ndim("x", x, 2, "[N, H]")
    check_dtype("x", x, ATTENTION_DTYPES)
    check_last_dim_contiguous("x", x)
    check_ndim("weight", weight, 1, "[H]")
    num_rows, hidden = x.shape
    if weight.shape[0] != hidden or weight.dtype != x.dtype or (hidden > 1 and weight.stride(0) != 1):
        raise ValueError(f"weight must be a contiguous [{hidden}] {x.dtype} tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype} with strides {weight.stride()}")
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {MAX_HIDDEN}], got {hidden}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({tuple(x.shape)} {x.dtype}), got {tuple(residual.shape)} "
                             f"{residual.dtype}")
        check_last_dim_contiguous("residual", residual)
        tensors["residual"] = residual
    check_same_device(**tensors)
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x, x if residual is None else residual, weight, out,
        x.stride(0), 0 if residual is None else residual.stride(0), hidden, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out
