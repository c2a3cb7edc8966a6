"""Our own Llama-family forward pass over a flat, ragged batch of tokens (no padding, no transformers).

T = tokens in the step, S = rows whose logits are wanted, H = hidden size, Hq/Hkv = query/KV heads,
D = head dim, I = MLP intermediate size, V = vocab size.

Weights are kept fused (q|k|v in one matrix, gate|up in another) because one larger matmul beats three
small ones, on the CPU especially; `worker.model.loader` fills them from Hugging Face tensor names.
Parameters are created uninitialized: the loader overwrites every one of them.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig, rope_cos_sin
from worker.model.input import AttentionMetadata


def _param(*shape: int, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [N, H] -> [N, H]
    # Statistics in float32 and the weight applied after casting back, exactly as transformers does, so
    # bf16 results track the reference too.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/signed_sin: [T, 1, D]. rotate_half convention: x * cos + cat(-x2, x1) * sin.
    # The minus sign lives in signed_sin (first half negated), which saves a negation per call and
    # gives the same floats: negation is exact.
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, device, dtype) -> None:
        super().__init__()
        c = config
        self.config = c
        self.scale = c.head_dim**-0.5
        self.input_norm = _param(c.hidden_size, device=device, dtype=dtype)
        self.qkv_weight = _param(c.q_size + 2 * c.kv_size, c.hidden_size, device=device, dtype=dtype)
        self.qkv_bias = _param(c.q_size + 2 * c.kv_size, device=device, dtype=dtype) if c.qkv_bias else None
        self.o_weight = _param(c.hidden_size, c.q_size, device=device, dtype=dtype)
        self.o_bias = _param(c.hidden_size, device=device, dtype=dtype) if c.o_bias else None
        self.post_attn_norm = _param(c.hidden_size, device=device, dtype=dtype)
        self.gate_up_weight = _param(2 * c.intermediate_size, c.hidden_size, device=device, dtype=dtype)
        self.gate_up_bias = _param(2 * c.intermediate_size, device=device, dtype=dtype) if c.mlp_bias else None
        self.down_weight = _param(c.hidden_size, c.intermediate_size, device=device, dtype=dtype)
        self.down_bias = _param(c.hidden_size, device=device, dtype=dtype) if c.mlp_bias else None

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], first half negated (see apply_rope)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_tokens: int | None = None,
    ) -> torch.Tensor:  # [T, H]
        """`num_tokens` < T: rows past it are padding (see LlamaModel.row_buckets), left out of attention; the
        matmuls run over all T rows."""
        c = self.config
        num_rows = hidden.shape[0]
        num_tokens = num_rows if num_tokens is None else num_tokens
        x = rms_norm(hidden, self.input_norm, c.rms_norm_eps)
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)[:num_tokens]  # [T, (Hq + 2 Hkv) D]
        # q and k heads rotate together: one set of elementwise ops instead of two.
        qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = apply_rope(qk, cos, sin)  # [T, Hq + Hkv, D]
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, c.q_size + c.kv_size :].reshape(num_tokens, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        attn = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, Hq, D]
        attn = attn.reshape(num_tokens, c.q_size)
        if num_rows > num_tokens:
            attn = F.pad(attn, (0, 0, 0, num_rows - num_tokens))
        hidden = hidden + F.linear(attn, self.o_weight, self.o_bias)

        x = rms_norm(hidden, self.post_attn_norm, c.rms_norm_eps)
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)  # [T, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, self.down_weight, self.down_bias)


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed = _param(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(LlamaLayer(config, device, dtype) for _ in range(config.num_layers))
        self.final_norm = _param(config.hidden_size, device=device, dtype=dtype)
        # Tied models share the embedding matrix; the loader fills lm_head only when it is separate.
        self.lm_head = (
            self.embed if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        )
        # Computed in float32 and cast once, as transformers casts its cos/sin to the activation dtype.
        cos, sin = rope_cos_sin(config, max_positions)  # [P, D] each
        half = config.head_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_signed_sin", signed_sin.to(device=device, dtype=dtype), persistent=False)

        self.row_buckets: tuple[int, ...] = ()
        """Sizes every matmul's row count is padded up to (none: no padding). On the CPU, oneDNN builds and
        caches a kernel for each distinct matmul shape it meets, about 0.6 MB each and up to 1,024 of them per
        cache: a worker whose steps have every token count from 1 to 512 grows by hundreds of MB over hours.
        Padding to a fixed set of sizes bounds the shapes, and ModelRunner builds them all at start-up."""

    @property
    def max_positions(self) -> int:
        return self.rope_cos.shape[0]

    def padded_rows(self, rows: int) -> int:
        """The smallest row bucket that holds `rows`; `rows` itself past the largest or without buckets."""
        index = bisect.bisect_left(self.row_buckets, rows)
        return self.row_buckets[index] if index < len(self.row_buckets) else rows

    def _pad(self, indices: torch.Tensor) -> torch.Tensor:  # [N] -> [padded_rows(N)], padded with index 0
        extra = self.padded_rows(indices.shape[0]) - indices.shape[0]
        return F.pad(indices, (0, extra)) if extra else indices

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, 2 x [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] int64
        logits_out: torch.Tensor | None = None,  # [>= padded S, V] in the model dtype
    ) -> torch.Tensor:  # [S, V] in the model dtype; a view of logits_out when given
        num_tokens, num_sampled = input_ids.shape[0], logits_indices.shape[0]
        hidden = self.embed[self._pad(input_ids)]  # [T, H]
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rope_signed_sin[positions].unsqueeze(1)  # [T, 1, D]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta, self.backend, num_tokens)
        # Norm and LM head only for the rows that sample: the head is the largest matmul per token.
        hidden = rms_norm(hidden[self._pad(logits_indices)], self.final_norm, self.config.rms_norm_eps)  # [S, H]
        return self.lm_head_logits(hidden, logits_out)[:num_sampled]  # [S, V]

    def lm_head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[R, H] -> [R, V], written into the first R rows of `out` when it has them (the same kernel and the
        same numbers as without)."""
        if out is None or out.shape[0] < hidden.shape[0]:
            return F.linear(hidden, self.lm_head)
        return torch.mm(hidden, self.lm_head.t(), out=out[:hidden.shape[0]])
