"""How the CPU multiplies by a layer's weights: oneDNN's packed bf16 layout, or weight-only int8.

Packed (`pack_for_cpu`): torch's `F.linear` on a bf16 weight reorders the weight into oneDNN's blocked layout
on every call it does not take its one-row path for, which costs more than the product itself for a few rows
(a 1536x576 weight: 71 us at 4 rows, 28 us from the packed layout; the SmolLM2 head, 3.1 ms and 0.9 ms).
Packing once at start-up keeps only the packed copy. From two rows on, the numbers are F.linear's (the same
oneDNN kernel without the reorder); at one row torch takes a path of its own, which rounds a little
differently.

Int8: every layer's projection weights as int8 with one scale per output
channel (symmetric: the largest |w| of a row maps to 127), taken from the checkpoint's weights at start-up.

A step of few rows is bound by reading the weights, a quarter or half of whose bytes int8 saves; torch's
`_weight_int8pack_mm` multiplies by the int8 weight and applies the scales in one pass, without a dequantized
copy. Activations (bf16 or fp16: with float32 ones torch's kernel is several times slower than float32
weights), the KV cache, norms, the embedding and the LM head stay in the model dtype. Where the matmul is
bound by arithmetic (many rows) the int8 kernel is slower than the float one: a latency setting, not a
throughput one (docs/quantization.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N] in the weight's dtype); w ≈ q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(weight.dtype)


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
    (pack_for_cpu), or the int8 product when `scale` is set (weight int8 [N, K], scale [N])."""
    if scale is None:
        if weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)
    out = torch._weight_int8pack_mm(x, weight, scale)
    return out if bias is None else out + bias


def pack_param(module: nn.Module, name: str) -> bool:
    """Replace the float parameter `name` of `module` by its packed form (pack_for_cpu); whether it was."""
    packed = pack_for_cpu(getattr(module, name).data)
    if packed is None:
        return False
    setattr(module, name, nn.Parameter(packed, requires_grad=False))
    return True


def quantize_param(module: nn.Module, name: str) -> torch.Tensor:
    """Replace the float parameter `name` of `module` by its int8 form; returns its scales."""
    q, scale = quantize_int8(getattr(module, name).data)
    setattr(module, name, nn.Parameter(q, requires_grad=False))
    return scale
