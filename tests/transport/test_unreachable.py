"""A broker that cannot be reached: the worker keeps retrying instead of crashing, and still stops cleanly."""

import asyncio
import logging

import pytest

from worker.broker.local import free_port
from worker.kafka_settings import KafkaSettings
from worker.engine.instant import InstantEngine
from worker.transport.worker import Worker
from tests.transport.kafka_helpers import worker_settings


@pytest.mark.slow  # 3 s of waiting: in the full suite, not the fast subset
async def test_worker_waits_for_an_unreachable_broker_and_exits_zero_on_stop(caplog):
    kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}")
    worker = Worker(kafka, worker_settings(), InstantEngine())
    caplog.set_level(logging.WARNING, logger="worker.transport.worker")
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(3.0)
    assert not task.done()  # still trying, not crashed
    assert sum("cannot reach Kafka" in r.getMessage() for r in caplog.records) >= 2  # retried with backoff
    worker.stop()
    assert await asyncio.wait_for(task, 15) == 0
