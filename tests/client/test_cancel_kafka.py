"""Cancelling from the client library and from `llm-worker generate` (Ctrl-C), against a real broker and a worker
on the instant engine with slow steps (so a request runs long enough to be cancelled mid-stream)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from llm_client import LLMClient
from schemas.decode import decode_control
from schemas.request import GenerationRequest, SamplingSpec
from tests.client.helpers import instant_text, new_id, read_topic
from tests.client.test_cli_kafka import LLM_WORKER
from tests.transport.kafka_helpers import REPO, running_worker, subprocess_env, worker_settings
from worker.engine.instant import InstantEngine

pytestmark = pytest.mark.kafka


def slow_engine() -> InstantEngine:
    return InstantEngine(max_num_seqs=8, step_time_s=0.05)


def long_request(request_id: str, max_new_tokens: int = 300) -> GenerationRequest:
    return GenerationRequest(id=request_id, prompt="A long answer, please.", max_new_tokens=max_new_tokens,
                             sampling=SamplingSpec(ignore_eos=True))


async def test_handle_cancel_ends_the_stream_with_a_cancelled_final(kafka_topics):
    kafka = kafka_topics
    request = long_request(new_id())
    async with running_worker(kafka, worker_settings(chunk_interval_ms=0), slow_engine(), max_num_seqs=8):
        async with LLMClient(kafka) as client:
            handle = await client.submit(request, priority=0)
            texts = []
            async for delta in handle.stream(timeout=30):
                texts.append(delta.text)
                if len(texts) == 3:
                    sent = time.monotonic()
                    await handle.cancel("enough")
                    await handle.cancel("twice is harmless")  # sent once
            final = await handle.result(timeout=5)
            latency_ms = (time.monotonic() - sent) * 1000
            assert (final.status, final.reason) == ("cancelled", "cancelled")
            assert final.text == "".join(texts) and instant_text(request).startswith(final.text)
            assert final.usage.completion_tokens == len(final.token_ids) >= 3
            assert "enough" in final.message and handle.cancel_requested
            assert client.num_in_flight == 0
            await client.cancel("never-sent")  # an unknown id: harmless, no error
    records = await read_topic(kafka, kafka.control_topic, 2)
    assert [decode_control(r.value).id for r in records] == [request.id, "never-sent"]
    assert records[0].key == request.id.encode()
    print(f"\nCANCEL-LATENCY client: handle.cancel() -> cancelled final {latency_ms:.0f} ms")


async def test_a_cancelled_waiting_task_sends_a_cancel(kafka_topics):
    kafka = kafka_topics
    request = long_request(new_id())
    async with running_worker(kafka, worker_settings(chunk_interval_ms=0), slow_engine(), max_num_seqs=8):
        async with LLMClient(kafka) as client:
            handle = await client.submit(request, priority=1)
            waiter = asyncio.create_task(handle.result(timeout=30))
            await asyncio.sleep(1.0)
            waiter.cancel()  # the caller gave up: cancel_on_abandon sends a cancel
            await asyncio.gather(waiter, return_exceptions=True)
            final = await handle.result(timeout=10)
            assert final.status == "cancelled" and 0 < final.usage.completion_tokens < request.max_new_tokens


async def test_generate_ctrl_c_cancels_prints_the_cancelled_final_and_exits_130(kafka_topics):
    kafka = kafka_topics
    request_id = new_id("gen-cancel")
    async with running_worker(kafka, worker_settings(chunk_interval_ms=0), slow_engine(), max_num_seqs=8):
        process = await asyncio.create_subprocess_exec(
            LLM_WORKER, "generate", "A long answer, please.", "--raw", "--max-new-tokens", "300", "--id", request_id,
            env=subprocess_env(kafka), cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out = b""
        async with asyncio.timeout(60):
            while out.count(b"<") < 3:  # some tokens printed: it streams
                out += await process.stdout.read(1)
        process.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(process.communicate(), 30)
    out += rest
    text, err = out.decode(), err.decode()
    assert process.returncode == 130, err
    expected = instant_text(long_request("x"))
    assert text.endswith("\n") and expected.startswith(text[:-1]) and len(text[:-1]) < len(expected)
    summary = err.strip().splitlines()[-1]
    assert summary.startswith(f"[{request_id}] cancelled (cancelled) · "), err
    assert "interrupted (Ctrl-C)" in summary and "[interrupted: cancelling the request]" in err
    tokens = int(summary.split(" · ")[1].split()[0])
    assert tokens == text.count("<")  # the whole text so far was printed, once
