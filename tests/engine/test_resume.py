"""A resumed request (EngineRequest.resume_token_ids: tokens an earlier run delivered) goes on exactly as the
uninterrupted run did: greedy and seeded output token for token, its text continuing the text already sent,
stop strings that span the cut, min_tokens, a stop token, a structured format, and a run the delivered tokens
already ended. With the tiny model on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams, StructuredOutput
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.engine import LLMEngine

pytestmark = pytest.mark.slow  # an engine and a dozen generations: in the full suite, not the fast subset

PROMPT = [300 + 17 * i for i in range(12)]


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> LLMEngine:
    return LLMEngine(EngineSettings(model=str(tiny_model_path), device="cpu", dtype="float32",
                                    attention_backend="torch", block_size=16, num_kv_blocks=96,
                                    max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256))


def run(engine: LLMEngine, sampling: SamplingParams, resume: list[int] | None = None, request_id: str = "r",
        prompt: list[int] = PROMPT):
    done = engine.generate([EngineRequest(request_id, prompt_token_ids=prompt, sampling=sampling,
                                          resume_token_ids=resume)])
    return done[request_id]


def sent_text(engine: LLMEngine, tokens: list[int], stop: tuple[str, ...] = (), prompt: list[int] = PROMPT) -> str:
    """The text a stream had sent after these tokens (what the detokenizer emitted, stop-string holdback and all)."""
    detokenizer = IncrementalDetokenizer(engine.tokenizer, prompt, stop=stop)
    return "".join(detokenizer.push([t]) for t in tokens)


def check_resumes(engine: LLMEngine, sampling: SamplingParams, cuts: list[int], prompt: list[int] = PROMPT) -> None:
    full = run(engine, sampling, prompt=prompt)
    assert full.token_ids, full
    for k in cuts:
        k = min(k, len(full.token_ids))
        rest = run(engine, sampling, resume=full.token_ids[:k], request_id=f"resumed-at-{k}", prompt=prompt)
        assert full.token_ids[:k] + rest.token_ids == full.token_ids, k
        assert sent_text(engine, full.token_ids[:k], sampling.stop, prompt) + rest.text == full.text, k
        assert rest.finish_reason == full.finish_reason, k


def test_greedy_and_seeded_output_go_on_token_for_token(engine):
    check_resumes(engine, SamplingParams(max_new_tokens=24, ignore_eos=True), [1, 7, 23])
    check_resumes(engine, SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.9,
                                         seed=1234), [1, 9, 20])
    # With penalties the resumed tokens count as output, as they did in the earlier run.
    check_resumes(engine, SamplingParams(max_new_tokens=20, ignore_eos=True, repetition_penalty=1.5,
                                         frequency_penalty=0.5), [5, 13])


def test_a_run_the_delivered_tokens_already_ended_finishes_at_once(engine):
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    full = run(engine, sampling)
    rest = run(engine, sampling, resume=full.token_ids, request_id="all-delivered")
    assert rest.token_ids == [] and rest.finish_reason == "length"
    # Ended by a stop token (never shown): the last delivered token is that token.
    stop_token = full.token_ids[5]
    stopped = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_token,))
    ended = run(engine, stopped)
    assert ended.token_ids[-1] == stop_token and ended.finish_reason == "stop"
    rest = run(engine, stopped, resume=ended.token_ids, request_id="stop-token-delivered")
    assert rest.token_ids == [] and rest.text == "" and rest.finish_reason == "stop"


def test_stop_strings_across_the_cut_and_min_tokens(engine):
    plain = run(engine, SamplingParams(max_new_tokens=30, ignore_eos=True))
    text = plain.text
    assert len(text) > 40, text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    sampling = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,))
    full = run(engine, sampling)
    assert full.finish_reason == "stop" and stop not in full.text
    check_resumes(engine, sampling, list(range(1, len(full.token_ids) + 1)))
    # min_tokens: a stop token that comes early is masked until min_tokens, in the resumed run as in the first.
    early = plain.token_ids[2]
    masked = SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=(early,), min_tokens=10)
    check_resumes(engine, masked, [1, 3, 9, 10, 11])


def test_structured_output_replays_its_grammar(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    sampling = SamplingParams(max_new_tokens=60, structured=StructuredOutput("json_schema", json.dumps(schema)))
    full = run(engine, sampling)
    json.loads(full.text)  # the format holds
    check_resumes(engine, sampling, [1, 4, len(full.token_ids) // 2, len(full.token_ids) - 1,
                                     len(full.token_ids)])
