"""In-memory stand-ins for the Kafka clients and the engine thread, for unit tests of the transport's parts
(intake, dispatcher, streamer, load control). They implement only the calls those parts make; the Kafka
integration tests run the same parts against a real broker."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from aiokafka import TopicPartition

from schemas.decode import encode
from schemas.priority import partition_for
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, StreamChunk
from worker.kafka_settings import KafkaSettings
from worker.engine.api import EngineRequest, EngineStats
from schemas.decode import decode_dead_letter, decode_result

TOPIC = "llm.requests"


@dataclass
class Record:
    """What the transport reads of an aiokafka ConsumerRecord."""

    value: bytes | None
    key: bytes | None
    offset: int
    timestamp: int
    headers: tuple = ()


class FakeConsumer:
    """Per-partition logs; getmany returns unread records of unpaused partitions, in offset order."""

    def __init__(self) -> None:
        self.logs: dict[TopicPartition, list[Record]] = defaultdict(list)
        self.positions: dict[TopicPartition, int] = defaultdict(int)
        self._paused: set[TopicPartition] = set()
        self.commits: list[dict[TopicPartition, int]] = []
        self.getmany_calls: list[tuple[int, ...]] = []

    def append(self, tp: TopicPartition, value: bytes | None, key: bytes | None, timestamp: int) -> int:
        log = self.logs[tp]
        log.append(Record(value, key, len(log), timestamp))
        return len(log) - 1

    async def getmany(self, *partitions, timeout_ms: int = 0, max_records: int | None = None):
        partitions = partitions or tuple(sorted(self.logs))
        self.getmany_calls.append(tuple(tp.partition for tp in partitions))
        out = {}
        budget = max_records if max_records is not None else 1 << 30
        for tp in partitions:
            if tp in self._paused or budget <= 0:
                continue
            unread = self.logs[tp][self.positions[tp]:self.positions[tp] + budget]
            if unread:
                out[tp] = unread
                self.positions[tp] += len(unread)
                budget -= len(unread)
        return out

    def highwater(self, tp: TopicPartition) -> int | None:
        return len(self.logs[tp]) if tp in self.logs else None

    async def position(self, tp: TopicPartition) -> int:
        return self.positions[tp]

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset

    def pause(self, *partitions) -> None:
        self._paused.update(partitions)

    def resume(self, *partitions) -> None:
        self._paused.difference_update(partitions)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    async def commit(self, offsets) -> None:
        self.commits.append(dict(offsets))


class FakePublisher:
    """Keeps what was published; `ack_all()` plays Kafka acknowledging every record so far."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | None, bytes]] = []
        self.on_failed: list = []
        """Each record's on_failed (None for most), parallel to `records`: a test calls one to play a record
        that cannot be delivered."""
        self._unacked: list = []

    def publish_nowait(self, topic, key, value, on_acked=None, on_failed=None) -> None:
        self.records.append((topic, key, value))
        self.on_failed.append(on_failed)
        if on_acked is not None:
            self._unacked.append(on_acked)

    def publish_group_nowait(self, records, on_acked=None) -> None:
        for topic, key, value, on_failed in records:
            self.records.append((topic, key, value))
            self.on_failed.append(on_failed)
        if on_acked is not None:
            self._unacked.append(on_acked)

    async def publish(self, topic, key, value, on_acked=None) -> None:
        self.publish_nowait(topic, key, value, on_acked)

    async def wait_room(self) -> None:
        pass

    def ack_all(self) -> None:
        callbacks, self._unacked = self._unacked, []
        for callback in callbacks:
            callback()

    def finals(self, topic: str = "llm.results") -> dict[str, FinalRecord]:
        out = {}
        for t, _, value in self.records:
            if t == topic:
                record = decode_result(value)
                if isinstance(record, FinalRecord):
                    assert record.id not in out, f"two finals for {record.id}"
                    out[record.id] = record
        return out

    def all_finals(self, topic: str = "llm.results") -> list[FinalRecord]:
        """Every final record in order (a request with n > 1 has one per completion, then its own)."""
        return [r for t, _, v in self.records if t == topic and isinstance(r := decode_result(v), FinalRecord)]

    def chunks(self, topic: str = "llm.results") -> list[StreamChunk]:
        return [r for t, _, v in self.records if t == topic and isinstance(r := decode_result(v), StreamChunk)]

    def dead_letters(self, topic: str = "llm.dead-letter") -> list:
        return [decode_dead_letter(v) for t, _, v in self.records if t == topic]


class FakeEngineThread:
    def __init__(self) -> None:
        self.added: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.input_ended: list[bool] = []
        self.stats = EngineStats()

    def add(self, request: EngineRequest) -> None:
        self.added.append(request)

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def set_input_ended(self, ended: bool) -> None:
        self.input_ended.append(ended)


def request_partition(kafka: KafkaSettings, priority: int, request_id: str) -> TopicPartition:
    return TopicPartition(TOPIC, partition_for(priority, request_id, kafka.num_request_partitions,
                                               kafka.num_priorities))


def request_bytes(request_id: str, **fields) -> bytes:
    return encode(GenerationRequest(id=request_id, prompt=fields.pop("prompt", "hello"), **fields))


def tenant_book(num_priorities: int = 3):
    """The worker's tenant book (TenantBook) with the default settings."""
    from worker.transport.load.tenant_book import TenantBook
    from worker.worker_settings import WorkerSettings

    return TenantBook.from_settings(WorkerSettings(), num_priorities)
