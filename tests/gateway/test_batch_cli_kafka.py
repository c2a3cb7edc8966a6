"""`llm-worker batch run` as a subprocess against a real broker and a worker on the instant engine: killed
(SIGKILL) midway, then run again; every custom_id ends with exactly one answer, and each answer is what the
engine gives its prompt. A malformed line goes to the error file and never reaches Kafka."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import uuid

import pytest

from tests.client.helpers import instant_text
from tests.transport.kafka_helpers import REPO, running_worker, subprocess_env, worker_settings
from schemas.request import ChatMessage, GenerationRequest
from worker.kafka_settings import KafkaSettings
from worker.engine.instant import InstantEngine

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

NUM_LINES = 300
MAX_TOKENS = 6


def batch_line(i: int) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": f"line {i}"}],
                     "max_tokens": MAX_TOKENS, "temperature": 0}}


async def run_cli(kafka: KafkaSettings, prefix: str, *args: str, kill_when=None) -> int:
    env = subprocess_env(kafka)
    env.update({"GATEWAY_REPLY_TOPIC_PREFIX": prefix})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker.cli", "batch", "run", *args, "--concurrency", "16", env=env, cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    if kill_when is not None:
        async with asyncio.timeout(120):
            while not kill_when():
                if process.returncode is not None:
                    break
                await asyncio.sleep(0.05)
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
    _, stderr = await asyncio.wait_for(process.communicate(), 180)
    run_cli.stderr = stderr.decode()
    return process.returncode


async def test_a_batch_killed_midway_resumes_without_gaps_or_duplicates(kafka_bootstrap, tmp_path):
    from worker.broker.topics import ensure_topics

    suffix = uuid.uuid4().hex[:10]
    prefix = f"test.replies.{suffix}."
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, request_topic=f"test.requests.{suffix}",
                          result_topic=f"test.results.{suffix}", dead_letter_topic=f"test.dead-letter.{suffix}",
                          status_topic=f"test.status.{suffix}", control_topic=f"test.control.{suffix}",
                          group_id=f"test-workers-{suffix}", allowed_reply_topic_prefixes=[prefix])
    await ensure_topics(kafka)
    source = tmp_path / "in.jsonl"
    lines = [json.dumps(batch_line(i)) for i in range(NUM_LINES)]
    lines.insert(7, "{not json")
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"

    def num_answers() -> int:
        return output.read_bytes().count(b"\n") if output.exists() else 0

    # A slow engine (a step of 20 ms) so that the kill lands midway.
    async with running_worker(kafka, worker_settings(), InstantEngine(max_num_seqs=16, step_time_s=0.02),
                              max_num_seqs=16):
        code = await run_cli(kafka, prefix, str(source), "--output", str(output),
                             kill_when=lambda: num_answers() >= NUM_LINES // 3)
        assert code == -signal.SIGKILL, run_cli.stderr
        answered_first = num_answers()
        assert 0 < answered_first < NUM_LINES
        code = await run_cli(kafka, prefix, str(source), "--output", str(output), "--quiet")
        assert code == 0, run_cli.stderr
        assert "answered before this run" in run_cli.stderr

    answers = [json.loads(x) for x in output.read_text().splitlines()]
    ids = [a["custom_id"] for a in answers]
    assert len(ids) == len(set(ids)) == NUM_LINES  # 0 missing, 0 duplicates
    for answer in answers:
        i = int(answer["custom_id"][1:])
        request = GenerationRequest(id="x", messages=[ChatMessage(role="user", content=f"line {i}")],
                                    max_new_tokens=MAX_TOKENS)
        assert answer["response"]["body"]["choices"][0]["message"]["content"] == instant_text(request)
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json" and errors[0]["error"]["line"] == 8
