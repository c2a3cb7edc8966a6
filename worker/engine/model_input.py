"""Turn a SchedulerOutput (plain Python) into the tensors of one forward pass (worker/model/input.py)."""

from __future__ import annotations

import torch

from worker.engine.outputs import ScheduledRequest
from worker.model.input import AttentionMetadata, ModelInput


def build_model_input(scheduled: list[ScheduledRequest], block_size: int, device: torch.device) -> ModelInput:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    block_rows: list[list[int]] = []
    for entry in scheduled:
        input_ids += entry.token_ids()
        positions += entry.positions()
        slot_mapping += entry.slot_mapping(block_size)
        query_start_loc.append(query_start_loc[-1] + entry.num_new_tokens)
        seq_lens.append(entry.seq_len)
        if entry.samples:
            logits_indices.append(query_start_loc[-1] - 1)
        # Only the blocks the context spans: the table may already hold blocks for later tokens.
        block_rows.append(entry.request.block_ids[: -(-entry.seq_len // block_size)])

    max_blocks = max((len(row) for row in block_rows), default=0)
    block_tables = [row + [0] * (max_blocks - len(row)) for row in block_rows]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
    attn = AttentionMetadata(
        slot_mapping=tensor(slot_mapping, torch.int64),  # [T]
        query_start_loc=tensor(query_start_loc, torch.int32),  # [B + 1]
        seq_lens=tensor(seq_lens, torch.int32),  # [B]
        block_tables=tensor(block_tables, torch.int32).reshape(len(block_rows), max_blocks),  # [B, max_blocks]
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return ModelInput(
        input_ids=tensor(input_ids, torch.int64),  # [T]
        positions=tensor(positions, torch.int64),  # [T]
        attn=attn,
        logits_indices=tensor(logits_indices, torch.int64),  # [S]
    )
