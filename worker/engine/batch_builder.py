"""A step's `SchedulerOutput` as the model runner's `StepBatch`: plain ints gathered request after request.

Planning only, no torch: the model runner builds the tensors from it on its own device.
"""

from __future__ import annotations

from worker.engine.scheduler_output import SchedulerOutput
from worker.model.step_batch import StepBatch


def build_step_batch(output: SchedulerOutput) -> StepBatch:
    block_size = output.block_size
    batch = StepBatch()
    for entry in output.scheduled:
        batch.input_ids += entry.token_ids()
        batch.positions += entry.positions()
        batch.slot_mapping += entry.slot_mapping(block_size)
        batch.query_start_loc.append(batch.query_start_loc[-1] + entry.num_new_tokens)
        batch.seq_lens.append(entry.seq_len)
        if entry.samples:
            batch.logits_indices.append(batch.query_start_loc[-1] - 1)
        # Only the blocks the context spans: the table may already hold blocks for later tokens.
        batch.block_table_rows.append(entry.request.block_ids[: -(-entry.seq_len // block_size)])
    return batch
