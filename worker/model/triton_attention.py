"""TritonAttention: the CUDA attention backend built on the kernels in kernels/.

Each step writes the new K/V into the paged cache, then runs the decode kernel (one query per request,
split-context when the GPU would otherwise sit idle) when every request brings exactly one token, and the
ragged prefill kernel otherwise (prefill, chunked prefill, prefix-cache hits and mixed batches).
"""

from __future__ import annotations

import torch

from kernels.kv_write import write_kv
from kernels.paged_decode import paged_decode_attention
from kernels.ragged_prefill import prefill_block_sizes, ragged_prefill_attention
from worker.model.attention import AttentionBackend
from worker.model.input import AttentionMetadata


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_windows = True

    def prompt_lengths_to_compile(self, num_heads: int, num_kv_heads: int, head_dim: int,
                                  max_query_len: int) -> tuple[int, ...]:
        """One length per tile height the prefill kernel can pick (prefill_block_sizes), each a kernel of its
        own. The height grows with next_power_of_2(length x group size), so the powers of two from 2 up to
        `max_query_len` meet every height. 1 is left out: a lone one-token request goes to the decode kernel,
        which the CUDA graphs' capture builds."""
        if max_query_len < 2:
            return ()
        group_size = num_heads // num_kv_heads
        lengths, heights = [], set()
        for length in sorted({min(2 ** k, max_query_len) for k in range(1, max_query_len.bit_length() + 1)}):
            height, _ = prefill_block_sizes(group_size, length, head_dim)
            if height not in heights:
                heights.add(height)
                lengths.append(length)
        return tuple(lengths)

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
        kv_written: bool = False,
    ) -> torch.Tensor:  # [T, Hq, D]
        """`kv_written`: the step's K/V are in the caches already (kernels.fused.rope_kv_write); k and v unused."""
        if not kv_written:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # The decode kernel maps q row b to request b, which holds only if every request has one token:
        # max_query_len == 1 with T == B (a request with 0 new tokens would shift the rows).
        if meta.is_decode_only and q.shape[0] == meta.seq_lens.shape[0]:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, max_seq_len=meta.max_seq_len,
                window=window, softcap=softcap,
            )
        return ragged_prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, meta.max_query_len,
            window=window, softcap=softcap,
        )
