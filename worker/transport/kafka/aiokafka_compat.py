"""The only place that reads aiokafka's private state; tests/transport/test_aiokafka_compat.py fails when a
new aiokafka release moves what these functions rely on (checked against aiokafka 0.14).

- The consumer group's generation id (the `attempt` of every request fetched under it, see intake.py):
  aiokafka keeps it on its group coordinator and has no public accessor.
- Failing a stopped producer's unresolved batches (publisher.py replaces a producer whose idempotent
  sequence broke): a dead sender leaves them pending forever, and aiokafka has no public call for this.
- Whether a producer's sender task has died (a connection lost at the wrong moment ends it with "Unexpected
  error during batch delivery"): the producer can never send again, and a transactional one is left in a fatal
  state where every begin_transaction fails, so exactly_once.py replaces it.
- Deriving a SCRAM user's salted password once per process rather than at every login (see
  `cache_scram_salted_passwords`).
- A topic's record limit from DescribeConfigs (raw protocol tuples), and dropping a topic from the producer's
  tracked metadata topics once it is known to be missing (destinations.py).
- Sending a request the admin client has no method for (CreateAcls, DeleteAcls: worker/broker/acls.py).
- A partition's committed offset *with its metadata* (progress.py): `AIOKafkaConsumer.committed` returns the
  offset alone; its group coordinator fetches both.
- Backing off between failed metadata updates (`back_off_failed_metadata_updates`): aiokafka retries at a fixed
  100 ms, in every client.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError


def group_generation(consumer: AIOKafkaConsumer) -> int:
    """The generation id of the group the started consumer last joined (-1 before the first join)."""
    coordinator = consumer._coordinator
    if coordinator is None:
        raise RuntimeError("the consumer is not started: it has no group coordinator yet")
    return coordinator.generation


async def committed_with_metadata(consumer: AIOKafkaConsumer, partitions) -> dict:
    """{partition: (offset, metadata)} of the group's committed offsets; partitions with none are left out."""
    coordinator = consumer._coordinator
    if coordinator is None:
        raise RuntimeError("the consumer is not started: it has no group coordinator yet")
    found = await coordinator.fetch_committed_offsets(list(partitions))
    return {tp: (meta.offset, meta.metadata) for tp, meta in found.items() if meta is not None and meta.offset >= 0}


def fail_unsent_batches(producer: AIOKafkaProducer, error: KafkaError) -> None:
    """Resolve every batch the (stopped) producer still holds with `error`, so their callbacks run."""
    producer._message_accumulator.fail_all(error)


def producer_is_dead(producer: AIOKafkaProducer) -> bool:
    """True when the started producer's sender task has ended or its transactions are in a fatal state: nothing
    it is given will ever be sent, whatever the broker does next."""
    sender = producer._sender
    task = sender.sender_task if sender is not None else None
    txn = producer._txn_manager
    return (task is not None and task.done()) or (txn is not None and txn.is_fatal_error())


@functools.lru_cache(maxsize=16)
def _salted_password(hashname: str, password: bytes, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac(hashname, password, salt, iterations)


def cache_scram_salted_passwords() -> None:
    """Make aiokafka's SCRAM logins derive each user's salted password once per process. The derivation is
    PBKDF2 with the broker's iteration count (4096 by default: milliseconds of CPU each for SHA-512) and its
    result is the same at every login of that user (same password, salt and count, which the
    broker sends), yet aiokafka derives it at each one; a worker opens some 25 connections at start-up (its
    consumer, publisher, control reader, admin client and a transactional producer per partition) and again
    after every broker outage. Safe to call more than once; other mechanisms are untouched."""
    from aiokafka.conn import ScramAuthenticator

    if getattr(ScramAuthenticator.create_salted_password, "cached", False):
        return

    def create_salted_password(self, salt: bytes, iterations: int) -> None:
        self._salted_password = _salted_password(self._hashname, self._sasl_plain_password, salt, iterations)

    create_salted_password.cached = True
    ScramAuthenticator.create_salted_password = create_salted_password


METADATA_BACKOFF_S = (0.1, 1.0)
"""First and longest wait after a failed metadata update, doubling in between (the Java client's reconnect
backoff: 50 ms to 1 s)."""


def back_off_failed_metadata_updates() -> None:
    """Make each aiokafka client wait after a metadata update that reached no broker, 0.1 s then twice as long
    each time up to 1 s, and not at all once one succeeds. aiokafka retries at its fixed retry backoff (100 ms)
    whenever a producer, the consumer or the coordinator asks for metadata, which they do on every failure,
    and each try opens a socket to every known broker and logs an error: with a client per request partition
    (exactly-once's transactional producers) a worker spent most of a core on it while the broker was down, and
    more partitions mean more. Callers awaiting the update wait with it, so the whole client slows its retries;
    a broker that comes back is seen within a second. Safe to call more than once."""
    from aiokafka.client import AIOKafkaClient

    original = AIOKafkaClient._metadata_update
    if getattr(original, "backs_off", False):
        return

    async def _metadata_update(self, cluster_metadata, topics):
        updated = await original(self, cluster_metadata, topics)
        if updated:
            self._failed_metadata_backoff_s = 0.0
        else:
            first, longest = METADATA_BACKOFF_S
            delay = min(longest, max(first, 2 * getattr(self, "_failed_metadata_backoff_s", 0.0)))
            self._failed_metadata_backoff_s = delay
            await asyncio.sleep(delay)
        return updated

    _metadata_update.backs_off = True
    AIOKafkaClient._metadata_update = _metadata_update


async def describe_topic_max_message_bytes(admin, topic: str) -> int | None:
    """The topic's `max.message.bytes` as the broker reports it, or None when it reports none. aiokafka's
    admin client returns the raw DescribeConfigs responses (tuples in protocol order), with no accessor."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic,
                                                             {"max.message.bytes": None})])
    for response in responses:
        for resource in response.resources:
            error_code, _message, _type, name, entries = resource[:5]
            if error_code != 0 or name != topic:
                continue
            for entry in entries:
                if entry[0] == "max.message.bytes" and entry[1] is not None:
                    return int(entry[1])
    return None


def stop_tracking_topic(producer: AIOKafkaProducer, topic: str) -> None:
    """Drop a topic from the producer's metadata topics. aiokafka adds a topic for good once anything waits on
    its metadata, and from then on logs an ERROR for it at every metadata update while it is missing."""
    client = producer.client
    if topic in client._topics:
        client._topics.discard(topic)


async def send_admin_request(admin, request):
    """Send a protocol request through a started admin client to any broker; aiokafka's admin client has no
    public method for ACLs, though its protocol module defines the requests."""
    return await admin._send_request(request)
