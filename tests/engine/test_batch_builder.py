"""build_step_batch: the scheduler's output laid out as the model runner's plain-int StepBatch."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("drafting", [False, True])
@pytest.mark.parametrize("kv_window", [None, 6])
def test_persistent_input_equals_the_explicit_layout_through_preemption_and_prefix_hits(kv_window, drafting):
    """Random traffic on a tight KV budget (preemptions, prefix-cache hits, chunked prefill): at every step the
    runner's incremental tensors equal those of the explicit per-token batch, block tables compared over each
    request's context (past it the persistent rows hold stale ids nothing reads). With a window on every layer,
    the entries given back read -1 in the persistent rows too, not the ids they held (now another's). With
    speculative drafts, the drafts follow each drafting request's last token and its logits rows cover them."""
    import random

    from tests.engine.fake_runner import Simulation
    from tests.engine.test_speculative import draft_for
    from worker.engine.batch_builder import build_step_requests
    from worker.model.input import PersistentInput, build_model_input

    rng = random.Random(3)
    # Fewer blocks under a window: given back as requests go, 24 would not run out (nor 12 when drafts shorten
    # the run).
    num_blocks = 24 if kv_window is None else 10 if drafting else 12
    sim = Simulation(make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=24, max_num_seqs=6,
                                    kv_window=kv_window))
    inputs = PersistentInput(max_blocks_per_request=64, block_size=sim.scheduler.block_size, device="cpu",
                             num_rows=2)  # grows as needed
    num_checked = 0
    for _ in range(300):
        if rng.random() < 0.3:
            sim.add(rng.randint(0, 32), rng.randint(1, 20), rng.randint(1, 12), rng.randint(0, 2), None, True)
        output = sim.scheduler.schedule(sim.now)
        inputs.release(output.preempted_request_ids)
        if not output.is_empty:
            ours = inputs.build(build_step_requests(output))
            ref = build_model_input(build_step_batch(output), "cpu")
            for name in ("input_ids", "positions", "logits_indices"):
                assert torch.equal(getattr(ours, name), getattr(ref, name)), name
            for name in ("slot_mapping", "query_start_loc", "seq_lens"):
                assert torch.equal(getattr(ours.attn, name), getattr(ref.attn, name)), name
            assert (ours.attn.max_query_len, ours.attn.max_seq_len) == (ref.attn.max_query_len, ref.attn.max_seq_len)
            for row, seq_len in enumerate(ref.attn.seq_lens.tolist()):
                span = -(-seq_len // sim.scheduler.block_size)
                assert torch.equal(ours.attn.block_tables[row, :span], ref.attn.block_tables[row, :span])
            num_checked += 1
        updates = sim.scheduler.update(output, sim.runner.step(output), sim.now)
        inputs.release(u.request_id for u in updates if u.finished)
        sim.now += 0.01
        if drafting:
            draft_for(sim.scheduler, rng, 4)
    assert num_checked > 200 and sim.scheduler.num_preemptions > 0 and sim.scheduler.pool.num_hit_tokens > 0
    assert (sim.scheduler.pool.num_window_freed > 0) == (kv_window is not None)


def test_a_step_scheduled_while_the_previous_is_in_flight_marks_the_inputs_it_waits_for():
    """Async scheduling: the second schedule() runs before update() of the first. a (prompt done in the first
    step) decodes the token the first step samples; b continues its prompt; a's last token is never scheduled
    past max_new_tokens."""
    from worker.engine.batch_builder import build_step_requests

    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=10)  # block_size 4
    a, b = make_request("a", 6, max_new_tokens=2), make_request("b", 9, max_new_tokens=4, arrival_time=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule(0.0)
    assert (a.num_inflight_tokens, a.num_pending_samples, b.num_inflight_tokens) == (6, 1, 4)
    second = scheduler.schedule(0.0)  # the first step still in flight
    step = build_step_requests(second)
    assert step.request_ids == ["a", "b"] and step.num_computed == [6, 4] and step.num_new == [1, 5]
    assert step.input_ids == [0] + b.prompt_token_ids[4:] and step.pending == [(0, "a")]
    assert step.samples == [True, True]
    runner = FakeRunner(16, 4)
    scheduler.update(first, runner.step(first), 0.0)
    assert (a.num_computed_tokens, a.num_inflight_tokens, a.num_pending_samples) == (6, 1, 1)
    assert a.num_output_tokens == 1
    # a has 1 of 2 tokens and its last in flight: nothing more is scheduled for it; b decodes its first token.
    third = scheduler.schedule(0.0)
    assert [entry.request_id for entry in third.scheduled] == ["b"]
    assert build_step_requests(third).pending == [(0, "b")]
    scheduler.update(second, runner.step(second), 0.0)
    assert a.is_finished and a.num_output_tokens == 2
    scheduler.update(third, runner.step(third), 0.0)
    assert (b.num_output_tokens, b.num_inflight_tokens, b.num_pending_samples) == (2, 0, 0)
    scheduler.check_invariants()
