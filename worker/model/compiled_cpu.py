"""One-row steps compiled on the CPU (ENGINE_CPU_COMPILE): a lone request's decode steps, where a step's time is
its weights' bytes plus the many small operations between the matmuls (norms, residual adds, RoPE, SiLU·mul,
casts), each a Python call and an ATen dispatch of a few microseconds. torch.compile (inductor) fuses the work
between two attentions, from one layer's output projection to the next layer's rotated q/k/v, into one compiled
call; attention runs eagerly between the calls, over the paged cache (the piecewise layout vLLM uses for its CUDA
graphs). One graph serves every layer: the layers are passed in, their weights become the graph's inputs.

Smaller pieces lose: a layer compiled whole, with attention left out by a graph break, enters four compiled
regions, each through dynamo's cache lookup (about 15 µs here), which costs more than the fusions save. Only
one-row steps: a graph is specialised to its row count, and at more rows the matmuls are most of a step.
Families on the Llama graph with gated MLPs (no mixture of experts, no per-layer RoPE tables), with weights
inductor takes as inputs (int8, or bf16 unpacked: not oneDNN's packed layout); LoRA steps run eagerly."""

from __future__ import annotations

import time

import torch
from torch import nn

from worker.model.input import AttentionMetadata
from worker.model.layers import GatedMLP, rms_norm


def _first(layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return layer.pre_attention(hidden, cos, sin)


def _between(layer: nn.Module, following: nn.Module, hidden: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor):
    hidden = layer.post_attention(hidden, attn)
    return (hidden, *following.pre_attention(hidden, cos, sin))


def _last(layer: nn.Module, hidden: torch.Tensor, attn: torch.Tensor, final_norm: torch.Tensor, eps: float):
    return rms_norm(layer.post_attention(hidden, attn), final_norm, eps)


def compilable(model: nn.Module) -> str | None:
    """Why `model` cannot run compiled one-row steps, or None when it can."""
    from worker.model.models.llama import LlamaLayer

    if not all(type(layer) is LlamaLayer and isinstance(layer.mlp, GatedMLP) for layer in model.layers):
        return f"{model.config.architecture}: only the Llama graph with gated MLPs is compiled"
    if model.local_rope is not None or model.norm is not rms_norm or model.fused_add_norm is not None:
        return f"{model.config.architecture}: its norms or RoPE tables are not the Llama graph's"
    if len(model.layers) < 2:
        return "fewer than two layers"
    if model.layers[0].attn.qkv_weight.is_mkldnn:
        # inductor takes a oneDNN-packed weight only as a constant of the graph, and one graph serves every layer
        return ("the layers' weights are packed for oneDNN, which inductor cannot take as inputs: compile with "
                "ENGINE_QUANTIZATION=int8 or ENGINE_CPU_PACKED_WEIGHTS=false")
    return None


class OneRowSteps:
    """The compiled pieces of a one-row step, and the step that runs them (CausalLM.forward calls it)."""

    def __init__(self) -> None:
        def compiled(fn):
            return torch.compile(fn, dynamic=False, fullgraph=True)

        self.first, self.between, self.last = compiled(_first), compiled(_between), compiled(_last)
        self.attn_out: torch.Tensor | None = None
        """[1, Hq, D]: each layer's attention output, handed to the next piece (made by compile)."""

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_out: torch.Tensor | None) -> torch.Tensor:  # [1, V]
        hidden = model.embed_tokens(input_ids)  # [1, H]
        cos, sin = model.rope_cos[positions].unsqueeze(1), model.rope_signed_sin[positions].unsqueeze(1)
        layers = model.layers
        q, k, v = self.first(layers[0], hidden, cos, sin)
        for index, layer in enumerate(layers):
            # Copied into one buffer: the graphs are specialised to their inputs' strides, which the attention
            # paths do not all give alike (a view of q's rows, say).
            attn = self.attn_out.copy_(layer.attn.attend(q, k, v, kv_caches[index], meta, model.backend))
            if index + 1 < len(layers):
                hidden, q, k, v = self.between(layer, layers[index + 1], hidden, attn, cos, sin)
            else:
                hidden = self.last(layer, hidden, attn, model.final_norm, model.config.rms_norm_eps)
        return model.lm_head_logits(hidden, logits_out)

    @torch.inference_mode()
    def compile(self, model: nn.Module) -> float:
        """Compile every piece now, so that no request waits for it; seconds taken. Runs each piece on zeros in
        the shapes and dtype of a one-row step, the middle one over two pairs of layers: one graph for all."""
        start = time.perf_counter()
        c, layers = model.config, model.layers
        hidden = torch.zeros(1, c.hidden_size, device=model.embed.device, dtype=model.embed.dtype)
        positions = torch.zeros(1, dtype=torch.long, device=hidden.device)  # indexed as a step does: guards
        cos, sin = model.rope_cos[positions].unsqueeze(1), model.rope_signed_sin[positions].unsqueeze(1)  # see it
        attn = self.attn_out = torch.zeros(1, c.num_heads, c.head_dim, device=hidden.device, dtype=hidden.dtype)
        self.first(layers[0], hidden, cos, sin)
        for index in range(min(2, len(layers) - 1)):
            self.between(layers[index], layers[index + 1], hidden, attn, cos, sin)
        self.last(layers[-1], hidden, attn, model.final_norm, c.rms_norm_eps)
        return time.perf_counter() - start
