"""Destinations that refuse records, without a broker: how a topic's state is decided (destinations.py), and
what becomes of a final record that its topic does not take (Answers.final_fallback). The same paths run
against a real broker in test_destinations_kafka.py."""

from __future__ import annotations

import pytest

import asyncio

from aiokafka.errors import KafkaConnectionError

from schemas import FinalRecord, decode_result
from schemas.result import TokenLogprob, TopLogprob, Usage
from worker.transport.requests.answers import Answers
from worker.transport.kafka.destinations import DEFAULT_MAX_MESSAGE_BYTES, Destinations
from worker.transport.metrics import WorkerMetrics
from worker.transport.kafka.offsets import OffsetTracker
from tests.transport.fakes import FakePublisher, tenant_book


class Probe:
    def __init__(self, topics: set[str], limits: dict[str, int] | None = None) -> None:
        self.topics_present = topics
        self.limits = limits or {}
        self.broker_away = False
        self.num_calls = 0

    async def topics(self) -> set[str]:
        self.num_calls += 1
        if self.broker_away:
            raise KafkaConnectionError("no broker")
        return set(self.topics_present)

    async def max_message_bytes(self, topic: str) -> int | None:
        return self.limits.get(topic)

    async def close(self) -> None:
        pass


async def resolved(destinations: Destinations, topic: str, timeout_s: float = 5.0):
    done = asyncio.Event()
    destinations.resolve(topic, on_done=done.set)
    await asyncio.wait_for(done.wait(), timeout_s)
    return destinations.state(topic)


async def test_a_present_topic_is_available_with_the_limit_the_broker_reports():
    changes = []
    destinations = Destinations(Probe({"a", "b"}, {"a": 65536}), wait_s=0.2,
                                on_change=lambda topic, state: changes.append((topic, state.available)))
    assert destinations.state("a") is None  # unknown until looked up
    state = await resolved(destinations, "a")
    assert state.available and state.max_message_bytes == 65536
    assert (await resolved(destinations, "b")).max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    assert changes == [("a", True), ("b", True)]


async def test_a_missing_topic_becomes_unavailable_after_the_wait_and_is_rechecked_later():
    probe = Probe({"other"})
    destinations = Destinations(probe, wait_s=0.2, recheck_s=0.3)
    loop = asyncio.get_running_loop()
    start = loop.time()
    state = await resolved(destinations, "gone")
    assert not state.available and "'gone' does not exist" in state.message
    assert 0.2 <= loop.time() - start < 1.5
    assert destinations.unavailable_topics() == {"gone": state.message}
    await asyncio.sleep(0.35)
    assert destinations.state("gone") is None  # stale: the next record looks it up again
    probe.topics_present.add("gone")
    assert (await resolved(destinations, "gone")).available


@pytest.mark.slow
async def test_no_answer_from_any_broker_declares_nothing():
    probe = Probe(set())
    probe.broker_away = True
    destinations = Destinations(probe, wait_s=0.1)
    done = asyncio.Event()
    destinations.resolve("t", on_done=done.set)
    await asyncio.sleep(1.2)  # far past wait_s: a broker restart must not turn into "topic missing"
    assert not done.is_set() and destinations.state("t") is None and probe.num_calls >= 2
    probe.broker_away = False
    probe.topics_present.add("t")
    await asyncio.wait_for(done.wait(), 3)
    assert destinations.state("t").available


@pytest.mark.slow
async def test_one_lookup_at_a_time_per_topic():
    probe = Probe(set())
    destinations = Destinations(probe, wait_s=0.3)
    done = []
    for i in range(5):
        destinations.resolve("t", on_done=lambda i=i: done.append(i))
    assert destinations.num_checking == 1
    await asyncio.sleep(0.8)
    assert sorted(done) == [0, 1, 2, 3, 4] and destinations.num_checking == 0


def long_final(num_tokens: int = 50) -> FinalRecord:
    logprobs = [TokenLogprob(token_id=t, logprob=-0.5, top_logprobs=[TopLogprob(token_id=t, logprob=-0.5)] * 20)
                for t in range(num_tokens)]
    return FinalRecord(id="r1", attempt=2, status="completed", reason="length", finish_reason="length",
                       text="x" * num_tokens, token_ids=list(range(num_tokens)), logprobs=logprobs,
                       usage=Usage(prompt_tokens=3, completion_tokens=num_tokens), num_chunks=4,
                       metadata={"k": "v"})


def answers_with(publisher: FakePublisher) -> Answers:
    return Answers(publisher, OffsetTracker(), WorkerMetrics.create(), "w", "llm.results", "llm.dead",
                   tenants=tenant_book())


def test_a_final_too_large_goes_again_without_logprobs_then_token_ids_then_as_an_error():
    publisher = FakePublisher()
    answers = answers_with(publisher)
    original = lambda: None  # noqa: E731
    answers.final("p", 7, "reply.a", long_final())
    for step in range(3):
        # The publisher hands the failed record's own on_acked to on_failed: each replacement must carry it.
        publisher.on_failed[-1]("result_too_large", "over the limit", original)
    finals = [decode_result(value) for _, _, value in publisher.records]
    assert [t for t, _, _ in publisher.records] == ["reply.a"] * 4  # the topic is there: it stays the target
    assert finals[1].status == "completed" and finals[1].logprobs is None and finals[1].omitted == ["logprobs"]
    assert finals[1].text == finals[0].text and finals[1].token_ids == finals[0].token_ids
    assert finals[1].usage == finals[0].usage
    assert finals[2].token_ids is None and finals[2].omitted == ["logprobs", "token_ids"]
    last = finals[3]
    assert (last.status, last.reason, last.id, last.attempt) == ("error", "result_too_large", "r1", 2)
    assert "over the limit" in last.message and last.usage == finals[0].usage and last.metadata == {"k": "v"}
    assert publisher.on_failed[-1] is None  # the error final is small; nothing more to leave out
    assert len(publisher._unacked) == 4  # the request's offset waits on whichever replacement lands


def test_a_final_for_an_unavailable_reply_topic_becomes_an_error_on_the_result_topic():
    publisher = FakePublisher()
    answers = answers_with(publisher)
    answers.final("p", 7, "reply.gone", long_final(5))
    publisher.on_failed[-1]("reply_topic_unavailable", "topic 'reply.gone' does not exist", lambda: None)
    topic, key, value = publisher.records[-1]
    final = decode_result(value)
    assert (topic, key) == ("llm.results", b"r1")
    assert (final.status, final.reason) == ("error", "reply_topic_unavailable")
    assert "reply topic 'reply.gone' unavailable: topic 'reply.gone' does not exist" == final.message


def test_one_completions_final_is_not_replaced_the_requests_own_final_carries_the_error():
    publisher = FakePublisher()
    answers = answers_with(publisher)
    completion = FinalRecord(id="r1", status="completed", reason="stop", finish_reason="stop", index=1)
    answers.final("p", None, "reply.gone", completion)
    acked = []
    publisher.on_failed[-1]("reply_topic_unavailable", "gone", lambda: acked.append(1))
    assert len(publisher.records) == 1 and acked == [1]
