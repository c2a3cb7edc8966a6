"""Speculative decoding with n-gram drafts: the proposer (ngram.py), the scheduler's verify steps against a
model-free runner that checks every context it reads, and the engine on the real default model, whose greedy
output must not change."""

from __future__ import annotations

import random

import pytest

from tests.engine.fake_runner import FakeRunner, make_request, make_scheduler, next_token, step
from worker.engine.api import SamplingParams
from worker.engine.ngram import MAX_COOLDOWN_STEPS, NgramDrafts, size_drafts
from worker.engine.request import RequestStatus


def reference_proposal(tokens: list[int], num_draft: int, min_n: int, max_n: int) -> list[int]:
    """The proposer's rule written plainly: the latest earlier occurrence of the longest suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + num_draft]
    return []


def test_the_proposer_takes_what_followed_the_latest_longest_match():
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # [6, 7] occurred twice before; the latest occurrence was followed by 3, 4.
    assert NgramDrafts(tokens).propose(3, 2, 4) == [3, 4, 6]
    # A longer suffix wins over a later shorter one.
    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 7, 1, 2, 3]
    assert NgramDrafts(tokens).propose(2, 2, 4) == [9, 9]
    assert NgramDrafts([1, 2, 3, 4]).propose(4, 2, 4) == []
    assert NgramDrafts([4, 4, 4]).propose(3, 2, 4) == [4]  # overlapping itself


def test_the_proposer_matches_the_plain_rule_on_random_histories():
    # Values spanning several bytes: a byte pattern straddling two tokens must not count as a match.
    rng = random.Random(7)
    values = [0, 1, 256, 257, 65536, 16777216, 16777217]
    for _ in range(3000):
        tokens = [rng.choice(values) for _ in range(rng.randint(1, 40))]
        num_draft, min_n = rng.randint(1, 5), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        drafts = NgramDrafts(tokens[:3])
        drafts.extend(tokens[3:])
        assert drafts.propose(num_draft, min_n, max_n) == reference_proposal(tokens, num_draft, min_n, max_n), tokens


def test_rejected_drafts_make_a_request_wait_ever_longer_and_an_accepted_one_resets_it():
    drafts = NgramDrafts([1, 2, 1, 2, 1, 2])
    waits = []
    for _ in range(9):
        num_empty = 0
        while not drafts.propose(2, 2, 2):
            num_empty += 1
        waits.append(num_empty)
        drafts.verified(0, 2)
    assert waits == [0, 1, 2, 4, 8, 16, 32, MAX_COOLDOWN_STEPS, MAX_COOLDOWN_STEPS]
    while not drafts.propose(2, 2, 2):
        pass
    drafts.verified(1, 2)
    assert drafts.propose(2, 2, 2) == [1, 2]  # at once: a kept draft ends the waiting


def draft_for(scheduler, rng: random.Random, num_draft: int) -> None:
    """Drafts for every request that decodes next step: each the greedy model's true next token or, one time in
    three, a wrong one, so that steps keep all, some and none of them."""
    for request in scheduler.running:
        if request.num_computed_tokens != request.num_tokens - 1:
            continue
        context = list(request.all_token_ids)
        drafts = []
        for _ in range(rng.randint(1, num_draft)):
            token = next_token(context)
            if rng.random() < 1 / 3:
                token = (token + 1) % 101
            drafts.append(token)
            context.append(token)
        request.draft_token_ids = drafts


def solo(prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    context = list(prompt)
    while len(context) - len(prompt) < max_new_tokens:
        context.append(next_token(context))
        if context[-1] == eos:
            break
    return context[len(prompt):]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 6])
def test_verified_drafts_give_each_request_its_greedy_tokens_through_preemption_and_caching(seed, window):
    """Random drafts (right, wrong, several in a row) for requests of random lengths, some ending on EOS, in a KV
    cache small enough to preempt, with prefix caching and, for a model windowed on every layer, blocks given
    back behind the window: the runner checks every context it reads, and each request's tokens are those of
    the greedy model alone."""
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=24, max_num_seqs=6,
                               kv_window=window)
    runner = FakeRunner(16, 4, window=window)
    shared = [rng.randint(1, 100) for _ in range(9)]
    requests = []
    for i in range(14):
        prompt = (shared if i % 2 else []) + [rng.randint(1, 100) for _ in range(rng.randint(2, 12))]
        eos = 0 if i % 3 == 0 else None
        requests.append(make_request(f"r{i}", prompt_token_ids=prompt, arrival_time=i,
                                     sampling=SamplingParams(max_new_tokens=rng.randint(1, 30)),
                                     eos_token_ids=() if eos is None else (eos,)))
    pending = list(requests)
    num_drafted = num_steps = 0
    streamed: dict[str, list[int]] = {}
    while pending or scheduler.has_unfinished():
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not scheduler.has_unfinished():
            continue
        output, updates = step(scheduler, runner)
        for update in updates:
            streamed.setdefault(update.request_id, []).extend(update.new_token_ids)
        num_steps += 1
        num_drafted += sum(1 for entry in output.scheduled if entry.draft_token_ids)
        assert num_steps < 2000
        draft_for(scheduler, rng, 5)
    assert num_drafted > 20 and (window is not None or scheduler.num_preemptions > 0)
    for request in requests:
        eos = request.eos_token_ids[0] if request.eos_token_ids else None
        assert request.output_token_ids == solo(request.prompt_token_ids, request.sampling.max_new_tokens, eos)
        assert streamed[request.request_id] == request.output_token_ids
        assert request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


def test_a_verify_step_stays_within_the_budget_and_the_model_length():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=4, max_model_len=14)
    runner = FakeRunner(64, 4)
    request = make_request("r", prompt_token_ids=[1, 2, 3, 4], sampling=SamplingParams(max_new_tokens=50))
    scheduler.add_request(request)
    step(scheduler, runner)  # the prompt
    request.draft_token_ids = [7, 7, 7, 7, 7, 7]
    output, _ = step(scheduler, runner)
    assert output.scheduled[0].draft_token_ids == [7, 7, 7] and output.num_batched_tokens == 4
    assert request.draft_token_ids == []  # taken by the step, never reused
    while request.num_tokens < 12:
        step(scheduler, runner)
    assert not request.is_finished
    num_tokens = request.num_tokens
    request.draft_token_ids = [7, 7, 7]
    output, _ = step(scheduler, runner)
    # max_model_len 14: the step's context reaches 14 tokens at most.
    assert len(output.scheduled[0].draft_token_ids or []) == min(3, 14 - num_tokens)
    assert output.scheduled[0].seq_len <= 14


def engine_of(model_path, num_draft: int, **overrides):
    from worker.engine.engine import LLMEngine
    from worker.model.settings import EngineSettings

    values = dict(model=str(model_path), device="cpu", dtype="float32", attention_backend="torch", block_size=16,
                  num_kv_blocks=40, max_num_batched_tokens=64, max_num_seqs=8, speculative_ngram_tokens=num_draft,
                  speculative_max_batch=8)
    return LLMEngine(EngineSettings(**{**values, **overrides}))


def generate(engine, requests) -> dict:
    return {rid: (c.token_ids, c.text, c.finish_reason) for rid, c in engine.generate(requests).items()}


def tiny_requests():
    """Prompts that repeat a phrase, so drafts are proposed from them (a random model rarely takes them)."""
    from worker.engine.api import EngineRequest

    out = []
    for i in range(10):
        phrase = " the worker reads topic " + str(i) + " and writes it back"
        sampling = SamplingParams(max_new_tokens=(40, 7, 64, 25)[i % 4], stop=("ing",) if i % 3 == 1 else ())
        if i == 9:  # sampled, seeded: its drafts are kept when they are the tokens drawn at their places
            sampling = SamplingParams(max_new_tokens=30, temperature=0.8, seed=3)
        out.append(EngineRequest(f"t{i}", prompt=phrase * (2 + i % 4), sampling=sampling))
    return out


@pytest.mark.slow
def test_the_engine_gives_the_same_outputs_with_drafts_through_stops_and_preemption(tiny_model_path):
    """Ten requests at once in a KV cache small enough to preempt, some ending on a stop string, with drafts
    after any earlier token equal to the last (a random model rarely takes them, so they are proposed often and
    rejected, wholly or in part): the same tokens, text and finish reasons as without, a seeded sampled one
    among them included."""
    small = dict(max_num_seqs=10, num_kv_blocks=16, speculative_max_batch=10, speculative_ngram_min=1)
    plain = generate(engine_of(tiny_model_path, 0, **small), tiny_requests())
    engine = engine_of(tiny_model_path, 4, **small)
    drafted = generate(engine, tiny_requests())
    assert drafted == plain
    assert engine.num_proposed_tokens > 0 and engine.scheduler.num_preemptions > 0
    assert any(reason == "stop" for _, _, reason in plain.values())


@pytest.mark.slow
def test_no_drafts_above_the_batch_limit_or_with_async_scheduling(tiny_model_path):
    engine = engine_of(tiny_model_path, 4, speculative_max_batch=2)
    generate(engine, tiny_requests()[:6])
    assert engine.num_proposed_tokens == 0
    engine = engine_of(tiny_model_path, 4, async_scheduling="on")
    generate(engine, tiny_requests()[:2])
    assert engine.num_draft_tokens == 0 and engine.num_proposed_tokens == 0


COPIED = ("The Kafka consumer group protocol assigns partitions to members. When a member leaves, the group "
          "rebalances and another member takes over its partitions, starting from the committed offsets. ")


def smollm2_requests():
    from worker.engine.api import EngineRequest

    def chat(request_id: str, content: str, **sampling) -> EngineRequest:
        return EngineRequest(request_id, messages=[{"role": "user", "content": content}],
                             sampling=SamplingParams(**sampling))

    return [
        chat("copy", "Repeat this text exactly:\n" + COPIED * 2, max_new_tokens=64),
        chat("json", "Rewrite as JSON with keys name and city: name Alice, city Paris; name Bob, city Rome.",
             max_new_tokens=48),
        chat("copy-stop", "Repeat this text exactly:\n" + COPIED, max_new_tokens=64, stop=("leaves",)),
        chat("story", "Tell me a story about a dragon.", max_new_tokens=40),
    ]


@pytest.mark.slow
def test_smollm2_drafts_keep_its_greedy_output_and_copy_in_fewer_steps(smollm2_path):
    """The default model in float32 asked to repeat a text, rewrite records as JSON and tell a story: alone and
    four at once in a KV cache small enough to preempt, one ending on a stop string inside a run of kept drafts,
    the same tokens, text and finish reasons with drafts as without; most drafts are kept, and the copy alone
    takes far fewer steps."""
    requests = smollm2_requests()
    results, steps = {}, {}
    for num_draft in (0, 4):
        engine = engine_of(smollm2_path, num_draft, num_kv_blocks=64)
        before = engine.num_steps
        results[num_draft, "alone"] = generate(engine, requests[:1])
        steps[num_draft] = engine.num_steps - before
        crowded = engine_of(smollm2_path, num_draft, num_kv_blocks=13, max_num_seqs=4, speculative_max_batch=4)
        results[num_draft, "together"] = generate(crowded, smollm2_requests())
        if num_draft:
            assert crowded.scheduler.num_preemptions > 0
            assert crowded.num_accepted_tokens >= 0.5 * crowded.num_proposed_tokens > 0
    assert results[4, "alone"] == results[0, "alone"]
    assert results[4, "together"] == results[0, "together"]
    assert results[0, "together"]["copy-stop"][2] == "stop"
    assert steps[4] <= 0.6 * steps[0], steps


@pytest.mark.slow
def test_smollm2_sampled_requests_draft_with_the_tokens_of_plain_decoding(smollm2_path):
    """A seeded sampled copy request: with drafts, most drafts are kept and the tokens are those without drafts
    (each row drawn at its token's counter, a draft kept when it is the token drawn there)."""
    from worker.engine.api import EngineRequest

    def request():
        return [EngineRequest("s", messages=[{"role": "user", "content": "Repeat this text exactly:\n" + COPIED}],
                              sampling=SamplingParams(max_new_tokens=48, temperature=0.9, seed=11, ignore_eos=True))]

    engine = engine_of(smollm2_path, 4, num_kv_blocks=64)
    drafted = generate(engine, request())
    assert engine.num_accepted_tokens >= 0.5 * engine.num_proposed_tokens > 0
    assert drafted == generate(engine_of(smollm2_path, 0, num_kv_blocks=64), request())


def expected_rate(counts: list[int], continuations: list[float], rows: int, tokens: float, base: float,
                  per_row: float) -> float:
    for count, q in zip(counts, continuations):
        rows += count
        tokens += sum(q ** k for k in range(1, count + 1))
    return tokens / (base + per_row * rows)


def test_drafts_are_sized_to_the_most_tokens_per_second_the_step_model_gives():
    rng = random.Random(5)
    for _ in range(200):
        num = rng.randint(1, 6)
        proposed = [[7] * rng.randint(0, 8) for _ in range(num)]
        continuations = [rng.random() for _ in range(num)]
        rows, base, per_row = num + rng.randint(0, 20), rng.uniform(0.005, 0.05), rng.uniform(1e-4, 3e-3)
        counts = size_drafts(proposed, continuations, rows, float(num), base, per_row)
        assert all(0 <= c <= len(p) for c, p in zip(counts, proposed))
        best = expected_rate(counts, continuations, rows, num, base, per_row)
        # No single draft more, or the last one taken less, would give more tokens per second.
        for i in range(num):
            for delta in (1, -1):
                other = list(counts)
                other[i] += delta
                if 0 <= other[i] <= len(proposed[i]):
                    assert expected_rate(other, continuations, rows, num, base, per_row) <= best + 1e-12


def test_a_request_copying_long_runs_takes_its_drafts_and_one_stopping_early_few():
    copying, stopping = NgramDrafts([1, 2, 3]), NgramDrafts([1, 2, 3])
    for _ in range(4):
        copying.verified(7, 7)
        stopping.verified(0, 7)
    assert copying.continuation() > 0.9 and stopping.continuation() < 0.25
    # Four decoding requests, a step of 20 ms plus 1 ms a row (about this CPU's in bf16).
    counts = size_drafts([[5] * 7, [5] * 7], [copying.continuation(), stopping.continuation()], 4, 4.0,
                         0.020, 0.001)
    assert counts == [7, 0]
    assert size_drafts([[5] * 7, [5] * 7], [0.1, 0.1], 4, 4.0, 0.0, 0.0) == [7, 7]  # no step model yet: all



@pytest.mark.slow
def test_constrained_requests_draft_under_their_grammar_with_the_tokens_of_plain_decoding(tiny_model_path):
    """JSON-schema requests, greedy and seeded, beside free ones, drafting after any earlier token equal to the
    last: each verify row is drawn under the grammar's mask where its drafts lead, so the tokens, texts and
    finish reasons are those without drafts, and every output still validates."""
    from tests.engine.test_structured_output import assert_valid, constrained_requests, free_requests

    def requests():
        return constrained_requests() + free_requests()

    plain = generate(engine_of(tiny_model_path, 0, max_model_len=192, num_kv_blocks=160, max_num_seqs=16,
                               max_num_batched_tokens=128), requests())
    engine = engine_of(tiny_model_path, 4, max_model_len=192, num_kv_blocks=160, max_num_seqs=16,
                       max_num_batched_tokens=128, speculative_max_batch=16, speculative_ngram_min=1,
                       speculative_adaptive=False)  # every draft verified: the random model keeps few
    completions = engine.generate(requests())
    drafted = {rid: (c.token_ids, c.text, c.finish_reason) for rid, c in completions.items()}
    assert drafted == plain
    assert engine.num_proposed_tokens > 0
    assert_valid(completions, constrained_requests())


@pytest.mark.slow
def test_smollm2_rewriting_a_record_under_a_json_schema_drafts_from_the_prompt(smollm2_path):
    """The default model in float32 asked to rewrite a record as JSON under a schema, greedy: with drafts, the
    same tokens and text as without, drafts kept, in fewer steps."""
    import json

    from worker.engine.api import EngineRequest, StructuredOutput

    text = {"type": "string", "maxLength": 60}  # bounded: a small model's list may repeat an item to its end
    schema = {"type": "object", "properties": {
        "name": text, "city": text, "team": text, "topics": {"type": "array", "items": text, "maxItems": 5}},
        "required": ["name", "city", "team", "topics"], "additionalProperties": False}
    record = ("name: Alice Fernandez-Lindqvist, city: Saint Petersburg, team: streaming platform reliability, "
              "topics: consumer group rebalancing, exactly-once delivery, partition reassignment")

    def request():
        return [EngineRequest("json", messages=[{"role": "user", "content": "Rewrite this record as JSON, "
                                                 "copying every value exactly:\n" + record}],
                              sampling=SamplingParams(max_new_tokens=200, structured=StructuredOutput(
                                  "json_schema", json.dumps(schema))))]

    results, steps = {}, {}
    for num_draft in (0, 4):
        engine = engine_of(smollm2_path, num_draft, num_kv_blocks=64)
        before = engine.num_steps
        results[num_draft] = generate(engine, request())
        steps[num_draft] = engine.num_steps - before
        if num_draft:
            assert engine.num_accepted_tokens >= 0.4 * engine.num_proposed_tokens > 0
    assert results[4] == results[0]
    assert json.loads(results[0]["json"][1])["city"] == "Saint Petersburg"
    assert steps[4] <= 0.8 * steps[0], steps  # 42 against 61 when written
