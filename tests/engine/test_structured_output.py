"""Structured output through LLMEngine: constrained and free requests share steps, every constrained output
validates, a refused schema ends in error/invalid_request with the library's message, preemption and a second
run give the same tokens, and a request whose grammar is still compiling waits outside the scheduler.

The tiny random model writes nonsense, but nonsense the grammar allows; the real model's test is at the end
(slow): issue #17's 50 requests over five schemas, greedy and sampled."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jsonschema
import pytest

from benchmarks.lib.structured_schemas import PROMPTS, SCHEMAS
from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams, StructuredOutput
from worker.engine.engine import LLMEngine
from worker.model.structured.manager import GRAMMAR_POLL_S


def tiny_engine(model: Path, num_kv_blocks: int = 160, grammar_compile_timeout_s: float = 60.0) -> LLMEngine:
    """The compile budget is wall-clock time: generous here, so that on a busy shared machine the library's own
    limits, not the clock, decide which formats are refused."""
    return LLMEngine(EngineSettings(model=str(model), device="cpu", dtype="float32", attention_backend="torch",
                                    block_size=16, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=128,
                                    max_num_seqs=16, max_model_len=192,
                                    grammar_compile_timeout_s=grammar_compile_timeout_s))


def schema_request(request_id: str, name: str, temperature: float = 0.0, max_new_tokens: int = 150) -> EngineRequest:
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=7 if temperature else None,
                              structured=spec)
    return EngineRequest(request_id, prompt_token_ids=[300 + len(request_id), 301, 302], sampling=sampling)


FAST_SCHEMAS = ("enums", "numbers", "arrays")
"""The ones whose outputs are short (about 25-40 tokens): the tiny model's forward dominates these tests."""


def constrained_requests(names=FAST_SCHEMAS) -> list[EngineRequest]:
    return [schema_request(f"{name}-{t}", name, t) for name in names for t in (0.0, 1.0)]


def free_requests() -> list[EngineRequest]:
    return [EngineRequest(f"free-{i}", prompt_token_ids=[500 + i, 17, 4000], sampling=SamplingParams(
        max_new_tokens=12, temperature=0.8 * (i % 2), ignore_eos=True)) for i in range(4)]


def assert_valid(completions: dict, requests: list[EngineRequest]) -> None:
    for request in requests:
        done = completions[request.request_id]
        name = request.request_id.rsplit("-", 1)[0]
        assert done.finish_reason == "stop", (request.request_id, done.text)
        jsonschema.validate(json.loads(done.text), SCHEMAS[name])


@pytest.mark.slow  # ~2 s: in the full suite, not the fast subset
def test_constrained_and_free_requests_share_steps_and_free_ones_are_unchanged(tiny_model_path: Path):
    engine = tiny_engine(tiny_model_path)
    alone = {k: v.token_ids for k, v in engine.generate(free_requests()).items()}
    steps = []
    sample_step = engine.sampler.sample_step

    def recording(logits, params, counters=None, history=None, mask=None):
        steps.append((logits.shape[0], len(mask.rows) if mask is not None else 0))
        return sample_step(logits, params, counters, history, mask)

    engine.sampler.sample_step = recording
    constrained = constrained_requests()
    done = engine.generate(constrained + free_requests())
    assert_valid(done, constrained)
    assert {k: done[k].token_ids for k in alone} == alone
    assert any(0 < masked < rows for rows, masked in steps), "constrained and free rows were meant to share a step"


@pytest.mark.slow  # ~3 s: in the full suite, not the fast subset
def test_preemption_and_a_second_run_give_the_same_outputs(tiny_model_path: Path):
    requests = constrained_requests() + [schema_request("nested-0.0", "nested")]
    roomy = tiny_engine(tiny_model_path)
    first = {k: v.token_ids for k, v in roomy.generate(requests).items()}
    tight = tiny_engine(tiny_model_path, num_kv_blocks=12)  # 192 tokens: a request fits, not all of them
    done = tight.generate(requests)
    assert tight.scheduler.num_preemptions > 0, "the KV budget was meant to force preemptions"
    assert {k: v.token_ids for k, v in done.items()} == first
    assert_valid(done, requests)
    # Nothing of a finished request's grammar state leaks into the next one of the same id.
    again = tight.generate(requests[:2])
    assert {k: v.token_ids for k, v in again.items()} == {k: first[k] for k in again}


@pytest.mark.slow  # ~1 s: in the full suite, not the fast subset
def test_a_refused_schema_ends_in_invalid_request_with_the_library_message(tiny_model_path: Path):
    engine = tiny_engine(tiny_model_path)
    bad = EngineRequest("bad", prompt_token_ids=[5, 6], sampling=SamplingParams(
        structured=StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}')))
    done = engine.generate([bad, schema_request("enums-0.0", "enums")])
    last = done["bad"].last
    assert (last.finish_reason, last.error_code) == ("error", "invalid_request")
    assert "Invalid type: strin" in last.error_message and last.new_token_ids == []
    assert done["enums-0.0"].finish_reason == "stop"
    # Cached: the same schema again is refused at once, from add_request.
    [out] = engine.add_request(EngineRequest("bad-2", prompt_token_ids=[5, 6], sampling=bad.sampling))
    assert out.error_code == "invalid_request" and out.error_message == last.error_message


@pytest.mark.slow  # ~1.3 s: in the full suite, not the fast subset
def test_a_request_waits_outside_the_scheduler_while_its_grammar_compiles(tiny_model_path: Path):
    engine = tiny_engine(tiny_model_path)
    engine.generate([schema_request("enums-0.0", "enums")])  # the compiler exists, its tokenizer built
    release = threading.Event()
    compile_grammar = engine.structured.compiler._compile
    engine.structured.compiler._compile = lambda kind, spec: (release.wait(30), compile_grammar(kind, spec))[1]
    held, aborted = schema_request("numbers-0.0", "numbers"), schema_request("nested-0.0", "nested")
    assert engine.add_request(held) == [] and engine.add_request(aborted) == []
    assert engine.has_unfinished() and engine.scheduler.num_waiting == 0 and engine.stats().num_waiting == 2
    now = time.monotonic()
    assert now <= engine.wake_time() <= time.monotonic() + GRAMMAR_POLL_S
    assert engine.step() == []
    [out] = engine.abort(["nested-0.0"])
    assert out.finished and out.finish_reason == "abort"
    release.set()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    text = "".join(o.text_delta for o in outputs if o.request_id == "numbers-0.0")
    jsonschema.validate(json.loads(text), SCHEMAS["numbers"])
    assert {o.request_id for o in outputs} == {"numbers-0.0"}


@pytest.mark.slow
def test_smollm2_50_requests_over_5_schemas_all_validate(smollm2_path: Path):
    """Issue #17: 50 requests, 10 per schema (nested objects, enums, arrays, bounded numbers), half greedy and half
    sampled, in one batch on the real model: every output parses and validates."""
    engine = LLMEngine(EngineSettings(model=str(smollm2_path), device="cpu", dtype="float32", max_num_seqs=64,
                                      max_num_batched_tokens=2048, max_model_len=512))
    requests = []
    for name in SCHEMAS:
        spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))
        for i in range(10):
            sampled = i % 2 == 1
            requests.append(EngineRequest(
                f"{name}-{i}", messages=[{"role": "user", "content": PROMPTS[name]}],
                sampling=SamplingParams(max_new_tokens=96, temperature=0.8 if sampled else 0.0,
                                        seed=i if sampled else None, structured=spec)))
    start = time.perf_counter()
    done = engine.generate(requests)
    elapsed = time.perf_counter() - start
    failures = {}
    for request in requests:
        result = done[request.request_id]
        try:
            assert result.finish_reason == "stop", result.finish_reason
            jsonschema.validate(json.loads(result.text), SCHEMAS[request.request_id.rsplit("-", 1)[0]])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures[request.request_id] = (str(exc)[:120], result.text)
    assert not failures, failures
    print(f"50 structured requests on SmolLM2 in {elapsed:.1f} s, {engine.num_steps} steps")


@pytest.mark.slow
def test_closing_the_engine_stops_its_grammar_judges(tiny_model_path: Path, monkeypatch):
    from tests.model.test_grammar import judges_gone

    monkeypatch.setattr("worker.model.structured.compile.QUICK_LEXER_FUEL", 500)  # so an ordinary enum goes to a judge
    engine = tiny_engine(tiny_model_path)
    spec = json.dumps({"enum": [f"v{i}" for i in range(300)]})
    request = EngineRequest("enum", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(
        max_new_tokens=8, structured=StructuredOutput("json_schema", spec)))
    assert engine.generate([request])["enum"].finish_reason in ("stop", "length")
    pids = engine.structured.compiler._judges.pids
    assert pids
    engine.close()
    assert judges_gone(pids)
    # A constrained request after close starts a fresh compiler.
    assert engine.generate([request])["enum"].finish_reason in ("stop", "length")
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("cache_size, compiled_again", [(2, 1), (4, 0)])
def test_a_format_is_compiled_again_once_more_than_the_cache_size_came_after_it(tiny_model_path: Path, cache_size,
                                                                               compiled_again):
    engine = LLMEngine(EngineSettings(model=str(tiny_model_path), device="cpu", dtype="float32",
                                      attention_backend="torch", block_size=16, num_kv_blocks=64,
                                      max_num_batched_tokens=128, max_num_seqs=4, max_model_len=192,
                                      grammar_compile_timeout_s=60.0, grammar_cache_size=cache_size))
    names = ["enums", "numbers", "arrays"]
    for name in names:
        engine.generate([schema_request(f"{name}-first", name, max_new_tokens=4)])
    before = engine.structured.compiler.num_compiled
    engine.generate([schema_request("enums-again", "enums", max_new_tokens=4)])
    assert engine.structured.compiler.num_compiled - before == compiled_again
