"""How what is answered becomes committed, chosen once from the settings (docs/delivery.md):

- ConsumerCommits (at least once): the consumer commits each partition's safe offset every commit interval, at
  revocation and at shutdown; a partition that comes here is read from its committed offset.
- TransactionalCommits (exactly once): each partition's lane (kafka/exactly_once.py) commits its finals and
  their offsets in one transaction; a partition that comes here fences its previous owner, skips what that owner
  answered above the committed offset, and resumes the streams it left (kafka/progress.py, kafka/resume.py).

The worker holds one of the two and calls it the same way, so nothing along the request path asks which.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition

from worker.kafka_settings import KafkaSettings
from worker.transport.kafka import progress
from worker.transport.kafka.aiokafka_compat import committed_with_metadata
from worker.transport.kafka.exactly_once import FinalLanes
from worker.transport.kafka.publisher import Publisher
from worker.transport.kafka.resume import takeover_progress
from worker.transport.requests.intake import Intake

log = logging.getLogger(__name__)
RESUME_READ_TIMEOUT_S = 15.0
"""How long a takeover may spend reading where the moved requests stopped before they start over instead."""
COMMITTED_READ_TIMEOUT_S = 30.0

Found = dict | None
"""{partition: (committed offset, its decoded progress)} read at an assignment, or None when not read."""


class ConsumerCommits:
    """At least once: offsets committed by the consumer."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def commit(self, partitions: set[TopicPartition] | None = None) -> None:
        await self.intake.commit(partitions)

    async def tick(self) -> None:
        """Every commit interval: what is done is committed."""
        await self.intake.commit()

    async def check_progress_topic(self) -> None:
        return None

    async def take_over(self, assigned: set[TopicPartition], generation: int) -> tuple[Found, set[TopicPartition]]:
        """Nothing to fence or skip: partitions are read from their committed offsets."""
        return None, set()

    async def stop(self) -> None:
        return None


class TransactionalCommits:
    """Exactly once: finals and offsets committed together, by each partition's lane."""

    def __init__(self, lanes: FinalLanes, kafka: KafkaSettings, consumer: AIOKafkaConsumer, publisher: Publisher,
                 intake: Intake) -> None:
        self.lanes, self.kafka, self.consumer, self.publisher, self.intake = lanes, kafka, consumer, publisher, intake

    async def commit(self, partitions: set[TopicPartition] | None = None) -> None:
        await self.lanes.flush(partitions)

    async def tick(self) -> None:
        """Lanes commit with their transactions, on their own interval."""
        return None

    async def check_progress_topic(self) -> None:
        """Streams are resumed only through a progress topic with a partition per request partition: without one
        (a deployment that has not run `llm-worker topics` since it came), a record written to it would abort
        every transaction of its lane, so no progress is written and moved requests start over."""
        topic = self.kafka.progress_topic
        if not topic:
            return
        try:
            metadata = await asyncio.wait_for(self.publisher.metadata(), 10.0)
            partitions = metadata.partitions_for_topic(topic)
        except Exception as exc:  # noqa: BLE001 - unknown now: keep it on; a failed transaction is retried
            log.debug("could not look the progress topic up (%r)", exc)
            return
        needed = self.kafka.num_request_partitions
        if partitions is None or len(partitions) < needed:
            self.lanes.progress_source = None
            log.warning("progress topic %r %s: streams of requests that move between workers start over instead of "
                        "resuming (`llm-worker topics` creates it with %d partitions)", topic,
                        "is missing" if partitions is None else f"has {len(partitions)} partitions, fewer than the "
                        f"{needed} request partitions", needed)

    async def take_over(self, assigned: set[TopicPartition], generation: int) -> tuple[Found, set[TopicPartition]]:
        """An assignment: the lanes of partitions that left (or whose lane was fenced) end, those of the assigned
        ones start, fencing their previous owners; returns what was committed for the partitions that come here
        and the partitions whose lane was lost."""
        lanes = self.lanes
        lost = lanes.fenced()
        if self.intake.missed_a_generation(generation):
            # Every lane may have been fenced by an owner in between, whether or not it has tried to write since:
            # each starts anew, fencing that owner in turn; except those of partitions this worker kept through
            # the generations it missed (it led them: Intake.kept_of).
            lost = lanes.owned() - self.intake.kept_of(assigned, generation, lost)
        await lanes.revoke((lanes.owned() - assigned) | lost)
        await lanes.assign(assigned)  # fences the previous owners first: their commits are final
        committed = await self._committed_progress(assigned - self.intake.kept_of(assigned, generation, lost))
        found = {tp: (offset, progress.decode(offset, metadata)) for tp, (offset, metadata) in committed.items()}
        await self._read_resume_points(committed)
        return found, lost

    async def stop(self) -> None:
        await self.lanes.stop()

    async def _read_resume_points(self, committed: dict) -> None:
        """Where the unfinished requests of the partitions that come here stopped (kafka/resume.py): their
        streams go on from there. The resume points are committed again until this worker's own progress
        replaces them, so a second takeover still finds what the first did not serve yet."""
        kafka = self.kafka
        points = {tp: point for tp, (offset, metadata) in committed.items()
                  if (point := progress.resume_pointer(offset, metadata)) is not None}
        for tp, point in points.items():
            self.lanes.keep_resume_point(tp, point)
        if not points or not kafka.progress_topic or self.lanes.progress_source is None:
            return
        found = await takeover_progress(
            kafka.client_kwargs(), kafka.progress_topic, {tp.partition: point for tp, point in points.items()},
            self.publisher.partition_of, self.publisher.send_wait_s, timeout_s=RESUME_READ_TIMEOUT_S)
        self.intake.expect_resumed({tp: found.get(tp.partition, {}) for tp in points})

    async def _committed_progress(self, partitions: set[TopicPartition]) -> dict:
        """{partition: (committed offset, its metadata)} for partitions that come to this worker (progress.py).
        Unreadable (the coordinator away): none, and those partitions are read from their offset as before,
        at-least-once; a warning says so."""
        if not partitions:
            return {}
        try:
            return await asyncio.wait_for(committed_with_metadata(self.consumer, partitions),
                                          COMMITTED_READ_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the rebalance goes on; only the skipping is lost
            log.warning("could not read the committed progress of partitions %s (%r): requests answered above "
                        "their committed offsets may be answered again", sorted(tp.partition for tp in partitions),
                        exc)
            return {}
