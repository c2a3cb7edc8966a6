"""The gateway with the official `openai` package as its client, a real broker and a real worker (the tiny random
Llama, so logprobs and structured output are the engine's own): streamed and not, n = 2, logprobs, a
json_schema answer validated against its schema, a 429 with Retry-After while a priority is shed, a disconnect
that cancels, bad input that never reaches Kafka, a batch through the SDK's files and batches calls, and two
instances that each read only their own reply topic. One broker, worker and gateway for the whole module."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid

import httpx2 as httpx
import jsonschema
import openai
import pytest
import uvicorn

from gateway.cli import build_app
from schemas.status import PriorityStatus, WorkerStatus
from tests.client.helpers import RawProducer, read_topic
from tests.transport.kafka_helpers import Collector, running_worker, worker_settings
from tests.transport.test_stream_kafka import tiny_engine
from gateway.settings import GatewaySettings
from worker.kafka_settings import KafkaSettings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningGateway:
    def __init__(self, kafka: KafkaSettings, settings: GatewaySettings) -> None:
        self.port = free_port()
        self.app, self.gateway = build_app(kafka, settings.model_copy(update={"port": self.port}))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", access_log=False))

    async def __aenter__(self) -> "RunningGateway":
        self.task = asyncio.create_task(self.server.serve())
        async with asyncio.timeout(30):
            while not self.server.started:
                assert not self.task.done(), self.task
                await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 30)

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
async def stack(kafka_bootstrap, tiny_model_path, tmp_path_factory):
    from worker.broker.topics import ensure_topics

    suffix = uuid.uuid4().hex[:10]
    prefix = f"test.replies.{suffix}."
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, request_topic=f"test.requests.{suffix}",
                          result_topic=f"test.results.{suffix}", dead_letter_topic=f"test.dead-letter.{suffix}",
                          status_topic=f"test.status.{suffix}", control_topic=f"test.control.{suffix}",
                          group_id=f"test-workers-{suffix}", allowed_reply_topic_prefixes=[prefix])
    await ensure_topics(kafka)
    settings = GatewaySettings(reply_topic_prefix=prefix, data_dir=tmp_path_factory.mktemp("gateway"),
                               max_body_bytes=64 * 1024)
    async with running_worker(kafka, worker_settings(), tiny_engine(tiny_model_path), max_num_seqs=16):
        async with RunningGateway(kafka, settings) as gateway:
            yield kafka, settings, gateway


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


async def test_chat_streamed_and_not_with_n_2_and_logprobs(stack):
    kafka, _, gateway = stack
    client = gateway.client()
    answer = await client.chat.completions.create(model=MODEL, messages=ask("Hello there"), max_tokens=8,
                                                  temperature=0, n=2, logprobs=True, top_logprobs=2)
    assert answer.object == "chat.completion" and len(answer.choices) == 2
    # Greedy: both completions are the same text.
    assert answer.choices[0].message.content == answer.choices[1].message.content
    assert answer.usage.completion_tokens == 16 and answer.usage.total_tokens > 16
    for choice in answer.choices:
        assert choice.finish_reason in ("length", "stop")
        content = choice.logprobs.content
        assert content and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)
        # Token text from the tokenizer, not ids; the chosen greedy token is the most likely one.
        assert not any(e.token.startswith("token_id:") for e in content)
        assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-4 for e in content)

    stream = await client.chat.completions.create(model=MODEL, messages=ask("Hello there"), max_tokens=8,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])

    completion = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                                 temperature=0, logprobs=1)
    assert completion.object == "text_completion" and len(completion.choices[0].logprobs.tokens) == 5


async def test_streamed_n_2_through_the_sdk_matches_the_answer_not_streamed(stack):
    _, _, gateway = stack
    client = gateway.client()
    # Sampled, not greedy, so the two completions differ; the same seed gives the same tokens streamed or not.
    kwargs = dict(model=MODEL, messages=ask("Name three colours."), max_tokens=6, temperature=0.9, seed=11, n=2)
    answer = await client.chat.completions.create(**kwargs)
    expected = {c.index: c.message.content for c in answer.choices}
    assert sorted(expected) == [0, 1] and all(expected.values())

    stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]  # the SDK stops at `data: [DONE]`
    texts: dict[int, str] = {}
    roles: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        assert choice.index not in finishes, "a delta after its completion's finish_reason"
        if choice.delta.role is not None:
            assert choice.index not in roles and choice.index not in texts, "the role comes with the first delta"
            roles[choice.index] = choice.delta.role
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert roles == {0: "assistant", 1: "assistant"}
    assert sorted(finishes) == [0, 1] and all(len(f) == 1 for f in finishes.values())
    assert {i: f[0] for i, f in finishes.items()} == {c.index: c.finish_reason for c in answer.choices}
    assert texts == expected
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == answer.usage.completion_tokens
    if all(f == ["length"] for f in finishes.values()):
        assert last.usage.completion_tokens == 2 * kwargs["max_tokens"]
    assert last.usage.prompt_tokens == answer.usage.prompt_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1
    # The SDK also stops when the connection just closes: the last event on the wire must be [DONE].
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(f"http://127.0.0.1:{gateway.port}/v1/chat/completions",
                                json={**kwargs, "stream": True, "stream_options": {"include_usage": True}})
    events = [line for line in reply.text.split("\n\n") if line]
    assert reply.headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["usage"]["completion_tokens"] == \
        last.usage.completion_tokens


async def test_json_schema_answer_validates(stack):
    _, _, gateway = stack
    answer = await gateway.client().chat.completions.create(
        model=MODEL, messages=ask("Give a name."), max_tokens=60, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


async def test_a_response_in_json_schema_format_validates(stack):
    _, _, gateway = stack
    answer = await gateway.client().responses.create(
        model=MODEL, input="Give a name.", instructions="Answer in JSON.", max_output_tokens=60, temperature=0.7,
        text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}})
    assert answer.status == "completed" and answer.output[0].content[0].type == "output_text"
    jsonschema.validate(json.loads(answer.output_text), SCHEMA)
    assert answer.usage.output_tokens > 0 and answer.text.format.type == "json_schema"


async def test_bad_input_gets_openai_errors_and_nothing_reaches_kafka(stack):
    kafka, settings, gateway = stack
    client = gateway.client()
    before = len(await read_topic(kafka, kafka.request_topic, 10_000, timeout_s=2))
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="no-such-model", messages=ask("x"))
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ask("x"), n=17)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=ask("x"), temperature=3)
    raw = client.with_options(max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        await raw.chat.completions.create(model=MODEL, messages=ask("x" * (settings.max_body_bytes + 10)))
    assert info.value.status_code == 413
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"http://127.0.0.1:{gateway.port}/v1/chat/completions", content=b"{not json",
                                headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    assert len(await read_topic(kafka, kafka.request_topic, 10_000, timeout_s=2)) == before


async def test_shed_priority_gets_429_with_retry_after_before_anything_is_produced(stack):
    kafka, _, gateway = stack
    client = gateway.client()
    before = len(await read_topic(kafka, kafka.request_topic, 10_000, timeout_s=2))
    shed = WorkerStatus(worker_id="overloaded", ts_ms=int(time.time() * 1000), shedding=True,
                        priorities=[PriorityStatus(priority=2, shed=True, est_wait_s=7.2)])
    async with RawProducer(kafka) as raw:
        await raw.status(shed)
    await asyncio.sleep(1.0)  # the gateway reads it
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2, service_tier="flex")
    assert info.value.response.headers["retry-after"] == "8"
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2,
                                             extra_headers={"X-Priority": "2"})
    assert len(await read_topic(kafka, kafka.request_topic, 10_000, timeout_s=2)) == before
    # Another priority is served meanwhile.
    answer = await client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2


async def test_a_disconnect_cancels_the_request(stack):
    kafka, settings, gateway = stack
    reply_topic = gateway.gateway.door.reply_topic
    async with Collector(kafka, extra_topics=(reply_topic,)) as collector:
        stream = await gateway.client().chat.completions.create(
            model=MODEL, messages=ask("Tell me a long story."), max_tokens=1500, temperature=0.8, seed=1,
            stream=True)
        first = await stream.__anext__()
        request_id = first.id.removeprefix("chatcmpl-")
        await stream.close()
        await collector.wait_until(lambda r: request_id in r.finals, 30, "the cancelled final")
    final = collector.results.finals[request_id][-1]
    assert final.status == "cancelled" and final.usage.completion_tokens < 1500, final


async def test_a_batch_through_the_sdk_files_and_batches(stack):
    _, _, gateway = stack
    client = gateway.client()
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": ask(f"Count to {i}"), "max_tokens": 4, "temperature": 0}}
             for i in range(12)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "no-such-model", "messages": ask("x")}})
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines) + b"{broken\n"
    uploaded = await client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"job": "test"})
    assert batch.status in ("validating", "in_progress")
    async with asyncio.timeout(60):
        while (batch := await client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.3)
    assert batch.status == "completed" and batch.request_counts.total == 14
    assert (batch.request_counts.completed, batch.request_counts.failed) == (12, 2)
    output = [json.loads(line) for line in (await client.files.content(batch.output_file_id)).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"q{i}" for i in range(12))
    for line in output:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] <= 4
        assert body["object"] == "chat.completion"
    errors = [json.loads(line) for line in (await client.files.content(batch.error_file_id)).text.splitlines()]
    by_id = {e["custom_id"]: e for e in errors}
    assert by_id["bad"]["response"]["status_code"] == 404
    assert by_id[None]["error"]["code"] == "invalid_json"


async def test_two_instances_each_read_only_their_own_answers(stack):
    kafka, settings, first = stack
    async with RunningGateway(kafka, settings) as second:
        answers = await asyncio.gather(*[
            gw.client().chat.completions.create(model=MODEL, messages=ask(f"hi {i}"), max_tokens=3, temperature=0)
            for i, gw in enumerate([first, second, first, second])])
        assert all(a.usage.completion_tokens == 3 for a in answers)
        topics = {gw.gateway.door.reply_topic for gw in (first, second)}
        assert len(topics) == 2
        for gw, mine in ((first, answers[0::2]), (second, answers[1::2])):
            records = await read_topic(kafka, gw.gateway.door.reply_topic, 10_000, timeout_s=2)
            keys = {r.key.decode() for r in records}
            assert {a.id.removeprefix("chatcmpl-") for a in mine} <= keys
            other = second if gw is first else first
            assert not any(k.startswith(other.gateway.door.instance_id) for k in keys)
