"""Mixture-of-experts MLP (MixtralForCausalLM, Qwen3MoeForCausalLM): a router picks the top k of E experts per
token with softmax weights; each expert is a SwiGLU MLP of its own.

N = rows, E = experts, k = experts per token, H = hidden size, I = one expert's intermediate size.

Grouped: the (token, expert) assignments are sorted by expert, and each expert that any token chose runs one
matmul pair over exactly its tokens, so a step costs k expert MLPs per token, not E. Experts are summed into
each token in expert order, the order transformers adds them in, so float32 results track it closely.

On CUDA the same grouping runs as two fused Triton kernels (kernels/moe.py: every expert's block of rows in one
launch, no loop over experts on the host, nothing read back to it); tests/kernels/test_moe.py holds the two paths
to each other and to a reference.

With ENGINE_QUANTIZATION=int8 (the CPU) the experts' matrices go int8 too, a scale per row of each expert's
matrix: in a MoE model they are most of the weights a step reads. FP8 leaves them in the model dtype: the fused
kernels take bf16 experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig
from worker.model.layers import ACTIVATIONS, Matmul, param
from worker.model.quantize import empty_quantized_param, linear, quantize_param


class SparseMoE(nn.Module):
    quantized_kinds = ("int8",)
    """The kinds of ENGINE_QUANTIZATION the experts take (the router stays in the model dtype)."""

    def __init__(self, config: ModelConfig, device, dtype) -> None:
        super().__init__()
        c = self.config = config
        self.act = ACTIVATIONS[c.hidden_act]
        size = c.moe_intermediate_size
        self.router_weight = param(c.num_experts, c.hidden_size, device=device, dtype=dtype)
        self.gate_up_weight = param(c.num_experts, 2 * size, c.hidden_size, device=device, dtype=dtype)  # [E, 2I, H]
        self.down_weight = param(c.num_experts, c.hidden_size, size, device=device, dtype=dtype)  # [E, H, I]
        # Mixtral scales each expert's output by the float32 routing weight; Qwen3-MoE casts the weights to the
        # model dtype first. The same numbers in float32; bf16 rounds where the reference rounds.
        self.weights_in_model_dtype = c.architecture == "Qwen3MoeForCausalLM"
        self.gate_up_scale: torch.Tensor | None = None  # [E, 2I], when the experts are int8
        self.down_scale: torch.Tensor | None = None  # [E, H]

    def quantize(self, kind: str) -> None:
        """The experts' matrices to int8, a scale per row of each (worker/model/quantize.py)."""
        self.gate_up_scale = quantize_param(self, "gate_up_weight", kind)  # [E, 2I]
        self.down_scale = quantize_param(self, "down_weight", kind)  # [E, H]

    def prepare_quantized(self, kind: str) -> None:
        """Empty int8 experts and scales, for a checkpoint with int8 experts to fill (or float ones, quantized as
        they load)."""
        self.gate_up_scale = empty_quantized_param(self, "gate_up_weight", kind, self.gate_up_weight.dtype)
        self.down_scale = empty_quantized_param(self, "down_weight", kind, self.down_weight.dtype)

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Mixtral: block_sparse_moe.gate and experts.{e}.w1 (gate), w3 (up), w2 (down); Qwen3-MoE: mlp.gate and
        experts.{e}.gate_proj, up_proj, down_proj. `prefix` ends with the layer's "model.layers.{i}."."""
        size = self.config.moe_intermediate_size
        mixtral = self.config.architecture == "MixtralForCausalLM"
        block = prefix + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        out = {block + "gate.weight": self.router_weight.data}
        for e in range(self.config.num_experts):
            expert = f"{block}experts.{e}."
            out[f"{expert}{names[0]}.weight"] = self.gate_up_weight.data[e].narrow(0, 0, size)
            out[f"{expert}{names[1]}.weight"] = self.gate_up_weight.data[e].narrow(0, size, size)
            out[f"{expert}{names[2]}.weight"] = self.down_weight.data[e]
            if self.gate_up_scale is not None:
                out[f"{expert}{names[0]}.weight_scale"] = self.gate_up_scale[e].narrow(0, 0, size)
                out[f"{expert}{names[1]}.weight_scale"] = self.gate_up_scale[e].narrow(0, size, size)
                out[f"{expert}{names[2]}.weight_scale"] = self.down_scale[e]
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, H] -> [N, k] weights, ids
        probs = torch.softmax(F.linear(x, self.router_weight).float(), dim=-1)  # [N, E] float32
        weights, expert_ids = torch.topk(probs, self.config.num_experts_per_tok, dim=-1)  # [N, k] each
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.weights_in_model_dtype else weights), expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        k = self.config.num_experts_per_tok
        weights, expert_ids = self.route(x)
        if x.device.type == "cuda":
            from kernels.moe import fused_moe  # imported here: Triton is slow to import and absent on some CPUs

            return fused_moe(x, self.gate_up_weight, self.down_weight, weights, expert_ids, self.act)
        flat_weights = weights.reshape(-1)  # [N k]
        # Assignments grouped by expert; a stable sort keeps each expert's tokens in row order.
        order = torch.argsort(expert_ids.reshape(-1), stable=True)  # [N k]
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.config.num_experts).tolist()  # [E]
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            assignments = order[start : start + count]  # [n]
            start += count
            rows = assignments // k  # [n] token rows
            gate_up_scale, down_scale = (None, None) if self.gate_up_scale is None else (self.gate_up_scale[e],
                                                                                          self.down_scale[e])
            gate, up = linear(x[rows], self.gate_up_weight[e], None, gate_up_scale).chunk(2, dim=-1)  # [n, I] each
            y = linear(self.act(gate) * up, self.down_weight[e], None, down_scale) * flat_weights[assignments, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out

    def matmuls(self) -> list[Matmul]:
        return [(self.config.hidden_size, self.router_weight, None, None)]
