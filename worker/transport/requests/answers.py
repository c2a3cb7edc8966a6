"""The one way out: every final record (and, for records that cannot be served at all, a dead-letter record)
is written here. The engine's finals (`request_final`, from streamer.py) and those of requests it did not
finish: `error` (invalid, too large, reply topic not allowed, ...), `rejected`/`shed`, `rejected`/`deadline`
and `cancelled`; dead letters for undecodable records, for offsets whose batch cannot be read, and for poison
requests (the engine fails on them). A request's final ends it in the RequestBook (stages.py), which refuses a
second one. The request record's offset counts as done only once Kafka has acknowledged everything written
for it (`OffsetTracker.on_acked`), or once its partition's transaction commits (exactly-once lanes).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import msgspec

from schemas.dead_letter import DeadLetterRecord
from schemas.limits import MAX_SAFE_INT
from schemas.decode import RequestError, encode
from schemas.result import FinalRecord
from schemas.usage import UsageRecord
from worker.transport.load.admission import Verdict
from worker.transport.requests.local_queue import QueuedRequest
from worker.transport.metrics import WorkerMetrics
from worker.transport.kafka.offsets import OffsetTracker
from worker.transport.kafka.publisher import OnFailed, Publisher
from worker.transport.requests.records import answer_record, cancel_message, slimmed
from worker.transport.requests.stages import RequestBook

if TYPE_CHECKING:
    from worker.transport.kafka.exactly_once import FinalLanes
    from worker.transport.load.tenant_book import TenantBook

log = logging.getLogger(__name__)

MAX_DEAD_LETTER_VALUE = 512 * 1024
"""Bytes of an original record's value kept in its dead-letter record (base64 grows it by a third)."""
MAX_DEAD_LETTER_KEY = 4 * 1024
"""Bytes of an original record's key kept, in the dead-letter record and as its Kafka key: with the value
limit this keeps every dead letter well under the broker's default message.max.bytes (1 MiB), so it is
never refused and its offset never waits on it."""


class FinalReplacement:
    """What goes instead of a final record that its topic does not take, and where: the publisher's fallback
    (Answers.final_fallback) and the exactly-once lanes (exactly_once.py) both ask it."""

    def __init__(self, result_topic: str, worker_id: str, metrics: WorkerMetrics) -> None:
        self.result_topic = result_topic
        self.worker_id = worker_id
        self.metrics = metrics

    def __call__(self, topic: str, final: FinalRecord, code: str, message: str) -> tuple[str, FinalRecord] | None:
        """What goes instead of a final record that `topic` does not take, and where; None: nothing. Too large:
        the final without the parts that may be left out (`omitted` says which: records.slimmed), and a
        `result_too_large` error when even that does not fit. Topic unavailable: an `error` final naming the
        cause, on the result topic."""
        if code == "result_too_large":
            slim = slimmed(final)
            if slim is not None:
                return topic, slim
            target = topic
        elif final.index is not None:
            return None  # one completion's final: the request's own final carries the error
        elif topic == self.result_topic:
            log.error("a final record for request %r cannot be delivered to the result topic: %s", final.id, message)
            return None
        else:
            target, message = self.result_topic, f"reply topic {topic!r} unavailable: {message}"
        error = msgspec.structs.replace(
            answer_record(final.id, final.attempt, "error", code, message, None, self.worker_id, final.metadata),
            timings=final.timings, usage=final.usage, index=final.index, num_chunks=final.num_chunks)
        self.metrics.rejected_for(code).inc()
        return target, error


class Answers:
    def __init__(
        self, publisher: Publisher, tracker: OffsetTracker, metrics: WorkerMetrics, worker_id: str,
        result_topic: str, dead_letter_topic: str, *, usage_topic: str = "", model: str = "",
        tenants: TenantBook, priority_of: Callable[[Hashable], int] = lambda partition: 0,
        lanes: FinalLanes | None = None, replacement: FinalReplacement | None = None,
        book: RequestBook | None = None,
    ) -> None:
        self.publisher = publisher
        self.book = book if book is not None else RequestBook()
        """The requests not ended yet (stages.py): a request's final ends it there, and a request that has ended
        gets no second one."""
        self.usage_topic = usage_topic
        """Where each request's usage record goes, beside its final (schemas/usage.py); empty: nowhere."""
        self.model = model
        self.priority_of = priority_of
        self.tracker = tracker
        self.metrics = metrics
        self.worker_id = worker_id
        self.result_topic = result_topic
        self.dead_letter_topic = dead_letter_topic
        self.num_dead_letters = 0
        self.lanes = lanes
        """Exactly-once finals (exactly_once.FinalLanes) when on: then every answer goes through them."""
        self._deliver = self._through_lanes if lanes is not None else self._through_publisher
        self.replacement = replacement or FinalReplacement(result_topic, worker_id, metrics)
        """The lanes' too (they are built with the same one)."""
        self._completions: dict[tuple[Hashable, str], list] = {}
        """With exactly-once finals: (partition, request id) -> the per-completion finals written so far of a
        request with several completions, held for its own final (`answer`)."""
        self.tenants = tenants
        """The worker's TenantBook: counts each tenant's finals by status."""

    def reject(
        self, partition: Hashable, offset: int, request_id: str, attempt: int, verdict: Verdict, topic: str,
        timestamp_ms: int, metadata: dict[str, str] | None, tenant: str = "",
    ) -> None:
        """Answer a decoded request with the verdict's final record on `topic`."""
        record = answer_record(request_id, attempt, verdict.status, verdict.reason, verdict.message, timestamp_ms,
                               self.worker_id, metadata)
        if verdict.retry_after_s is not None:
            record = msgspec.structs.replace(record, retry_after_ms=min(MAX_SAFE_INT, math.ceil(
                verdict.retry_after_s * 1000)))
        if verdict.reason != "shed":
            self.metrics.rejected_for(verdict.reason).inc()
        self.final(partition, offset, topic, record, tenant)

    def reject_queued(self, queued: QueuedRequest, verdict: Verdict, topic: str | None = None) -> None:
        """Answer a request with the verdict's final record, on its reply topic unless `topic` is given."""
        if not self.book.answered(queued):
            return
        self.tenants.finished(queued.tenant, verdict.status)
        self.reject(queued.partition, queued.offset, queued.request.id, queued.attempt, verdict,
                    topic or queued.reply_topic, queued.timestamp_ms, queued.request.metadata, queued.tenant)

    def request_final(self, queued: QueuedRequest, final: FinalRecord) -> None:
        """The engine's final of a request (the request's own when it has several completions)."""
        if self.book.answered(queued):
            self.final(queued.partition, queued.offset, queued.reply_topic, final, queued.tenant)

    def cancelled(self, queued: QueuedRequest, reason: str, when: str) -> None:
        """A request cancelled before it reached the engine: a `cancelled` final with empty output."""
        if not self.book.answered(queued):
            return
        record = answer_record(queued.request.id, queued.attempt, "cancelled", "cancelled",
                               cancel_message(reason, when), queued.timestamp_ms, self.worker_id,
                               queued.request.metadata)
        done = queued.resumed(0) if queued.request.num_completions == 1 else None
        if done is not None:  # it continued an earlier attempt's stream: that output is what it ends with
            record = msgspec.structs.replace(
                record, text=done.text, token_ids=list(done.token_ids), num_chunks=done.seq,
                usage=msgspec.structs.replace(record.usage, completion_tokens=len(done.token_ids)),
                resumed_at=done.seq if queued.request.stream else None)
        else:
            record = msgspec.structs.replace(record, text="", token_ids=[])
        self.metrics.requests_cancelled.inc()
        self.tenants.finished(queued.tenant, "cancelled")
        self.final(queued.partition, queued.offset, queued.reply_topic, record, queued.tenant)

    def final(self, partition: Hashable, offset: int | None, topic: str, final: FinalRecord, tenant: str = "") -> None:
        """Send a final record of the request read at (partition, offset); its offset counts as done once the
        record (or its replacement, see `replacement`) is acknowledged. `offset` None: a final that answers no
        request record by itself (one completion's, when the request has several)."""
        self.answer(partition, offset, [(topic, final.id.encode(), encode(final), final)], tenant)

    def usage_record(self, partition: Hashable, final: FinalRecord, tenant: str) -> UsageRecord:
        usage, timings = final.usage, final.timings
        return UsageRecord(
            id=final.id, attempt=final.attempt, tenant=tenant, priority=self.priority_of(partition), model=self.model,
            status=final.status, reason=final.reason, prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens, queue_ms=timings.queue_ms,
            ttft_ms=timings.ttft_ms, e2e_ms=timings.e2e_ms, worker_id=self.worker_id, ts_ms=int(time.time() * 1000))

    def answer(self, partition: Hashable, offset: int | None,
               records: list[tuple[str, bytes | None, bytes, FinalRecord | None]], tenant: str = "") -> None:
        """The one way out for records that answer a request record: through its partition's transaction when
        finals are exactly-once (exactly_once.py), else through the publisher, a final with its fallback. The
        final that answers the request record (one with an offset) brings its usage record along, in the same
        transaction: a read_committed reader of the usage topic counts each request once."""
        if offset is not None and self.usage_topic:
            final = next((final for _, _, _, final in reversed(records) if final is not None), None)
            if final is not None:
                usage = self.usage_record(partition, final, tenant)
                records = [*records, (self.usage_topic, final.id.encode(), encode(usage), None)]
        self._deliver(partition, offset, records)

    def _through_lanes(self, partition: Hashable, offset: int | None, records: list) -> None:
        final = next((final for _, _, _, final in records if final is not None), None)
        key = (partition, final.id) if final is not None else None
        if offset is None and key is not None:
            # One completion's final (n > 1): held until the request's own, so that all of them go in one
            # transaction with its offset. Committed earlier, they would be answered again, a second time, by
            # the partition's next owner if this worker died before the request's final.
            self._completions.setdefault(key, []).extend(records)
            return
        held = self._completions.pop(key, None) if key is not None else None
        self.lanes.add(partition, offset, held + records if held else records)

    def _through_publisher(self, partition: Hashable, offset: int | None, records: list) -> None:
        on_acked = self.tracker.on_acked(partition, offset) if offset is not None else None
        self.publisher.publish_group_nowait(
            [(topic, key, value, self.final_fallback(topic, final) if final is not None else None)
             for topic, key, value, final in records], on_acked)

    def forget(self, partitions: set) -> None:
        """Partitions given up: the completions held for their requests go (the next owner answers them)."""
        self._completions = {key: held for key, held in self._completions.items() if key[0] not in partitions}

    @property
    def num_held_completions(self) -> int:
        return len(self._completions)

    def final_fallback(self, topic: str, final: FinalRecord) -> OnFailed:
        """The publisher's on_failed for a final record: its replacement goes out, with a fallback of its own
        (a slimmed final may still be too large); the request's offset waits for the replacement."""

        def on_failed(code: str, message: str, on_acked: Callable[[], None]) -> None:
            found = self.replacement(topic, final, code, message)
            if found is None:
                on_acked()
                return
            target, record = found
            self.publisher.publish_nowait(target, record.id.encode(), encode(record), on_acked,
                                          self.final_fallback(target, record) if record.status != "error" else None)

        return on_failed

    def shed(self, queued: QueuedRequest, message: str) -> None:
        self.metrics.shed_for(queued.priority).inc()
        self.reject_queued(queued, Verdict("rejected", "shed", message))

    def dead_letter(self, partition, msg, error: RequestError, attempt: int) -> None:
        """An undecodable record: its bytes to the dead-letter topic and, when an id could be read, an `error`
        final record to the result topic; the offset is done when both are acknowledged."""
        self._set_aside(partition, msg.offset, msg.value, msg.key, msg.timestamp, error.code, error.message,
                        error.request_id, attempt)

    def dead_letter_request(self, queued: QueuedRequest, code: str, message: str) -> None:
        """A decoded request that cannot be served (it makes the engine fail): its re-encoded request goes to
        the dead-letter topic and an `error` final to its reply topic."""
        if not self.book.answered(queued):
            return
        self._set_aside(queued.partition, queued.offset, encode(queued.request), queued.request.id.encode(),
                        queued.timestamp_ms, code, message, queued.request.id, queued.attempt, queued.reply_topic,
                        queued.tenant)

    def unreadable(self, partition, offset: int, message: str) -> None:
        """An offset whose record could not even be read from its batch: a dead letter without the bytes."""
        self.metrics.unreadable_records.inc()
        self._set_aside(partition, offset, None, None, None, "decode_error", message, None, 0)

    def _set_aside(
        self, partition, offset: int, value: bytes | None, key: bytes | None, timestamp_ms: int | None, code: str,
        message: str, request_id: str | None, attempt: int, reply_topic: str | None = None, tenant: str = "",
    ) -> None:
        notes = []
        if value is not None and len(value) > MAX_DEAD_LETTER_VALUE:
            notes.append(f"value truncated to {MAX_DEAD_LETTER_VALUE} of {len(value)} bytes")
            value = value[:MAX_DEAD_LETTER_VALUE]
        if key is not None and len(key) > MAX_DEAD_LETTER_KEY:
            notes.append(f"key truncated to {MAX_DEAD_LETTER_KEY} of {len(key)} bytes")
            key = key[:MAX_DEAD_LETTER_KEY]
        message = message[:2000] + "".join(f" [{note}]" for note in notes)
        dead = DeadLetterRecord(
            value=value, key=key, error_code=code, error_message=message, request_id=request_id,
            topic=partition.topic, partition=partition.partition, offset=offset, timestamp_ms=timestamp_ms,
            dead_lettered_ms=int(time.time() * 1000), worker_id=self.worker_id,
        )
        records: list = [(self.dead_letter_topic, key, encode(dead), None)]
        if request_id is not None:
            final = answer_record(request_id, attempt, "error", code, message, timestamp_ms, self.worker_id)
            records.append((reply_topic or self.result_topic, request_id.encode(), encode(final), final))
        self.num_dead_letters += 1
        self.metrics.dead_letters.inc()
        self.metrics.rejected_for(code).inc()
        self.answer(partition, offset, records, tenant)
