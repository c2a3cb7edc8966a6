"""Our Llama forward over paged, ragged batches equals transformers' logits (float32, tiny random model)."""

from __future__ import annotations

import pytest
import torch

from tests.model.batch import BLOCK, Chunk, assert_logits_close, hf_logits, make_input, random_tokens, tiny_settings
from worker.model.runner import ModelRunner


@pytest.fixture(scope="module", params=["off", "on"])
def runner(tiny_model_path, request) -> ModelRunner:
    """Every test twice: rows as they come, and padded to the row buckets (ENGINE_ROW_BUCKETS), whose padding
    must change no real row's logits."""
    runner = ModelRunner(tiny_model_path, tiny_settings(row_buckets=request.param))
    assert bool(runner.model.row_buckets) == (request.param == "on")
    return runner


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def test_runner_exposes_model_facts(runner):
    assert runner.vocab_size == 49152
    assert runner.num_blocks == 64 and runner.block_size == BLOCK
    assert runner.max_model_len == 512
    assert 2 in runner.eos_token_ids  # <|im_end|>, from config and generation_config
    assert runner.tokenizer.decode([2]) == "<|im_end|>"
    assert runner.kv_caches[0][0].shape == (64, BLOCK, 2, 64)  # GQA: 2 KV heads of dim 64


@pytest.mark.slow
def test_single_prompt_prefill_all_positions(runner, hf_model):
    prompt = random_tokens(13, seed=1)
    # Non-contiguous, unordered blocks: the block table, not the cache order, defines the sequence.
    model_input = make_input([Chunk(prompt, 0, [9, 2, 30, 5])], BLOCK, all_logits=True)
    assert_logits_close(runner.execute(model_input), hf_logits(hf_model, prompt))


def test_ragged_batch_of_three_prompts(runner, hf_model):
    prompts = [random_tokens(n, seed=10 + n) for n in (5, 11, 2)]
    chunks = [Chunk(prompts[0], 0, [1, 3]), Chunk(prompts[1], 0, [40, 12, 6]), Chunk(prompts[2], 0, [7])]
    logits = runner.execute(make_input(chunks, BLOCK, all_logits=True))
    ref = torch.cat([hf_logits(hf_model, p) for p in prompts])
    assert_logits_close(logits, ref)


def test_decode_steps_after_prefill(runner, hf_model):
    # Three requests of different lengths prefilled together, then decoded together for several steps:
    # the batched decode path pads contexts to the longest and must mask the rest.
    prompts = [random_tokens(n, seed=20 + n) for n in (6, 1, 9)]
    tables = [[11, 13, 14], [15, 17], [19, 21, 23, 25]]
    logits = runner.execute(make_input([Chunk(p, 0, t) for p, t in zip(prompts, tables)], BLOCK))
    seqs = [list(p) for p in prompts]
    for _ in range(4):
        next_ids = logits.argmax(-1).tolist()
        chunks = []
        for seq, table, token in zip(seqs, tables, next_ids):
            chunks.append(Chunk([token], len(seq), table))
            seq.append(token)
        logits = runner.execute(make_input(chunks, BLOCK))
        assert_logits_close(logits, torch.stack([hf_logits(hf_model, s)[-1] for s in seqs]))


def test_chunked_prefill_across_two_steps(runner, hf_model):
    prompt = random_tokens(21, seed=3)
    table = [33, 34, 8, 35, 36, 37]
    first = runner.execute(make_input([Chunk(prompt[:10], 0, table)], BLOCK, all_logits=True))
    second = runner.execute(make_input([Chunk(prompt[10:], 10, table)], BLOCK, all_logits=True))
    assert_logits_close(torch.cat([first, second]), hf_logits(hf_model, prompt))


def test_mixed_step_of_decode_chunk_and_fresh_prefill(runner, hf_model):
    a, b = random_tokens(7, seed=4), random_tokens(12, seed=5)
    c = random_tokens(5, seed=6)
    runner.execute(make_input([Chunk(a[:6], 0, [41, 42]), Chunk(b[:4], 0, [43, 44, 45])], BLOCK))
    # One step: a decodes its 7th token, b prefills a chunk over its cached 4, c arrives fresh.
    step = [Chunk(a[6:], 6, [41, 42]), Chunk(b[4:], 4, [43, 44, 45]), Chunk(c, 0, [46, 47])]
    logits = runner.execute(make_input(step, BLOCK, all_logits=True))
    ref = torch.cat([hf_logits(hf_model, a)[6:], hf_logits(hf_model, b)[4:], hf_logits(hf_model, c)])
    assert_logits_close(logits, ref)


def test_prefix_cache_hit_reuses_blocks_of_another_request(runner, hf_model):
    shared = random_tokens(8, seed=7)  # two full blocks
    first = shared + random_tokens(3, seed=8)
    second = shared + random_tokens(6, seed=9)
    runner.execute(make_input([Chunk(first, 0, [50, 51, 52])], BLOCK))
    # The second request finds blocks 50 and 51 cached and computes only its own tail.
    logits = runner.execute(make_input([Chunk(second[8:], 8, [50, 51, 53, 54])], BLOCK, all_logits=True))
    assert_logits_close(logits, hf_logits(hf_model, second)[8:])


def test_slot_minus_one_is_not_written(runner):
    prompt = random_tokens(4, seed=12)
    k_cache = runner.kv_caches[0][0]
    k_cache[60].fill_(7.0)
    runner.execute(make_input([Chunk(prompt, 0, [60], skip_write=[1, 3])], BLOCK))
    assert torch.all(k_cache[60, 1] == 7.0) and torch.all(k_cache[60, 3] == 7.0)
    assert not torch.all(k_cache[60, 0] == 7.0) and not torch.all(k_cache[60, 2] == 7.0)


def test_greedy_generation_matches_transformers_generate(runner, hf_model):
    prompt = random_tokens(9, seed=13)
    table = list(range(10, 20))
    logits = runner.execute(make_input([Chunk(prompt, 0, table)], BLOCK))
    seq = list(prompt)
    for _ in range(20):
        token = int(logits.argmax(-1)[0])
        seq.append(token)
        logits = runner.execute(make_input([Chunk([token], len(seq) - 1, table)], BLOCK))
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    assert seq == ref[0].tolist()
    assert len(set(seq[9:])) > 5  # the tiny model's output varies, so the comparison means something


def test_sequence_longer_than_max_model_len_is_refused(runner):
    prompt = random_tokens(4, seed=14)
    model_input = make_input([Chunk(prompt, 510, [0] * 129)], BLOCK)
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute(model_input)
