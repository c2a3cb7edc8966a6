"""A real secured broker: the request path over SASL_SSL and over mutual TLS, with librdkafka and our own
clients, and every credential or permission error ending `serve` within 30 s with one line naming it.

Two brokers for the module (one per TLS mode: `ssl` demands client certificates), each started once."""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid
from pathlib import Path

import pytest

from schemas.decode import decode_result, encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest
from schemas.result import FinalRecord
from worker.broker.acls import Acl, client_acls, create_acls, delete_acls, worker_acls
from worker.broker.local import LocalBroker, free_ports
from worker.broker.pki import CertificateAuthority
from worker.broker.secure import Security, settings_for
from worker.broker.topics import ensure_topics
from worker.kafka_settings import KafkaSettings
from worker.engine.instant import InstantEngine
from tests.transport.test_failover_kafka import wait_assigned
from tests.transport.kafka_helpers import (
    REPO,
    Collector,
    produce_requests,
    running_worker,
    subprocess_env,
    worker_settings,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
SERVE_DEADLINE_S = 30.0


class SecuredBroker:
    def __init__(self, tmp: Path, mode: str) -> None:
        port, controller_port = free_ports(2)
        self.broker = LocalBroker(tmp / mode, port, controller_port, detach=False, security=mode)
        suffix = uuid.uuid4().hex[:8]
        self.base = KafkaSettings(
            bootstrap_servers=self.broker.bootstrap_servers, request_topic=f"sec.requests.{suffix}",
            result_topic=f"sec.results.{suffix}", dead_letter_topic=f"sec.dead-letter.{suffix}",
            status_topic=f"sec.status.{suffix}", control_topic=f"sec.control.{suffix}", group_id=f"sec-{suffix}")

    async def start(self) -> "SecuredBroker":
        await asyncio.to_thread(self.broker.start)
        self.security: Security = self.broker.load_security()
        await ensure_topics(self.as_("admin"))
        await create_acls(self.as_("admin"), worker_acls(self.base) + client_acls(self.base))
        return self

    def as_(self, principal: str, **overrides) -> KafkaSettings:
        settings = settings_for(self.security, principal, self.broker.bootstrap_servers, self.base)
        return KafkaSettings(**{**settings.model_dump(), **overrides}) if overrides else settings

    def librdkafka(self, principal: str) -> dict:
        path = self.broker.data_dir / "clients" / f"{principal}.properties"
        return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


@pytest.fixture(scope="module")
async def sasl_ssl(tmp_path_factory):
    secured = await SecuredBroker(tmp_path_factory.mktemp("secured"), "sasl_ssl").start()
    yield secured
    secured.broker.stop()


@pytest.fixture(scope="module")
async def mtls(tmp_path_factory):
    secured = await SecuredBroker(tmp_path_factory.mktemp("secured"), "ssl").start()
    yield secured
    secured.broker.stop()


def _request(prompt: str, max_new_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(id=f"sec-{uuid.uuid4().hex[:10]}", prompt=prompt, max_new_tokens=max_new_tokens)


async def _librdkafka_round_trip(secured: SecuredBroker, num_requests: int = 5) -> None:
    """Requests written and results read by librdkafka with the client's .properties, through our worker."""
    from confluent_kafka import Consumer, Producer

    kafka = secured.base
    requests = [_request(f"hello {i}") for i in range(num_requests)]
    async with running_worker(secured.as_("worker"), worker_settings(), InstantEngine(max_num_seqs=8)):
        producer = Producer(secured.librdkafka("client"))
        for request in requests:
            producer.produce(kafka.request_topic, encode(request), key=request.id.encode(),
                             partition=partition_for(1, request.id, kafka.num_request_partitions, kafka.num_priorities))
        assert producer.flush(20) == 0
        consumer = Consumer({**secured.librdkafka("client"), "group.id": f"client-reader-{uuid.uuid4().hex[:6]}",
                             "auto.offset.reset": "earliest", "enable.auto.commit": False})
        consumer.subscribe([kafka.result_topic])
        finals: dict[str, FinalRecord] = {}
        deadline = time.monotonic() + 30
        try:
            while len(finals) < num_requests and time.monotonic() < deadline:
                message = await asyncio.to_thread(consumer.poll, 0.5)
                if message is None:
                    continue
                assert message.error() is None, message.error()
                record = decode_result(message.value())
                if isinstance(record, FinalRecord):
                    assert record.id not in finals, "two finals for one request"
                    finals[record.id] = record
        finally:
            consumer.close()
    assert {r.id for r in requests} == set(finals)
    assert all(f.status == "completed" for f in finals.values())


async def test_request_path_with_librdkafka_over_sasl_ssl(sasl_ssl: SecuredBroker) -> None:
    await _librdkafka_round_trip(sasl_ssl)


async def test_request_path_with_librdkafka_over_mutual_tls(mtls: SecuredBroker) -> None:
    await _librdkafka_round_trip(mtls)


async def test_generate_and_our_client_over_sasl_ssl(sasl_ssl: SecuredBroker) -> None:
    client = sasl_ssl.as_("client")
    async with running_worker(sasl_ssl.as_("worker"), worker_settings(), InstantEngine(max_num_seqs=8)):
        env = {**subprocess_env(client), **sasl_ssl.security.client_env("client", client.bootstrap_servers)}
        proc = await asyncio.create_subprocess_exec(
            str(REPO / ".venv" / "bin" / "llm-worker"), "generate", "hi there", "--max-new-tokens", "3",
            "--wait-s", "20", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output, _ = await asyncio.wait_for(proc.communicate(), 40)
    assert proc.returncode == 0, output.decode()
    assert "completed" in output.decode()


def _serve_env(secured: SecuredBroker, principal: str, **overrides: str) -> dict[str, str]:
    """The principal's settings for a `serve` subprocess; an override of "" removes that variable."""
    env = {**subprocess_env(secured.base), **secured.security.client_env(principal, secured.base.bootstrap_servers)}
    for key, value in overrides.items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


async def _serve_fails(env: dict[str, str], log_path: Path) -> tuple[float, list[str]]:
    """Runs `serve` until it exits; returns how long it took and its ERROR lines."""
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            str(REPO / ".venv" / "bin" / "llm-worker"), "serve", "--engine", "instant", env=env, stdout=log,
            stderr=log, cwd=str(REPO))
        try:
            returncode = await asyncio.wait_for(proc.wait(), SERVE_DEADLINE_S + 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"serve still running after {SERVE_DEADLINE_S + 15} s:\n{log_path.read_text()}")
    elapsed = time.monotonic() - started
    text = log_path.read_text()
    assert returncode == 3, text
    return elapsed, [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line]


async def test_credential_and_permission_errors_end_serve_with_one_line(sasl_ssl: SecuredBroker,
                                                                        tmp_path: Path) -> None:
    other_ca = CertificateAuthority.create(tmp_path / "other-ca", "someone else's CA")
    kafka, broker = sasl_ssl.base, sasl_ssl.broker
    unwritable = f"sec.not-allowed.{uuid.uuid4().hex[:6]}"
    await ensure_topics(sasl_ssl.as_("admin", result_topic=unwritable))
    cases = {
        "wrong password": (_serve_env(sasl_ssl, "worker", KAFKA_SASL_PASSWORD="not-the-password"),
                           "authentication failed for user worker (SCRAM-SHA-512)"),
        "unknown CA": (_serve_env(sasl_ssl, "worker", KAFKA_SSL_CAFILE=str(other_ca.cert_path)),
                       "TLS verification failed for host 127.0.0.1"),
        "plaintext on the TLS port": (_serve_env(sasl_ssl, "worker", KAFKA_SECURITY_PROTOCOL="PLAINTEXT",
                                                 KAFKA_SASL_MECHANISM="", KAFKA_SASL_USERNAME="",
                                                 KAFKA_SASL_PASSWORD="", KAFKA_SSL_CAFILE=""),
                                      f"the listener at {broker.bootstrap_servers} speaks TLS"),
        "no READ on the request topic": (_serve_env(sasl_ssl, "client"),
                                         f"not authorized to READ topic {kafka.request_topic} (user client"),
        "no WRITE on the result topic": (_serve_env(sasl_ssl, "worker", KAFKA_RESULT_TOPIC=unwritable),
                                         f"not authorized to WRITE topic {unwritable}"),
        "no READ on the group": (_serve_env(sasl_ssl, "worker", KAFKA_GROUP_ID="a-group-nobody-granted"),
                                 "not authorized to READ group a-group-nobody-granted"),
    }
    results = await asyncio.gather(*(_serve_fails(env, tmp_path / f"serve-{i}.log")
                                     for i, (env, _) in enumerate(cases.values())))
    for (name, (env, expected)), (elapsed, errors) in zip(cases.items(), results):
        assert elapsed < SERVE_DEADLINE_S, f"{name}: {elapsed:.1f} s"
        assert len(errors) == 1 and expected in errors[0], f"{name}: {errors}"
        for secret in (env.get("KAFKA_SASL_PASSWORD"), env.get("KAFKA_SSL_KEY_PASSWORD")):
            assert not secret or secret not in errors[0]


async def test_client_certificate_errors_end_serve_with_one_line(mtls: SecuredBroker, tmp_path: Path) -> None:
    other_ca = CertificateAuthority.create(tmp_path / "other-ca", "someone else's CA")
    stranger = other_ca.issue(tmp_path / "other-ca", "worker")
    now = datetime.datetime.now(datetime.timezone.utc)
    expired = CertificateAuthority.load(mtls.security.folder).issue(
        tmp_path / "expired", "worker", not_before=now - datetime.timedelta(days=30),
        not_after=now - datetime.timedelta(days=1))
    cases = {
        "certificate from an unknown CA": (
            _serve_env(mtls, "worker", KAFKA_SSL_CERTFILE=str(stranger.cert_path),
                       KAFKA_SSL_KEYFILE=str(stranger.key_path), KAFKA_SSL_KEY_PASSWORD=""),
            "the broker rejected the client certificate"),
        "expired certificate": (
            _serve_env(mtls, "worker", KAFKA_SSL_CERTFILE=str(expired.cert_path),
                       KAFKA_SSL_KEYFILE=str(expired.key_path), KAFKA_SSL_KEY_PASSWORD=""),
            "expired on"),
        "no certificate": (
            _serve_env(mtls, "worker", KAFKA_SSL_CERTFILE="", KAFKA_SSL_KEYFILE="", KAFKA_SSL_KEY_PASSWORD=""),
            "the broker requires a client certificate"),
    }
    results = await asyncio.gather(*(_serve_fails(env, tmp_path / f"serve-{i}.log")
                                     for i, (env, _) in enumerate(cases.values())))
    for (name, (_, expected)), (elapsed, errors) in zip(cases.items(), results):
        assert elapsed < SERVE_DEADLINE_S, f"{name}: {elapsed:.1f} s"
        assert len(errors) == 1 and expected in errors[0], f"{name}: {errors}"


async def test_a_withdrawn_acl_stops_fetching_and_loses_nothing(sasl_ssl: SecuredBroker) -> None:
    worker_kafka, client, admin = sasl_ssl.as_("worker"), sasl_ssl.as_("client"), sasl_ssl.as_("admin")
    read_requests = [Acl("worker", "TOPIC", sasl_ssl.base.request_topic, "READ")]
    before = [_request("before")]
    in_flight = _request("streaming when the ACL goes", max_new_tokens=1000)  # 20 ms steps: 20 s
    during = [_request(f"during {i}") for i in range(4)]
    async with Collector(admin) as collector, running_worker(worker_kafka, worker_settings(),
                                                             InstantEngine(max_num_seqs=8, step_time_s=0.02)) as worker:
        await produce_requests(client, [(1, r) for r in before + [in_flight]])
        await collector.wait_until(lambda r: before[0].id in r.finals and any(i == in_flight.id for i, _ in r.chunks),
                                   20, "the first answer, and the long request streaming")
        await delete_acls(admin, read_requests)
        try:
            async with asyncio.timeout(20):
                while not worker.metrics.kafka_access_denied._value.get():
                    await asyncio.sleep(0.1)
            await produce_requests(client, [(1, r) for r in during])
            await asyncio.sleep(3.0)
            assert not any(r.id in collector.results.finals for r in during), "answered while denied"
            assert in_flight.id not in collector.results.finals, "the long request ended before the test could see"
        finally:
            await create_acls(admin, read_requests)
        await collector.wait_until(lambda r: all(q.id in r.finals for q in during), 12, "answers after the ACL")
        await collector.wait_until(lambda r: in_flight.id in r.finals, 30, "the long request's final")
        assert worker.metrics.kafka_access_denied._value.get() == 0
    for request in before + [in_flight] + during:
        finals = collector.results.finals[request.id]
        assert len(finals) == 1 and finals[0].status == "completed", finals
    # The request that was streaming when reading was denied streamed on, whole, under its one attempt.
    final = collector.results.finals[in_flight.id][0]
    assert final.usage.completion_tokens == 1000
    assert [c.seq for c in collector.results.chunks[(in_flight.id, final.attempt)]] == list(range(final.num_chunks))


async def test_a_broker_restart_over_sasl_ssl_loses_nothing_and_duplicates_no_final(tmp_path: Path) -> None:
    """Its own broker (the module's stay up for the other tests): a `serve` process with the worker's env file
    settings, 60 requests streaming, the secured broker stopped for 5 s and started again on the same data.
    Every TLS connection and SASL login is made again; a read_committed reader sees exactly one final each."""
    from tests.transport.exactly_once_checks import (all_answered, check_exactly_one, stop,
                                                     wait_for_answers_above_watermark)
    from tests.transport.test_exactly_once_kafka import ARGS, requests_of

    secured = await SecuredBroker(tmp_path, "sasl_ssl").start()
    requests = requests_of("sec-restart", 90)
    proc = None
    try:
        admin = secured.as_("admin")
        async with Collector(admin, isolation_level="read_committed") as committed:
            env = {**_serve_env(secured, "worker"), "WORKER_DRAIN_TIMEOUT_S": "0.3", "WORKER_WORKER_ID": "sec-eos"}
            with open(tmp_path / "serve.log", "wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    str(REPO / ".venv" / "bin" / "llm-worker"), "serve", *ARGS, "--worker-id", "sec-eos", env=env,
                    stdout=log, stderr=log, cwd=str(REPO))
            await wait_assigned(committed, {"sec-eos"}, secured.base.num_request_partitions)
            # Requests of varied lengths (the fake engine): the broker goes while finals are committed above
            # committed offsets and others still stream.
            offsets = await produce_requests(secured.as_("client"), requests)
            await wait_for_answers_above_watermark(admin, committed, set(range(secured.base.num_request_partitions)),
                                                   requests, offsets)
            assert await asyncio.to_thread(secured.broker.stop)
            await asyncio.sleep(5.0)
            await asyncio.to_thread(secured.broker.start)
            restarted = time.monotonic()
            await committed.wait_until(lambda r: all_answered(committed, requests), 120, "finals after the restart")
            answered_s = time.monotonic() - restarted
            await asyncio.sleep(2.0)
        assert proc.returncode is None, (tmp_path / "serve.log").read_text()[-3000:]
        check_exactly_one(committed, requests, "broker restart")
        print(f"\nSASL_SSL broker restart: {len(requests)} requests, one committed final each; all answered "
              f"{answered_s:.1f} s after the broker came back")
    finally:
        if proc is not None:
            await stop([proc])
        secured.broker.stop()


async def test_a_gateway_serves_the_openai_sdk_on_the_sasl_ssl_broker(sasl_ssl: SecuredBroker, tmp_path) -> None:
    """The gateway as the `client` principal with only the ACLs `broker start --security` writes: it creates its
    reply topic, heartbeats, sweeps and reads its answers under the reply prefix, and a worker answers there."""
    import openai

    from tests.gateway.test_gateway_kafka import RunningGateway
    from gateway.settings import GatewaySettings

    settings = GatewaySettings(data_dir=tmp_path / "gateway", reply_sweep_s=1.0)
    async with running_worker(sasl_ssl.as_("worker"), worker_settings(), InstantEngine(max_num_seqs=8)):
        async with RunningGateway(sasl_ssl.as_("client"), settings) as gateway:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="-",
                                        max_retries=0, timeout=30)
            answer = await client.chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert answer.choices[0].message.content and answer.usage.completion_tokens == 3
            await asyncio.sleep(2.5)  # two sweeps and heartbeats under the ACLs
            assert gateway.gateway.door.num_swept == 0
            from aiokafka.admin import AIOKafkaAdminClient

            from gateway.door import heartbeat_ms

            admin = AIOKafkaAdminClient(**sasl_ssl.as_("admin").client_kwargs())
            await admin.start()
            try:  # the heartbeat was committed (a missing group grant would leave none, and others would sweep)
                offsets = await admin.list_consumer_group_offsets(gateway.gateway.door.reply_topic)
            finally:
                await admin.close()
            assert heartbeat_ms(offsets) > time.time() * 1000
            stream = await client.chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": "again"}], max_tokens=3,
                stream=True)
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
