"""Client-side bookkeeping of the Kafka-path benchmark: which records count, TTFT/e2e times, the ratio."""

import math

import pytest

from benchmarks.bench_kafka_path import ResultTracker, compare, worker_env
from benchmarks.lib.trace import TraceRequest
from schemas.result import FinalRecord, StreamChunk, Timings, Usage
from worker.model.settings import EngineSettings
from worker.kafka_settings import KafkaSettings


def _trace() -> list[TraceRequest]:
    return [TraceRequest("a", 0.0, [20, 21], 3, 1, "short"), TraceRequest("b", 0.5, [22], 2, 0, "short")]


def _final(rid: str, tokens: int, status: str = "completed", reason: str = "length") -> FinalRecord:
    return FinalRecord(id=rid, status=status, reason=reason, finish_reason=reason if status == "completed" else None,
                       usage=Usage(prompt_tokens=1, completion_tokens=tokens), timings=Timings(ttft_ms=12.0))


def test_first_chunk_sets_ttft_final_sets_e2e_and_tokens():
    t = ResultTracker.for_trace(_trace())
    t.on_record(StreamChunk(id="a", seq=0, token_ids=[], text=""), 0.1)  # empty chunk: no token yet
    t.on_record(StreamChunk(id="a", seq=1, token_ids=[5], text="x"), 0.2)
    t.on_record(StreamChunk(id="a", seq=2, token_ids=[6], text="y"), 0.3)
    t.on_record(_final("a", 3), 0.4)
    a = t.records["a"]
    assert (a.first_token_s, a.finish_s, a.num_output_tokens, a.error) == (0.2, 0.4, 3, None)
    assert not t.done and t.num_finished == 1 and t.last_final_s == 0.4
    assert t.worker_ttft_ms == {"a": 12.0}


def test_foreign_ids_and_records_after_the_final_are_ignored():
    t = ResultTracker.for_trace(_trace())
    t.on_record(_final("warm-r0", 4), 0.1)
    t.on_record(_final("b", 2), 1.0)
    t.on_record(StreamChunk(id="b", attempt=1, seq=0, token_ids=[9]), 1.5)  # a redelivery's late chunk
    t.on_record(_final("b", 2), 2.0)
    b = t.records["b"]
    assert "warm-r0" not in t.records
    assert (b.finish_s, b.first_token_s) == (1.0, 1.0)  # no chunk seen (stream=False): the final counts
    assert t.last_final_s == 1.0


def test_a_rejected_final_is_an_error():
    t = ResultTracker.for_trace(_trace())
    t.on_record(_final("a", 0, status="rejected", reason="shed"), 0.5)
    t.on_record(_final("b", 2), 0.7)
    assert t.done and t.records["a"].error == "shed" and t.records["a"].first_token_s is None


def test_compare_ratio_of_medians_and_per_rep():
    inproc = [{"output_tokens_per_s": 10.0}, {"output_tokens_per_s": 20.0}]
    kafka = [{"output_tokens_per_s": 9.0}, {"output_tokens_per_s": 19.0}]
    c = compare(inproc, kafka)
    assert c["ratio_of_medians"] == pytest.approx(14.0 / 15.0)
    assert c["ratio_per_rep"] == pytest.approx([0.9, 0.95])
    assert c["meets_floor"]
    assert not compare(inproc, [{"output_tokens_per_s": 5.0}, {"output_tokens_per_s": 5.0}])["meets_floor"]
    assert math.isnan(compare([], [])["ratio_of_medians"])


def test_worker_env_reads_back_as_the_in_process_engine_settings(monkeypatch):
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1", request_topic="rq", group_id="g")
    env = worker_env(kafka, "smollm2-135m-instruct", 1024, threads=1)
    for key, value in env.items():
        if key.startswith(("ENGINE_", "KAFKA_")):
            monkeypatch.setenv(key, value)
    from benchmarks.lib.settings import engine_settings

    assert EngineSettings() == engine_settings("continuous", 1024)
    assert KafkaSettings().request_topic == "rq" and env["OMP_NUM_THREADS"] == "1"
