"""On the CPU the engine's steps write their logits into buffers the runner keeps (ModelRunner.launch), so a
burst of large steps allocates no vocabulary-sized arrays that would stay in the allocator's arenas
(docs/memory.md). The logits must be those of a fresh forward, whatever the dtype and the rows."""

from __future__ import annotations

import pytest
import torch

from tests.model.batch import BLOCK, Chunk, make_input, random_tokens, tiny_settings
from worker.model.runner import ModelRunner


def _step(rows: int, seed: int):
    return make_input([Chunk(random_tokens(3, seed=seed * 100 + i), 0, [1 + i]) for i in range(rows)], BLOCK)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launched_logits_are_a_fresh_forwards_and_last_until_the_next_launch(tiny_model_path, dtype):
    runner = ModelRunner(tiny_model_path, tiny_settings(dtype=dtype, max_num_seqs=8))
    for rows in (1, 8, 3):
        step = _step(rows, seed=rows)
        expected = runner.execute(step)
        launched = runner.launch(step).result()
        assert launched.dtype == torch.float32 and launched.shape == expected.shape
        torch.testing.assert_close(launched, expected, rtol=0, atol=0)
    first = runner.launch(_step(2, seed=7)).result()
    kept = first.clone()
    runner.execute(_step(2, seed=8))  # a test's or benchmark's own forward leaves the engine's logits alone
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    second = runner.launch(_step(2, seed=9)).result()
    assert second.data_ptr() == first.data_ptr()  # the same rows, reused: nothing vocabulary-sized allocated
    assert not torch.equal(second, kept)


def test_a_step_larger_than_the_buffers_still_gets_its_logits(tiny_model_path):
    """More rows than max_num_seqs (a caller asking for every token's logits): a forward of its own."""
    runner = ModelRunner(tiny_model_path, tiny_settings(max_num_seqs=2))
    step = make_input([Chunk(random_tokens(6, seed=1), 0, [1, 2])], BLOCK, all_logits=True)
    torch.testing.assert_close(runner.launch(step).result(), runner.execute(step), rtol=0, atol=0)
