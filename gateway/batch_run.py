"""One batch: OpenAI's batch JSONL in, one answer line per `custom_id` out, resumable.

Input lines: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}. Answers go to the output file ({"id", "custom_id", "response": {"status_code": 200,
"request_id", "body"}, "error": null}) or to the error file (a request refused: its status code and OpenAI's
error body; a line that is not a request at all: "response": null and an "error" object). A line that cannot
be served never reaches Kafka.

The two files are the state: a run first reads them, cuts a last line that a crash left half-written, and sends
only the `custom_id`s that have no answer yet; an answer is written once (a redelivered or late answer to an id
already written is dropped). Lines are appended as answers come (from a thread, off the event loop), so a
kill loses at most the requests in flight and the few answers not yet written, which the next run sends
again. Requests go at the least urgent priority by default, wait (not fail) while the workers report that
priority shed or paused, and are sent again when a worker sheds one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from gateway.openai_api import ENDPOINTS, ApiError, Tiers, TokenText, completion_body, final_error, now_s, to_request
from llm_client import ClientError, LLMClient

log = logging.getLogger(__name__)

MAX_SENDS = 8
"""A request shed this many times ends in the error file (shedding at the bulk priority is off by default)."""
CONGESTED_POLL_S = 1.0


@dataclass(slots=True, frozen=True)
class BatchLine:
    number: int
    """1-based line number in the input file."""
    custom_id: str
    url: str
    body: dict


def answer_key(custom_id: str | None, number: int) -> str:
    """What an answer line is known by: its custom_id, or its line number for a line without one."""
    return custom_id if custom_id is not None else f"#line{number}"


ParsedInput = tuple[list[BatchLine], list[tuple[str, dict]]]


def parse_input(data: bytes, endpoint: str | None = None) -> ParsedInput:
    """(the requests, (key, error line) for each line that is not one). Blank lines are skipped."""
    lines: list[BatchLine] = []
    errors: list[tuple[str, dict]] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        custom_id = None
        try:
            item = msgspec.json.decode(raw)
            if not isinstance(item, dict):
                raise ValueError("a line must be a JSON object")
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                custom_id = None
                raise ValueError("custom_id must be a non-empty string")
            if custom_id in seen:
                raise ValueError(f"custom_id {custom_id!r} appears more than once")
            if item.get("method", "POST") != "POST":
                raise ValueError("method must be POST")
            url = item.get("url")
            if url not in ENDPOINTS or (endpoint is not None and url != endpoint):
                raise ValueError(f"url must be {endpoint or ' or '.join(ENDPOINTS)}, got {url!r}")
            if not isinstance(item.get("body"), dict):
                raise ValueError("body must be an object")
        except (msgspec.DecodeError, ValueError) as exc:
            code = "invalid_json" if isinstance(exc, msgspec.DecodeError) else "invalid_request"
            key = answer_key(custom_id if custom_id not in seen else None, number)
            errors.append((key, {"id": f"batch_req_line{number}", "custom_id": custom_id, "response": None,
                                 "error": {"code": code, "message": str(exc), "line": number}}))
            continue
        seen.add(custom_id)
        lines.append(BatchLine(number, custom_id, url, item["body"]))
    return lines, errors


class AnswerFile:
    """An append-only JSONL file of answers, keyed by custom_id (or #line<n>).

    `open` reads the file (run it in a thread); `write` decides at once whether an answer is new and queues
    it, and one writer task appends what is queued from a thread, so the event loop never waits on the disk.
    A kill loses at most the queued lines, whose requests the next run sends again."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.keys: set[str] = set()
        self.num_lines = 0
        self._file = None
        self._queued: list[bytes] = []
        self._writer: asyncio.Task | None = None
        self._failure: BaseException | None = None

    def open(self) -> "AnswerFile":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            data = self.path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end < len(data):  # a line cut by a crash: its request is sent again
                with open(self.path, "r+b") as f:
                    f.truncate(end)
            for raw in data[:end].splitlines():
                try:
                    item = msgspec.json.decode(raw)
                    error = item.get("error") or {}
                    self.keys.add(answer_key(item.get("custom_id"), error.get("line", 0)))
                    self.num_lines += 1
                except (msgspec.DecodeError, AttributeError):
                    log.warning("%s: an unreadable answer line is ignored", self.path)
        self._file = open(self.path, "ab")
        return self

    def write(self, key: str, line: dict) -> bool:
        """Queue the answer unless one is there already; True if queued. Called on the event loop."""
        if self._failure is not None:
            raise OSError(f"cannot write {self.path}: {self._failure!r}")
        if key in self.keys:
            return False
        self.keys.add(key)
        self._queued.append(msgspec.json.encode(line) + b"\n")
        self.num_lines += 1
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_queued())
        return True

    async def _write_queued(self) -> None:
        try:
            while self._queued:
                lines, self._queued = self._queued, []
                await asyncio.to_thread(self._append, lines)
        except Exception as exc:  # noqa: BLE001 - kept for the next write and close, which raise it
            log.error("cannot write %s: %r", self.path, exc)
            self._failure = exc

    def _append(self, lines: list[bytes]) -> None:
        self._file.writelines(lines)
        self._file.flush()

    async def drain(self) -> None:
        """Returns once every queued answer is in the file."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)
        if self._failure is not None:
            raise OSError(f"cannot write {self.path}: {self._failure!r}")

    async def close(self) -> None:
        try:
            await self.drain()
        finally:
            if self._file is not None:
                await asyncio.to_thread(self._sync_and_close, self._file)
                self._file = None

    @staticmethod
    def _sync_and_close(file) -> None:
        file.flush()
        os.fsync(file.fileno())
        file.close()


@dataclass(slots=True)
class Progress:
    total: int
    done_before: int = 0
    """Answered by earlier runs."""
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> int:
        return self.done_before + self.completed + self.failed

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def eta_s(self) -> float | None:
        done_now = self.completed + self.failed
        if done_now == 0:
            return None
        return (self.total - self.done) * self.elapsed_s / done_now


@dataclass(slots=True)
class Translator:
    """What turning a body into a request needs: the served models, the tier map, token text for logprobs."""

    models: list[str]
    tiers: Tiers
    tokens: TokenText


class BatchRunner:
    def __init__(self, client: LLMClient, translator: Translator, parsed: ParsedInput, output: AnswerFile,
                 errors: AnswerFile, *, priority: int, concurrency: int,
                 on_progress: Callable[[Progress], None] = lambda progress: None,
                 refusal: Callable[[int], tuple[str, int] | None] = lambda priority: None,
                 wait_s: float = 24 * 3600.0, tenant: str | None = None) -> None:
        """parsed: parse_input's answer (a large file takes a while: run it in a thread); refusal(priority):
        (why, seconds to wait) while the workers report the priority shed or paused; wait_s: how long one
        request may wait for its answer (a batch's requests queue behind everything)."""
        self.client = client
        self.translator = translator
        self.lines, self.bad_lines = parsed
        self.output, self.errors = output, errors
        self.priority = priority
        self.concurrency = concurrency
        self.on_progress = on_progress
        self.refusal = refusal
        self.wait_s = wait_s
        self.tenant = tenant
        self.run_tag = f"b{uuid.uuid4().hex[:10]}"
        self.progress = Progress(total=len(self.lines) + len(self.bad_lines))
        self._cancelled = False
        self._tasks: set[asyncio.Task] = set()

    def _answered(self, key: str) -> bool:
        return key in self.output.keys or key in self.errors.keys

    async def run(self) -> Progress:
        pending = [line for line in self.lines if not self._answered(line.custom_id)]
        self.progress.done_before = self.progress.total - len(pending) - sum(
            not self._answered(key) for key, _ in self.bad_lines)
        for key, line in self.bad_lines:
            if self.errors.write(key, line):
                self.progress.failed += 1
        self.on_progress(self.progress)
        slots = asyncio.Semaphore(self.concurrency)
        try:
            for line in pending:
                await slots.acquire()
                if self._cancelled:
                    slots.release()
                    break
                task = asyncio.create_task(self._serve(line))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                # Not in _serve's finally: a task cancelled before its first step never runs that, and its
                # slot would be lost with the loop above waiting for it.
                task.add_done_callback(lambda _: slots.release())
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        finally:
            for task in list(self._tasks):
                task.cancel()  # a handle cancelled while waiting sends a cancel record for its request
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        return self.progress

    def cancel(self) -> None:
        """Send nothing more, and cancel what is in flight (their requests get cancel records)."""
        self._cancelled = True
        for task in list(self._tasks):
            task.cancel()

    async def _serve(self, line: BatchLine) -> None:
        try:
            for send in range(MAX_SENDS):
                request_id = f"{self.run_tag}-{line.number}-{send}"
                try:
                    request, priority, options = to_request(line.body, line.url, request_id, self.translator.models,
                                                            self.translator.tiers, tenant=self.tenant)
                except ApiError as error:
                    self._fail(line, request_id, error)
                    return
                # Batches ride at the batch priority whatever the body says.
                priority = self.priority
                request = msgspec.structs.replace(request, stream=False, priority=priority)
                while (refused := self.refusal(priority)) is not None and not self._cancelled:
                    await asyncio.sleep(min(refused[1], CONGESTED_POLL_S * 5))
                handle = await self.client.submit(request, priority, timeout_s=self.wait_s)
                final = await handle.result()
                if final.status == "completed":
                    completions = await handle.completions()
                    body = completion_body(options, request_id, now_s(), final, completions, self.translator.tokens)
                    if self.output.write(line.custom_id, {
                            "id": f"batch_req_{request_id}", "custom_id": line.custom_id,
                            "response": {"status_code": 200, "request_id": request_id, "body": body},
                            "error": None}):
                        self.progress.completed += 1
                        self.progress.output_tokens += final.usage.completion_tokens
                    return
                if final.status == "rejected" and final.reason != "deadline":
                    await asyncio.sleep(min(2.0 ** send * 0.1, 5.0))
                    continue
                self._fail(line, request_id, final_error(final))
                return
            self._fail(line, request_id, ApiError(429, f"shed {MAX_SENDS} times", "rate_limit_error",
                                                  "rate_limit_exceeded"))
        except ClientError as exc:
            self._fail(line, f"{self.run_tag}-{line.number}", ApiError(500, str(exc), "server_error"))
        finally:
            self.on_progress(self.progress)

    def _fail(self, line: BatchLine, request_id: str, error: ApiError) -> None:
        if self.errors.write(line.custom_id, {
                "id": f"batch_req_{request_id}", "custom_id": line.custom_id,
                "response": {"status_code": error.status, "request_id": request_id, "body": error.body()},
                "error": None}):
            self.progress.failed += 1
