"""Weight-only int8 quantization on the CPU: every layer's projection weights as int8 with one scale per output
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           scale: torch.Tensor | None) -> torch.Tensor:
    """F.linear, or the int8 product when `scale` is set (weight int8 [N, K], scale [N])."""
    if scale is None:
        return F.linear(x, weight, bias)
    out = torch._weight_int8pack_mm(x, weight, scale)
    return out if bias is None else out + bias


def quantize_param(module: nn.Module, name: str) -> torch.Tensor:
    """Replace the float parameter `name` of `module` by its int8 form; returns its scales."""
    q, scale = quantize_int8(getattr(module, name).data)
    setattr(module, name, nn.Parameter(q, requires_grad=False))
    return scale
