"""What the engine hands the model runner for one step: a flat, ragged batch (no padding).

T = tokens scheduled this step (all requests' new tokens concatenated, request after request),
B = requests in the step, S = rows that get a next token sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] int64: flat KV slot (block_id * block_size + offset) each new token's K/V is written to; -1 skips."""
    query_start_loc: torch.Tensor
    """[B + 1] int32: cumulative new-token counts; request b's tokens are [qsl[b], qsl[b+1])."""
    seq_lens: torch.Tensor
    """[B] int32: context length of each request after this step (cached tokens + new tokens)."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32: block ids of each request, padded with 0 past its last block."""
    max_query_len: int
    max_seq_len: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor
    """[T] int64."""
    positions: torch.Tensor
    """[T] int64: position of each token in its own request."""
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    """[S] int64: indices into T whose logits are computed (last token of each request that samples)."""
