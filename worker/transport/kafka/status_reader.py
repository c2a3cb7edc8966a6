"""The status reader: the other workers' status records, as they come, to a handler (the fleet's fair share,
load/fleet_share.py).

Every worker reads every partition of the status topic from its end, without a consumer group, on a consumer and
task of its own: a slow, missing or unreachable status topic never holds up anything else. Failures are logged
and retried with backoff; records that do not decode (another kind, a newer version) are skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaConsumer

from schemas.decode import decode_status
from worker.kafka_settings import KafkaSettings
from worker.kafka_stop import stop_client

log = logging.getLogger(__name__)


class StatusReader:
    def __init__(self, kafka: KafkaSettings, on_status: Callable[[object], None], *, client_id: str) -> None:
        self.kafka, self.on_status, self.client_id = kafka, on_status, client_id
        self.num_records = 0

    async def run(self) -> None:
        backoff_s = 1.0
        while True:
            consumer = AIOKafkaConsumer(**self.kafka.client_kwargs(), group_id=None, enable_auto_commit=False,
                                        auto_offset_reset="latest", client_id=self.client_id)
            try:
                await consumer.start()
                if self.kafka.status_topic not in await consumer.topics():
                    raise RuntimeError(f"status topic {self.kafka.status_topic!r} does not exist")
                consumer.subscribe([self.kafka.status_topic])
                backoff_s = 1.0
                while True:
                    batches = await consumer.getmany(timeout_ms=1000, max_records=500)
                    for msgs in batches.values():
                        for msg in msgs:
                            self._handle(msg.value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the fleet's share waits; nothing else depends on it
                log.warning("status reader: %r; the fleet's fair share pauses, retrying in %.0f s", exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
            finally:
                await stop_client(consumer, "status reader")

    def _handle(self, value: bytes | None) -> None:
        if value is None:
            return
        try:
            status = decode_status(value)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
            return
        self.num_records += 1
        self.on_status(status)
