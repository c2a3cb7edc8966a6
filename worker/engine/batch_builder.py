"""A step's `SchedulerOutput` as the model runner's input, plain ints request after request.

`build_step_requests` is what the engine hands the runner each step: per request its id, block table, computed
and new token counts; the runner derives positions, slots and padded block tables in vectorized form from
buffers it keeps between steps. `build_step_batch` lays every token out explicitly (positions, slots, block
table rows): the reference that the runner's incremental input is tested against.

Planning only, no torch: the model runner builds the tensors on its own device.
"""

from __future__ import annotations

from worker.engine.scheduler_output import SchedulerOutput
from worker.model.step_batch import StepBatch, StepRequests


def build_step_batch(output: SchedulerOutput) -> StepBatch:
    block_size = output.block_size
    batch = StepBatch()
    for entry in output.scheduled:
        batch.input_ids += entry.token_ids()
        batch.positions += entry.positions()
        batch.slot_mapping += entry.slot_mapping(block_size)
        batch.query_start_loc.append(batch.query_start_loc[-1] + entry.num_new_tokens)
        batch.seq_lens.append(entry.seq_len)
        end = batch.query_start_loc[-1]
        batch.logits_indices += range(end - entry.num_logits, end)
        # Only the blocks the context spans: the table may already hold blocks for later tokens.
        batch.block_table_rows.append(entry.request.block_ids[: -(-entry.seq_len // block_size)])
    return batch


def build_step_requests(output: SchedulerOutput) -> StepRequests:
    """The same step per request (no per-token lists): the runner derives positions, slots and block tables
    from its persistent buffers. A decode entry costs a few list appends."""
    scheduled = output.scheduled
    requests = [entry.request for entry in scheduled]
    adapters = [request.adapter for request in requests]
    input_ids: list[int] = []
    pending: list[tuple[int, str]] = []
    drafting = False
    for entry in scheduled:  # runs for every request at every step: properties inlined
        request = entry.request
        seq_len = entry.num_computed_before + entry.num_new_tokens
        output_ids = request.output_token_ids
        num_tokens = len(request.prompt_token_ids) + len(output_ids)
        if entry.draft_token_ids:  # its last token, then the drafts it verifies
            input_ids += entry.token_ids()
            drafting = True
        elif seq_len > num_tokens:  # its one input is the token the step in flight samples
            pending.append((len(input_ids), entry.request_id))
            input_ids.append(0)
        elif entry.num_new_tokens == 1 and seq_len == num_tokens and output_ids:
            input_ids.append(output_ids[-1])  # a decode step: the last sampled token
        else:
            input_ids += entry.token_ids()
    return StepRequests(
        request_ids=[entry.request_id for entry in scheduled],
        block_ids=[request.block_ids for request in requests],
        num_computed=[entry.num_computed_before for entry in scheduled],
        num_new=[entry.num_new_tokens for entry in scheduled],
        samples=[entry.samples for entry in scheduled],
        input_ids=input_ids,
        adapters=adapters if any(name is not None for name in adapters) else [],
        pending=pending,
        num_freed=[request.num_freed_blocks for request in requests],
        num_logits=[entry.num_logits for entry in scheduled] if drafting else [],
    )
