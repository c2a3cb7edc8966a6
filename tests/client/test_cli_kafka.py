"""The example programs end to end against a real broker and a worker on the instant engine: `llm-worker
generate` and the chat example as subprocesses, `llm-worker loadgen` through its own argument parser."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import pytest

from llm_client.commands import loadgen
from schemas.decode import decode_request
from schemas.request import ChatMessage, GenerationRequest
from tests.client.helpers import instant_text, read_topic
from tests.transport.kafka_helpers import REPO, running_worker, subprocess_env, worker_settings
from worker.kafka_settings import KafkaSettings
from worker.engine.instant import InstantEngine

pytestmark = pytest.mark.kafka

LLM_WORKER = str(REPO / ".venv" / "bin" / "llm-worker")


async def run_process(kafka: KafkaSettings, *command: str, stdin: bytes | None = None,
                      timeout_s: float = 60) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *command, env=subprocess_env(kafka), cwd=str(REPO), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(stdin), timeout_s)
    return process.returncode, stdout.decode(), stderr.decode()


async def test_generate_streams_the_answer_and_exits_zero(kafka_topics):
    kafka = kafka_topics
    async with running_worker(kafka, worker_settings(), InstantEngine()):
        code, out, err = await run_process(
            kafka, LLM_WORKER, "generate", "What is Kafka?", "--priority", "0", "--max-new-tokens", "6",
            "--system", "Be brief.", "--timeout-s", "30", "--id", "gen-cli-1")
    assert code == 0, err
    expected = instant_text(GenerationRequest(id="x", max_new_tokens=6, messages=[
        ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="What is Kafka?")]))
    assert out == expected + "\n"
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("[gen-cli-1] completed (length) · 6 tokens · TTFT ")
    assert "e2e " in summary and "priority 0" in summary
    [record] = await read_topic(kafka, kafka.request_topic, 1)
    request = decode_request(record.value)
    assert request.timeout_ms == 30_000 and request.max_new_tokens == 6


async def test_generate_exits_one_when_the_worker_refuses(kafka_topics):
    kafka = kafka_topics
    async with running_worker(kafka, worker_settings(), InstantEngine()):
        # Beyond the worker's max_new_tokens cap: answered with an `error` final record.
        code, out, err = await run_process(kafka, LLM_WORKER, "generate", "hi", "--max-new-tokens", "100000",
                                           "--raw", "--id", "gen-cli-2")
    assert code == 1
    assert out == ""
    assert "[gen-cli-2] error (invalid_request)" in err


async def test_chat_sends_the_whole_conversation_each_turn(kafka_topics):
    kafka = kafka_topics
    async with running_worker(kafka, worker_settings(), InstantEngine()):
        code, out, err = await run_process(
            kafka, str(REPO / ".venv" / "bin" / "python"), "-m", "producer_examples.chat", "--system", "S",
            "--max-new-tokens", "3", stdin=b"first question\nsecond question\n/quit\n")
    assert code == 0, err
    records = await read_topic(kafka, kafka.request_topic, 2)
    first, second = sorted((decode_request(r.value) for r in records), key=lambda r: len(r.messages))
    answer = instant_text(first)
    assert [(m.role, m.content) for m in second.messages] == [
        ("system", "S"), ("user", "first question"), ("assistant", answer), ("user", "second question")]
    assert out.splitlines() == [answer, instant_text(second)]


def loadgen_args(tmp_path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    loadgen.configure_parser(parser)
    return parser.parse_args([*argv, "--out", str(tmp_path / "results.json")])


async def test_loadgen_short_run_writes_the_summary(kafka_topics, tmp_path, monkeypatch, capsys):
    kafka = kafka_topics
    for name, value in subprocess_env(kafka).items():
        if name.startswith("KAFKA_"):
            monkeypatch.setitem(os.environ, name, value)
    args = loadgen_args(tmp_path, "--rate", "25", "--duration", "2", "--priority-mix", "0:0.2,1:0.3,2:0.5",
                        "--prompt-len-dist", "0.8:4-16,0.2:64-128", "--output-len-dist", "0.9:2-6,0.1:20-30",
                        "--deadline-s", "0:10,1:20,2:30", "--drain-s", "20", "--seed", "3")
    async with running_worker(kafka, worker_settings(), InstantEngine(max_num_seqs=32), max_num_seqs=32):
        result = await loadgen.main_async(args)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert set(saved) >= {"config", "wall_s", "send_window_s", "totals", "per_priority", "requests"}
    num_requests = len(saved["requests"])
    assert 20 <= num_requests <= 80  # Poisson(50) with a fixed seed; bounds only guard against a broken clock
    assert saved["send_window_s"] <= 2.5 and saved["wall_s"] < 15
    assert saved["totals"]["num_sent"] == saved["totals"]["num_completed"] == num_requests
    assert set(saved["per_priority"]) == {"0", "1", "2"}
    for row in saved["per_priority"].values():
        assert set(row) >= {"num_sent", "num_completed", "num_rejected", "rejected_by_reason", "completed_per_s",
                            "output_tokens_per_s", "ttft_ms", "e2e_ms"}
        assert set(row["ttft_ms"]) == set(row["e2e_ms"]) == {"p50", "p95", "p99"}
        assert row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]
    for request in saved["requests"]:
        assert request["status"] == "completed" and request["completion_tokens"] == request["max_new_tokens"]
    out = capsys.readouterr()
    assert out.out.splitlines()[0].split()[:3] == ["prio", "sent", "done"]
    assert f"sent {num_requests} | completed {num_requests}" in out.err
