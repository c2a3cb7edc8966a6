"""The pre-norm decoder family: LlamaForCausalLM (SmolLM2), MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM (per-head q/k norm) and, with a mixture of experts in place of the MLP, MixtralForCausalLM and
Qwen3MoeForCausalLM. Phi-3 is this graph too, with other checkpoint names (worker/model/models/phi3.py).

Each layer: x + attn(norm(x)), then x + mlp(norm(x)). T = tokens in the step, R = rows (T, or padded to a row
bucket), H = hidden size, D = head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.input import AttentionMetadata
from worker.model.lora import LayerLora
from worker.model.layers import Attention, GatedMLP, Matmul, param, rms_norm
from worker.model.models.base import CausalLM
from worker.model.models.moe import SparseMoE


class LlamaLayer(nn.Module):
    rope_index = 0
    """Which of the model's RoPE tables this layer uses (one table in this family)."""

    def __init__(self, config: ModelConfig, layer: int, device, dtype) -> None:
        super().__init__()
        c = self.config = config
        self.input_norm = param(c.hidden_size, device=device, dtype=dtype)
        self.attn = Attention(c, layer, device, dtype)
        self.post_attn_norm = param(c.hidden_size, device=device, dtype=dtype)
        self.mlp = (SparseMoE(c, device, dtype) if c.is_moe_layer(layer)
                    else GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, c.hidden_act, device, dtype))
        self.fused_add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        """kernels.fused.add_rms_norm where fused kernels run (ENGINE_FUSED_KERNELS)."""

    def use_fused_kernels(self) -> None:
        from kernels.fused import act_mul, add_rms_norm

        self.fused_add_norm = add_rms_norm
        if isinstance(self.mlp, GatedMLP) and self.mlp.act_name in ("silu", "gelu_pytorch_tanh"):
            self.mlp.fused_act_mul = act_mul

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {prefix + "input_layernorm.weight": self.input_norm.data,
               prefix + "post_attention_layernorm.weight": self.post_attn_norm.data}
        out |= self.attn.checkpoint_tensors(prefix + "self_attn.")
        out |= self.mlp.checkpoint_tensors(prefix if isinstance(self.mlp, SparseMoE) else prefix + "mlp.")
        return out

    def matmuls(self) -> list[Matmul]:
        return self.attn.matmuls() + self.mlp.matmuls()

    def forward(
        self,
        hidden: torch.Tensor,  # [R, H]
        cos: torch.Tensor,  # [T, 1, rotary_dim]
        sin: torch.Tensor,  # [T, 1, rotary_dim], first half negated (see apply_rope)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_tokens: int,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:  # [R, H]
        """Rows past `num_tokens` are padding (see CausalLM.row_buckets), left out of attention; the matmuls run
        over all R rows. Sublayers are called through .forward: nn.Module's __call__ costs microseconds per
        call, and no hooks are used."""
        hidden = hidden + self.attn.forward(rms_norm(hidden, self.input_norm, self.config.rms_norm_eps), cos, sin,
                                            kv_cache, meta, backend, num_tokens, lora)
        return self._mlp_block(hidden, lora)

    def pre_attention(self, hidden: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward() up to attention, every row a token, no adapter: the rotated q, k and v."""
        return self.attn.project(rms_norm(hidden, self.input_norm, self.config.rms_norm_eps), cos, sin,
                                 hidden.shape[0])

    def post_attention(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:  # [R, H]
        """forward() from attention's output ([T, Hq, D]) on, no adapter: the residual stream after the MLP."""
        return self._mlp_block(hidden + self.attn.output(attn, hidden.shape[0]), None)

    def _mlp_block(self, hidden: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:  # [R, H]
        return hidden + self._mlp(rms_norm(hidden, self.post_attn_norm, self.config.rms_norm_eps), lora)

    def forward_deferred(
        self,
        hidden: torch.Tensor,  # [R, H], the residual stream without the previous layer's MLP output
        pending: torch.Tensor | None,  # [R, H], that output (None before the first layer)
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_tokens: int,
        lora: LayerLora | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the residual stream, this layer's MLP output not yet added
        """forward() with the fused kernels (ENGINE_FUSED_KERNELS): each residual add runs in one kernel with
        the norm after it, so the MLP's output is handed on unadded, to be added with the next layer's input
        norm (or the model's final norm); the same values as forward()."""
        eps = self.config.rms_norm_eps
        if pending is None:
            x = rms_norm(hidden, self.input_norm, eps)
        else:
            x, hidden = self.fused_add_norm(pending, hidden, self.input_norm, eps)
        attn = self.attn.forward(x, cos, sin, kv_cache, meta, backend, num_tokens, lora)
        x, hidden = self.fused_add_norm(attn, hidden, self.post_attn_norm, eps)
        return hidden, self._mlp(x, lora)

    def _mlp(self, x: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
        # Adapters of a mixture of experts target attention only (worker/model/lora.py refuses the rest).
        return self.mlp.forward(x) if lora is None or isinstance(self.mlp, SparseMoE) else self.mlp.forward(x, lora)


class LlamaModel(CausalLM):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        layers = [LlamaLayer(config, i, device, dtype) for i in range(config.num_layers)]
        super().__init__(config, backend, layers, max_positions, device, dtype)
