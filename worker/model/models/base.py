"""What every family's model shares: the embedding, the layer loop over a flat, ragged batch of tokens (no
padding, no transformers), the final norm and LM head, RoPE tables, and row buckets.

T = tokens in the step, S = rows whose logits are wanted, H = hidden size, D = head dim, V = vocab size.
A family subclasses `CausalLM` with its layer class, norm and checkpoint names (worker/model/models/*.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionBackend
from worker.model.compiled_cpu import OneRowSteps, compilable
from worker.model.config import ModelConfig
from worker.model.input import AttentionMetadata
from worker.model.lora import LoraStep
from worker.model.layers import Matmul, Norm, param, rms_norm, rope_tables
from worker.model.quantize import pack_for_cpu, quantize_int8

INT8_HEAD_MAX_ROWS = 4
"""Steps sampling at most this many rows multiply by the int8 head (quantize_head); the bf16 head at more, where
the int8 kernel turns slower (SmolLM2's head out of cache: 1.2 against 1.5 ms at 4 rows, 2.2 against 1.7 at 8)."""


class CausalLM(nn.Module):
    norm: Norm = staticmethod(rms_norm)
    """The family's RMSNorm (final norm and, through the layers, the others)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layers: list[nn.Module], max_positions: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed = param(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.final_norm = param(config.hidden_size, device=device, dtype=dtype)
        # Tied models share the embedding matrix; the loader fills lm_head only when it is separate.
        self.lm_head = (
            self.embed if config.tie_word_embeddings
            else param(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        )
        cos, sin = rope_tables(config, max_positions, device, dtype)  # [P, rotary_dim] each
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_signed_sin", sin, persistent=False)
        self.local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        """(cos, signed sin) of the windowed layers' own RoPE, where the family has one (Gemma3)."""
        self.fused_add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        """kernels.fused.add_rms_norm where the layers run fused (use_fused_kernels)."""
        self.packed_head: torch.Tensor | None = None
        """The LM head in oneDNN's packed layout (pack_weights), which lm_head_logits then multiplies by."""
        self.one_row_steps: OneRowSteps | None = None
        """Compiled one-row steps (compile_one_row_steps), which forward runs a lone decode row through."""
        self.int8_head: tuple[torch.Tensor, torch.Tensor] | None = None
        """(int8 weight, per-row scales) of the LM head (quantize_head), for steps sampling a few rows."""
        self.embed_scale: float | None = None
        """Embeddings are multiplied by this (in the model dtype), where the family scales them (Gemma)."""

        self.row_buckets: tuple[int, ...] = ()
        """Sizes every matmul's row count is padded up to (none: no padding). On the CPU, oneDNN builds and
        caches a kernel for each distinct matmul shape it meets, about 0.6 MB each and up to 1,024 of them per
        cache: a worker whose steps have every token count from 1 to 512 grows by hundreds of MB over hours.
        Padding to a fixed set of sizes bounds the shapes, and ModelRunner builds them all at start-up."""

    @property
    def max_positions(self) -> int:
        return self.rope_cos.shape[0]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Hugging Face tensor name -> the view of our parameters it fills (the loader checks shapes)."""
        out = {"model.embed_tokens.weight": self.embed.data, "model.norm.weight": self.final_norm.data}
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.data
        for i, layer in enumerate(self.layers):
            out.update(layer.checkpoint_tensors(f"model.layers.{i}."))
        return out

    def matmuls(self) -> list[Matmul]:
        """(input width, weight, bias, int8 or FP8 scales) of every distinct matmul shape a step runs per row: every
        layer of a family has the first layer's shapes, but for the expert matmuls, whose rows are the tokens
        routed there."""
        return self.layers[0].matmuls()

    def quantize(self, kind: str, from_checkpoint: bool = False) -> list[str]:
        """Every layer's projection weights to int8 or FP8 with per-channel scales (worker/model/quantize.py):
        made from the float weights, or (`from_checkpoint`) emptied for a checkpoint quantized already to fill.
        The embedding and the LM head stay in the model dtype (an int8 copy of the head is quantize_head's); so
        does a MoE layer's router, and its experts under FP8 (a quantized checkpoint's are widened into them).
        Returns the kinds of layer part left unquantized."""
        skipped = set()
        for layer in self.layers:
            for part in (layer.attn, layer.mlp):
                if kind not in getattr(part, "quantized_kinds", ()):
                    skipped.add(type(part).__name__)
                elif from_checkpoint:
                    part.prepare_quantized(kind)
                else:
                    part.quantize(kind)
        return sorted(skipped)

    def quantize_head(self) -> None:
        """An int8 copy of the LM head beside it, which steps sampling up to INT8_HEAD_MAX_ROWS rows multiply by:
        there the head is read from memory for a few rows, and int8 halves its bytes (SmolLM2's 49152x576 head
        at one row, out of cache: 1.0 ms against 1.4-1.5 for bf16); from 8 rows on the int8 kernel is slower
        than the packed bf16 one. The embedding rows stay in the model dtype."""
        self.int8_head = quantize_int8(self.lm_head.data)

    def compile_one_row_steps(self) -> float:
        """Run every one-row step through torch.compile's pieces (worker/model/compiled_cpu.py), compiled now;
        seconds taken. ValueError naming why where the family cannot."""
        why = compilable(self)
        if why is not None:
            raise ValueError(why)
        steps = OneRowSteps()
        seconds = steps.compile(self)
        self.one_row_steps = steps
        return seconds

    def use_fused_kernels(self) -> int:
        """Triton's fused chains (kernels/fused.py) in every layer, where every layer has them (the Llama graph),
        the residual adds then each fused with the norm after it, and, with the Triton attention backend and a
        rotary embedding over the whole head, RoPE with the KV cache write; the number of layers (0: none)."""
        if not all(hasattr(layer, "forward_deferred") for layer in self.layers) or self.norm is not rms_norm:
            return 0
        whole_head_rotates = (self.config.rotary_dim or self.config.head_dim) == self.config.head_dim
        for layer in self.layers:
            layer.use_fused_kernels()
            if self.backend.name == "triton" and whole_head_rotates:
                from kernels.fused import rope_kv_write  # Triton: imported only where the layers run fused

                layer.attn.fused_rope_kv = rope_kv_write
        self.fused_add_norm = self.layers[0].fused_add_norm
        return len(self.layers)

    def pack_weights(self, layers: bool = True) -> int:
        """Every layer's projection weights (unless `layers` is false: int8 weights have their own kernel) in
        oneDNN's packed layout (worker/model/quantize.py), where they are bf16 on the CPU, and a packed copy of
        the LM head beside it (lm_head_logits takes the plain head for one row, where it is faster, and a tied
        head is the embedding, read row by row); the number packed."""
        packed = 0
        for layer in self.layers if layers else ():
            for part in (layer.attn, layer.mlp):
                if hasattr(part, "pack_weights"):
                    packed += 2 * part.pack_weights()
        self.packed_head = pack_for_cpu(self.lm_head.data)
        return packed + (self.packed_head is not None)

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
        lora: LoraStep | None = None,
    ) -> torch.Tensor:  # [S, V] in the model dtype; a view of logits_out when given
        num_tokens, num_sampled = input_ids.shape[0], logits_indices.shape[0]
        if self.one_row_steps is not None and num_tokens == 1 and lora is None and self.padded_rows(1) == 1:
            return self.one_row_steps.forward(self, input_ids, positions, kv_caches, meta, logits_out)[:num_sampled]
        hidden = self.embed_tokens(self._pad(input_ids))  # [T, H]
        rope = [(self.rope_cos[positions].unsqueeze(1), self.rope_signed_sin[positions].unsqueeze(1))]  # [T, 1, D]
        if self.local_rope is not None:
            rope.append((self.local_rope[0][positions].unsqueeze(1), self.local_rope[1][positions].unsqueeze(1)))
        rows = self._pad(logits_indices)
        eps = self.config.rms_norm_eps
        if self.fused_add_norm is not None:
            pending = None
            for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                cos, sin = rope[layer.rope_index]
                hidden, pending = layer.forward_deferred(hidden, pending, cos, sin, kv_cache, meta, self.backend,
                                                         num_tokens, None if lora is None else lora.layer(index))
            # The last MLP's output joins the residual of the sampled rows only, in the final norm's kernel.
            hidden, _ = self.fused_add_norm(pending[rows], hidden[rows], self.final_norm, eps)  # [S, H]
            return self.lm_head_logits(hidden, logits_out)[:num_sampled]  # [S, V]
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos, sin = rope[layer.rope_index]
            if lora is None:
                hidden = layer(hidden, cos, sin, kv_cache, meta, self.backend, num_tokens)
            else:
                hidden = layer(hidden, cos, sin, kv_cache, meta, self.backend, num_tokens, lora.layer(index))
        # Norm and LM head only for the rows that sample: the head is the largest matmul per token.
        hidden = self.norm(hidden[rows], self.final_norm, eps)  # [S, H]
        return self.lm_head_logits(hidden, logits_out)[:num_sampled]  # [S, V]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        hidden = self.embed[input_ids]
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden

    def lm_head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[R, H] -> [R, V], written into the first R rows of `out` when it has them (the same kernel and the
        same numbers as without); soft-capped where the family caps its logits."""
        rows = hidden.shape[0]
        into = out[:rows] if out is not None and out.shape[0] >= rows else None
        if self.int8_head is not None and rows <= INT8_HEAD_MAX_ROWS:
            logits = torch._weight_int8pack_mm(hidden, *self.int8_head)
            logits = logits if into is None else into.copy_(logits)
        elif self.packed_head is not None and rows > 1:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, self.packed_head, None, "none", [], "")
            logits = logits if into is None else into.copy_(logits)
        elif into is None:
            logits = F.linear(hidden, self.lm_head)
        else:
            logits = torch.mm(hidden, self.lm_head.t(), out=into)
        cap = self.config.final_logit_softcap
        if cap is not None:  # in place, so logits written into `out` stay there
            logits.div_(cap).tanh_().mul_(cap)
        return logits
