"""The gateway's front door with the official `openai` package, a real broker and a worker (instant engine):
no key, a wrong key, a revoked key; an ordinary key that forges X-Tenant or X-Priority (refused, and nothing
reaches Kafka for the forged tenant); a trusted key that names tenants; a key past its rate; a caller's
traceparent on the request record; a broker outage answered with OpenAI's error JSON and Retry-After."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx2 as httpx
import openai
import pytest

from gateway.keys import KeyEntry, digest, new_key, write_keys
from schemas.decode import decode_request
from schemas.usage import UsageRecord
from tests.client.helpers import read_topic
from tests.gateway.test_gateway_kafka import RunningGateway
from tests.transport.kafka_helpers import polling_clients, running_worker, worker_settings
from gateway.settings import GatewaySettings
from worker.kafka_settings import KafkaSettings
from worker.engine.instant import InstantEngine

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def settings_for(kafka_bootstrap: str) -> KafkaSettings:
    suffix = uuid.uuid4().hex[:10]
    return KafkaSettings(bootstrap_servers=kafka_bootstrap, request_topic=f"test.requests.{suffix}",
                         result_topic=f"test.results.{suffix}", dead_letter_topic=f"test.dead-letter.{suffix}",
                         status_topic=f"test.status.{suffix}", control_topic=f"test.control.{suffix}",
                         usage_topic=f"test.usage.{suffix}", progress_topic=f"test.progress.{suffix}",
                         group_id=f"test-workers-{suffix}",
                         allowed_reply_topic_prefixes=[f"test.replies.{suffix}."])


class KeyRing:
    def __init__(self, path) -> None:
        self.path = path
        self.entries: list[KeyEntry] = []

    def add(self, tenant: str, **kw) -> tuple[str, str]:
        ident, key = new_key()
        self.entries.append(KeyEntry(id=ident, sha256=digest(key), tenant=tenant, **kw))
        write_keys(self.path, self.entries)
        return ident, key

    def revoke(self, ident: str) -> None:
        self.entries = [e for e in self.entries if e.id != ident]
        write_keys(self.path, self.entries)


@pytest.fixture(scope="module")
async def door(kafka_bootstrap, tmp_path_factory):
    from worker.broker.topics import ensure_topics

    kafka = settings_for(kafka_bootstrap)
    await ensure_topics(kafka)
    data_dir = tmp_path_factory.mktemp("gateway-auth")
    ring = KeyRing(data_dir / "keys.json")
    ring.add("first-tenant")  # a keys file from the start: every test below runs with keys on
    settings = GatewaySettings(reply_topic_prefix=kafka.allowed_reply_topic_prefixes[0], data_dir=data_dir)
    async with running_worker(kafka, worker_settings(), InstantEngine()):
        async with RunningGateway(kafka, settings) as gateway:
            gateway.gateway.keys.reload_s = 0.2
            yield kafka, ring, gateway


def sdk(gateway: RunningGateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=key, max_retries=0)


async def chat(client: openai.AsyncOpenAI, **kw):
    return await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, **kw)


def wire_id(answer) -> str:
    """The request's id on the wire (the answer's id is OpenAI's `chatcmpl-` + it)."""
    return answer.id.removeprefix("chatcmpl-")


async def wait_reloaded(gateway: RunningGateway, ring: KeyRing) -> None:
    ids = {e.id for e in ring.entries}
    async with asyncio.timeout(10):
        while set(gateway.gateway.keys._by_id) != ids:
            await asyncio.sleep(0.05)


async def usage_of(kafka: KafkaSettings, ids: set[str], timeout_s: float = 20.0) -> dict[str, UsageRecord]:
    import msgspec

    found: dict[str, UsageRecord] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for record in await read_topic(kafka, kafka.usage_topic, 10_000, timeout_s=1.0):
            usage = msgspec.json.decode(record.value, type=UsageRecord)
            found[usage.id] = usage
        if ids <= set(found):
            break
    return found


async def test_no_key_a_wrong_key_and_a_revoked_key_get_401_in_openai_shape(door):
    kafka, ring, gateway = door
    ident, key = ring.add("acme")
    await wait_reloaded(gateway, ring)
    async with httpx.AsyncClient() as http:  # the SDK will not send a request without a key
        plain = await http.post(f"http://127.0.0.1:{gateway.port}/v1/chat/completions",
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert plain.status_code == 401 and plain.json()["error"]["code"] == "invalid_api_key"
    for bad in ("sk-not-ours", key[:-2] + "xx"):
        with pytest.raises(openai.AuthenticationError) as refused:
            await chat(sdk(gateway, bad))
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await sdk(gateway, "sk-wrong").models.list()
    assert (await chat(sdk(gateway, key))).choices[0].message.content
    ring.revoke(ident)
    await wait_reloaded(gateway, ring)
    with pytest.raises(openai.AuthenticationError):
        await chat(sdk(gateway, key))


async def test_an_ordinary_key_cannot_forge_a_tenant_or_a_priority_and_nothing_reaches_kafka(door):
    kafka, ring, gateway = door
    _, key = ring.add("acme", most_urgent=1)
    await wait_reloaded(gateway, ring)
    client = sdk(gateway, key)
    before = gateway.gateway.num_requests
    forged = [dict(extra_headers={"X-Tenant": "victim"}), dict(extra_headers={"X-Priority": "0"}),
              dict(service_tier="priority"), dict(extra_headers={"X-Tenant": "victim", "X-Priority": "2"})]
    for kw in forged:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await chat(client, **kw)
        assert refused.value.status_code == 403 and refused.value.code in ("tenant_not_allowed",
                                                                              "priority_not_allowed")
    assert gateway.gateway.num_requests == before  # refused before anything was produced
    # Its own tenant named, and a less urgent priority, are fine.
    answers = [await chat(client), await chat(client, extra_headers={"X-Tenant": "acme", "X-Priority": "2"})]
    usage = await usage_of(kafka, {wire_id(a) for a in answers})
    assert [usage[wire_id(a)].tenant for a in answers] == ["acme", "acme"]
    assert [usage[wire_id(a)].priority for a in answers] == [1, 2]
    requests = [decode_request(r.value) for r in await read_topic(kafka, kafka.request_topic, 10_000, 3.0)]
    assert not [r for r in requests if getattr(r, "tenant", None) == "victim"]
    assert not [u for u in usage.values() if u.tenant == "victim"]


async def test_a_trusted_key_names_tenants_and_a_busy_key_gets_429(door):
    kafka, ring, gateway = door
    upstream_id, upstream = ring.add("upstream", trusted=True, most_urgent=0)
    slow_id, slow = ring.add("slowpoke", requests_per_minute=2)
    await wait_reloaded(gateway, ring)
    named = await chat(sdk(gateway, upstream), extra_headers={"X-Tenant": "team-x", "X-Priority": "0"})
    own = await chat(sdk(gateway, upstream))
    usage = await usage_of(kafka, {wire_id(named), wire_id(own)})
    assert (usage[wire_id(named)].tenant, usage[wire_id(named)].priority) == ("team-x", 0)
    assert usage[wire_id(own)].tenant == "upstream"

    client = sdk(gateway, slow)
    await chat(client)
    await chat(client)
    with pytest.raises(openai.RateLimitError) as limited:
        await chat(client)
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 30

    # Metrics by key id, never by key.
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{gateway.port}/metrics")).text
    chat_route = 'route="/v1/chat/completions"'
    assert f'llm_gateway_requests_total{{key_id="{slow_id}",{chat_route},status="200"}} 2.0' in text
    assert f'llm_gateway_requests_total{{key_id="{slow_id}",{chat_route},status="429"}} 1.0' in text
    assert f'llm_gateway_tokens_total{{key_id="{upstream_id}",kind="completion"}} 6.0' in text
    assert "sk-llmw-" not in text


async def test_the_callers_traceparent_reaches_the_request_record(door):
    kafka, ring, gateway = door
    _, key = ring.add("tracer")
    await wait_reloaded(gateway, ring)
    answer = await chat(sdk(gateway, key), extra_headers={"traceparent": TRACE, "tracestate": "vendor=1"})
    records = await read_topic(kafka, kafka.request_topic, 10_000, 3.0)
    (record,) = [r for r in records if decode_request(r.value).id == wire_id(answer)]
    headers = dict(record.headers)
    assert headers["traceparent"] == TRACE.encode() and headers["tracestate"] == b"vendor=1"
    bad = await chat(sdk(gateway, key), extra_headers={"traceparent": "01-zz"})
    records = await read_topic(kafka, kafka.request_topic, 10_000, 3.0)
    (record,) = [r for r in records if decode_request(r.value).id == wire_id(bad)]
    assert "traceparent" not in dict(record.headers)  # malformed: not passed on


async def test_a_broker_outage_is_answered_503_with_openais_error_json(tmp_path):
    from worker.broker.local import LocalBroker, free_ports
    from worker.broker.topics import ensure_topics

    port, controller_port = free_ports(2)
    broker = LocalBroker(tmp_path / "broker", port, controller_port, detach=False)
    broker.start()
    try:
        kafka = settings_for(broker.bootstrap_servers)
        await ensure_topics(kafka)
        settings = GatewaySettings(reply_topic_prefix=kafka.allowed_reply_topic_prefixes[0],
                                   data_dir=tmp_path / "gw", submit_timeout_s=3.0)
        async with RunningGateway(kafka, settings) as gateway:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="-", timeout=20,
                                        max_retries=0)
            broker.stop()
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as refused:
                await chat(client)
            elapsed = time.monotonic() - started
            assert refused.value.status_code == 503 and elapsed < 10, elapsed
            assert refused.value.code == "service_unavailable"
            assert refused.value.body["type"] == "server_error" and refused.value.response.headers["retry-after"]
            # What needs no broker still answers.
            assert [m.id async for m in client.models.list()] == [MODEL]
            stopping = time.monotonic()
        # It stops whole and in bounded time with the broker gone: no client of it goes on polling the address.
        assert time.monotonic() - stopping < 20
        assert polling_clients(broker.bootstrap_servers) == []
    finally:
        broker.stop()



async def test_reply_topics_of_crashed_random_instances_expire_and_others_stay(door, tmp_path):
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.structs import OffsetAndMetadata

    kafka, _, live = door
    prefix = kafka.allowed_reply_topic_prefixes[0]
    crashed, stable, named = prefix + "gw-0123456789", prefix + "stable-7", prefix + "myapp"
    long_gone = prefix + "batch-abcdef0123"  # its last heartbeat expired an hour ago
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, 1, 1) for t in (crashed, long_gone, stable, named)])
        beat = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=long_gone, enable_auto_commit=False)
        await beat.start()
        beat.assign([TopicPartition(long_gone, 0)])
        hour_ago = int(time.time() * 1000) - 3600_000
        await beat.commit({TopicPartition(long_gone, 0): OffsetAndMetadata(0, f"alive-until@{hour_ago}")})
        await beat.stop()
        settings = GatewaySettings(reply_topic_prefix=prefix, data_dir=tmp_path, reply_sweep_s=0.5)
        async with RunningGateway(kafka, settings) as sweeper:
            async with asyncio.timeout(30):
                while {crashed, long_gone} & set(await admin.list_topics()):
                    await asyncio.sleep(0.2)
            await asyncio.sleep(1.5)  # three sweeps more: the live instance's topic must outlast them
            left = set(await admin.list_topics())
            assert sweeper.gateway.door.num_swept == 2
        assert {stable, named, live.gateway.door.reply_topic} <= left
        # The live instance still answers on its topic.
        _, key = door[1].add("after-sweep")
        await wait_reloaded(live, door[1])
        assert (await chat(sdk(live, key))).choices
    finally:
        await admin.close()


async def test_a_keys_batch_is_its_own_and_runs_as_its_tenant(door):
    import io
    import json

    kafka, ring, gateway = door
    _, key = ring.add("batcher", most_urgent=2)
    _, other = ring.add("someone-else")
    await wait_reloaded(gateway, ring)
    client = sdk(gateway, key)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 2}}
             for i in range(3)]
    upload = await client.files.create(file=("in.jsonl", io.BytesIO(
        "\n".join(json.dumps(line) for line in lines).encode())), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    for call in (sdk(gateway, other).files.retrieve(upload.id), sdk(gateway, other).batches.retrieve(batch.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    async with asyncio.timeout(60):
        while (batch := await client.batches.retrieve(batch.id)).status != "completed":
            await asyncio.sleep(0.2)
    output = (await client.files.content(batch.output_file_id)).text
    ids = {json.loads(line)["response"]["request_id"] for line in output.splitlines()}
    usage = await usage_of(kafka, ids)
    assert {usage[i].tenant for i in ids} == {"batcher"} and len(ids) == 3


async def test_a_gateway_whose_reply_topic_the_workers_refuse_says_so_at_once(kafka_bootstrap, tmp_path):
    """Workers that do not allow the gateway's reply prefix would answer on the result topic, which the gateway
    never reads: its callers would wait out the request timeout. The workers' status reports say what they
    allow, and the gateway answers 503 at once naming both settings."""
    from worker.broker.topics import ensure_topics

    kafka = settings_for(kafka_bootstrap)
    await ensure_topics(kafka)
    workers_kafka = kafka.model_copy(update={"allowed_reply_topic_prefixes": ["elsewhere."]})
    settings = GatewaySettings(reply_topic_prefix=kafka.allowed_reply_topic_prefixes[0], data_dir=tmp_path)
    async with running_worker(workers_kafka, worker_settings(), InstantEngine()):
        async with RunningGateway(kafka, settings) as gateway:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="-", max_retries=0,
                                        timeout=20)
            started = time.monotonic()
            async with asyncio.timeout(10):
                while True:  # the first status report may come a moment after the gateway started
                    try:
                        await chat(client)
                    except openai.APIStatusError as error:
                        refused = error
                        break
                    await asyncio.sleep(0.2)
            assert time.monotonic() - started < 10
            assert refused.status_code == 503 and refused.code == "reply_topic_not_allowed"
            assert "KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES" in refused.message
            assert "GATEWAY_REPLY_TOPIC_PREFIX" in refused.message


async def test_a_really_shedding_worker_makes_the_gateway_answer_429_and_urgent_work_passes(kafka_bootstrap,
                                                                                           tmp_path):
    """No status record made by hand: a worker flooded with bulk work sheds priority 2 for real, reports it,
    and the gateway refuses a `flex` request with 429 and Retry-After before producing it, while a `priority`
    request is served."""
    from schemas.request import GenerationRequest
    from tests.transport.kafka_helpers import produce_requests
    from worker.broker.topics import ensure_topics
    from worker.engine.dynamic import DynamicEngine

    kafka = settings_for(kafka_bootstrap)
    await ensure_topics(kafka)
    settings = worker_settings(max_engine_inflight=8, status_interval_s=0.2, max_queue_time_s=[60.0, 60.0, 0.5],
                               drain_timeout_s=1.0)
    engine = DynamicEngine(max_num_seqs=8, step_time_s=0.02, per_seq_s=0.0, prefill_s_per_token=0.0005,
                           eos_probability=0.0)
    bulk = [(2, GenerationRequest(id=f"bulk-{i}", prompt=f"bulk {i}", max_new_tokens=200)) for i in range(60)]
    gateway_settings = GatewaySettings(reply_topic_prefix=kafka.allowed_reply_topic_prefixes[0], data_dir=tmp_path)
    async with running_worker(kafka, settings, engine, max_num_seqs=8):
        async with RunningGateway(kafka, gateway_settings) as gateway:
            await produce_requests(kafka, bulk)
            async with asyncio.timeout(20):
                while gateway.gateway.door.refusal(2) is None:
                    await asyncio.sleep(0.1)
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="-", max_retries=0,
                                        timeout=30)
            before = gateway.gateway.num_requests
            with pytest.raises(openai.RateLimitError) as limited:
                await chat(client, service_tier="flex")
            assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
            assert gateway.gateway.num_requests == before  # refused before anything was produced
            urgent = await chat(client, service_tier="priority")
            assert urgent.choices[0].message.content
