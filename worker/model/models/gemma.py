"""Gemma2ForCausalLM and Gemma3ForCausalLM (text only, model_type gemma3_text).

What sets the family apart from Llama's: embeddings scaled by sqrt(H); RMSNorm of (1 + weight), taken in float32;
a norm before and after both attention and MLP; a GeGLU MLP (tanh gelu); q.k scaled by query_pre_attn_scalar;
windowed layers alternating with global ones; Gemma2's tanh soft-capping of attention scores and of logits;
Gemma3's per-head q/k norm and its windowed layers' own plain RoPE (rope_local_base_freq).

R = rows (tokens, or padded to a row bucket), T = tokens, H = hidden size, D = head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.input import AttentionMetadata
from worker.model.lora import LayerLora
from worker.model.layers import Attention, GatedMLP, Matmul, offset_rms_norm, param, rope_tables
from worker.model.models.base import CausalLM


class GemmaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, device, dtype) -> None:
        super().__init__()
        c = self.config = config
        self.rope_index = 1 if c.local_rope_theta is not None and c.window_of(layer) is not None else 0
        self.input_layernorm = param(c.hidden_size, device=device, dtype=dtype)
        self.post_attention_layernorm = param(c.hidden_size, device=device, dtype=dtype)
        self.pre_feedforward_layernorm = param(c.hidden_size, device=device, dtype=dtype)
        self.post_feedforward_layernorm = param(c.hidden_size, device=device, dtype=dtype)
        self.attn = Attention(c, layer, device, dtype, norm=offset_rms_norm)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, False, c.hidden_act, device, dtype)

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}{name}.weight": getattr(self, name).data for name in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        return out | self.attn.checkpoint_tensors(prefix + "self_attn.") | self.mlp.checkpoint_tensors(prefix + "mlp.")

    def matmuls(self) -> list[Matmul]:
        return self.attn.matmuls() + self.mlp.matmuls()

    def forward(
        self,
        hidden: torch.Tensor,  # [R, H]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], first half negated (see apply_rope)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_tokens: int,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:  # [R, H]
        eps = self.config.rms_norm_eps
        x = self.attn.forward(offset_rms_norm(hidden, self.input_layernorm, eps), cos, sin, kv_cache, meta, backend,
                              num_tokens, lora)
        hidden = hidden + offset_rms_norm(x, self.post_attention_layernorm, eps)
        x = self.mlp.forward(offset_rms_norm(hidden, self.pre_feedforward_layernorm, eps), lora)
        return hidden + offset_rms_norm(x, self.post_feedforward_layernorm, eps)


class GemmaModel(CausalLM):
    norm = staticmethod(offset_rms_norm)

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        layers = [GemmaLayer(config, i, device, dtype) for i in range(config.num_layers)]
        super().__init__(config, backend, layers, max_positions, device, dtype)
        self.embed_scale = config.hidden_size**0.5
        if config.local_rope_theta is not None:
            self.local_rope = rope_tables(config, max_positions, device, dtype, local=True)
