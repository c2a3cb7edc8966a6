"""The local Kafka broker, the topics command, and a real produce/consume round trip."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import stat
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from worker.broker.jars import BrokerError, ensure_kafka_jars, find_java, parse_java_major
from worker.broker.local import (
    LocalBroker,
    free_port,
    free_ports,
    new_cluster_id,
    port_is_free,
    probe_api_versions,
    render_server_properties,
)
from worker.broker.topics import CONTROL_RETENTION_MS, STATUS_RETENTION_MS, ensure_topics, topic_specs
from worker.cli import main as cli_main
from worker.kafka_settings import KafkaSettings

# ---------------------------------------------------------------- fast unit tests (no Java, no broker)


def _parse_properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_server_properties_single_node_kraft(tmp_path: Path) -> None:
    props = _parse_properties(render_server_properties(log_dir=tmp_path / "kraft", port=19092, controller_port=19093))
    assert props["process.roles"] == "broker,controller"
    assert props["node.id"] == "1"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19092"
    assert props["controller.listener.names"] == "CONTROLLER"
    # Static voters and --standalone formatting exclude each other; we format without it.
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert "controller.quorum.bootstrap.servers" not in props
    assert props["log.dirs"] == str(tmp_path / "kraft")
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.replication.factor",
        "share.coordinator.state.topic.min.isr",
    ):
        assert props[key] == "1", key
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert props["auto.create.topics.enable"] == "false"


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(4)
    assert len(set(ports)) == 4
    assert all(1024 <= port <= 65535 and port_is_free(port) for port in ports)


def test_port_is_free_sees_a_listening_socket() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])


def _plain_bind_refused(port: int) -> bool:
    """True when a bind without SO_REUSEADDR fails: what the old free-port probe saw after a stop."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_port_is_free_after_a_server_closed_its_connections() -> None:
    # A server that closes first (a broker stopping) leaves its side of each connection in TIME_WAIT for a
    # minute; a server socket with SO_REUSEADDR, as the JVM makes it, binds over them.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            conn.close()  # the server's FIN first: TIME_WAIT lands on the server's port
            assert client.recv(1) == b""
    if sys.platform.startswith("linux"):
        assert _plain_bind_refused(port), "no TIME_WAIT on the port: this test no longer tests anything"
    assert port_is_free(port)


def test_probe_is_false_when_nothing_listens() -> None:
    assert not probe_api_versions("127.0.0.1", free_port(), timeout_s=0.5)


def test_probe_is_false_for_a_server_that_is_not_kafka() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        async def answer_garbage() -> bool:
            loop = asyncio.get_running_loop()
            probe = loop.run_in_executor(None, probe_api_versions, "127.0.0.1", port, 2.0)
            conn, _ = await loop.run_in_executor(None, server.accept)
            with conn:
                await loop.run_in_executor(None, conn.recv, 64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            return await probe

        assert asyncio.run(answer_garbage()) is False


def test_cluster_id_is_a_kafka_uuid() -> None:
    for _ in range(50):
        cluster_id = new_cluster_id()
        assert len(cluster_id) == 22 and not cluster_id.startswith("-")
        assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_392"', 8),
    ],
)
def test_parse_java_major(output: str, major: int) -> None:
    assert parse_java_major(output) == major


def test_parse_java_major_rejects_garbage() -> None:
    with pytest.raises(BrokerError, match="cannot read the Java version"):
        parse_java_major("command not found")


def test_missing_java_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(BrokerError, match=r"`java` not found.*Java 17"):
        find_java()
    broker = LocalBroker(tmp_path / "data", free_port(), kafka_dir=tmp_path / "kafka")
    with pytest.raises(BrokerError, match="`java` not found"):
        broker.start()
    assert not (tmp_path / "data").exists()


def test_old_java_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    java = tmp_path / "java"
    java.write_text('#!/bin/sh\necho \'openjdk version "11.0.22" 2024-01-16\' >&2\n')
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(BrokerError, match="Java 11; Kafka 4 needs Java 17"):
        find_java()


def test_missing_mvn_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BrokerError, match="`mvn` not found"):
        ensure_kafka_jars(tmp_path / "kafka")


def test_topic_specs_follow_settings() -> None:
    settings = KafkaSettings(num_priorities=4, partitions_per_priority=3, result_retention_ms=1234)
    specs = {spec.name: spec for spec in topic_specs(settings)}
    names = {settings.request_topic, settings.result_topic, settings.dead_letter_topic, settings.status_topic,
             settings.control_topic, settings.usage_topic, settings.progress_topic}
    assert set(specs) == names
    assert specs[settings.usage_topic].num_partitions == 12
    assert specs[settings.progress_topic].num_partitions == 12  # one per request partition
    assert {spec.name for spec in topic_specs(KafkaSettings(progress_topic=""))} == names - {settings.progress_topic}
    assert {spec.name for spec in topic_specs(KafkaSettings(usage_topic=""))} == names - {settings.usage_topic}
    assert specs[settings.request_topic].num_partitions == 12
    assert specs[settings.result_topic].topic_configs["retention.ms"] == "1234"
    assert specs[settings.status_topic].topic_configs["retention.ms"] == str(STATUS_RETENTION_MS)
    assert specs[settings.control_topic].topic_configs["retention.ms"] == str(CONTROL_RETENTION_MS)
    assert specs[settings.control_topic].num_partitions == 1


def test_broker_status_cli_when_not_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["broker", "status", "--data-dir", str(tmp_path)]) == 3
    assert "not running" in capsys.readouterr().out


# ---------------------------------------------------------------- against the real broker


@pytest.mark.kafka
async def test_produce_and_consume_round_trip(kafka_topics: KafkaSettings) -> None:
    # Three streams of four chunks each, interleaved as a worker would write them.
    sent = [(f"req-{i}".encode(), f"chunk {seq}".encode()) for seq in range(4) for i in range(3)]
    producer = AIOKafkaProducer(**kafka_topics.client_kwargs(), acks="all")
    await producer.start()
    try:
        for key, value in sent:
            await producer.send_and_wait(kafka_topics.result_topic, value, key=key)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        kafka_topics.result_topic, **kafka_topics.client_kwargs(),
        group_id=kafka_topics.group_id, auto_offset_reset="earliest", enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    received = []
    try:
        deadline = time.monotonic() + 30
        while len(received) < len(sent) and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            received += [record for records in batches.values() for record in records]
    finally:
        await consumer.stop()
    assert sorted((r.key, r.value) for r in received) == sorted(sent)
    # Same key, same partition, in send order: the per-request ordering the result stream relies on.
    for key in {key for key, _ in sent}:
        records = sorted((r for r in received if r.key == key), key=lambda r: r.offset)
        assert len({r.partition for r in records}) == 1
        assert [r.value for r in records] == [f"chunk {seq}".encode() for seq in range(4)]


async def _retention_ms(settings: KafkaSettings, topic: str) -> str:
    admin = AIOKafkaAdminClient(**settings.client_kwargs())
    await admin.start()
    try:
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic, None)])
    finally:
        await admin.close()
    entries = responses[0].to_object()["resources"][0]["config_entries"]
    return next(entry["config_value"] for entry in entries if entry["config_names"] == "retention.ms")


@pytest.mark.kafka
async def test_ensure_topics_creates_once_with_configured_partitions(kafka_settings: KafkaSettings) -> None:
    first = await ensure_topics(kafka_settings)
    assert all(state.created for state in first.values())
    assert first[kafka_settings.request_topic].num_partitions == kafka_settings.num_request_partitions == 6
    assert first[kafka_settings.dead_letter_topic].num_partitions == 1
    second = await ensure_topics(kafka_settings)
    assert not any(state.created for state in second.values())
    assert {n: s.num_partitions for n, s in second.items()} == {n: s.num_partitions for n, s in first.items()}
    assert await _retention_ms(kafka_settings, kafka_settings.result_topic) == str(kafka_settings.result_retention_ms)
    assert await _retention_ms(kafka_settings, kafka_settings.status_topic) == str(STATUS_RETENTION_MS)


@pytest.mark.kafka
async def test_ensure_topics_grows_a_short_request_topic(kafka_settings: KafkaSettings) -> None:
    small = kafka_settings.model_copy(update={"partitions_per_priority": 1})
    assert (await ensure_topics(small))[small.request_topic].num_partitions == 3
    grown = (await ensure_topics(kafka_settings))[kafka_settings.request_topic]
    assert (grown.created, grown.num_partitions, grown.num_partitions_added) == (False, 6, 3)


@pytest.mark.kafka
def test_topics_cli_reads_env_and_flags(
    kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for field in ("request_topic", "result_topic", "dead_letter_topic", "status_topic", "control_topic"):
        monkeypatch.setenv(f"KAFKA_{field.upper()}", getattr(kafka_settings, field))
    args = ["topics", "--bootstrap-servers", kafka_settings.bootstrap_servers, "--priorities", "2"]
    assert cli_main([*args, "--partitions-per-priority", "4"]) == 0
    assert f"created  {kafka_settings.request_topic}: 8 partitions" in capsys.readouterr().out
    assert cli_main(args) == 0  # fewer configured partitions than exist: nothing shrinks
    assert f"exists   {kafka_settings.request_topic}: 8 partitions" in capsys.readouterr().out


@pytest.mark.kafka
def test_start_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        broker = LocalBroker(tmp_path, sock.getsockname()[1], free_port())
        with pytest.raises(BrokerError, match="in use"):
            broker.start()


@pytest.mark.kafka
@pytest.mark.slow
async def test_topics_and_records_survive_a_restart_on_the_same_port(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    port, controller_port = free_ports(2)
    data_dir = tmp_path / "broker"
    settings = KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}", partitions_per_priority=1)
    cli_args = ["--data-dir", str(data_dir), "--port", str(port), "--controller-port", str(controller_port)]
    broker = LocalBroker(data_dir, port, controller_port, detach=False)
    producer: AIOKafkaProducer | None = None
    try:
        # First run through the CLI (a detached broker), second through the class: both share the data dir.
        assert await asyncio.to_thread(cli_main, ["broker", "start", *cli_args]) == 0
        assert cli_main(["broker", "status", *cli_args]) == 0
        assert f"bootstrap=127.0.0.1:{port}" in capsys.readouterr().out
        await ensure_topics(settings)
        producer = await _round_trip(settings, b"before")
        await producer.send_and_wait(settings.request_topic, b"kept", key=b"req-1", partition=2)
        # The producer stays connected through the stop: the broker's side of its connection is left in
        # TIME_WAIT, and the JVM binds over it (SO_REUSEADDR), so `broker start` must not call the port taken.
        assert await asyncio.to_thread(cli_main, ["broker", "stop", *cli_args]) == 0
        assert not probe_api_versions("127.0.0.1", port, timeout_s=0.5)
        if sys.platform.startswith("linux"):  # else the test could pass without the race it is about
            assert _plain_bind_refused(port), "the stop left no TIME_WAIT on the port"

        started = time.monotonic()
        await asyncio.to_thread(broker.start)  # the first try: no retry loop hides a refusal
        restart_s = time.monotonic() - started
        await producer.stop()
        producer = await _round_trip(settings, b"after")
        states = await ensure_topics(settings)
        assert not any(state.created for state in states.values())
        assert states[settings.request_topic].num_partitions == 3
        consumer = AIOKafkaConsumer(**settings.client_kwargs(), auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(settings.request_topic, 2)])
            batches = await consumer.getmany(timeout_ms=10_000)
        finally:
            await consumer.stop()
        assert [(r.key, r.value) for records in batches.values() for r in records] == [(b"req-1", b"kept")]
        print(f"restart on the same port and data: started in {restart_s:.1f} s, then served")
    finally:
        if producer is not None:
            await producer.stop()
        await asyncio.to_thread(broker.stop)
    assert not os.path.exists(data_dir / "broker.json")


async def _round_trip(settings: KafkaSettings, value: bytes) -> AIOKafkaProducer:
    """Produce `value` and read it back; returns the producer, still connected."""
    producer = AIOKafkaProducer(**settings.client_kwargs(), acks="all")
    await producer.start()
    sent = await producer.send_and_wait(settings.result_topic, value, key=b"k", partition=0)
    consumer = AIOKafkaConsumer(**settings.client_kwargs(), enable_auto_commit=False)
    await consumer.start()
    try:
        partition = TopicPartition(settings.result_topic, 0)
        consumer.assign([partition])
        consumer.seek(partition, sent.offset)
        batches = await consumer.getmany(partition, timeout_ms=10_000)
    finally:
        # Closed now: aiokafka's consumer.stop() raises CancelledError when its fetch waits out a backoff
        # against a stopped broker. The producer's connection stays open across the stop.
        await consumer.stop()
    assert [r.value for r in batches.get(partition, [])][:1] == [value]
    return producer
