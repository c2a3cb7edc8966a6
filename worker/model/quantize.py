"""How a layer's weights are multiplied: oneDNN's packed bf16 layout on the CPU, weight-only int8, or FP8.

Packed (`pack_for_cpu`): torch's `F.linear` on a bf16 weight reorders the weight into oneDNN's blocked layout
on every call it does not take its one-row path for, which costs more than the product itself for a few rows
(a 1536x576 weight: 71 us at 4 rows, 28 us from the packed layout; the SmolLM2 head, 3.1 ms and 0.9 ms).
Packing once at start-up keeps only the packed copy. From two rows on, the numbers are F.linear's (the same
oneDNN kernel without the reorder); at one row torch takes a path of its own, which rounds a little
differently.

Int8: every layer's projection weights as int8 with one scale per output channel (symmetric: the largest |w| of
a row maps to 127), taken from the checkpoint's weights at start-up or from a checkpoint quantized so already
(worker/model/checkpoint_quant.py).

A step of few rows is bound by reading the weights, a quarter or half of whose bytes int8 saves; torch's
`_weight_int8pack_mm` multiplies by the int8 weight and applies the scales in one pass, without a dequantized
copy. Activations (bf16 or fp16: with float32 ones torch's kernel is several times slower than float32
weights), the KV cache, norms, the embedding and the LM head stay in the model dtype. Where the matmul is
bound by arithmetic (many rows) the int8 kernel is slower than the float one: a latency setting, not a
throughput one (docs/quantization.md).

FP8 (`quantize_fp8`): the weights as float8 e4m3 with one float32 scale per output channel, and each row of the
activations quantized to e4m3 with its own scale at every product (dynamic, per token), as vLLM's and
llm-compressor's FP8_DYNAMIC do; `torch._scaled_mm` multiplies the two and applies both scales. Hopper and Ada
GPUs run it on their FP8 tensor cores, twice bf16's arithmetic and half its bytes; on the CPU torch computes it
without FP8 hardware, slowly: a reference path for checking accuracy, not a way to serve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
QUANTIZED_DTYPES = {"int8": torch.int8, "fp8": FP8}
"""ENGINE_QUANTIZATION's kinds -> the dtype their weights are stored in."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (int8 [..., N, K], scales [..., N] in the weight's dtype); w ≈ q * scale[..., None]:
    a scale per row (a stack of matrices, as a MoE layer's experts, row by row too)."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(weight.dtype)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (e4m3, scales [..., N] float32); w ≈ q * scale[..., None], a row's largest |w| at 448."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_fits(weight: torch.Tensor) -> bool:
    """Whether `_scaled_mm` takes this [..., N, K] weight: the FP8 tensor cores' tiles need N and K in multiples
    of 16. A weight that does not fit stays in the model dtype."""
    return weight.shape[-2] % 16 == 0 and weight.shape[-1] % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [R, K] (bf16, fp16 or float32) times the e4m3 weight [N, K] with scales [N] float32: each row of x
    quantized with its own scale (its largest |x| at 448), both scales applied in the product, out in x's dtype."""
    x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12) / FP8_MAX  # [R, 1]
    x_q = (x.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)


def pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in oneDNN's packed layout (an opaque mkldnn tensor `linear` takes), or None where that
    does not apply: not a bf16 weight on the CPU, or a torch or CPU without the kernel (fp16 needs AVX512-FP16
    or AVX-NE-CONVERT, so it stays unpacked)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           scale: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] times weight [N, K] transposed, plus bias: F.linear, oneDNN's product with a packed weight
    (pack_for_cpu), or, when `scale` is set, the int8 product (weight int8 [N, K], scale [N] in x's dtype) or the
    FP8 one (weight e4m3, scale [N] float32)."""
    if scale is None:
        if weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)
    if weight.dtype == FP8:
        out = fp8_linear(x, weight, scale)
    else:
        out = torch._weight_int8pack_mm(x, weight, scale)
    return out if bias is None else out + bias


def pack_param(module: nn.Module, name: str) -> bool:
    """Replace the float parameter `name` of `module` by its packed form (pack_for_cpu); whether it was."""
    packed = pack_for_cpu(getattr(module, name).data)
    if packed is None:
        return False
    setattr(module, name, nn.Parameter(packed, requires_grad=False))
    return True


def quantize_param(module: nn.Module, name: str, kind: str = "int8") -> torch.Tensor | None:
    """Replace the float parameter `name` of `module` by its int8 or FP8 form; returns its scales (None: an FP8
    weight of a shape `_scaled_mm` does not take, left as it was)."""
    weight = getattr(module, name).data
    if kind == "fp8" and not fp8_fits(weight):
        return None
    q, scale = (quantize_fp8 if kind == "fp8" else quantize_int8)(weight)
    setattr(module, name, nn.Parameter(q, requires_grad=False))
    return scale


def empty_quantized_param(module: nn.Module, name: str, kind: str, dtype: torch.dtype) -> torch.Tensor | None:
    """Make the float parameter `name` of `module` an empty int8 or FP8 one, for a checkpoint whose weights are
    quantized already to fill; returns its empty scales (float32 for FP8, `dtype` for int8), or None where the
    FP8 product does not take the shape (the loader then widens the checkpoint's weight into the float one)."""
    weight = getattr(module, name).data
    if kind == "fp8" and not fp8_fits(weight):
        return None
    setattr(module, name, nn.Parameter(torch.empty_like(weight, dtype=QUANTIZED_DTYPES[kind]), requires_grad=False))
    return torch.empty(weight.shape[:-1], device=weight.device, dtype=torch.float32 if kind == "fp8" else dtype)
