"""The intake, dispatcher and answers against in-memory Kafka clients: what is queued, what is answered at
once and how, what enters the engine in which order, and which offsets become committable."""

from __future__ import annotations

import time

import pytest
from types import SimpleNamespace

from aiokafka import TopicPartition

from schemas.limits import DEFAULT_LIMITS
from worker.kafka_settings import KafkaSettings
from worker.worker_settings import WorkerSettings
from worker.engine.api import EngineStats
from worker.transport.load.admission import Admission
from worker.transport.requests.answers import Answers
from worker.transport.requests.lifecycle import Lifecycle
from worker.transport.requests.stages import RequestBook
from worker.transport.requests.cancels import CancelledIds
from worker.transport.requests.dispatcher import COMPILING_CAPS, Dispatcher
from worker.transport.requests.intake import Intake, IntakeLayout
from worker.transport.load.load_control import LoadControl
from worker.transport.load.backpressure import Backpressure
from worker.transport.requests.local_queue import LocalQueue
from worker.transport.metrics import WorkerMetrics
from worker.transport.kafka.offsets import OffsetTracker
from worker.transport.load.service_model import EngineView, ServiceModel
from worker.transport.load.shedding import Shedder
from worker.transport.requests.streamer import Streamer
from worker.transport.load.tenant_book import TenantBook
from tests.transport.fakes import TOPIC, FakeConsumer, FakeEngineThread, FakePublisher, request_bytes, request_partition

KAFKA = KafkaSettings(num_priorities=3, partitions_per_priority=2, allowed_reply_topics=["replies.ok"])


def build(max_in_engine: int = 4, **settings_overrides) -> SimpleNamespace:
    """The parts as Worker wires them, around fake clients and a fake engine thread."""
    settings = WorkerSettings(metrics_port=0, worker_id="w-test", **settings_overrides)
    consumer, publisher, engine = FakeConsumer(), FakePublisher(), FakeEngineThread()
    tracker, metrics = OffsetTracker(), WorkerMetrics.create()
    service = ServiceModel(KAFKA.num_priorities, 64, 512)
    tenants = TenantBook.from_settings(settings, KAFKA.num_priorities)
    queue = LocalQueue(KAFKA.num_priorities, settings.max_waiting, tenants.fair)
    book = RequestBook()
    answers = Answers(publisher, tracker, metrics, settings.worker_id, KAFKA.result_topic, KAFKA.dead_letter_topic,
                      tenants=tenants, book=book)
    admission = Admission(KAFKA.result_topic, frozenset(KAFKA.allowed_reply_topics), list(settings.itl_target_ms))
    streamer = Streamer(publisher, tracker, answers, metrics, service, settings.worker_id, KAFKA.num_priorities, 0.0,
                        tenants)
    lifecycle = Lifecycle(book, queue, streamer, engine, answers, admission, service, tenants,
                          CancelledIds(settings.cancel_ttl_s, settings.cancel_max_ids), KAFKA.result_topic)
    dispatcher = Dispatcher(lifecycle, admission, max_in_engine)
    intake = Intake(consumer, tracker, lifecycle, answers, IntakeLayout.from_settings(KAFKA, settings, DEFAULT_LIMITS))
    load_control = LoadControl(Shedder(list(settings.max_queue_time_s), KAFKA.num_priorities),
                               Backpressure.from_settings(settings, KAFKA.num_priorities), service)
    all_partitions = {TopicPartition(TOPIC, p) for p in range(KAFKA.num_request_partitions)}
    intake.on_assigned(all_partitions, group_generation=7)
    return SimpleNamespace(consumer=consumer, publisher=publisher, engine=engine, tracker=tracker, queue=queue,
                           intake=intake, dispatcher=dispatcher, streamer=streamer, load_control=load_control,
                           service=service, answers=answers, tenants=tenants, lifecycle=lifecycle, book=book)


def revoke(w, partitions: set) -> None:
    """The start of a rebalance, as Worker._on_revoked does it (without the commit)."""
    w.lifecycle.hold(partitions)
    w.intake.on_revoked(partitions)


def assign(w, partitions: set, group_generation: int, **kwargs) -> set:
    """The assignment that ends it, as Worker._on_assigned does it: returns the partitions given up."""
    held = set(w.streamer.held_partitions)
    gone = w.intake.on_assigned(partitions, group_generation, **kwargs) | (held - partitions)
    w.engine.abort(w.lifecycle.settle(gone))
    return gone


def send(w, priority: int, request_id: str, value: bytes | None = None, timestamp_ms: int | None = None, **fields):
    tp = request_partition(KAFKA, priority, request_id)
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    offset = w.consumer.append(tp, request_bytes(request_id, **fields) if value is None else value,
                               request_id.encode(), ts)
    return tp, offset


async def test_requests_enter_the_engine_most_urgent_first_within_the_cap():
    w = build()
    for i in range(3):
        send(w, 2, f"low-{i}")
    for i in range(3):
        send(w, 0, f"urgent-{i}")
    send(w, 1, "mid-0")
    await w.intake.fetch_once()
    assert len(w.queue) == 7
    w.dispatcher.admit()
    assert [r.request_id.split("#")[0] for r in w.engine.added] == ["urgent-0", "urgent-1", "urgent-2", "mid-0"]
    added = w.engine.added[0]
    assert added.request_id == "urgent-0#7@" + added.request_id.split("@")[1]  # attempt = group generation
    assert added.priority == 0 and len(w.queue) == 3 and len(w.streamer) == 4


async def test_bad_records_are_dead_lettered_and_answered_when_their_id_is_readable():
    w = build()
    tp_bad, off_bad = send(w, 1, "bad", value=b'{"id": "bad", "prompt": 5}')
    tp_junk, off_junk = send(w, 1, "junk", value=b"\xff\x00not json")
    await w.intake.fetch_once()
    assert len(w.queue) == 0 and w.answers.num_dead_letters == 2
    dead = w.publisher.dead_letters()
    assert sorted(d.offset for d in dead) == sorted([off_bad, off_junk])
    assert w.publisher.finals()["bad"].status == "error"  # the id was readable: the producer gets a final
    assert w.tracker.num_pending() == 2  # not done before Kafka acknowledged what was written
    w.publisher.ack_all()
    assert w.tracker.num_pending() == 0
    await w.intake.commit()
    assert w.consumer.commits[-1] == {tp: w.tracker.watermark(tp) for tp in {tp_bad, tp_junk}}


async def test_reply_topic_not_allowed_is_answered_on_the_result_topic():
    w = build()
    send(w, 0, "sneaky", reply_topic="somewhere.else")
    send(w, 0, "fine", reply_topic="replies.ok")
    await w.intake.fetch_once()
    final = w.publisher.finals(KAFKA.result_topic)["sneaky"]
    assert (final.status, final.reason) == ("error", "reply_topic_not_allowed")
    assert not [r for r in w.publisher.records if r[0] == "somewhere.else"]
    assert [q.request.id for q in w.queue] == ["fine"] and next(iter(w.queue)).reply_topic == "replies.ok"


async def test_a_deadline_that_passed_is_rejected_at_fetch_and_in_the_local_queue():
    w = build()
    now_ms = int(time.time() * 1000)
    send(w, 1, "late", timestamp_ms=now_ms - 5_000, timeout_ms=1_000)
    send(w, 1, "soon", deadline_ms=now_ms + 400)  # the fake engine measured nothing: only the safety margin
    send(w, 1, "too-soon", deadline_ms=now_ms + 100)  # less than the margin left: refused before any compute
    await w.intake.fetch_once()
    assert w.publisher.finals()["late"].reason == "deadline"
    assert "margin" in w.publisher.finals()["too-soon"].message
    assert [q.request.id for q in w.queue] == ["soon"]
    time.sleep(0.45)
    w.dispatcher.admit()
    assert w.publisher.finals()["soon"].reason == "deadline" and w.engine.added == []


async def test_admission_predicts_and_refuses_by_tokens_ahead():
    w = build()
    # 200 ms a step, any size: a full step of at most max_num_batched_tokens is modelled at no more than 4000
    # tokens/s, so the measured rate stands (it is never taken below a quarter of the model's).
    w.engine.stats = EngineStats(step_time_base_s=0.2, step_time_per_token_s=0.0)
    w.service.see(EngineView(w.engine.stats))  # as the worker does before each turn of its loops
    w.service.rate.rate = 1000.0  # tokens/s, measured while saturated
    now_ms = int(time.time() * 1000)
    for i in range(5):  # 5 requests of about 2000 tokens ahead: 10 s of work
        send(w, 0, f"big-{i}", prompt=None, prompt_token_ids=[5] * 1990, max_new_tokens=10)
    send(w, 1, "fits", prompt=None, prompt_token_ids=[5] * 10, max_new_tokens=10, deadline_ms=now_ms + 20_000)
    send(w, 1, "waits-too-long", prompt=None, prompt_token_ids=[5] * 10, max_new_tokens=10, deadline_ms=now_ms + 8_000)
    await w.intake.fetch_once()
    assert [q.request.id for q in w.queue][-1] == "fits"
    assert w.publisher.finals()["waits-too-long"].reason == "deadline"
    fits = next(q for q in w.queue if q.request.id == "fits")
    assert 9_900 < fits.predicted_queue_ms < 10_300  # 10 000 tokens ahead at 1000 tokens/s
    # Its prefill (which samples the first token) and 9 decode steps.
    assert fits.predicted_e2e_ms - fits.predicted_queue_ms == pytest.approx(10 * 200, rel=0.01)


async def test_load_decisions_shed_pause_and_resume():
    w = build(max_queue_time_s=[10.0, 100.0, 1.0], priority_backlog_threshold=2, pause_dwell_s=0.0)
    for i in range(3):
        send(w, 2, f"low-{i}")
    await w.intake.fetch_once()
    w.service.rate.rate = w.service.mean_cost(2)  # about one request per second, measured while saturated
    for i in range(4):
        send(w, 0, f"urgent-{i}")  # unread: lag of priority 0 is 4
    lag = await w.intake.lag_by_priority()
    assert lag == [4, 0, 0]
    decision = w.load_control.decide(lag, w.queue.num_waiting_by_priority(), 0.0, now=10.0)
    assert decision.newly_shed == {2} and decision.backlog_by_priority == [4, 0, 3]  # 7 s > 1 s; 4 s < 100 s
    assert 2 not in decision.pause_reasons  # shed, so not paused: consuming it is what drains it
    assert decision.pause_reasons == {1: "priority_backlog"} and not decision.input_ended
    w.intake.apply(decision)
    finals = w.publisher.finals()
    assert {f"low-{i}" for i in range(3)} <= set(finals) and all(finals[f"low-{i}"].reason == "shed" for i in range(3))
    assert "priority 2 shed" in finals["low-0"].message
    assert {tp.partition for tp in w.consumer.paused()} == {2, 3}  # priority 1's partitions
    send(w, 2, "low-late")
    await w.intake.fetch_once()
    assert w.publisher.finals()["low-late"].reason == "shed"  # answered at fetch while shed
    # The urgent backlog drains: everything resumes.
    w.dispatcher.admit()
    decision = w.load_control.decide(await w.intake.lag_by_priority(), w.queue.num_waiting_by_priority(), 0.0, 20.0)
    w.intake.apply(decision)
    assert decision.pause_reasons == {} and w.consumer.paused() == set()


async def test_a_local_queue_full_of_less_urgent_work_still_fetches_urgent_records():
    w = build(max_waiting=2, resume_waiting=1)
    for i in range(3):
        send(w, 1, f"mid-{i}")
    await w.intake.fetch_once()
    assert len(w.queue) == 3  # one poll may overshoot by its records
    send(w, 1, "mid-3")
    send(w, 2, "low")
    w.consumer.getmany_calls.clear()
    await w.intake.fetch_once()  # no room at priority 1 or below, nothing shed: only priority 0 is asked
    urgent_partitions = {tp.partition for tp in w.intake.partitions_of(0)}
    assert {p for call in w.consumer.getmany_calls for p in call} <= urgent_partitions and len(w.queue) == 3
    send(w, 0, "urgent")  # the queue is full of priority 1, but the urgent record is read at once
    await w.intake.fetch_once()
    assert [q.request.id for q in w.queue][0] == "urgent" and len(w.queue) == 4
    assert {p for call in w.consumer.getmany_calls for p in call} <= urgent_partitions


async def test_the_end_of_input_follows_lag_and_the_local_queue():
    w = build()
    decision = w.load_control.decide([0, 0, 0], [0, 0, 0], 0.0, 0.0)
    w.dispatcher.set_input_ended(decision.input_ended)
    send(w, 1, "a")
    decision = w.load_control.decide(await w.intake.lag_by_priority(), w.queue.num_waiting_by_priority(), 0.0, 0.1)
    w.dispatcher.set_input_ended(decision.input_ended)
    await w.intake.fetch_once()
    decision = w.load_control.decide(await w.intake.lag_by_priority(), w.queue.num_waiting_by_priority(), 0.0, 0.2)
    w.dispatcher.set_input_ended(decision.input_ended)  # still waiting locally: not ended
    w.dispatcher.admit()
    decision = w.load_control.decide(await w.intake.lag_by_priority(), w.queue.num_waiting_by_priority(), 0.0, 0.3)
    w.dispatcher.set_input_ended(decision.input_ended)
    w.dispatcher.set_input_ended(decision.input_ended)  # unchanged: not sent again
    assert w.engine.input_ended == [True, False, True]


async def test_a_rebalance_keeps_what_stays_and_forgets_what_moved():
    w = build()
    tp_a, _ = send(w, 1, "a")
    tp_b, _ = send(w, 2, "b")
    await w.intake.fetch_once()
    everything = set(w.intake.assigned)
    revoke(w, everything)  # eager: every partition, at the start of the rebalance
    assert list(w.queue) == [] and w.intake.assigned == set()
    assert w.book.by_stage()["held"] == 2
    w.consumer.seek(tp_b, 0)  # what aiokafka does at the assignment: back to the committed offset
    assign(w, everything - {tp_a}, group_generation=8)
    # tp_b stayed: its request waits again, under its first attempt, and reading resumes after it (no refetch).
    assert [(q.request.id, q.attempt) for q in w.queue] == [("b", 7)]
    assert w.book.by_stage()["queued"] == 1 and w.book.num_given_up == 1 and w.book.violations == []
    assert w.consumer.positions[tp_b] == 1 and w.tracker.next_offset(tp_b) == 1
    await w.intake.fetch_once()
    assert [q.request.id for q in w.queue] == ["b"]
    # tp_a moved: its request and its watermark are gone; the new owner serves it again.
    assert tp_a not in w.intake.assigned and w.tracker.next_offset(tp_a) is None


async def test_a_worker_that_missed_a_generation_keeps_nothing_of_what_it_held():
    """A frozen worker's session expires, the group moves on without it (another owner answers and commits), then
    it rejoins and gets its partitions back: nothing it held may be published or committed, and reading starts
    again from the committed offset, skipping what the other owner recorded as answered."""
    w = build()
    tp_b, _ = send(w, 2, "b")
    await w.intake.fetch_once()
    everything = set(w.intake.assigned)
    revoke(w, everything)
    assert w.intake.kept_of(everything, 8) == everything  # the next generation: it kept them
    assert w.intake.kept_of(everything, 9) == set()  # generation 8 went on without it
    assert w.intake.kept_of(everything, 8, lost={tp_b}) == everything - {tp_b}  # its lane was fenced
    w.consumer.seek(tp_b, 0)
    moved = assign(w, everything, group_generation=9, progress={tp_b: (0, [(1, 2)])})
    assert moved == everything and list(w.queue) == [] and len(w.book) == 0 and w.book.num_given_up == 1
    assert w.consumer.positions[tp_b] == 0 and w.tracker.progress(tp_b) == (0, [(1, 2)])
    await w.intake.fetch_once()
    assert [(q.request.id, q.attempt) for q in w.queue] == [("b", 9)]  # offset 0 again, under the new generation


async def test_a_worker_whose_assignment_says_it_held_its_partitions_through_a_missed_generation_keeps_them():
    """A join during generation 8's assignment failed its syncs: the worker comes back at 9 having held nothing
    of 8, but its new assignment says (the leader made 8's) which partitions it held through: those it keeps,
    the rest start over."""
    w = build()
    tp_a, _ = send(w, 1, "a")
    tp_b, _ = send(w, 2, "b")
    await w.intake.fetch_once()
    everything = set(w.intake.assigned)
    revoke(w, everything)
    held: list[int] | None = [tp_b.partition]
    w.intake.held_through = lambda: held
    assert w.intake.kept_of(everything, 9) == {tp_b}
    assert w.intake.kept_of(everything, 9, lost={tp_b}) == set()  # its lane was fenced meanwhile
    held = None
    assert w.intake.kept_of(everything, 9) == set()  # the assignment could not tell
    held = [tp_b.partition]
    moved = assign(w, everything, group_generation=9)
    assert moved == everything - {tp_b} and tp_a in moved and [(q.request.id, q.attempt) for q in w.queue] == [("b", 7)]


async def test_records_of_an_old_generation_are_skipped():
    w = build()
    tp_b, _ = send(w, 2, "b")
    await w.intake.fetch_once()
    # A rebalance while one poll asks priority after priority: records the poll got before it (priority 1,
    # generation 7) are not handled; those returned by the call that saw it belong to the new generation.
    tp_c1, _ = send(w, 1, "c1")
    tp_c2, _ = send(w, 2, "c2")
    w.intake.on_assigned({tp_c1, tp_b}, group_generation=7)
    original = w.consumer.getmany

    async def getmany_with_rebalance(*parts, **kwargs):
        if tp_b in parts:
            w.intake.on_assigned({tp_c1, tp_b}, group_generation=8)
        return await original(*parts, **kwargs)

    w.consumer.getmany = getmany_with_rebalance
    await w.intake.fetch_once()
    assert sorted(q.request.id for q in w.queue) == ["b", "c2"]
    assert [q.attempt for q in w.queue if q.request.id == "c2"] == [8]
    assert w.tracker.next_offset(tp_c1) is None  # untracked: the watermark cannot pass it


async def test_stop_fetching_pauses_everything_and_later_decisions_do_not_resume():
    w = build(pause_dwell_s=0.0)
    w.intake.stop_fetching()
    assert w.consumer.paused() == w.intake.assigned
    w.intake.apply(w.load_control.decide([0, 0, 0], [0, 0, 0], 0.0, 1.0))
    assert w.consumer.paused() == w.intake.assigned


def test_the_engine_request_carries_sampling_deadline_and_arrival_on_the_monotonic_clock():
    from schemas.request import GenerationRequest, SamplingSpec
    from worker.transport.requests.dispatcher import to_engine_requests
    from worker.transport.requests.local_queue import QueuedRequest

    now_ms = int(time.time() * 1000)
    request = GenerationRequest(id="x", prompt="hi", max_new_tokens=7,
                                sampling=SamplingSpec(temperature=0.5, top_k=3, seed=11, stop=["."]))
    queued = QueuedRequest(request=request, partition=TopicPartition(TOPIC, 3), offset=9, priority=1, attempt=4,
                           timestamp_ms=now_ms - 2_000, deadline_ms=now_ms + 5_000, reply_topic="r",
                           num_prompt_tokens=1)
    [engine_request] = to_engine_requests(queued)
    assert engine_request.request_id == "x#4@3:9" and engine_request.prefix_leader is None
    assert (engine_request.sampling.max_new_tokens, engine_request.sampling.top_k) == (7, 3)
    assert engine_request.sampling.seed == 11 and engine_request.sampling.stop == (".",)
    assert abs(engine_request.deadline - time.monotonic() - 5.0) < 0.1
    assert abs(time.monotonic() - engine_request.arrival_time - 2.0) < 0.1
    assert EngineStats().num_running == 0


def test_n_completions_are_engine_requests_with_derived_seeds_that_wait_for_the_first_ones_prompt():
    from schemas.request import GenerationRequest, SamplingSpec
    from worker.transport.requests.dispatcher import completion_seed, to_engine_requests
    from worker.transport.requests.local_queue import QueuedRequest

    def engine_requests(**fields):
        request = GenerationRequest(id="x", prompt="hi", max_new_tokens=7, **fields)
        return to_engine_requests(QueuedRequest(request=request, partition=TopicPartition(TOPIC, 3), offset=9,
                                                priority=1, attempt=4, timestamp_ms=int(time.time() * 1000),
                                                deadline_ms=None, reply_topic="r", num_prompt_tokens=1))

    first, *others = engine_requests(n=3, sampling=SamplingSpec(temperature=0.5, seed=11))
    assert [r.request_id for r in [first, *others]] == ["x#4@3:9/0", "x#4@3:9/1", "x#4@3:9/2"]
    assert first.prefix_leader is None and {r.prefix_leader for r in others} == {"x#4@3:9/0"}
    seeds = [r.sampling.seed for r in [first, *others]]
    assert seeds[0] == 11 and len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [completion_seed(11, i) for i in range(3)]  # the same on a redelivery
    assert not any(r.sampling.logprobs for r in [first, *others])
    # best_of > n ranks by cumulative logprob, so every completion computes its logprobs.
    ranked = engine_requests(n=1, best_of=4, sampling=SamplingSpec(temperature=0.5))
    assert len(ranked) == 4 and all(r.sampling.logprobs and r.sampling.seed is None for r in ranked)


async def test_partitions_outside_the_layout_are_paused_and_never_read():
    w = build()
    grown = TopicPartition(TOPIC, KAFKA.num_request_partitions + 1)  # the topic grew past the layout
    w.intake.on_assigned(w.intake.assigned | {grown}, group_generation=8)
    assert grown not in w.intake.assigned and grown in w.consumer.paused()
    w.consumer.append(grown, request_bytes("stray"), b"stray", int(time.time() * 1000))
    w.consumer.resume(grown)  # even if something resumed it, the intake never asks for it
    send(w, 1, "fine")
    await w.intake.fetch_once()
    await w.intake.fetch_once()
    assert [q.request.id for q in w.queue] == ["fine"]
    assert all(grown.partition not in call for call in w.consumer.getmany_calls)
    assert await w.intake.lag_by_priority() == [0, 0, 0]


async def test_a_producer_clock_in_the_past_cannot_jump_the_queue():
    w = build(max_clock_skew_ms=1000.0)
    now_ms = int(time.time() * 1000)
    send(w, 1, "honest", timestamp_ms=now_ms - 200)
    send(w, 1, "behind", timestamp_ms=now_ms - 3_600_000)  # an hour behind
    await w.intake.fetch_once()
    by_id = {q.request.id: q for q in w.queue}
    assert by_id["honest"].arrival_ms == now_ms - 200
    assert by_id["behind"].arrival_ms >= now_ms - 1000
    assert by_id["behind"].timestamp_ms == now_ms - 3_600_000  # timings still start at the record's timestamp


async def test_with_every_partition_paused_a_poll_still_yields_to_the_loop():
    w = build()
    w.consumer.pause(*w.intake.assigned)
    w.intake.paused = set(w.intake.assigned)
    started = time.monotonic()
    await w.intake.fetch_once()  # nothing readable: it must wait, not return at once (the caller loops on it)
    assert time.monotonic() - started >= 0.04


async def test_an_urgent_request_enters_past_a_cap_filled_with_less_urgent_work():
    w = build()  # max_in_engine=4
    for i in range(6):
        send(w, 2, f"bulk-{i}")
    await w.intake.fetch_once()
    w.dispatcher.admit()
    assert len(w.streamer) == 4 and len(w.queue) == 2
    for i in range(5):
        send(w, 0, f"urgent-{i}")
    await w.intake.fetch_once()
    w.dispatcher.admit()
    # Past the cap while less urgent work holds places (the scheduler preempts it), up to the cap in urgent ones.
    assert w.streamer.num_open_by_priority == [4, 0, 4]
    left = [q.request.id for q in w.queue]
    assert len(left) == 3 and left[0].startswith("urgent-") and sorted(left[1:]) == ["bulk-4", "bulk-5"]


async def test_requests_whose_grammar_compiles_hold_no_seat_up_to_some_caps_worth():
    w = build()  # max_in_engine=4
    for i in range(12):
        send(w, 1, f"r-{i}")
    await w.intake.fetch_once()
    w.dispatcher.admit()
    assert len(w.streamer) == 4
    w.engine.stats = EngineStats(num_compiling=3)  # three of them wait for their grammars outside the scheduler
    w.dispatcher.admit()
    assert len(w.streamer) == 7
    w.engine.stats = EngineStats(num_compiling=7)
    w.dispatcher.admit()
    assert len(w.streamer) == 11 and len(w.queue) == 1
    # Never more than COMPILING_CAPS caps' worth past the cap: at a cap of 1, eleven compiling count as eight.
    w.dispatcher.max_in_engine = 1
    w.engine.stats = EngineStats(num_compiling=11)
    w.dispatcher.admit()
    assert COMPILING_CAPS == 8 and len(w.streamer) == 11 and len(w.queue) == 1


async def test_a_backlogged_partition_does_not_keep_the_others_of_its_priority_unread():
    """Each poll shares its record budget among the priority's partitions: asked in a fixed order, a partition
    with a backlog of the whole budget was drained first at every poll and the next one was never read, so a
    tenant whose requests land there waited in Kafka until shed."""
    w = build(max_poll_records=10)
    first, second = w.intake.partitions_of(1)
    now_ms = int(time.time() * 1000)
    for i in range(100):
        w.consumer.append(first, request_bytes(f"backlog-{i}"), f"backlog-{i}".encode(), now_ms)
    for i in range(10):
        w.consumer.append(second, request_bytes(f"other-{i}"), f"other-{i}".encode(), now_ms)
    read = []
    for _ in range(3):
        before = len(w.queue)
        await w.intake.fetch_once()
        read.append(len(w.queue) - before)
    ids = [q.request.id for q in w.queue]
    assert sum(i.startswith("other-") for i in ids) >= 10, ids  # all of them within the budget of three polls
    assert sum(read) <= 30
