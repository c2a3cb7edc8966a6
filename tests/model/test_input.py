"""build_model_input: a StepBatch's plain ints become the forward's tensors, block tables padded to a rectangle; and
PersistentInput, which builds the same tensors from per-request rows kept between steps."""

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


def test_persistent_input_copies_only_new_blocks_and_forgets_released_requests():
    from worker.model.input import PersistentInput
    from worker.model.step_batch import StepRequests

    inputs = PersistentInput(max_blocks_per_request=8, block_size=4, device="cpu", num_rows=1)
    table_a, table_b = [7], [3, 4]
    step = StepRequests(request_ids=["a", "b"], block_ids=[table_a, table_b], num_computed=[0, 5], num_new=[3, 1],
                        samples=[True, True], input_ids=[11, 12, 13, 14])
    model_input = inputs.build(step)  # grows to two rows
    assert model_input.positions.tolist() == [0, 1, 2, 5] and model_input.attn.slot_mapping.tolist() == [28, 29, 30, 17]
    assert model_input.attn.block_tables.tolist() == [[7, 0], [3, 4]] and model_input.logits_indices.tolist() == [2, 3]
    table_a.append(9)  # a grows past its first block; b decodes
    step = StepRequests(request_ids=["a", "b"], block_ids=[table_a, table_b], num_computed=[3, 6], num_new=[2, 1],
                        samples=[True, True], input_ids=[15, 16, 17])
    model_input = inputs.build(step)
    assert model_input.attn.slot_mapping.tolist() == [31, 36, 18] and model_input.attn.seq_lens.tolist() == [5, 7]
    assert model_input.attn.block_tables.tolist() == [[7, 9], [3, 4]]
    # Released (finished, preempted) or forgotten (a new engine): the next table is copied afresh.
    inputs.release(["a"])
    step = StepRequests(request_ids=["a"], block_ids=[[5, 6]], num_computed=[4], num_new=[1], samples=[True],
                        input_ids=[18])
    assert inputs.build(step).attn.slot_mapping.tolist() == [24]
    inputs.reset()
    assert inputs.num_rows_in_use == 0
    step = StepRequests(request_ids=["b"], block_ids=[[2]], num_computed=[0], num_new=[2], samples=[False],
                        input_ids=[1, 2])
    model_input = inputs.build(step)
    assert model_input.attn.slot_mapping.tolist() == [8, 9] and model_input.logits_indices.tolist() == []
