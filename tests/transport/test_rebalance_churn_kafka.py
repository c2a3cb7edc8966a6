"""Membership churn through the real broker: workers leave while others join, so rebalances overlap (a join
arriving while the group waits for its leader's assignment aborts that generation, and its members rejoin
with a generation they hold no assignment of). Whatever the interleaving, every request ends completed, with
its latest attempt's stream exact."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tests.transport.test_failover_kafka import wait_assigned
from tests.transport.kafka_helpers import Collector, produce_requests
from tests.transport.test_rebalance_kafka import (attempts_of, check_served_once_per_attempt, make_requests, start,
                                                  stop_all, wait_all_completed)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def test_workers_leaving_as_others_join_lose_nothing(kafka_topics, tmp_path):
    kafka = kafka_topics
    requests = make_requests("churn", 75, 60)  # 1.2 s each
    waves = [requests[i:i + 5] for i in range(0, len(requests), 5)]
    written: dict[str, tuple[int, int]] = {}
    async with Collector(kafka) as collector:
        procs = {f"w{i}": await start(kafka, f"w{i}", tmp_path, drain_timeout_s=0.2) for i in range(3)}

        async def send_waves() -> None:
            for wave in waves:
                written.update(await produce_requests(kafka, wave))
                await asyncio.sleep(0.5)

        stopped = []
        try:
            await wait_assigned(collector, set(procs), kafka.num_request_partitions)
            sender = asyncio.create_task(send_waves())
            for turn in range(5):
                await asyncio.sleep(1.0 + 0.35 * (turn % 3))
                old = next(iter(procs))  # the longest up: its signal handler is in place
                new = f"w{3 + turn}"
                procs[new] = await start(kafka, new, tmp_path, drain_timeout_s=0.2)
                await asyncio.sleep(0.3 * (turn % 4))  # the join lands at a different point of each rebalance
                stopped.append(procs.pop(old))
                stopped[-1].send_signal(signal.SIGTERM)
            await sender
            await wait_all_completed(kafka, collector, requests, written)
        finally:
            codes = await stop_all([*stopped, *procs.values()])
    assert codes == [0] * len(codes)
    check_served_once_per_attempt(collector.results, requests)
    # The churn cut requests short: some ran again under a later attempt (else it proved nothing).
    assert any(len(attempts_of(collector.results, q.id)) > 1 for _, q in requests)
