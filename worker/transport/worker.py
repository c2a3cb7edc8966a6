"""The worker: built once from its settings, it connects to Kafka, runs its loops and shuts down cleanly.

The path of one request (docs/architecture.md): Intake.fetch_once → decode → Lifecycle.arrive → LocalQueue →
Dispatcher.admit → Lifecycle.enter → the engine client (engine_client.py) → Streamer.handle → Answers →
Publisher → OffsetTracker → Intake.commit. The lifecycle (lifecycle.py) decides every way a request ends
before the engine's final (rejected, shed, deadline, cancelled), each through Answers, the one way out.

Tasks on one asyncio loop: intake (fetch, decode, check, queue; then admit into the engine), outputs (engine
outputs -> chunks and finals; then admit, since room was made), commits (every commit_interval_s), control
(every 100 ms: lag -> load decision -> pause/shed/end of input; a status record every status_interval_s),
and the control reader (control.py: cancel records, on a consumer of their own; see `_on_cancel`); a
watchdog thread logs the loop's stack when the loop stands still for 2 s (loop_watchdog.py).
The engine runs in its own thread, or in its own process (WORKER_ENGINE_PROCESS): one client interface, made by
engine_client.make_engine_client, either way.

Shutdown on SIGTERM/SIGINT: stop fetching, pause every partition, let in-flight requests finish for up to
drain_timeout_s, abort the rest (their offsets stay uncommitted, so they are redelivered), wait for every
record's acknowledgement, commit, leave the group, exit 0. A broker that cannot be reached is retried with
backoff, at start and while running; nothing is dropped meanwhile.

Rebalance (aiokafka's protocol is eager: every member gives up every partition at each rebalance). On
revocation the revoked partitions' safe offsets are committed, their waiting requests are set aside and their
streams held: the engine keeps running them, but nothing of theirs is published. The assignment that ends
the rebalance decides: a partition that stays with this worker (the sticky assignor keeps as many as the
balance allows) resumes where it was, its requests streaming on under the same attempt with no gap; one that
moved has its requests aborted and nothing more published, and the new owner serves them again under a
higher attempt. docs/delivery.md argues why no two workers publish under the same attempt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiokafka import TopicPartition
from aiokafka.errors import GroupAuthorizationFailedError, KafkaError, TopicAuthorizationFailedError

from worker.kafka_stop import stop_client
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.priority import priority_of_partition
from worker.kafka_settings import KafkaSettings
from worker.worker_settings import WorkerSettings
from worker.config_cli import masked_dump
from worker.engine.api import Engine, EngineStats
from worker.transport.kafka.access_check import AccessDenied, Needs, check_access
from worker.transport.load.admission import Admission
from worker.transport.kafka.aiokafka_compat import group_generation
from worker.transport.requests.answers import Answers, FinalReplacement
from worker.transport.load.autoscale import ArrivalRate, ScaleSignal
from worker.transport.load.backpressure import Backpressure
from worker.transport.requests.cancels import Cancel, CancelledIds
from worker.transport.requests.control import ControlReader
from worker.transport.requests.delivery import ConsumerCommits, TransactionalCommits
from worker.transport.requests.dispatcher import Dispatcher
from worker.transport.requests.engine_client import make_engine_client
from worker.transport.requests.intake import Intake, IntakeLayout
from worker.transport.requests.lifecycle import Lifecycle
from worker.transport.requests.stages import RequestBook
from worker.transport.kafka.kafka_clients import RebalanceListener, make_consumer
from worker.transport.load.load_control import LoadControl
from worker.transport.requests.local_queue import LocalQueue
from worker.transport.loop_watchdog import LoopWatchdog
from worker.transport.memory_metrics import MemoryCollector
from worker.transport.metrics import WorkerMetrics
from worker.transport.kafka.offsets import OffsetTracker
from worker.transport.kafka.destinations import MAX_TOPICS, TopicState
from worker.transport.kafka.exactly_once import FinalLanes
from worker.transport.kafka.publisher import Publisher
from worker.transport.load.service_model import EngineView, ServiceModel
from worker.transport.load.shedding import Shedder
from worker.transport.load.fleet_share import FleetShare
from worker.transport.load.tenant_book import TenantBook
from worker.transport.kafka.status_reader import StatusReader
from worker.transport.status_report import LoadView, StatusReporter, TenantCollector
from worker.transport.requests.streamer import Streamer
from worker.transport.requests.tracing import NoTracing, RequestTracing

log = logging.getLogger(__name__)
CONTROL_INTERVAL_S = 0.1
IO_GATHER_STEP_FRACTION = 0.05
"""Reads and sends gather for this fraction of the engine's last step (Worker.io_gather_s)."""
ACCESS_DENIED_EXIT = 3
"""serve's exit status when the broker refuses the worker's credentials or permissions (access_check.py)."""
ACCESS_RETRY_S = 2.0
"""While an ACL the worker needs is withdrawn: how often fetching is tried again."""


def io_gather_s(stats: EngineStats, max_ms: float) -> float:
    """How long the intake and the publisher let records gather before they read or send: a small fraction
    of the engine's last step (IO_GATHER_STEP_FRACTION, at most max_ms), and nothing while the engine runs no
    request. A request read or a record sent a few percent of a step later changes nothing the engine does
    (work joins at step boundaries), but each read and send wakes the loop, and on a CPU worker every
    wake-up takes the core from the forward: under overload the loop would wake once per arriving request
    and once per answer, and those wake-ups add up to a visible share of the worker's core."""
    if max_ms <= 0 or not stats.num_running:
        return 0.0
    return min(max_ms / 1000.0, IO_GATHER_STEP_FRACTION * stats.last_step_s)


def served_model_name(engine: Engine) -> str:
    """The model as usage records name it: ENGINE_MODEL's name, or its folder's for a path."""
    model = str(getattr(getattr(engine, "settings", None), "model", "") or "")
    return model.rstrip("/").rsplit("/", 1)[-1]


STILL_MEMBER_WAIT_S = 1.0
"""How long a lane waits for the group's word before it replaces a stuck producer (Worker._still_member)."""


class Worker:
    """Built once from its settings (inside the event loop that will run it): every part, the Kafka clients
    included, exists from construction on; `run` starts the clients (retried until Kafka answers) and the
    loops."""

    def __init__(self, kafka: KafkaSettings, settings: WorkerSettings, engine: Engine, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, limits: Limits = DEFAULT_LIMITS,
                 tracing: RequestTracing | NoTracing | None = None) -> None:
        """`tracing`: the process's (RequestTracing.from_env) unless given."""
        self.kafka, self.settings, self.limits, self.engine = kafka, settings, limits, engine
        self.max_num_seqs = max_num_seqs
        self.stopping = asyncio.Event()
        self.started = asyncio.Event()
        self.closing = False
        """Set at the end of shutdown, so the background loops exit at their next turn even if a library call
        inside one of them swallowed its cancellation."""
        self.tracker = OffsetTracker()
        self.metrics = WorkerMetrics.create(commit_progress=self.tracker.commit_progress)
        self.cancels = CancelledIds(settings.cancel_ttl_s, settings.cancel_max_ids)
        self.control = ControlReader(kafka, self.cancels, self._on_cancel, client_id=f"{settings.worker_id}-control")
        self.tenants = TenantBook.from_settings(settings, kafka.num_priorities)
        """Fair share, quotas and per-tenant traffic."""
        TenantCollector(self.metrics.registry, self.tenants)
        self.fleet_share = FleetShare(self.tenants, settings.worker_id)
        self.status_reader = StatusReader(kafka, self.fleet_share.observe, client_id=f"{settings.worker_id}-status")
        model = served_model_name(engine)
        if tracing is None:
            tracing = RequestTracing.from_env(model)
        self.publisher = Publisher(kafka.client_kwargs(),
                                   on_dropped=lambda topic: self.metrics.dropped_for(self._topic_label(topic)).inc(),
                                   gather_s=self.io_gather_s, topic_wait_s=settings.destination_wait_s,
                                   on_topic_change=self._on_topic_change,
                                   # An exactly-once lane writes a final only once its request's chunks settled.
                                   track_settled=kafka.exactly_once, headers_for=tracing.headers_for)
        self.consumer, assignor = make_consumer(kafka, settings)
        # Subscribed before start: the first assignment may arrive inside start(), and its listener needs the parts.
        self.consumer.subscribe([kafka.request_topic], listener=RebalanceListener(self._on_revoked, self._on_assigned))
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.engine_thread = make_engine_client(engine, asyncio.get_running_loop(), self.outputs)
        self.queue = LocalQueue(kafka.num_priorities, settings.max_waiting, self.tenants.fair)
        self.service = ServiceModel(kafka.num_priorities, max_num_seqs, max_num_batched_tokens)
        replacement = FinalReplacement(kafka.result_topic, settings.worker_id, self.metrics)
        lanes = FinalLanes(
            kafka.client_kwargs(), kafka.group_id, self.tracker, self.publisher, replacement,
            interval_s=settings.transaction_interval_ms / 1000.0,
            max_metadata_bytes=kafka.offset_metadata_max_bytes, still_member=self._still_member,
            progress_topic=kafka.progress_topic, progress_source=self._progress_of,
            progress_interval_s=settings.progress_interval_ms / 1000.0,
        ) if kafka.exactly_once else None
        self.answers = Answers(
            self.publisher, self.tracker, self.metrics, settings.worker_id, kafka.result_topic,
            kafka.dead_letter_topic, usage_topic=kafka.usage_topic, model=model,
            priority_of=lambda tp: priority_of_partition(tp.partition, kafka.num_request_partitions,
                                                         kafka.num_priorities),
            tenants=self.tenants, lanes=lanes, replacement=replacement,
            book=RequestBook(on_violation=self.metrics.lifecycle_violations.inc))
        self.admission = admission = Admission(kafka.result_topic, frozenset(kafka.allowed_reply_topics),
                                               list(settings.itl_target_ms), max_num_batched_tokens,
                                               allowed_reply_topic_prefixes=tuple(kafka.allowed_reply_topic_prefixes))
        self.streamer = Streamer(self.publisher, self.tracker, self.answers, self.metrics, self.service,
                                 settings.worker_id, kafka.num_priorities, settings.chunk_interval_ms, self.tenants)
        self.lifecycle = Lifecycle(self.answers.book, self.queue, self.streamer, self.engine_thread, self.answers,
                                   admission, self.service, self.tenants, self.cancels, kafka.result_topic)
        """Every request from its read to its end: what becomes of it is decided there."""
        self.dispatcher = Dispatcher(self.lifecycle, admission, settings.max_engine_inflight or 2 * max_num_seqs)
        self.intake = Intake(self.consumer, self.tracker, self.lifecycle, self.answers,
                             IntakeLayout.from_settings(kafka, settings, limits), tracing=tracing)
        self.intake.held_through = lambda: None if assignor.kept is None else assignor.kept.get(kafka.request_topic, [])
        self.delivery = (TransactionalCommits(lanes, kafka, self.consumer, self.publisher, self.intake)
                         if lanes is not None else ConsumerCommits(self.intake))
        """How what is answered gets committed: the lanes' transactions (exactly once) or the consumer's."""
        self.load_control = LoadControl(Shedder(list(settings.max_queue_time_s), kafka.num_priorities),
                                        Backpressure.from_settings(settings, kafka.num_priorities), self.service)
        self.reporter = StatusReporter(self.publisher, self.metrics, settings.worker_id, kafka.status_topic,
                                       kafka.allowed_reply_topics, kafka.allowed_reply_topic_prefixes)
        self.scale_signal = ScaleSignal(list(settings.max_queue_time_s), kafka.num_request_partitions,
                                        ArrivalRate(settings.scale_arrival_window_s))
        self.watchdog = LoopWatchdog()
        self.memory = MemoryCollector(self.metrics.registry, self._tables())

    def stop(self) -> None:
        self.stopping.set()

    def ready(self) -> bool:
        """The readiness probe's answer (read from the metrics server's thread): the engine is built (its model
        loaded) before the worker runs, the group is joined (an assignment came, even an empty one) and intake
        runs, and the worker is not stopping."""
        return self.started.is_set() and not self.stopping.is_set() and self.intake.group_generation >= 0

    def _tables(self) -> dict:
        """What each per-request table and cache holds now (memory_metrics.py; bounds in docs/memory.md). Read on
        the metrics thread."""
        return {
            "requests": lambda: len(self.answers.book),
            "streams": lambda: len(self.streamer),
            "local_queue": lambda: len(self.queue),
            "engine_in_flight": lambda: self.engine_thread.num_in_flight,
            "offsets_pending": lambda: self.tracker.num_pending(),
            "held_completions": lambda: self.answers.num_held_completions,
            "cancelled_ids": lambda: len(self.cancels),
            "publisher_keys": lambda: self.publisher.num_cached_keys,
            "metric_children": lambda: len(self.metrics._children),
        }

    def _topic_label(self, topic: str) -> str:
        """A topic as a metric label: its name when configured, one label for the reply topics a prefix allows
        (requests may name any number of them, and each label value is a series kept for good)."""
        kafka = self.kafka
        if topic in (kafka.result_topic, kafka.dead_letter_topic, kafka.status_topic, *kafka.allowed_reply_topics):
            return topic
        return "reply_topic_by_prefix"

    def _on_topic_change(self, topic: str, state: TopicState) -> None:
        """A destination topic went missing or came back: requests naming it as their reply topic are answered
        at once meanwhile (admission), and the gauge shows it."""
        if topic == self.kafka.result_topic or not self.admission.allows_reply_topic(topic):
            return
        unavailable = self.admission.unavailable_reply_topics
        unavailable.pop(topic, None)
        if not state.available:
            unavailable[topic] = state.message
            while len(unavailable) > MAX_TOPICS:  # as many as Destinations remembers (a prefix allows any number)
                del unavailable[next(iter(unavailable))]
        if topic in self.kafka.allowed_reply_topics:  # one series per listed topic; prefixed ones are unbounded
            self.metrics.reply_topic_available.labels(topic=topic).set(1 if state.available else 0)

    async def _destination_loop(self) -> None:
        """Look the topics records go to up at start-up, and the allowed reply topics again now and then (their
        state ages out in `Destinations`), so a missing one is known before a request names it."""
        destinations = self.publisher.destinations
        kafka = self.kafka
        for topic in (kafka.result_topic, kafka.dead_letter_topic, kafka.status_topic):
            destinations.resolve(topic)
        while not self.closing:
            for topic in kafka.allowed_reply_topics:
                if destinations.state(topic) is None:
                    destinations.resolve(topic)
            await asyncio.sleep(self.settings.destination_check_interval_s)

    def io_gather_s(self) -> float:
        return io_gather_s(self.engine_thread.stats, self.settings.io_gather_max_ms)

    def _see_engine(self) -> None:
        """Hand the service model the engine as it is now, before the parts that ask it for estimates run.
        Saturated: requests wait inside the engine, or every seat is taken (requests in the local queue do not
        count: the transport may be what holds them, e.g. decoding a flood)."""
        stats = self.engine_thread.stats
        self.service.see(EngineView(stats, stats.num_waiting > 0 or stats.num_running >= self.max_num_seqs,
                                    tuple(self.streamer.num_open_by_priority)))

    # -- cancellation (docs/delivery.md, "Cancellation"; decided in lifecycle.py) --------------------------
    def _on_cancel(self, cancel: Cancel) -> None:
        """A cancel record was read (control.py); after shutdown only a request read later (by another worker)
        could need it."""
        if not self.closing:
            self.lifecycle.cancel_arrived(cancel)

    async def _wait_for_cancels(self) -> None:
        """Before intake starts: let the control reader catch up with the cancels of its lookback window, so a
        redelivered request that was cancelled is answered at once rather than run; bounded, since a slow or
        unreachable control topic must not hold up requests (a cancel read later still stops its request)."""
        try:
            await asyncio.wait_for(self.control.synced.wait(), self.settings.cancel_sync_timeout_s)
        except asyncio.TimeoutError:
            log.warning("control topic %r not read up to date within %.1f s; serving requests meanwhile",
                        self.kafka.control_topic, self.settings.cancel_sync_timeout_s)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        if not self.started.is_set():
            return  # the first join of a starting worker: nothing is owned yet
        await self.delivery.commit(revoked)
        self.lifecycle.hold(revoked)
        self.intake.on_revoked(revoked)
        log.info("revoked %s; their requests keep running, unpublished, until the assignment",
                 sorted(tp.partition for tp in revoked))

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        generation = group_generation(self.consumer)
        progress_found, lost = await self.delivery.take_over(assigned, generation)
        held = set(self.streamer.held_partitions)
        gone = self.intake.on_assigned(assigned, generation, progress_found, lost) | (held - assigned)
        ids = self.lifecycle.settle(gone)
        self.engine_thread.abort(ids)
        if held:
            log.info("rebalance: kept %d partitions, gave up %d; aborted %d requests of those given up",
                     len(held & assigned), len(held - assigned), len(ids))

    async def _still_member(self) -> bool:
        """Whether this worker is still the group member of its last assignment. Asked after a stall: a process
        that was frozen past its session timeout learns it at its first heartbeat, which is overdue and goes out
        as soon as the loop turns, so a moment's wait lets the answer come."""
        generation = self.intake.group_generation
        await asyncio.sleep(STILL_MEMBER_WAIT_S)
        return not self.closing and generation >= 0 and group_generation(self.consumer) == generation

    def _progress_of(self, partition: TopicPartition, full: bool) -> list[tuple[bytes, bytes]]:
        """The lanes' progress records (FinalLanes.progress_source): the streams' own, and in a full round the
        records read at takeover of requests not served here yet (so that the resume point can move past the
        previous owner's round without losing them)."""
        records = self.streamer.progress_records(partition, full)
        if full:
            written = {key for key, _ in records}
            records += [(key, value) for key, value in self.intake.unserved_resumed(partition) if key not in written]
        return records

    async def _connect(self) -> bool:
        """Start the clients, each retried with backoff until Kafka answers (a failed start leaves a client as it
        was built, ready to be started again); False when the worker is stopped first."""
        for start in (self.publisher.start, self.consumer.start):
            backoff = 0.5
            while True:
                if self.stopping.is_set():
                    return False
                try:
                    await start()
                    break
                except KafkaError as exc:
                    log.warning("cannot reach Kafka at %s (%r); retrying in %.1fs",
                                self.kafka.bootstrap_servers, exc, backoff)
                    try:
                        await asyncio.wait_for(self.stopping.wait(), backoff)
                    except asyncio.TimeoutError:
                        pass
                    backoff = min(backoff * 2, 10.0)
        return True

    async def _request_topic_layout_error(self, wait_s: float = 5.0) -> str | None:
        """Refuse a request topic whose partition count differs from the configured priority layout: its
        partitions would carry other priorities than the producers meant. None when it matches, or when the
        topic does not exist yet (the worker then waits for it, as before)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        partitions = self.consumer.partitions_for_topic(self.kafka.request_topic)
        while partitions is None and loop.time() < deadline:
            await asyncio.sleep(0.1)
            partitions = self.consumer.partitions_for_topic(self.kafka.request_topic)
        expected = self.kafka.num_request_partitions
        if partitions is None or len(partitions) == expected:
            return None
        return (f"request topic {self.kafka.request_topic!r} has {len(partitions)} partitions, but the configured "
                f"layout is KAFKA_NUM_PRIORITIES={self.kafka.num_priorities} x KAFKA_PARTITIONS_PER_PRIORITY="
                f"{self.kafka.partitions_per_priority} = {expected}: set them to the topic's layout (every worker "
                f"and producer must agree on it); refusing to start")

    # -- running -------------------------------------------------------------------------------------------
    async def run(self) -> int:
        log.info("effective configuration: %s", json.dumps(
            {"kafka": masked_dump(self.kafka), "worker": masked_dump(self.settings)}, default=str))
        try:  # before any client exists: a configuration error is then the one line the worker prints
            await check_access(self.kafka, Needs.of_worker(self.kafka))
        except AccessDenied as exc:
            log.error("cannot serve: %s", exc)
            return ACCESS_DENIED_EXIT
        metrics_server = (self.metrics.serve(self.settings.metrics_port, ready=self.ready)
                          if self.settings.metrics_port else None)
        # Its own consumer and task, started first: the cancels of the lookback window load while the group forms.
        control_task = asyncio.create_task(self.control.run(), name="control-reader")
        status_task = (asyncio.create_task(self.status_reader.run(), name="status-reader")
                       if self.settings.tenant_fleet_share else None)
        try:
            return await self._serve()
        finally:
            if status_task is not None:
                status_task.cancel()
                await asyncio.gather(status_task, return_exceptions=True)
            await self.control.stop(control_task)
            if metrics_server is not None:
                metrics_server.shutdown()

    async def _serve(self) -> int:
        if not await self._connect():
            await self.close()
            return 0
        layout_error = await self._request_topic_layout_error()
        if layout_error:
            log.error("%s", layout_error)
            await self.delivery.stop()
            await self.close()
            return 2
        await self.delivery.check_progress_topic()
        self.engine_thread.start()
        tasks = [asyncio.create_task(coro) for coro in (self._output_loop(), self._commit_loop(), self._control_loop(),
                                                        self._destination_loop(), self.watchdog.run())]
        await self._wait_for_cancels()
        intake_task = asyncio.create_task(self._intake_loop())
        self.started.set()
        await self.stopping.wait()
        log.info("stopping: draining %d in-flight requests (up to %.0fs)", len(self.streamer),
                 self.settings.drain_timeout_s)
        await self._shutdown(intake_task, tasks)
        log.info("stopped")
        return 0

    async def _shutdown(self, intake_task: asyncio.Task, tasks: list[asyncio.Task]) -> None:
        self.dispatcher.draining = True
        intake_task.cancel()
        await asyncio.gather(intake_task, return_exceptions=True)
        self.intake.stop_fetching()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout_s
        while len(self.streamer) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        abandoned = self.lifecycle.give_up(lambda queued: True)
        if abandoned:
            log.warning("drain timeout: %d requests abandoned; they stay uncommitted and will be redelivered",
                        len(abandoned))
            self.engine_thread.abort(abandoned)
        if not await self.publisher.wait_acked(timeout_s=30.0):
            log.warning("some records were not acknowledged before shutdown; their offsets stay uncommitted")
        await self.delivery.commit()
        await self.delivery.stop()
        self.closing = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.close()
        self.engine_thread.stop()

    async def close(self) -> None:
        """Stop the Kafka clients (`run` does at its end; a worker built and never run needs it)."""
        await stop_client(self.consumer, "request consumer")
        await self.publisher.stop()

    async def _intake_loop(self) -> None:
        backoff = 0.1
        denied: str | None = None
        while not self.stopping.is_set():
            try:
                self._see_engine()
                await self.intake.fetch_once()
                if denied:
                    log.info("access restored (%s); fetching again", denied)
                    denied = None
                    self.metrics.kafka_access_denied.set(0)
                self._see_engine()
                self.dispatcher.admit()
                await self.publisher.wait_room()
                gather = self.io_gather_s()
                if gather > 0:
                    await asyncio.sleep(gather)
                backoff = 0.1
            except (TopicAuthorizationFailedError, GroupAuthorizationFailedError) as exc:
                # An ACL withdrawn while running: nothing is fetched, so nothing is lost (offsets stay where the
                # finished requests put them); running requests finish; one line, not one per retry.
                if denied is None:
                    denied = f"{type(exc).__name__}: {', '.join(map(str, exc.args)) or exc}"
                    log.warning("the broker refuses what the worker needs (%s); fetching stops until it is allowed "
                                "again, retried every %.0f s", denied, ACCESS_RETRY_S)
                    self.metrics.kafka_access_denied.set(1)
                await self._refetch_assigned()
                await asyncio.sleep(ACCESS_RETRY_S)
            except KafkaError as exc:
                log.warning("fetch failed (%r); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any one bad record or state
                log.exception("intake error; continuing")
                await asyncio.sleep(0.1)

    async def _refetch_assigned(self) -> None:
        """Drop what the consumer holds for each assigned partition, refused reads included, by seeking it to its
        own position (nothing read is skipped or read twice), so the next read shows the broker's answer of now.
        aiokafka keeps one refused read per partition, refetches a partition only once that error was raised, and
        raises one error per read: without this, after the ACL came back each partition's stale refusal cost a
        retry round (minutes with many partitions) before anything was fetched again."""
        for tp in sorted(self.intake.assigned):
            try:
                position = await asyncio.wait_for(self.consumer.position(tp), ACCESS_RETRY_S)
                self.consumer.seek(tp, position)
            except (KafkaError, asyncio.TimeoutError):
                continue  # not assigned any more, or no position yet: the next read finds out

    async def _output_loop(self) -> None:
        while not self.closing:
            batch = await self.outputs.get()
            while not self.outputs.empty():
                batch += self.outputs.get_nowait()
            try:
                self._see_engine()
                await self.streamer.handle(batch)
                self._see_engine()
                self.dispatcher.admit()
            except Exception:  # publishing must go on for the other requests
                log.exception("output handling failed")

    async def _commit_loop(self) -> None:
        while not self.closing:
            await asyncio.sleep(self.settings.commit_interval_s)
            await self.delivery.tick()

    async def _control_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_status = loop.time()
        published_state = None
        while not self.closing:
            try:
                view = await self._control_tick()
                # Shedding or pausing that starts or stops goes out at once, so a producer that honours the
                # status topic can react within a control tick, not a status interval.
                state = (view.decision.shed_priorities, tuple(map(tuple, view.paused_by_priority)))
                if loop.time() >= next_status or state != published_state:
                    next_status = loop.time() + self.settings.status_interval_s
                    published_state = state
                    await self.reporter.publish(view)
            except Exception:
                log.exception("load control failed")
            await asyncio.sleep(CONTROL_INTERVAL_S)

    async def _control_tick(self) -> LoadView:
        """Measure, decide, apply: lag -> LoadDecision -> intake (shed, pause) and engine (end of input)."""
        self._see_engine()
        stats = self.engine_thread.stats
        waiting = self.queue.num_waiting_by_priority()
        decision = self.load_control.decide(await self.intake.lag_by_priority(), waiting, stats.kv_usage,
                                            time.monotonic(), self.intake.reach.fractions(),
                                            self.queue.tokens_by_priority())
        self.intake.apply(decision)
        self.dispatcher.set_input_ended(decision.input_ended)
        assigned = frozenset(tp.partition for tp in self.intake.assigned)
        desired = self.scale_signal.update(time.monotonic(), decision.unread_tokens, self.service.tokens_read,
                                           decision.shed.backlog_tokens, self.service.capacity_tokens_per_s(),
                                           assigned)
        tenants = self.tenants.snapshot(time.monotonic(), self.queue.num_waiting_by_tenant(),
                                        self.streamer.charged_in_engine())
        view = LoadView(decision, stats, self.queue.num_waiting_by_priority(), self.intake.paused_by_priority(),
                        sorted(assigned), self.streamer.num_completed, self.streamer.num_output_tokens, desired,
                        tenants, tuple(tp.partition for tp in self.intake.commit_waiting()))
        self.reporter.update_metrics(view)
        return view
