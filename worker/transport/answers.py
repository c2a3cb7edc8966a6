"""Answers that bypass the engine: the one place that writes a final record (and, for undecodable records,
a dead-letter record) for a request the engine never saw: `error` (invalid, too large, reply topic not
allowed, ...), `rejected`/`shed` and `rejected`/`deadline`. As for the engine's finals, the request record's
offset counts as done only once Kafka has acknowledged everything written for it (`OffsetTracker.on_acked`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable

from schemas.dead_letter import DeadLetterRecord
from schemas.decode import RequestError, encode
from worker.transport.admission import Verdict
from worker.transport.local_queue import QueuedRequest
from worker.transport.metrics import WorkerMetrics
from worker.transport.offsets import OffsetTracker
from worker.transport.publisher import Publisher
from worker.transport.records import answer_record

MAX_DEAD_LETTER_VALUE = 512 * 1024
"""Bytes of an original record kept in its dead-letter record."""


class Answers:
    def __init__(
        self, publisher: Publisher, tracker: OffsetTracker, metrics: WorkerMetrics, worker_id: str,
        result_topic: str, dead_letter_topic: str,
    ) -> None:
        self.publisher = publisher
        self.tracker = tracker
        self.metrics = metrics
        self.worker_id = worker_id
        self.result_topic = result_topic
        self.dead_letter_topic = dead_letter_topic
        self.num_dead_letters = 0

    def reject(
        self, partition: Hashable, offset: int, request_id: str, attempt: int, verdict: Verdict, topic: str,
        timestamp_ms: int, metadata: dict[str, str] | None,
    ) -> None:
        """Answer a decoded request with the verdict's final record on `topic`."""
        record = answer_record(request_id, attempt, verdict.status, verdict.reason, verdict.message, timestamp_ms,
                               self.worker_id, metadata)
        if verdict.reason != "shed":
            self.metrics.rejected_for(verdict.reason).inc()
        self.publisher.publish_nowait(topic, request_id.encode(), encode(record),
                                      self.tracker.on_acked(partition, offset))

    def reject_queued(self, queued: QueuedRequest, verdict: Verdict) -> None:
        self.reject(queued.partition, queued.offset, queued.request.id, queued.attempt, verdict, queued.reply_topic,
                    queued.timestamp_ms, queued.request.metadata)

    def shed(self, queued: QueuedRequest, message: str) -> None:
        self.metrics.shed_for(queued.priority).inc()
        self.reject_queued(queued, Verdict("rejected", "shed", message))

    def dead_letter(self, partition, msg, error: RequestError, attempt: int) -> None:
        """An undecodable record: its bytes to the dead-letter topic and, when an id could be read, an `error`
        final record to the result topic; the offset is done when both are acknowledged."""
        value = msg.value
        if value is not None and len(value) > MAX_DEAD_LETTER_VALUE:
            # Base64 grows it by a third: kept whole, a record near the broker's limit could not be set aside.
            value = value[:MAX_DEAD_LETTER_VALUE]
            error = RequestError(error.code, f"{error.message} [value truncated to {MAX_DEAD_LETTER_VALUE} of "
                                 f"{len(msg.value)} bytes]", error.request_id)
        dead = DeadLetterRecord(
            value=value, key=msg.key, error_code=error.code, error_message=error.message[:2000],
            request_id=error.request_id, topic=partition.topic, partition=partition.partition, offset=msg.offset,
            timestamp_ms=msg.timestamp, dead_lettered_ms=int(time.time() * 1000), worker_id=self.worker_id,
        )
        records = [(self.dead_letter_topic, msg.key, encode(dead))]
        if error.request_id is not None:
            final = answer_record(error.request_id, attempt, "error", error.code, error.message[:2000],
                                  msg.timestamp, self.worker_id)
            records.append((self.result_topic, error.request_id.encode(), encode(final)))
        self.num_dead_letters += 1
        self.metrics.dead_letters.inc()
        self.metrics.rejected_for(error.code).inc()
        self.publisher.publish_group_nowait(records, self.tracker.on_acked(partition, msg.offset))
