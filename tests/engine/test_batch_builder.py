"""build_step_batch: the scheduler's output laid out as the model runner's plain-int StepBatch."""

from __future__ import annotations

from tests.engine.fake_runner import FakeRunner, make_request, make_scheduler
from worker.engine.batch_builder import build_step_batch


def test_a_prefill_chunk_and_a_decode_are_laid_out_request_after_request():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=10)  # block_size 4
    a, b = make_request("a", 6, max_new_tokens=4), make_request("b", 9, max_new_tokens=4, arrival_time=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)

    first = scheduler.schedule(0.0)  # a: its whole prompt; b: a 4-token chunk within the budget of 10
    batch = build_step_batch(first)
    assert batch.input_ids == a.prompt_token_ids + b.prompt_token_ids[:4]
    assert batch.positions == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2])
    assert batch.slot_mapping == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    assert batch.query_start_loc == [0, 6, 10] and batch.seq_lens == [6, 4]
    assert batch.logits_indices == [5]  # b's chunk does not reach its last token: nothing to sample
    assert batch.block_table_rows == [[0, 1], [2]]
    scheduler.update(first, FakeRunner(16, 4).step(first), 0.0)

    second = scheduler.schedule(0.0)  # a decodes one token; b finishes its prompt
    batch = build_step_batch(second)
    assert batch.input_ids == a.output_token_ids + b.prompt_token_ids[4:]
    assert batch.positions == [6, 4, 5, 6, 7, 8]
    assert batch.slot_mapping == [6, 12, 13, 14, 15, 16]
    assert batch.query_start_loc == [0, 1, 6] and batch.seq_lens == [7, 9]
    assert batch.logits_indices == [0, 5]
    assert batch.block_table_rows == [[0, 1], [2, 3, 4]]
