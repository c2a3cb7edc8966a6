"""build_model_input: a StepBatch's plain ints become the forward's tensors, block tables padded to a rectangle."""

from __future__ import annotations

import torch

from worker.model.input import build_model_input
from worker.model.step_batch import StepBatch


def test_tensors_hold_the_batch_with_block_tables_padded_by_zeros():
    batch = StepBatch(input_ids=[11, 12, 13, 14], positions=[0, 1, 2, 9], slot_mapping=[12, 13, -1, 29],
                      query_start_loc=[0, 3, 4], seq_lens=[3, 10], block_table_rows=[[3], [5, 6, 7]],
                      logits_indices=[2, 3])
    model_input = build_model_input(batch, "cpu")
    attn = model_input.attn
    assert model_input.input_ids.dtype == model_input.positions.dtype == torch.int64
    assert model_input.input_ids.tolist() == [11, 12, 13, 14] and model_input.positions.tolist() == [0, 1, 2, 9]
    assert model_input.logits_indices.tolist() == [2, 3] and model_input.logits_indices.dtype == torch.int64
    assert attn.slot_mapping.dtype == torch.int64 and attn.slot_mapping.tolist() == [12, 13, -1, 29]
    assert attn.query_start_loc.dtype == attn.seq_lens.dtype == attn.block_tables.dtype == torch.int32
    assert attn.block_tables.tolist() == [[3, 0, 0], [5, 6, 7]]
    assert (attn.max_query_len, attn.max_seq_len, attn.is_decode_only) == (3, 10, False)


def test_an_empty_batch_keeps_two_dimensional_block_tables():
    assert build_model_input(StepBatch(), "cpu").attn.block_tables.shape == (0, 0)
