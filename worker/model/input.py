"""The tensors of one forward pass, built on the runner's device from the engine's plain `StepBatch`.

T = tokens scheduled this step (all requests' new tokens concatenated, request after request),
B = requests in the step, S = rows that get a next token sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.step_batch import StepBatch


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


def build_model_input(batch: StepBatch, device: torch.device | str) -> ModelInput:
    rows = batch.block_table_rows
    max_blocks = max((len(row) for row in rows), default=0)
    block_tables = [row + [0] * (max_blocks - len(row)) for row in rows]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    qsl = batch.query_start_loc
    attn = AttentionMetadata(
        slot_mapping=tensor(batch.slot_mapping, torch.int64),  # [T]
        query_start_loc=tensor(qsl, torch.int32),  # [B + 1]
        seq_lens=tensor(batch.seq_lens, torch.int32),  # [B]
        # reshape: with B == 0, torch.tensor([]) would be [0] rather than [0, 0].
        block_tables=tensor(block_tables, torch.int32).reshape(len(rows), max_blocks),  # [B, max_blocks]
        max_query_len=max((end - start for start, end in zip(qsl, qsl[1:])), default=0),
        max_seq_len=max(batch.seq_lens, default=0),
    )
    return ModelInput(
        input_ids=tensor(batch.input_ids, torch.int64),  # [T]
        positions=tensor(batch.positions, torch.int64),  # [T]
        attn=attn,
        logits_indices=tensor(batch.logits_indices, torch.int64),  # [S]
    )
