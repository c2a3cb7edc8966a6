"""TritonAttention: the CUDA attention backend built on the kernels in kernels/.

Each step writes the new K/V into the paged cache, then runs the decode kernel (one query per request,
split-context when the GPU would otherwise sit idle) when every request brings exactly one token, and the
ragged prefill kernel otherwise (prefill, chunked prefill, prefix-cache hits and mixed batches).
"""

from __future__ import annotations

import torch

from kernels.kv_write import write_kv
from kernels.paged_decode import paged_decode_attention
from kernels.ragged_prefill import ragged_prefill_attention
from worker.model.attention import AttentionBackend
from worker.model.input import AttentionMetadata


class TritonAttention(AttentionBackend):
    name = "triton"

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # The decode kernel maps q row b to request b, which holds only if every request has one token:
        # max_query_len == 1 with T == B (a request with 0 new tokens would shift the rows).
        if meta.is_decode_only and q.shape[0] == meta.seq_lens.shape[0]:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, max_seq_len=meta.max_seq_len
            )
        return ragged_prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, meta.max_query_len
        )
