"""The worker's Kafka clients: the request consumer (manual commits, the priority assignor) and its rebalance
listener. The result producer is publisher.py's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from worker.kafka_settings import KafkaSettings
from worker.worker_settings import WorkerSettings
from worker.transport.kafka.aiokafka_compat import group_generation
from worker.transport.kafka.assignor import PriorityRoundRobinAssignor


def make_consumer(kafka: KafkaSettings, settings: WorkerSettings
                  ) -> tuple[AIOKafkaConsumer, PriorityRoundRobinAssignor]:
    assignor = PriorityRoundRobinAssignor(kafka.num_priorities, kafka.num_request_partitions)
    consumer = AIOKafkaConsumer(
        **kafka.client_kwargs(),
        group_id=kafka.group_id,
        client_id=settings.worker_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        partition_assignment_strategy=(assignor,),
        max_poll_records=settings.max_poll_records,
        fetch_min_bytes=settings.fetch_min_bytes,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        session_timeout_ms=int(settings.session_timeout_s * 1000),
        heartbeat_interval_ms=max(100, int(settings.session_timeout_s * 1000) // 4),
    )
    # The leader stamps each assignment with the group generation (assignor.py "Generations"), read inside a
    # join, when the coordinator holds the generation being formed.
    assignor.group_generation = lambda: group_generation(consumer)
    return consumer, assignor


class RebalanceListener(ConsumerRebalanceListener):
    """Forwards aiokafka's rebalance callbacks (which run inside getmany, on the loop) to the worker."""

    def __init__(
        self,
        on_revoked: Callable[[set[TopicPartition]], Awaitable[None]],
        on_assigned: Callable[[set[TopicPartition]], Awaitable[None] | None],
    ) -> None:
        self._on_revoked = on_revoked
        self._on_assigned = on_assigned

    async def on_partitions_revoked(self, revoked) -> None:
        await self._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        # Awaited by aiokafka before it reads the new partitions' committed offsets: exactly-once lanes
        # fence the partitions' previous owners here (exactly_once.py).
        result = self._on_assigned(set(assigned))
        if result is not None:
            await result
