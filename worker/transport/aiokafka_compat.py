"""The only place that reads aiokafka's private state; tests/transport/test_aiokafka_compat.py fails when a
new aiokafka release moves what these functions rely on (checked against aiokafka 0.14).

- The consumer group's generation id (the `attempt` of every request fetched under it, see intake.py):
  aiokafka keeps it on its group coordinator and has no public accessor.
- Failing a stopped producer's unresolved batches (publisher.py replaces a producer whose idempotent
  sequence broke): a dead sender leaves them pending forever, and aiokafka has no public call for this.
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError


def group_generation(consumer: AIOKafkaConsumer) -> int:
    """The generation id of the group the started consumer last joined (-1 before the first join)."""
    coordinator = consumer._coordinator
    if coordinator is None:
        raise RuntimeError("the consumer is not started: it has no group coordinator yet")
    return coordinator.generation


def fail_unsent_batches(producer: AIOKafkaProducer, error: KafkaError) -> None:
    """Resolve every batch the (stopped) producer still holds with `error`, so their callbacks run."""
    producer._message_accumulator.fail_all(error)
