"""Load control and load reports: every tick, measure each priority's lag, decide shedding and pausing,
apply them to the consumer and the metrics; every status_interval_s, publish a WorkerStatus record.

Lag of a partition = fetch high watermark (aiokafka `highwater`, from the last fetch response, so it costs
no request) minus the next offset this worker will read. Backlog of a priority = its lag plus its requests
waiting in the local queue. Shedding is decided before pausing: a shed priority is never paused, because its
records are answered at once and consuming them is what drains its lag.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import TopicPartition

from schemas.decode import encode
from schemas.status import PriorityStatus, Throughput, WorkerStatus
from worker.transport.backpressure import LoadSnapshot

log = logging.getLogger(__name__)


class LoadControl:
    def __init__(self, worker) -> None:
        self.w = worker
        self.lag_by_priority: list[int] = [0] * worker.intake.num_priorities
        self.backlog_by_priority: list[int] = list(self.lag_by_priority)
        self.shed_decision = None
        self.pause_reasons: dict[int, str] = {}
        self._last_status = (time.monotonic(), 0, 0)

    async def partition_lag(self, tp: TopicPartition) -> int:
        consumer = self.w.consumer
        try:
            highwater = consumer.highwater(tp)
        except AssertionError:  # revoked between listing and asking
            return 0
        if highwater is None:
            return 0
        position = self.w.tracker.next_offset(tp)
        if position is None:
            try:
                position = await asyncio.wait_for(consumer.position(tp), 0.05)
            except Exception:  # noqa: BLE001 - no valid position yet (just assigned): no lag known
                return 0
        return max(0, highwater - position)

    async def tick(self) -> None:
        intake = self.w.intake
        lag = [0] * intake.num_priorities
        for tp in sorted(intake.assigned):
            lag[intake.priority_of(tp)] += await self.partition_lag(tp)
        self.lag_by_priority = lag
        self.backlog_by_priority = [lag[p] + len(intake.local[p]) for p in range(intake.num_priorities)]
        before = intake.shed_priorities
        self.shed_decision = self.w.shedder.decide(self.backlog_by_priority, self.w.rate)
        intake.shed_priorities = self.shed_decision.shed_priorities
        if intake.shed_priorities - before:
            log.warning("shedding priorities %s: %s", sorted(intake.shed_priorities),
                        [self.shed_decision.message(p) for p in sorted(intake.shed_priorities)])
            intake.shed_local(intake.shed_priorities - before)
        stats = self.w.engine.stats
        load = LoadSnapshot(intake.num_local_waiting, stats.kv_usage, self.backlog_by_priority)
        decision = self.w.backpressure.decide(load, time.monotonic())
        self.pause_reasons = {p: r for p, r in decision.reasons.items() if p not in intake.shed_priorities}
        if not intake.draining:
            self.apply_pauses({tp for tp in intake.assigned if intake.priority_of(tp) in self.pause_reasons})
        self.update_metrics(stats)

    def apply_pauses(self, want: set[TopicPartition]) -> None:
        intake, consumer = self.w.intake, self.w.consumer
        to_pause, to_resume = want - intake.paused, intake.paused - want
        try:
            if to_pause:
                consumer.pause(*to_pause)
                log.info("paused %s (%s)", sorted(tp.partition for tp in to_pause), self.pause_reasons)
            if to_resume:
                consumer.resume(*to_resume)
                log.info("resumed %s", sorted(tp.partition for tp in to_resume))
        except Exception:  # noqa: BLE001 - e.g. a partition revoked in between; the next tick retries
            log.debug("pause/resume failed", exc_info=True)
            return
        intake.paused = set(want)

    def update_metrics(self, stats) -> None:
        m, intake = self.w.metrics, self.w.intake
        m.num_requests_waiting.set(intake.num_local_waiting + stats.num_waiting)
        m.num_requests_running.set(stats.num_running)
        m.kv_cache_usage.set(stats.kv_usage)
        m.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        m.num_preemptions.set(stats.num_preemptions)
        if stats.last_step_num_seqs:
            m.batch_size.observe(stats.last_step_num_seqs)
        for p in range(intake.num_priorities):
            m.consumer_lag.labels(priority=str(p)).set(self.backlog_by_priority[p])
            m.paused_partitions.labels(priority=str(p)).set(
                sum(1 for tp in intake.paused if intake.priority_of(tp) == p))

    def build_status(self) -> WorkerStatus:
        intake, stats = self.w.intake, self.w.engine.stats
        now = time.monotonic()
        then, num_done_then, num_tokens_then = self._last_status
        streamer = self.w.streamer
        elapsed = max(now - then, 1e-6)
        throughput = Throughput(
            tokens_per_s=(streamer.num_output_tokens - num_tokens_then) / elapsed,
            requests_per_s=(streamer.num_completed - num_done_then) / elapsed,
        )
        self._last_status = (now, streamer.num_completed, streamer.num_output_tokens)
        shed = intake.shed_priorities
        est = self.shed_decision.est_wait_s if self.shed_decision else [None] * intake.num_priorities
        priorities = [
            PriorityStatus(
                priority=p, lag=self.backlog_by_priority[p], num_waiting=len(intake.local[p]),
                paused_partitions=sorted(tp.partition for tp in intake.paused if intake.priority_of(tp) == p),
                shed=p in shed, est_wait_s=est[p],
            )
            for p in range(intake.num_priorities)
        ]
        return WorkerStatus(
            worker_id=self.w.settings.worker_id,
            ts_ms=int(time.time() * 1000),
            num_waiting=intake.num_local_waiting + stats.num_waiting,
            num_running=stats.num_running,
            kv_usage=min(1.0, max(0.0, stats.kv_usage)),
            priorities=priorities,
            throughput=throughput,
            shedding=bool(shed),
            paused_partitions=sorted(tp.partition for tp in intake.paused),
            assigned_partitions=sorted(tp.partition for tp in intake.assigned),
        )

    async def publish_status(self) -> None:
        status = self.build_status()
        await self.w.publisher.publish(self.w.kafka.status_topic, status.worker_id.encode(), encode(status))
