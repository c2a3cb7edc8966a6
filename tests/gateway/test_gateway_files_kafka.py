"""The files and batches API against a real broker and a real worker (the instant engine, slowed so a batch
takes seconds): a chunked upload past the limit refused at once with the gateway's memory flat (the gateway a
process of its own, its RSS read from /proc), a batch that resumes after its gateway is SIGKILLed midway with
every line answered once, a batch cancelled through the SDK, file delete and list, batch list with
pagination, expiry bounds, quotas, and owners who see only their own files and batches."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from gateway.files import FRAMING_BYTES
from schemas.request import ChatMessage, GenerationRequest
from tests.client.helpers import instant_text, read_topic
from tests.gateway.test_gateway_kafka import RunningGateway, free_port
from tests.transport.kafka_helpers import REPO, running_worker, subprocess_env, worker_settings
from gateway.settings import GatewaySettings
from worker.kafka_settings import KafkaSettings
from worker.engine.instant import InstantEngine

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
MIB = 1 << 20


async def fresh_topics(bootstrap: str) -> tuple[KafkaSettings, str]:
    from worker.broker.topics import ensure_topics

    suffix = uuid.uuid4().hex[:10]
    prefix = f"test.replies.{suffix}."
    kafka = KafkaSettings(bootstrap_servers=bootstrap, request_topic=f"test.requests.{suffix}",
                          result_topic=f"test.results.{suffix}", dead_letter_topic=f"test.dead-letter.{suffix}",
                          status_topic=f"test.status.{suffix}", control_topic=f"test.control.{suffix}",
                          group_id=f"test-workers-{suffix}", allowed_reply_topic_prefixes=[prefix])
    await ensure_topics(kafka)
    return kafka, prefix


@contextlib.asynccontextmanager
async def slow_worker(bootstrap: str, step_s: float):
    """Fresh topics and an in-process worker on the instant engine with a step of `step_s` (a token a step)."""
    kafka, prefix = await fresh_topics(bootstrap)
    async with running_worker(kafka, worker_settings(), InstantEngine(max_num_seqs=32, step_time_s=step_s),
                              max_num_seqs=32):
        yield kafka, prefix


class GatewayProcess:
    """`llm-worker gateway` as a process of its own, so it can be SIGKILLed and its memory read."""

    def __init__(self, kafka: KafkaSettings, prefix: str, data_dir: Path, log: Path, instance_id: str,
                 **settings: str) -> None:
        self.port = free_port()
        self.env = subprocess_env(kafka)
        self.env.update({"GATEWAY_REPLY_TOPIC_PREFIX": prefix, "GATEWAY_DATA_DIR": str(data_dir),
                         **{f"GATEWAY_{k.upper()}": str(v) for k, v in settings.items()}})
        self.log, self.instance_id = log, instance_id
        self.process = None

    async def start(self) -> "GatewayProcess":
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker.cli", "gateway", "--port", str(self.port), "--instance-id",
            self.instance_id, env=self.env, cwd=str(REPO), stdout=open(self.log, "ab"),
            stderr=asyncio.subprocess.STDOUT)
        async with httpx.AsyncClient() as http, asyncio.timeout(60):
            while True:
                assert self.process.returncode is None, self.log.read_text()[-3000:]
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return self
                await asyncio.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def _status(self, field: str) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field}")

    def rss_bytes(self) -> int:
        return self._status("VmRSS")

    def reset_peak(self) -> None:
        """From now on VmHWM is the peak since this call (proc(5), clear_refs)."""
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")

    def peak_bytes(self) -> int:
        return self._status("VmHWM")

    async def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 30)
            except TimeoutError:
                await self.kill()


def batch_lines(n: int, max_tokens: int, tag: str) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"{tag} line {i}"}],
                 "max_tokens": max_tokens, "temperature": 0}}).encode() + b"\n" for i in range(n))


def expected(tag: str, i: int, max_tokens: int) -> str:
    request = GenerationRequest(id="x", messages=[ChatMessage(role="user", content=f"{tag} line {i}")],
                                max_new_tokens=max_tokens)
    return instant_text(request)


async def wait_batch(client: openai.AsyncOpenAI, batch_id: str, until, timeout_s: float = 120):
    async with asyncio.timeout(timeout_s):
        while not until(batch := await client.batches.retrieve(batch_id)):
            await asyncio.sleep(0.1)
    return batch


# -- uploads ----------------------------------------------------------------------------------------------
BOUNDARY = "gw-test-boundary-1b9c"
BLOCK = (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' * 14_000)[:MIB]


class ChunkedUpload:
    """A multipart upload sent with Transfer-Encoding: chunked over a raw socket (the SDK and httpx send a
    declared length), the answer read while the body still goes out."""

    def __init__(self, gateway: GatewayProcess, file_bytes: int) -> None:
        self.gateway, self.file_bytes = gateway, file_bytes
        self.sent_file = 0
        self.crossed_at: dict[int, float] = {}
        self.answered_at = None

    async def run(self, watch_limit: int | None = None) -> tuple[int, dict, float | None]:
        """(status, JSON answer, seconds from sending the file's byte `watch_limit` + 1 to the answer)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.gateway.port)
        head = (f"POST /v1/files HTTP/1.1\r\nhost: 127.0.0.1\r\ntransfer-encoding: chunked\r\n"
                f"content-type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n").encode()
        preamble = (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                    f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
                    "content-type: application/jsonl\r\n\r\n").encode()
        answer = asyncio.create_task(self._read_answer(reader))

        def chunk(data: bytes) -> bytes:
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        try:
            writer.write(head + chunk(preamble))
            while self.sent_file < self.file_bytes and not answer.done():
                piece = BLOCK[:min(MIB, self.file_bytes - self.sent_file)]
                writer.write(chunk(piece))
                await writer.drain()
                self.sent_file += len(piece)
                if watch_limit is not None and self.sent_file > watch_limit and not self.crossed_at:
                    self.crossed_at[watch_limit] = time.monotonic()
            if not answer.done():
                writer.write(chunk(f"\r\n--{BOUNDARY}--\r\n".encode()) + b"0\r\n\r\n")
                await writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            pass  # the gateway answered and closed the connection while the body was still coming
        status, body = await asyncio.wait_for(answer, 30)
        if status != 200:  # refused: the connection ends (EOF, or a reset for the body left unread)
            try:
                self.closed = await asyncio.wait_for(reader.read(), 5) == b""
            except ConnectionResetError:
                self.closed = True
            except TimeoutError:
                self.closed = False
        writer.close()
        since = self.answered_at - self.crossed_at[watch_limit] if watch_limit is not None else None
        return status, body, since

    async def _read_answer(self, reader: asyncio.StreamReader) -> tuple[int, dict]:
        head = await reader.readuntil(b"\r\n\r\n")
        self.answered_at = time.monotonic()
        length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
        return int(head[9:12]), json.loads(await reader.readexactly(length))


async def test_a_chunked_upload_past_the_limit_is_refused_at_once_and_memory_stays_flat(kafka_bootstrap, tmp_path):
    limit = 32 * MIB
    kafka, prefix = await fresh_topics(kafka_bootstrap)
    gateway = GatewayProcess(kafka, prefix, tmp_path / "data", tmp_path / "gateway.log", "files-rss",
                             max_upload_bytes=limit)
    await gateway.start()
    try:
        client = gateway.client()
        await client.files.create(file=("small.jsonl", batch_lines(3, 2, "s")), purpose="batch")  # warm up
        # Just under the limit: accepted whole, its content intact, without holding it in memory.
        before = gateway.rss_bytes()
        gateway.reset_peak()
        status, body, _ = await ChunkedUpload(gateway, 30 * MIB).run()
        assert status == 200 and body["bytes"] == 30 * MIB, body
        grown = gateway.peak_bytes() - before
        assert grown < 20 * MIB, f"the gateway grew {grown / MIB:.1f} MiB over a 30 MiB upload"
        digest = hashlib.sha256()
        async with httpx.AsyncClient(timeout=60) as http, \
                http.stream("GET", f"{gateway.url}/v1/files/{body['id']}/content") as download:
            async for piece in download.aiter_bytes():
                digest.update(piece)
        assert digest.hexdigest() == hashlib.sha256(BLOCK * 30).hexdigest()

        # 200 MiB, chunked: refused with OpenAI's error within a second of passing the limit, the rest unread.
        before = gateway.rss_bytes()
        gateway.reset_peak()
        too_big = ChunkedUpload(gateway, 200 * MIB)
        status, body, since = await too_big.run(watch_limit=limit)
        assert status == 413 and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["code"] == "file_too_large"
        assert since < 1.0, f"the 413 came {since:.2f} s after the limit was passed"
        assert too_big.sent_file < limit + FRAMING_BYTES + 24 * MIB, "the gateway read on past the limit"
        assert too_big.closed
        grown_refused = gateway.peak_bytes() - before
        print(f"30 MiB accepted: peak +{grown / MIB:.1f} MiB; 200 MiB refused after {too_big.sent_file / MIB:.0f} "
              f"MiB sent, {since * 1000:.0f} ms after the limit, peak +{grown_refused / MIB:.1f} MiB")
        assert grown_refused < 20 * MIB, f"the gateway grew {grown_refused / MIB:.1f} MiB over a refused upload"
        listed = await client.files.list()
        assert sorted(f.bytes for f in listed.data) == sorted([30 * MIB, len(batch_lines(3, 2, "s"))])
        assert not [p for p in (tmp_path / "data" / "files").iterdir() if p.name.startswith(".upload")]
    finally:
        await gateway.stop()


# -- batches ----------------------------------------------------------------------------------------------
async def test_a_batch_resumes_after_its_gateway_is_killed_and_answers_every_line_once(kafka_bootstrap, tmp_path):
    num, max_tokens = 60, 8
    async with slow_worker(kafka_bootstrap, step_s=0.03) as (kafka, prefix):
        def gateway() -> GatewayProcess:
            return GatewayProcess(kafka, prefix, tmp_path / "data", tmp_path / "gateway.log", "files-resume",
                                  batch_concurrency=4)

        first = await gateway().start()
        client = first.client()
        uploaded = await client.files.create(file=("in.jsonl", batch_lines(num, max_tokens, "r")), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        await wait_batch(client, batch.id, lambda b: b.request_counts.completed >= num // 4)
        await first.kill()
        on_disk = tmp_path / "data" / "batches" / batch.id / "output.jsonl"
        written = on_disk.read_bytes().count(b"\n") if on_disk.exists() else 0
        assert written < num, "the kill came after the batch had ended"

        second = await gateway().start()
        try:
            client = second.client()
            done = await wait_batch(client, batch.id, lambda b: b.status in ("completed", "failed", "cancelled"))
            assert done.status == "completed" and done.error_file_id is None, done
            assert (done.request_counts.total, done.request_counts.completed) == (num, num)
            output = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
        finally:
            await second.stop()
    ids = [line["custom_id"] for line in output]
    assert sorted(ids) == sorted(f"r{i}" for i in range(num)), "a line missing or answered twice"
    for line in output:
        i = int(line["custom_id"][1:])
        assert line["response"]["body"]["choices"][0]["message"]["content"] == expected("r", i, max_tokens)


async def test_a_batch_cancelled_through_the_sdk_keeps_what_was_done_and_runs_no_more(kafka_bootstrap, tmp_path):
    num, max_tokens, concurrency = 40, 20, 2
    async with slow_worker(kafka_bootstrap, step_s=0.03) as (kafka, prefix):
        settings = GatewaySettings(reply_topic_prefix=prefix, data_dir=tmp_path / "data",
                                   batch_concurrency=concurrency)
        async with RunningGateway(kafka, settings) as gateway:
            client = gateway.client()
            uploaded = await client.files.create(file=("in.jsonl", batch_lines(num, max_tokens, "k")),
                                                 purpose="batch")
            batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            await wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 3)
            cancelling = await client.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled")
            done = await wait_batch(client, batch.id, lambda b: b.status not in ("in_progress", "cancelling"), 30)
            assert done.status == "cancelled" and done.cancelled_at is not None
            output = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
            assert len(output) == done.request_counts.completed >= 3
            for line in output:
                assert line["response"]["body"]["choices"][0]["message"]["content"] == \
                    expected("k", int(line["custom_id"][1:]), max_tokens)
            with pytest.raises(openai.ConflictError):  # it has ended
                await client.batches.cancel(batch.id)
        # The rest never ran: no more requests than those answered and those in flight at the cancel.
        await asyncio.sleep(1.0)
        sent = await read_topic(kafka, kafka.request_topic, 10_000, timeout_s=3)
        lines_sent = {r.key.decode().split("-")[1] for r in sent}
        assert len(lines_sent) <= len(output) + 2 * concurrency < num


async def test_files_delete_list_expiry_and_batch_list_through_the_sdk(kafka_bootstrap, tmp_path):
    async with slow_worker(kafka_bootstrap, step_s=0.05) as (kafka, prefix):
        settings = GatewaySettings(reply_topic_prefix=prefix, data_dir=tmp_path / "data", batch_concurrency=1)
        async with RunningGateway(kafka, settings) as gateway:
            client = gateway.client()
            data = batch_lines(5, 30, "l")
            plain = await client.files.create(file=("a.jsonl", data), purpose="batch")
            hour = await client.files.create(file=("b.jsonl", data), purpose="batch",
                                              expires_after={"anchor": "created_at", "seconds": 3600})
            assert plain.expires_at == plain.created_at + 30 * 24 * 3600
            assert hour.expires_at == hour.created_at + 3600
            for seconds in (60, 40 * 24 * 3600):
                with pytest.raises(openai.BadRequestError) as info:
                    await client.files.create(file=("c.jsonl", data), purpose="batch",
                                              expires_after={"anchor": "created_at", "seconds": seconds})
                assert info.value.param == "expires_after.seconds"
            listed = [f.id async for f in client.files.list()]
            assert listed == [hour.id, plain.id]  # newest first

            deleted = await client.files.delete(plain.id)
            assert deleted.deleted and deleted.id == plain.id
            for call in (client.files.retrieve, client.files.content, client.files.delete):
                with pytest.raises(openai.NotFoundError):
                    await call(plain.id)
            assert [f.id async for f in client.files.list()] == [hour.id]

            batches = [await client.batches.create(input_file_id=hour.id, endpoint="/v1/chat/completions",
                                                   completion_window="24h",
                                                   output_expires_after={"anchor": "created_at", "seconds": 7200})
                       for _ in range(3)]
            with pytest.raises(openai.ConflictError) as info:  # a running batch still reads it
                await client.files.delete(hour.id)
            assert info.value.code == "file_in_use" and any(b.id in str(info.value) for b in batches)
            first_page = await client.batches.list(limit=2)
            assert [b.id for b in first_page.data] == [batches[2].id, batches[1].id] and first_page.has_more
            assert [b.id async for b in client.batches.list(limit=2)] == [b.id for b in reversed(batches)]
            for batch in batches:
                await client.batches.cancel(batch.id)
            for batch in batches:
                done = await wait_batch(client, batch.id, lambda b: b.status == "cancelled", 30)
                output = await client.files.retrieve(done.output_file_id)
                assert output.purpose == "batch_output" and output.expires_at == output.created_at + 7200
            assert (await client.files.delete(hour.id)).deleted


async def test_quotas_and_owners_over_http(kafka_bootstrap, tmp_path):
    async with slow_worker(kafka_bootstrap, step_s=0.05) as (kafka, prefix):
        settings = GatewaySettings(reply_topic_prefix=prefix, data_dir=tmp_path / "data", max_files_per_owner=2,
                                   max_active_batches_per_owner=1, batch_concurrency=1)
        async with RunningGateway(kafka, settings) as gateway:
            # Until requests carry keys every request is "anonymous"; here a header names the owner.
            gateway.gateway._owner = lambda request: request.headers.get("x-test-owner", "anonymous")

            def as_owner(owner: str) -> openai.AsyncOpenAI:
                return gateway.client().with_options(default_headers={"x-test-owner": owner})

            alice, bob = as_owner("alice"), as_owner("bob")
            data = batch_lines(4, 30, "q")
            mine = await alice.files.create(file=("a.jsonl", data), purpose="batch")
            await alice.files.create(file=("b.jsonl", data), purpose="batch")
            with pytest.raises(openai.RateLimitError) as info:
                await alice.files.create(file=("c.jsonl", data), purpose="batch")
            assert info.value.code == "too_many_files"
            theirs = await bob.files.create(file=("a.jsonl", data), purpose="batch")

            for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
                with pytest.raises(openai.NotFoundError):
                    await call(mine.id)
            assert [f.id async for f in bob.files.list()] == [theirs.id]
            with pytest.raises(openai.NotFoundError):
                await bob.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")

            running = await alice.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h")
            with pytest.raises(openai.RateLimitError) as info:
                await alice.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
            assert info.value.code == "too_many_active_batches"
            other = await bob.batches.create(input_file_id=theirs.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")
            for call in (bob.batches.retrieve, bob.batches.cancel):
                with pytest.raises(openai.NotFoundError):
                    await call(running.id)
            assert [b.id async for b in bob.batches.list()] == [other.id]
            assert [b.id async for b in alice.batches.list()] == [running.id]
            for client, batch in ((alice, running), (bob, other)):
                await client.batches.cancel(batch.id)
                await wait_batch(client, batch.id, lambda b: b.status == "cancelled", 30)
