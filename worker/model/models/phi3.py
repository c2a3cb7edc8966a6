"""Phi3ForCausalLM: the Llama graph (worker/model/models/llama.py) from a checkpoint that stores q|k|v as one
`qkv_proj` and gate|up as one `gate_up_proj`, in the order our fused weights keep them. Partial rotary
(partial_rotary_factor, Phi-4-mini) and its window are read by the config; longrope scaling is refused there."""

from __future__ import annotations

import torch

from worker.model.models.llama import LlamaModel


class Phi3Model(LlamaModel):
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, view in super().checkpoint_tensors().items():
            if ".self_attn." in name and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
                continue
            if ".mlp." in name and name.rsplit(".", 2)[-2] in ("gate_proj", "up_proj"):
                continue
            out[name] = view
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "self_attn.qkv_proj.weight"] = layer.attn.qkv_weight.data
            if layer.attn.qkv_bias is not None:
                out[p + "self_attn.qkv_proj.bias"] = layer.attn.qkv_bias.data
            out[p + "mlp.gate_up_proj.weight"] = layer.mlp.gate_up_weight.data
            if layer.mlp.gate_up_bias is not None:
                out[p + "mlp.gate_up_proj.bias"] = layer.mlp.gate_up_bias.data
        return out
