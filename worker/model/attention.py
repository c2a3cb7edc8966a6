"""Attention backends: given this step's q/k/v and the paged KV cache, write the new K/V into the cache
and attend over each request's whole context. Implementations: `TorchAttention` (worker/model/torch_attention.py,
the reference and the CPU default) and `TritonAttention` (worker/model/triton_attention.py, the CUDA default)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from worker.model.input import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    supports_windows: bool = False
    """Whether forward takes `window` (sliding-window layers) and `softcap` (attention logit soft-capping)."""

    def fix_kernels(self, num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> int:
        """Keep to attention shapes whose kernels are built now (ENGINE_ROW_BUCKETS), where the library would
        otherwise keep one per shape met; the number of shapes built. A backend without such a cache: 0."""
        return 0

    def prompt_lengths_to_compile(self, num_heads: int, num_kv_heads: int, head_dim: int,
                                  max_query_len: int) -> tuple[int, ...]:
        """Prompt lengths whose steps, run once each at start-up, build every attention kernel this backend
        compiles on first use, so that no request waits for a compile. A backend that compiles nothing: ()."""
        return ()

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write k/v at meta.slot_mapping, then causal attention of each request's new tokens over its
        cached context plus themselves (token i of request b sits at position seq_lens[b] - q_len_b + i).
        `window`: a query at position p sees only keys in (p - window, p]. `softcap`: scores (after `scale`)
        become softcap * tanh(score / softcap) before masking. Both only where `supports_windows`. The Triton
        backend also takes `kv_written=True` (k and v None): the step's K/V are in the caches already, written
        with the rotary embedding by kernels.fused.rope_kv_write."""
