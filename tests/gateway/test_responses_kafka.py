"""The Responses API through the official `openai` SDK, with a real broker and a real worker (the model-free
engine with the real one's dynamics, every request stopping on a seeded EOS so it ends `completed`): plain and
streamed answers, background responses polled to their end, a cancel, a poll answered by another instance, a
gateway killed and restarted on its data dir, owners and the background grant of API keys, and a webhook
receiver that verifies every event's signature with the SDK's `webhooks.unwrap` and counts each response's
terminal event, including across an endpoint down for a while."""

from __future__ import annotations

import asyncio
import json
import types
import uuid
from collections import Counter

import httpx2 as httpx
import openai
import pytest

from gateway.keys import KeyEntry, digest, new_key, write_keys
from gateway.webhooks import new_secret
from tests.client.helpers import read_topic
from tests.gateway.test_gateway_files_kafka import GatewayProcess, fresh_topics
from tests.gateway.test_gateway_kafka import RunningGateway
from tests.transport.kafka_helpers import running_worker, worker_settings
from gateway.settings import GatewaySettings
from worker.engine.dynamic import DynamicEngine, eos_point

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
SECRET = new_secret()
TERMINAL = ("completed", "failed", "cancelled", "incomplete")


class Receiver:
    """A webhook endpoint: a raw asyncio HTTP/1.1 server that verifies each event with the SDK and answers 200,
    or 400 for a bad signature. down() closes its port (connections refused) until up()."""

    def __init__(self) -> None:
        self.sdk = openai.OpenAI(api_key="-", base_url="http://127.0.0.1:1")
        self.events: list = []
        self.webhook_ids: list[str] = []
        self.num_bad = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            try:
                event = self.sdk.webhooks.unwrap(body, headers, secret=SECRET)
            except openai.InvalidWebhookSignatureError:
                self.num_bad += 1
                status = b"400 Bad Request"
            else:
                self.events.append(event)
                self.webhook_ids.append(headers["webhook-id"])
                status = b"200 OK"
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()

    def terminal(self, response_id: str) -> list[str]:
        return [e.type for e in self.events if e.data.id == response_id]

    async def wait_for(self, ids: set[str], timeout_s: float = 60) -> None:
        async with asyncio.timeout(timeout_s):
            while not ids <= {e.data.id for e in self.events}:
                await asyncio.sleep(0.05)


def engine() -> DynamicEngine:
    # Every request stops on EOS at a seeded point in [1, max_output_tokens]: a response ends `completed`.
    return DynamicEngine(max_num_seqs=32, step_time_s=0.005, per_seq_s=0.0, prefill_s_per_token=0.0,
                         eos_probability=1.0)


def stops_late(max_tokens: int) -> str:
    """An input whose request runs at least 90 % of max_tokens before its EOS: one that is still running."""
    for i in range(10_000):
        text = f"Tell a long story, take {i}."
        request = types.SimpleNamespace(prompt=None, prompt_token_ids=None,
                                        messages=[{"role": "user", "content": text}],
                                        sampling=types.SimpleNamespace(ignore_eos=False, max_new_tokens=max_tokens,
                                                                       seed=None))
        if eos_point(request, 1.0) >= 0.9 * max_tokens:
            return text
    raise AssertionError("no input found")


def settings_for(prefix: str, data_dir, responses_topic: str, receiver: Receiver | None, **kw) -> GatewaySettings:
    hooks = {} if receiver is None else dict(
        webhook_urls=[receiver.url], webhook_secret=SECRET, webhook_allowed_hosts=["127.0.0.1"],
        webhook_backoff_initial_s=0.2, webhook_backoff_max_s=1.0, webhook_retry_s=300)
    return GatewaySettings(reply_topic_prefix=prefix, data_dir=data_dir, responses_topic=responses_topic,
                           **hooks, **kw)


@pytest.fixture(scope="module")
async def stack(kafka_bootstrap, tmp_path_factory):
    kafka, prefix = await fresh_topics(kafka_bootstrap)
    responses_topic = f"test.responses.{uuid.uuid4().hex[:10]}"
    receiver = Receiver()
    await receiver.up()
    settings = settings_for(prefix, tmp_path_factory.mktemp("gateway"), responses_topic, receiver)
    async with running_worker(kafka, worker_settings(), engine(), max_num_seqs=32):
        async with RunningGateway(kafka, settings) as gateway:
            yield types.SimpleNamespace(kafka=kafka, prefix=prefix, topic=responses_topic, settings=settings,
                                        gateway=gateway, receiver=receiver, tmp=tmp_path_factory)
    await receiver.down()


async def poll(client: openai.AsyncOpenAI, response_id: str, until=TERMINAL, timeout_s: float = 60):
    async with asyncio.timeout(timeout_s):
        while (response := await client.responses.retrieve(response_id)).status not in until:
            await asyncio.sleep(0.05)
    return response


async def test_create_plain_and_streamed(stack):
    client = stack.gateway.client()
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
                  instructions="Be brief.", max_output_tokens=40, temperature=0, metadata={"job": "t1"})
    answer = await client.responses.create(**kwargs)
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.status == "completed"
    assert answer.output[0].type == "message" and answer.output[0].role == "assistant"
    text = answer.output_text
    assert text.startswith("<") and text.count("<") == answer.usage.output_tokens <= 40
    assert answer.usage.input_tokens > 0 and answer.metadata == {"job": "t1"} and answer.instructions == "Be brief."

    stream = await client.responses.create(**kwargs, stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == text == events[-4].text  # the same request gives the same output on this engine
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == text.count("<")
    assert not stack.receiver.terminal(answer.id)  # webhooks are for background responses only


async def test_background_responses_complete_once_and_each_sends_one_signed_event(stack):
    client = stack.gateway.client()
    created = await asyncio.gather(*[client.responses.create(model=MODEL, input=f"Count to {i}", background=True,
                                                             max_output_tokens=60) for i in range(6)])
    assert all(r.status == "queued" and r.background for r in created)
    done = [await poll(client, r.id) for r in created]
    assert [r.status for r in done] == ["completed"] * 6
    assert all(r.output_text and r.usage.output_tokens == r.output_text.count("<") for r in done)
    ids = {r.id for r in created}
    await stack.receiver.wait_for(ids)
    await asyncio.sleep(1.0)  # a duplicate would come now
    assert all(stack.receiver.terminal(i) == ["response.completed"] for i in ids)
    assert stack.receiver.num_bad == 0
    # Deleted: gone for every caller.
    deleted = await client.responses.delete(created[0].id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created[0].id)


async def test_a_running_background_response_is_cancelled(stack):
    client = stack.gateway.client()
    response = await client.responses.create(model=MODEL, input=stops_late(4000), background=True,
                                             max_output_tokens=4000)
    await poll(client, response.id, until=("in_progress",))
    await asyncio.sleep(0.3)
    cancelled = await client.responses.cancel(response.id)
    assert cancelled.status == "cancelled"
    again = await client.responses.retrieve(response.id)
    assert again.status == "cancelled" and again.usage.output_tokens < 3600
    await stack.receiver.wait_for({response.id})
    assert stack.receiver.terminal(response.id) == ["response.cancelled"]


async def test_another_instance_answers_polls_and_keys_own_their_responses(stack, tmp_path):
    first = stack.gateway.client()
    entries, keys = [], {}
    for name, background in (("alice", True), ("bob", True), ("interactive", False)):
        ident, key = new_key()
        entries.append(KeyEntry(id=ident, sha256=digest(key), tenant=name, background=background))
        keys[name] = key
    for folder in ("second", "third"):  # two instances with the same keys, each with its own data folder
        (tmp_path / folder).mkdir()
        write_keys(tmp_path / folder / "keys.json", entries)
    async with RunningGateway(stack.kafka, settings_for(stack.prefix, tmp_path / "second", stack.topic, None)) \
            as second, \
            RunningGateway(stack.kafka, settings_for(stack.prefix, tmp_path / "third", stack.topic, None)) as third:
        def as_key(name: str, gateway: RunningGateway = second) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=keys[name],
                                      max_retries=0)

        # Made on the second instance, polled on the third at once: it reads the topic to its end first.
        alices = await as_key("alice").responses.create(model=MODEL, input="Alice's", background=True,
                                                        max_output_tokens=30)
        seen = await as_key("alice", third).responses.retrieve(alices.id)
        assert seen.id == alices.id and seen.status in ("queued", "in_progress", "completed")
        done = await poll(as_key("alice", third), alices.id)
        assert done.status == "completed" and done.output_text
        assert (await as_key("alice").responses.retrieve(alices.id)).output_text == done.output_text
        # Owned by alice's key: another key, and the open gateway (owner `anonymous`), are told it does not exist.
        for other in (as_key("bob"), as_key("bob", third), first):
            with pytest.raises(openai.NotFoundError):
                await other.responses.retrieve(alices.id)
            with pytest.raises(openai.NotFoundError):
                await other.responses.cancel(alices.id)
        mine = await first.responses.create(model=MODEL, input="Anonymous", background=True, max_output_tokens=30)
        with pytest.raises(openai.NotFoundError):
            await as_key("alice", third).responses.retrieve(mine.id)

        with pytest.raises(openai.PermissionDeniedError) as refused:
            await as_key("interactive").responses.create(model=MODEL, input="x", background=True)
        assert refused.value.code == "background_not_allowed"
        # Not in the background, the same key is served.
        answer = await as_key("interactive").responses.create(model=MODEL, input="x", max_output_tokens=5)
        assert answer.status == "completed"
        # Deleted on the third instance: gone on the second too.
        await as_key("alice", third).responses.delete(alices.id)
        async with asyncio.timeout(5):
            while True:
                try:
                    await as_key("alice").responses.retrieve(alices.id)
                except openai.NotFoundError:
                    break
                await asyncio.sleep(0.05)
    assert (await poll(first, mine.id)).status == "completed"


async def test_a_killed_gateway_resumes_its_background_responses_and_each_ends_once(stack, tmp_path):
    data_dir = tmp_path / "killed"
    hooks = {"webhook_urls": f'["{stack.receiver.url}"]', "webhook_secret": SECRET,
             "webhook_allowed_hosts": '["127.0.0.1"]', "webhook_backoff_initial_s": "0.2",
             "webhook_backoff_max_s": "1", "responses_topic": stack.topic}

    def process() -> GatewayProcess:
        return GatewayProcess(stack.kafka, stack.prefix, data_dir, tmp_path / "gateway.log", "gw-killed", **hooks)

    gateway = await process().start()
    try:
        client = gateway.client()
        created = await asyncio.gather(*[client.responses.create(model=MODEL, input=stops_late(400) + f" {i}",
                                                                 background=True, max_output_tokens=400)
                                         for i in range(6)])
        ids = [r.id for r in created]
        await asyncio.sleep(0.5)
        await gateway.kill()
        # While it is down, another instance still answers for its responses.
        during = [await stack.gateway.client().responses.retrieve(i) for i in ids]
        assert {r.status for r in during} <= {"queued", "in_progress", "completed", "incomplete"}
        assert {r.status for r in during} & {"queued", "in_progress"}, "all ended before the kill"
        gateway = await process().start()
        client = gateway.client()
        done = [await poll(client, i, timeout_s=90) for i in ids]
        assert {r.status for r in done} <= {"completed", "incomplete"}
        await stack.receiver.wait_for(set(ids))
        await asyncio.sleep(1.5)
        assert all(len(stack.receiver.terminal(i)) == 1 for i in ids), Counter(
            e.data.id for e in stack.receiver.events)
        assert "resuming background response" in (tmp_path / "gateway.log").read_text()
        assert stack.receiver.num_bad == 0
    finally:
        await gateway.stop()


async def test_an_endpoint_down_for_a_while_gets_every_event_once_it_is_back(stack):
    client = stack.gateway.client()
    webhooks = stack.gateway.gateway.webhooks
    await stack.receiver.down()
    try:
        failed_before = webhooks.num_failed_attempts
        created = await asyncio.gather(*[client.responses.create(model=MODEL, input=f"While down {i}",
                                                                 background=True, max_output_tokens=20)
                                         for i in range(5)])
        for r in created:
            assert (await poll(client, r.id)).status == "completed"
        async with asyncio.timeout(30):
            while webhooks.num_failed_attempts < failed_before + 10:  # each retried at least twice
                await asyncio.sleep(0.1)
        await asyncio.sleep(3.0)  # down for a while: attempts back off to the 1 s bound
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{stack.gateway.port}/metrics")).text
            assert 'llm_gateway_webhook_attempts_total{outcome="failed",type="response.completed"}' in metrics
            assert "llm_gateway_webhook_pending 5.0" in metrics
            health = (await http.get(f"http://127.0.0.1:{stack.gateway.port}/health")).json()
            assert health["webhooks"]["pending"] == 5 and health["webhooks"]["failed_attempts"] >= 10
    finally:
        await stack.receiver.up()
    ids = {r.id for r in created}
    await stack.receiver.wait_for(ids, timeout_s=30)
    assert await webhooks.drained(10)
    assert all(stack.receiver.terminal(i) == ["response.completed"] for i in ids)
    assert webhooks.num_dropped == 0


async def test_bad_input_gets_openai_errors_and_nothing_is_produced(stack):
    client = stack.gateway.client()
    kafka = stack.kafka
    requests_before = len(await read_topic(kafka, kafka.request_topic, 100_000, timeout_s=2))
    states_before = len(await read_topic(kafka, stack.topic, 100_000, timeout_s=2))
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="no-such-model", input="x", background=True)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "x"}],
                                      background=True)
    assert info.value.param == "input[0].type"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert info.value.code == "unsupported_parameter" and info.value.param == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as info:  # a function's parameters that are no object schema
        await client.responses.create(model=MODEL, input="x", tools=[{"type": "function", "name": "f",
                                                                       "parameters": {"type": "string"}}])
    assert info.value.param.startswith("tools") and "type \"object\"" in info.value.message
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=MODEL, input="x", temperature=5, background=True)
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"http://127.0.0.1:{stack.gateway.port}/v1/responses", content=b"{nope",
                                headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
        missing = await http.get(f"http://127.0.0.1:{stack.gateway.port}/v1/responses/resp_nothere")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert len(await read_topic(kafka, kafka.request_topic, 100_000, timeout_s=2)) == requests_before
    assert len(await read_topic(kafka, stack.topic, 100_000, timeout_s=2)) == states_before


async def test_a_response_past_its_retention_is_deleted_everywhere(stack, tmp_path):
    short = settings_for(stack.prefix, tmp_path / "short", stack.topic, None, response_retention_s=2.0)
    async with RunningGateway(stack.kafka, short) as gateway:
        client = gateway.client()
        response = await client.responses.create(model=MODEL, input="Short-lived", background=True,
                                                 max_output_tokens=10)
        assert (await poll(client, response.id)).status == "completed"
        await asyncio.sleep(2.5)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
        # The sweeper's tombstone reaches the other instance too: its copy is gone.
        async with asyncio.timeout(10):
            while response.id in stack.gateway.gateway.responses._states:
                await asyncio.sleep(0.1)


async def test_a_batch_that_ends_sends_its_signed_event(stack):
    client = stack.gateway.client()
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 4}}
             for i in range(3)]
    uploaded = await client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                         purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    async with asyncio.timeout(60):
        while (batch := await client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.2)
    assert batch.status == "completed"
    await stack.receiver.wait_for({batch.id})
    assert stack.receiver.terminal(batch.id) == ["batch.completed"]
