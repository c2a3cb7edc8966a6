"""Checks shared by the exactly-once tests: did the fault hit what the bug needs (a final committed above its
partition's committed offset, judged from outside the worker), and does a read_committed reader see exactly one
final per request (also through librdkafka, as a third-party consumer reads)?"""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient
from confluent_kafka import Consumer

from schemas.decode import decode_result
from schemas.priority import partition_for
from schemas.result import FinalRecord
from worker.kafka_settings import KafkaSettings
from tests.transport.kafka_helpers import Collector, produce_requests

SKIPPED = re.compile(r"(\d+) offsets above its committed offset \d+ are answered already; skipped")


def finals_by_id(collector: Collector, requests) -> dict[str, list[FinalRecord]]:
    return {q.id: list(collector.results.finals.get(q.id, [])) for _, q in requests}


def answered(collector: Collector, request_id: str) -> bool:
    """The request's own final came (a request with several completions has one per completion besides)."""
    return any(f.index is None for f in collector.results.finals.get(request_id, ()))


def all_answered(collector: Collector, requests) -> bool:
    return all(answered(collector, q.id) for _, q in requests)


def check_exactly_one(collector: Collector, requests, what: str, shed_ok: bool = False) -> None:
    """One final per id (and, for a request with n completions, one per completion index too); each completed
    one with its whole stream. `shed_ok`: under steady traffic on a small, shared CPU host a worker may shed by lag,
    which is an answer too (one `rejected` final)."""
    finals = finals_by_id(collector, requests)
    duplicates, missing = {}, []
    for request_id, fs in finals.items():
        indexes = [f.index for f in fs]
        if len(indexes) != len(set(indexes)):
            duplicates[request_id] = [(f.index, f.attempt, f.worker_id) for f in fs]
        if None not in indexes:
            missing.append(request_id)
    assert not duplicates and not missing, (what, duplicates, missing)
    n_of = {q.id: q.n for _, q in requests}
    for request_id, fs in finals.items():
        (final,) = [f for f in fs if f.index is None]
        if shed_ok and final.status == "rejected" and final.reason == "shed":
            continue
        assert final.status == "completed", (what, final)
        if n_of[request_id] == 1:
            chunks = stream_of(collector, final)
            assert [c.seq for c in chunks] == list(range(final.num_chunks)), (what, request_id)
            assert "".join(c.text for c in chunks) == final.text, (what, request_id)
            continue
        completions = {f.index: f for f in fs if f.index is not None}
        assert sorted(completions) == list(range(n_of[request_id])), (what, request_id, sorted(completions))
        for index, completion in completions.items():
            mine = stream_of(collector, completion, index)
            assert [c.seq for c in mine] == list(range(completion.num_chunks)), (what, request_id, index)
            assert "".join(c.text for c in mine) == completion.text, (what, request_id, index)


def stream_of(collector: Collector, final: FinalRecord, index: int = 0) -> list:
    """The chunks of the stream `final` ends (Results.stream_of)."""
    return collector.results.stream_of(final, index)


async def committed_offsets(kafka: KafkaSettings) -> dict[int, int]:
    """partition -> the group's committed offset."""
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        found = await admin.list_consumer_group_offsets(kafka.group_id)
    finally:
        await admin.close()
    return {tp.partition: meta.offset for tp, meta in found.items() if tp.topic == kafka.request_topic}


def answered_above(collector: Collector, offsets: dict[str, tuple[int, int]], committed: dict[int, int],
                   partitions: set[int]) -> dict[int, int]:
    """partition -> how many requests of it have a committed (visible) final while their offset is at or above
    the partition's committed offset: what a new owner starting at that offset must not answer again. Judged
    from the outside (the records' offsets, the group's offsets, the finals a read_committed reader got), so it
    does not lean on the mechanism it checks."""
    out: dict[int, int] = {}
    for request_id, (partition, offset) in offsets.items():
        if partition in partitions and answered(collector, request_id) \
                and offset >= committed.get(partition, 0):
            out[partition] = out.get(partition, 0) + 1
    return out


def owned_by(collector: Collector, worker_id: str) -> set[int]:
    statuses = [s for s in collector.results.statuses if s.worker_id == worker_id]
    return set(statuses[-1].assigned_partitions) if statuses else set()


def unanswered_on(collector: Collector, requests, kafka: KafkaSettings, partitions: set[int]) -> int:
    return sum(1 for priority, q in requests if not answered(collector, q.id)
               and partition_for(priority, q.routing_key, kafka.num_request_partitions, kafka.num_priorities)
               in partitions)


def skipped_in_log(path: Path, since: int = 0) -> int:
    text = path.read_text(errors="replace")[since:] if path.exists() else ""
    return sum(int(m.group(1)) for m in SKIPPED.finditer(text))


async def wait_until_fenced(path: Path, timeout_s: float = 30.0) -> None:
    """A resumed zombie's loop tries to write what it held, and its log says the lanes were fenced; a moment
    more lets any record it might still get out reach the reader."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while "are fenced" not in path.read_text(errors="replace"):
        assert loop.time() < deadline, f"{path.name}: no fencing logged within {timeout_s:.0f} s"
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)


async def wait_for_answers_above_watermark(kafka: KafkaSettings, collector: Collector, partitions: set[int],
                                           requests, offsets: dict[str, tuple[int, int]],
                                           timeout_s: float = 120) -> None:
    """Until a request of one of `partitions` has its final committed above its partition's committed offset
    while requests of those partitions are still unanswered: the moment the bug needed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        committed = await committed_offsets(kafka)
        if answered_above(collector, offsets, committed, partitions) \
                and unanswered_on(collector, requests, kafka, partitions) >= 3:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no final was committed above a committed offset of {sorted(partitions)} "
                         f"within {timeout_s} s: {await committed_offsets(kafka)}")


async def freeze_with_answers_above(proc, kafka: KafkaSettings, collector: Collector, worker_id: str,
                                    make_batch, attempts: int = 3) -> tuple[list, set[int]]:
    """SIGSTOP a worker at the moment the bug needs on its partitions (wait_for_answers_above_watermark), checked
    again once it is stopped: it can commit past every answered request between the check and the signal, and
    then it goes on and another batch (make_batch(attempt)) is tried. Returns every request produced and the
    frozen worker's partitions."""
    sent: list = []
    for attempt in range(attempts):
        batch = make_batch(attempt)
        sent += batch
        offsets = await produce_requests(kafka, batch)
        partitions = owned_by(collector, worker_id)
        await wait_for_answers_above_watermark(kafka, collector, partitions, batch, offsets)
        proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(0.5)
        if answered_above(collector, offsets, await committed_offsets(kafka), partitions):
            return sent, partitions
        proc.send_signal(signal.SIGCONT)
    raise AssertionError(f"{worker_id} was never stopped with a final committed above a committed offset")


def third_party_final_counts(kafka: KafkaSettings, requests) -> dict[tuple[str, int | None], int]:
    """Finals per (request id, completion index: None for the request's own), read from the start of the result
    topic by librdkafka with isolation.level=read_committed."""
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"{kafka.group_id}-check",
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                         "enable.auto.commit": False})
    consumer.subscribe([kafka.result_topic])
    counts = {(q.id, index): 0 for _, q in requests for index in (None, *(range(q.n) if q.n > 1 else ()))}
    idle = 0
    try:
        while idle < 20:
            msg = consumer.poll(0.25)
            if msg is None:
                idle += 1
                continue
            idle = 0
            if msg.error():
                continue
            record = decode_result(msg.value())
            if isinstance(record, FinalRecord) and (record.id, record.index) in counts:
                counts[(record.id, record.index)] += 1
    finally:
        consumer.close()
    return counts


async def stop(procs) -> None:
    """SIGTERM every worker process still running (SIGCONT first: a frozen one would never exit), and wait."""
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
    await asyncio.gather(*(asyncio.wait_for(p.wait(), 60) for p in procs))
