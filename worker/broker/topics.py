"""Create the worker's topics, idempotently: `ensure_topics(settings)` and `llm-worker topics`.

Safe to run from every worker at start-up and from a one-shot deployment job at once: a topic that another
caller created first counts as existing. The request topic only ever grows (Kafka cannot remove
partitions); growing it changes which keys land on which partition, so do it before traffic flows.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.errors import InvalidPartitionsError, KafkaConnectionError, TopicAlreadyExistsError, for_code

from worker.kafka_settings import KafkaSettings

log = logging.getLogger(__name__)

# Status records are a heartbeat stream that producers read "from now"; an hour of history is plenty.
STATUS_RETENTION_MS = 3600 * 1000
# Small segments so that retention (applied per closed segment) actually drops old status records.
STATUS_SEGMENT_MS = 10 * 60 * 1000
# Cancels count for WORKER_CANCEL_TTL_S (15 minutes by default) and workers read them back that far at start.
CONTROL_RETENTION_MS = 3600 * 1000


@dataclass(slots=True)
class TopicState:
    name: str
    num_partitions: int
    created: bool
    """True when this call created the topic."""
    num_partitions_added: int = 0
    """Partitions this call added to an existing topic (request topic only)."""


PROGRESS_RETENTION_MS = 60 * 60 * 1000
USAGE_RETENTION_MS = 7 * 24 * 3600 * 1000


def topic_specs(settings: KafkaSettings) -> list[NewTopic]:
    """The topics the worker needs, with their partition counts and per-topic configs."""
    replication = settings.replication_factor
    return [
        NewTopic(settings.request_topic, settings.num_request_partitions, replication),
        NewTopic(
            settings.result_topic, settings.num_request_partitions, replication,
            topic_configs={"retention.ms": str(settings.result_retention_ms)},
        ),  # fmt: skip
        NewTopic(settings.dead_letter_topic, 1, replication),
        NewTopic(
            settings.status_topic, 1, replication,
            topic_configs={"retention.ms": str(STATUS_RETENTION_MS), "segment.ms": str(STATUS_SEGMENT_MS)},
        ),  # fmt: skip
        # One partition: every worker reads all of it anyway, and cancels are few.
        NewTopic(
            settings.control_topic, 1, replication,
            topic_configs={"retention.ms": str(CONTROL_RETENTION_MS), "segment.ms": str(STATUS_SEGMENT_MS)},
        ),  # fmt: skip
        # Billing reads it back over days: it keeps what the result topic keeps, at least a week.
        *([NewTopic(settings.usage_topic, settings.num_request_partitions, replication,
                    topic_configs={"retention.ms": str(max(settings.result_retention_ms, USAGE_RETENTION_MS))})]
          if settings.usage_topic else []),
        # Read back only from the latest round (the committed offset's metadata points at it): an hour is plenty.
        *([NewTopic(settings.progress_topic, settings.num_request_partitions, replication,
                    topic_configs={"retention.ms": str(PROGRESS_RETENTION_MS), "segment.ms": str(STATUS_SEGMENT_MS)})]
          if settings.progress_topic else []),
    ]


async def ensure_topics(
    settings: KafkaSettings, *, connect_timeout_s: float = 30.0, ready_timeout_s: float = 30.0
) -> dict[str, TopicState]:
    """Create missing topics, grow a short request topic, and wait until every partition has a leader.

    Returns topic name -> TopicState. Raises aiokafka errors other than "already exists".
    """
    admin = await _start_admin(settings, connect_timeout_s)
    try:
        specs = topic_specs(settings)
        # list_topics asks for all topics; describing a missing one by name could auto-create it on
        # brokers with auto.create.topics.enable=true, with one partition.
        existing = set(await admin.list_topics())
        missing = [spec for spec in specs if spec.name not in existing]
        created_names: set[str] = set()
        if missing:
            response = await admin.create_topics(missing)
            for topic_error in response.topic_errors:
                name, error_code = topic_error[0], topic_error[1]
                if error_code == 0:
                    created_names.add(name)
                elif error_code != TopicAlreadyExistsError.errno:
                    message = topic_error[2] if len(topic_error) > 2 else ""
                    raise for_code(error_code)(f"cannot create topic {name}: {message}")
        partition_counts = await _wait_for_leaders(admin, [spec.name for spec in specs], ready_timeout_s)
        states = {
            spec.name: TopicState(spec.name, partition_counts[spec.name], spec.name in created_names) for spec in specs
        }
        request_state = states[settings.request_topic]
        wanted = settings.num_request_partitions
        if request_state.num_partitions < wanted:
            log.warning(
                "growing %s from %d to %d partitions", request_state.name, request_state.num_partitions, wanted
            )
            try:
                await admin.create_partitions({request_state.name: NewPartitions(wanted)})
            except InvalidPartitionsError:
                # A concurrent caller grew it first; the re-read below tells whether enough partitions exist.
                pass
            counts = await _wait_for_leaders(admin, [request_state.name], ready_timeout_s, min_partitions=wanted)
            request_state.num_partitions_added = counts[request_state.name] - request_state.num_partitions
            request_state.num_partitions = counts[request_state.name]
        elif request_state.num_partitions > wanted:
            # Kafka cannot shrink a topic; the priority mapping uses the real count, so this is only a warning.
            log.warning(
                "%s has %d partitions, more than the %d configured (%d priorities x %d)",
                request_state.name, request_state.num_partitions, wanted,
                settings.num_priorities, settings.partitions_per_priority,
            )  # fmt: skip
        return states
    finally:
        await admin.close()


async def _start_admin(settings: KafkaSettings, connect_timeout_s: float) -> AIOKafkaAdminClient:
    # Retry the first connection: in a deployment the broker may still be starting when this runs.
    deadline = time.monotonic() + connect_timeout_s
    while True:
        admin = AIOKafkaAdminClient(**settings.client_kwargs())
        try:
            await admin.start()
            return admin
        except KafkaConnectionError:
            await admin.close()
            if time.monotonic() >= deadline:
                raise
            log.info("broker %s not reachable yet; retrying", settings.bootstrap_servers)
            await asyncio.sleep(1.0)


async def _wait_for_leaders(
    admin: AIOKafkaAdminClient, topic_names: list[str], timeout_s: float, min_partitions: int = 1
) -> dict[str, int]:
    """Partition count of each topic, once the broker's metadata shows at least `min_partitions` partitions,
    each with a leader (metadata trails a create or grow request by a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        described = await admin.describe_topics(topic_names)
        counts = {
            topic["topic"]: len(topic["partitions"])
            for topic in described
            if topic["error_code"] == 0
            and len(topic["partitions"]) >= min_partitions
            and all(p["error_code"] == 0 and p["leader"] >= 0 for p in topic["partitions"])
        }
        if len(counts) == len(topic_names):
            return counts
        if time.monotonic() >= deadline:
            pending = sorted(set(topic_names) - set(counts))
            raise TimeoutError(f"topics without leaders after {timeout_s:.0f} s: {pending}")
        await asyncio.sleep(0.1)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", help="overrides KAFKA_BOOTSTRAP_SERVERS")
    parser.add_argument("--priorities", type=int, dest="num_priorities", help="overrides KAFKA_NUM_PRIORITIES")
    parser.add_argument(
        "--partitions-per-priority", type=int, dest="partitions_per_priority",
        help="overrides KAFKA_PARTITIONS_PER_PRIORITY",
    )  # fmt: skip
    parser.add_argument("--replication-factor", type=int, help="overrides KAFKA_REPLICATION_FACTOR")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to keep retrying an unreachable broker")


def run(args: argparse.Namespace) -> int:
    overrides = {
        field: getattr(args, field)
        for field in ("bootstrap_servers", "num_priorities", "partitions_per_priority", "replication_factor")
        if getattr(args, field) is not None
    }
    settings = KafkaSettings(**overrides)
    states = asyncio.run(ensure_topics(settings, connect_timeout_s=args.wait))
    for state in states.values():
        verb = "created" if state.created else "exists"
        grown = f" (+{state.num_partitions_added} partitions)" if state.num_partitions_added else ""
        print(f"{verb:8} {state.name}: {state.num_partitions} partitions{grown}")
    return 0
