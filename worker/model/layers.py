"""Layers every model family is built from: norms, RoPE, the attention block and the gated MLP.

T = tokens in the step, R = rows the matmuls run over (T, or T padded to a row bucket), H = hidden size,
Hq/Hkv = query/KV heads, D = head dim, I = MLP intermediate size.

Weights are kept fused (q|k|v in one matrix, gate|up in another) because one larger matmul beats three small
ones, on the CPU especially; each block names the checkpoint tensors that fill it (`checkpoint_tensors`).
Parameters are created uninitialized: the loader overwrites every one of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig, rope_cos_sin
from worker.model.input import AttentionMetadata
from worker.model.lora import LayerLora
from worker.model.quantize import empty_quantized_param, linear, pack_param, quantize_param

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
Matmul = tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""(input width, weight, bias, int8 or FP8 scales or None) of one of a step's matmuls."""


def quantized_views(prefix: str, rows: dict[str, tuple[int, int]],
                    scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A quantized fused weight's scales by the checkpoint names of its parts (`rows`: name -> first row, rows)."""
    if scale is None:
        return {}
    return {f"{prefix}{name}.weight_scale": scale.narrow(0, start, num) for name, (start, num) in rows.items()}


def param(*shape: int, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., H] -> [..., H]
    # Statistics in float32 and the weight applied after casting back, exactly as transformers does, so
    # bf16 results track the reference too.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., H] -> [..., H]
    """Gemma's RMSNorm: the checkpoint stores weight - 1, and the product is taken in float32 before the cast
    (Llama casts first), so bf16 rounds once, where transformers rounds."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


def rope_tables(config: ModelConfig, max_positions: int, device, dtype,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [P, rotary_dim]
    """cos and signed sin (first half negated, see apply_rope), computed in float32 and cast once, as
    transformers casts its cos/sin to the activation dtype."""
    cos, sin = rope_cos_sin(config, max_positions, local)
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.to(device=device, dtype=dtype), signed_sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/signed_sin: [T, 1, R], R <= D rotated dims (partial rotary leaves the rest).
    # rotate_half convention: x * cos + cat(-x2, x1) * sin. The minus sign lives in signed_sin (first half
    # negated), which saves a negation per call and gives the same floats: negation is exact.
    rotary = cos.shape[-1]
    if rotary != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, signed_sin), x[..., rotary:]), dim=-1)
    half = rotary // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


class Projections(nn.Module):
    """A block's projection weights, each beside the attribute that holds its scales once it is int8 or FP8."""

    weight_scales: tuple[tuple[str, str], ...] = ()
    """(weight, scales) attribute names."""
    quantized_kinds = ("int8", "fp8")

    def quantize(self, kind: str) -> None:
        """The float weights to int8 or FP8 (worker/model/quantize.py)."""
        for weight, scale in self.weight_scales:
            setattr(self, scale, quantize_param(self, weight, kind))

    def prepare_quantized(self, kind: str) -> None:
        """Empty int8 or FP8 weights and scales, for a checkpoint quantized already to fill (the loader)."""
        for weight, scale in self.weight_scales:
            setattr(self, scale, empty_quantized_param(self, weight, kind, getattr(self, weight).dtype))

    def pack_weights(self) -> bool:
        """Every weight in oneDNN's packed layout where it applies (pack_for_cpu); whether all were."""
        return all([pack_param(self, weight) for weight, _ in self.weight_scales])


class Attention(Projections):
    """Fused q|k|v projection, per-head q/k norm where the family has one, RoPE, paged attention over the
    layer's window, output projection."""

    weight_scales = (("qkv_weight", "qkv_scale"), ("o_weight", "o_scale"))

    def __init__(self, config: ModelConfig, layer: int, device, dtype, norm: Norm = rms_norm) -> None:
        super().__init__()
        c = self.config = config
        self.norm = norm
        self.window = c.window_of(layer)
        self.softcap = c.attn_logit_softcap
        self.scale = c.attn_scale or c.head_dim**-0.5
        self.qkv_weight = param(c.q_size + 2 * c.kv_size, c.hidden_size, device=device, dtype=dtype)
        self.qkv_bias = param(c.q_size + 2 * c.kv_size, device=device, dtype=dtype) if c.qkv_bias else None
        self.o_weight = param(c.hidden_size, c.q_size, device=device, dtype=dtype)
        self.o_bias = param(c.hidden_size, device=device, dtype=dtype) if c.o_bias else None
        self.q_norm = param(c.head_dim, device=device, dtype=dtype) if c.qk_norm else None
        self.k_norm = param(c.head_dim, device=device, dtype=dtype) if c.qk_norm else None
        self.qkv_scale: torch.Tensor | None = None
        self.o_scale: torch.Tensor | None = None
        """Per output channel, when the weights are int8 or FP8 (quantize)."""
        self.fused_rope_kv: Callable[..., torch.Tensor] | None = None
        """kernels.fused.rope_kv_write where the layers run fused with the Triton attention backend and the whole
        head rotates: RoPE and the KV cache write in one kernel, the backend then only attends."""

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Hugging Face names (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm under `prefix`) -> our views."""
        c = self.config
        rows = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.kv_size), "v_proj": (c.q_size + c.kv_size, c.kv_size)}
        out = {}
        for name, (start, num) in rows.items():
            out[f"{prefix}{name}.weight"] = self.qkv_weight.data.narrow(0, start, num)
            if self.qkv_bias is not None:
                out[f"{prefix}{name}.bias"] = self.qkv_bias.data.narrow(0, start, num)
        out.update(quantized_views(prefix, rows, self.qkv_scale))
        out[prefix + "o_proj.weight"] = self.o_weight.data
        out.update(quantized_views(prefix, {"o_proj": (0, c.hidden_size)}, self.o_scale))
        if self.o_bias is not None:
            out[prefix + "o_proj.bias"] = self.o_bias.data
        if self.q_norm is not None:
            out[prefix + "q_norm.weight"] = self.q_norm.data
            out[prefix + "k_norm.weight"] = self.k_norm.data
        return out

    def forward(
        self,
        x: torch.Tensor,  # [R, H], normed
        cos: torch.Tensor,  # [T, 1, rotary_dim]
        sin: torch.Tensor,  # [T, 1, rotary_dim], first half negated (see apply_rope)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_tokens: int,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:  # [R, H]; rows past num_tokens are padding, left out of attention
        if self.fused_rope_kv is not None:
            qk, v = self._qk_v(x, num_tokens, lora)
            q = self.fused_rope_kv(qk, v, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, self.config.num_heads)
            attn = backend.forward(q, None, None, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window,
                                   softcap=self.softcap, kv_written=True)
        else:
            attn = self.attend(*self.project(x, cos, sin, num_tokens, lora), kv_cache, meta, backend)
        return self.output(attn, x.shape[0], lora)

    def _qk_v(self, x: torch.Tensor, num_tokens: int,
              lora: LayerLora | None) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq + Hkv, D], [T, Hkv, D]
        """The step's queries and keys (q/k-normed where the family norms them), not yet rotated, and values."""
        c = self.config
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_scale)
        if lora is not None:
            qkv = lora.add("qkv", x, qkv)
        qkv = qkv[:num_tokens]  # [T, (Hq + 2 Hkv) D]
        qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            qk = torch.cat((self.norm(q, self.q_norm, c.rms_norm_eps), self.norm(k, self.k_norm, c.rms_norm_eps)), 1)
        return qk, qkv[:, c.q_size + c.kv_size :].reshape(num_tokens, c.num_kv_heads, c.head_dim)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_tokens: int,
                lora: LayerLora | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's rotated queries and keys and its values: [T, Hq, D], [T, Hkv, D], [T, Hkv, D]."""
        qk, v = self._qk_v(x, num_tokens, lora)
        # q and k heads rotate together: one set of elementwise ops instead of two.
        qk = apply_rope(qk, cos, sin)  # [T, Hq + Hkv, D]
        q, k = qk.split([self.config.num_heads, self.config.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:  # [T, Hq, D]
        if self.window is None and self.softcap is None:
            return backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window,
                               softcap=self.softcap)

    def output(self, attn: torch.Tensor, num_rows: int, lora: LayerLora | None = None) -> torch.Tensor:
        """[T, Hq, D] -> [R, H]: the output projection, padding rows added back as zeros before it."""
        num_tokens = attn.shape[0]
        attn = attn.reshape(num_tokens, self.config.q_size)
        if num_rows > num_tokens:
            attn = F.pad(attn, (0, 0, 0, num_rows - num_tokens))
        out = linear(attn, self.o_weight, self.o_bias, self.o_scale)
        return out if lora is None else lora.add("o", attn, out)

    def matmuls(self) -> list[Matmul]:
        """(input width, weight, bias, scale) of each matmul, for building kernels ahead (ModelRunner)."""
        return [(self.config.hidden_size, self.qkv_weight, self.qkv_bias, self.qkv_scale),
                (self.config.q_size, self.o_weight, self.o_bias, self.o_scale)]


class GatedMLP(Projections):
    """down(act(gate(x)) * up(x)), gate|up fused in one matrix: SwiGLU (silu) or GeGLU (tanh gelu)."""

    weight_scales = (("gate_up_weight", "gate_up_scale"), ("down_weight", "down_scale"))

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str, device, dtype) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.act = ACTIVATIONS[act]
        self.gate_up_weight = param(2 * intermediate_size, hidden_size, device=device, dtype=dtype)
        self.gate_up_bias = param(2 * intermediate_size, device=device, dtype=dtype) if bias else None
        self.down_weight = param(hidden_size, intermediate_size, device=device, dtype=dtype)
        self.down_bias = param(hidden_size, device=device, dtype=dtype) if bias else None
        self.gate_up_scale: torch.Tensor | None = None
        self.down_scale: torch.Tensor | None = None
        self.act_name = act
        self.fused_act_mul: Callable[[torch.Tensor, str], torch.Tensor] | None = None
        """kernels.fused.act_mul where fused kernels run (ENGINE_FUSED_KERNELS)."""

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        size = self.intermediate_size
        out = {}
        for kind, param_ in (("weight", self.gate_up_weight), ("bias", self.gate_up_bias)):
            if param_ is not None:
                out[f"{prefix}gate_proj.{kind}"] = param_.data.narrow(0, 0, size)
                out[f"{prefix}up_proj.{kind}"] = param_.data.narrow(0, size, size)
        out.update(quantized_views(prefix, {"gate_proj": (0, size), "up_proj": (size, size)}, self.gate_up_scale))
        out[prefix + "down_proj.weight"] = self.down_weight.data
        out.update(quantized_views(prefix, {"down_proj": (0, self.hidden_size)}, self.down_scale))
        if self.down_bias is not None:
            out[prefix + "down_proj.bias"] = self.down_bias.data
        return out

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:  # [R, H] -> [R, H]
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_scale)  # [R, 2I]
        if lora is not None:
            gate_up = lora.add("gate_up", x, gate_up)
        if self.fused_act_mul is not None:
            h = self.fused_act_mul(gate_up, self.act_name)  # [R, I]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act(gate) * up  # [R, I]
        out = linear(h, self.down_weight, self.down_bias, self.down_scale)
        return out if lora is None else lora.add("down", h, out)

    def matmuls(self) -> list[Matmul]:
        return [(self.hidden_size, self.gate_up_weight, self.gate_up_bias, self.gate_up_scale),
                (self.intermediate_size, self.down_weight, self.down_bias, self.down_scale)]
