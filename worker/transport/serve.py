"""`llm-worker serve`: the worker process. Wires consumer, engine thread, publisher, load control and metrics.

Tasks on one asyncio loop: intake (fetch, decode, admit), outputs (engine outputs -> chunks and finals),
commits (every commit_interval_s, behind the per-partition watermark), control (lag, shedding, pausing every
100 ms; a status record every status_interval_s). The engine runs in its own thread.

Shutdown on SIGTERM/SIGINT: stop fetching, pause every partition, let in-flight requests finish for up to
drain_timeout_s, abort the rest (their offsets stay uncommitted, so they are redelivered), wait for every
record's acknowledgement, commit, leave the group, exit 0. A broker that cannot be reached is retried with
backoff, at start and while running; nothing is dropped meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

from aiokafka.errors import KafkaError

from schemas.limits import DEFAULT_LIMITS, Limits
from worker.config import EngineSettings, KafkaSettings, WorkerSettings
from worker.config_cli import masked_dump
from worker.engine.api import Engine
from worker.transport.backpressure import Backpressure
from worker.transport.consumer import Intake, RebalanceListener, make_consumer
from worker.transport.engine_thread import EngineThread
from worker.transport.metrics import WorkerMetrics
from worker.transport.offsets import OffsetTracker
from worker.transport.publisher import Publisher
from worker.transport.shedding import CompletionRate, Shedder
from worker.transport.status import LoadControl
from worker.transport.streaming import Streamer

log = logging.getLogger(__name__)
CONTROL_INTERVAL_S = 0.1


class Worker:
    def __init__(self, kafka: KafkaSettings, settings: WorkerSettings, engine: Engine, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, limits: Limits = DEFAULT_LIMITS) -> None:
        self.kafka, self.settings, self.limits = kafka, settings, limits
        self.engine_impl = engine
        self.max_engine_inflight = settings.max_engine_inflight or 2 * max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stopping = asyncio.Event()
        self.closing = False
        """Set at the end of shutdown: the background loops exit at their next turn even if a library call
        inside them swallowed the cancellation (seen once: a shutdown hung in the control loop)."""
        self.started = asyncio.Event()
        self.tracker = OffsetTracker()
        self.rate = CompletionRate()
        self.shedder = Shedder(list(settings.max_queue_time_s), kafka.num_priorities)
        self.backpressure = Backpressure.from_settings(settings, kafka.num_priorities)
        self.metrics = WorkerMetrics.create()
        self.intake = Intake(self, kafka, settings, limits)
        self.control = LoadControl(self)
        self.consumer = None
        self.publisher: Publisher | None = None
        self.engine: EngineThread | None = None
        self.streamer: Streamer | None = None
        self._metrics_server = None

    def stop(self) -> None:
        self.stopping.set()

    def record_done(self, tp, offset: int) -> None:
        self.tracker.done(tp, offset)

    def shed_message(self, priority: int) -> str:
        decision = self.control.shed_decision
        return decision.message(priority) if decision else f"priority {priority} shed"

    async def commit(self, partitions=None) -> None:
        offsets = {tp: o for tp, o in self.tracker.to_commit().items()
                   if tp in self.intake.assigned and (partitions is None or tp in partitions)}
        if not offsets or self.consumer is None:
            return
        try:
            await self.consumer.commit(offsets)
            self.tracker.committed(offsets)
        except (KafkaError, AssertionError) as exc:
            log.warning("commit failed (%r); retrying at the next interval", exc)

    async def _start_clients(self) -> bool:
        backoff = 0.5
        while not self.stopping.is_set():
            publisher, consumer = Publisher(self.kafka.client_kwargs()), make_consumer(self.kafka, self.settings)
            # Set before start: the first assignment may arrive inside start(), and its listener needs them.
            self.publisher, self.consumer = publisher, consumer
            try:
                await publisher.start()
                consumer.subscribe([self.kafka.request_topic], listener=RebalanceListener(self.intake))
                await consumer.start()
                return True
            except KafkaError as exc:
                log.warning("cannot reach Kafka at %s (%r); retrying in %.1fs",
                            self.kafka.bootstrap_servers, exc, backoff)
                for client in (consumer, publisher):
                    try:
                        await client.stop()
                    except Exception:  # noqa: BLE001 - half-started clients may fail to stop; nothing to keep
                        pass
                try:
                    await asyncio.wait_for(self.stopping.wait(), backoff)
                except asyncio.TimeoutError:
                    pass
                backoff = min(backoff * 2, 10.0)
        return False

    async def run(self) -> int:
        log.info("effective configuration: %s", json.dumps(
            {"kafka": masked_dump(self.kafka), "worker": masked_dump(self.settings)}, default=str))
        if self.settings.metrics_port:
            self._metrics_server = self.metrics.serve(self.settings.metrics_port)
        if not await self._start_clients():
            return 0
        outputs: asyncio.Queue = asyncio.Queue()
        self.engine = EngineThread(self.engine_impl, asyncio.get_running_loop(), outputs)
        self.streamer = Streamer(self.publisher, self.metrics, self.rate, self.settings.worker_id,
                                 self.kafka.num_priorities, self.settings.chunk_interval_ms, self.record_done)
        self.engine.start()
        tasks = [asyncio.create_task(coro) for coro in
                 (self._output_loop(outputs), self._commit_loop(), self._control_loop())]
        intake_task = asyncio.create_task(self.intake.run())
        self.started.set()
        await self.stopping.wait()
        log.info("stopping: draining %d in-flight requests (up to %.0fs)",
                 len(self.streamer.inflight), self.settings.drain_timeout_s)
        await self._shutdown(intake_task, tasks)
        return 0

    async def _shutdown(self, intake_task: asyncio.Task, tasks: list[asyncio.Task]) -> None:
        self.intake.draining = True
        intake_task.cancel()
        await asyncio.gather(intake_task, return_exceptions=True)
        if self.intake.assigned:
            try:
                self.consumer.pause(*self.intake.assigned)
            except Exception:  # noqa: BLE001
                log.debug("pause at shutdown failed", exc_info=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout_s
        while self.streamer.inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        abandoned = self.streamer.forget(lambda p: True)
        if abandoned:
            log.warning("drain timeout: %d requests abandoned; they stay uncommitted and will be redelivered",
                        len(abandoned))
            self.engine.abort(abandoned)
        if not await self.publisher.wait_acked(timeout_s=30.0):
            log.warning("some records were not acknowledged before shutdown; their offsets stay uncommitted")
        await self.commit()
        self.closing = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.consumer.stop()
        await self.publisher.stop()
        self.engine.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        log.info("stopped")

    async def _output_loop(self, outputs: asyncio.Queue) -> None:
        while not self.closing:
            batch = await outputs.get()
            while not outputs.empty():
                batch += outputs.get_nowait()
            try:
                await self.streamer.handle(batch)
                self.intake.admit()
            except Exception:  # noqa: BLE001 - publishing must go on for the other requests
                log.exception("output handling failed")

    async def _commit_loop(self) -> None:
        while not self.closing:
            await asyncio.sleep(self.settings.commit_interval_s)
            await self.commit()

    async def _control_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_status = loop.time()
        while not self.closing:
            try:
                await self.control.tick()
                if loop.time() >= next_status:
                    next_status = loop.time() + self.settings.status_interval_s
                    await self.control.publish_status()
            except Exception:  # noqa: BLE001
                log.exception("load control failed")
            await asyncio.sleep(CONTROL_INTERVAL_S)


def build_engine(kind: str, engine_settings: EngineSettings, instant_step_ms: float) -> Engine:
    if kind == "instant":
        from worker.engine.instant import InstantEngine

        return InstantEngine(max_num_seqs=engine_settings.max_num_seqs, step_time_s=instant_step_ms / 1000.0)
    from worker.engine.engine import LLMEngine

    return LLMEngine(engine_settings)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model folder or provisioned name (ENGINE_MODEL)")
    parser.add_argument("--policy", choices=["continuous", "dynamic", "static"], help="batching policy (ENGINE_POLICY)")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--group", help="consumer group (KAFKA_GROUP_ID)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port, 0 disables (WORKER_METRICS_PORT)")
    parser.add_argument("--worker-id", help="name in status and final records (WORKER_WORKER_ID)")
    parser.add_argument("--engine", choices=["llm", "instant"], default="llm",
                        help="llm: the model; instant: model-free, for plumbing benchmarks")
    parser.add_argument("--instant-step-ms", type=float, default=0.0, help="instant engine: emulated step time")


def run(args: argparse.Namespace) -> int:
    kafka_over = {k: v for k, v in (("bootstrap_servers", args.bootstrap), ("group_id", args.group)) if v}
    worker_over = {k: v for k, v in (("metrics_port", args.metrics_port), ("worker_id", args.worker_id))
                   if v is not None}
    engine_over = {k: v for k, v in (("model", args.model), ("policy", args.policy)) if v}
    kafka, settings, engine_settings = KafkaSettings(**kafka_over), WorkerSettings(**worker_over), EngineSettings(**engine_over)
    if args.engine == "llm":
        log.info("engine configuration: %s", json.dumps(masked_dump(engine_settings), default=str))
    engine = build_engine(args.engine, engine_settings, args.instant_step_ms)
    return asyncio.run(_serve(kafka, settings, engine, engine_settings))


async def _serve(kafka, settings, engine, engine_settings: EngineSettings) -> int:
    worker = Worker(kafka, settings, engine, max_num_seqs=engine_settings.max_num_seqs,
                    max_num_batched_tokens=engine_settings.max_num_batched_tokens)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    return await worker.run()
