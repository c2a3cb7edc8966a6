"""OpenAI's Batch API on disk: batch jobs, each running the lines of an uploaded file through the workers.

Layout under GATEWAY_DATA_DIR: `batches/<batch id>/batch.json` (the batch object, with its owner),
`output.jsonl`, `errors.jsonl`. A batch's progress is its two answer files (batch_run.py), so a gateway that
restarts resumes every batch that was validating, in progress or finalizing, sending only the lines without an
answer; a batch that was cancelling ends cancelled.

The batch objects are held in memory (loaded once at start; `GET` shows live counts) and written through one
thread of their own, in order, so the event loop never waits on the disk and an older state never overwrites
a newer one. A batch belongs to its owner: another is told it does not exist, and each owner has at most
GATEWAY_MAX_ACTIVE_BATCHES_PER_OWNER batches not yet ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from gateway.batch_run import AnswerFile, BatchRunner, Translator, parse_input
from gateway.files import (ANONYMOUS, DEFAULT_EXPIRY_S, FileStore, expiry_seconds, not_found, page, public,
                           quota_exceeded, sort_key, write_json)
from gateway.openai_api import ENDPOINTS, ApiError, bad_request
from llm_client import LLMClient

log = logging.getLogger(__name__)

COMPLETION_WINDOW = "24h"
PROGRESS_SAVE_S = 1.0
ACTIVE = ("validating", "in_progress", "finalizing")
UNFINISHED = (*ACTIVE, "cancelling")
"""A batch in one of these still runs (or is winding down) and still reads its input file."""


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


class BatchJobs:
    def __init__(self, root: Path, files: FileStore, client: LLMClient, translator: Translator, *, priority: int,
                 concurrency: int, max_lines: int, refusal, max_active_per_owner: int = 10,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root) / "batches"
        self.files = files
        files.in_use = self.reading
        self.client = client
        self.translator = translator
        self.priority = priority
        self.concurrency = concurrency
        self.max_lines = max_lines
        self.refusal = refusal
        self.max_active_per_owner = max_active_per_owner
        self.clock = clock
        self._batches: dict[str, dict] = {}
        self._runners: dict[str, BatchRunner] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="batch-objects")
        self._pending_saves: set[asyncio.Future] = set()
        self.notify: Callable[[dict], Awaitable[None]] | None = None
        """Told of each batch that ends (completed, failed, cancelled), once its state is saved: webhooks."""

    # -- disk -------------------------------------------------------------------------------------------
    def _dir(self, batch_id: str) -> Path:
        return self.root / Path(batch_id).name

    def _save_soon(self, batch: dict) -> asyncio.Future:
        """Writes the batch as it is now; writes happen in the order asked for."""
        data = msgspec.json.encode(batch)
        future = asyncio.get_running_loop().run_in_executor(self._disk, write_json, self._dir(batch["id"])
                                                            / "batch.json", data)
        self._pending_saves.add(future)
        future.add_done_callback(self._saved)
        return future

    def _saved(self, future: asyncio.Future) -> None:
        self._pending_saves.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("cannot save a batch object: %r", future.exception())

    async def _save(self, batch: dict) -> None:
        await self._save_soon(batch)

    def _read_all(self) -> list[dict]:
        self.root.mkdir(parents=True, exist_ok=True)
        batches = []
        for path in self.root.glob("*/batch.json"):
            try:
                batch = msgspec.json.decode(path.read_bytes())
            except (OSError, msgspec.DecodeError):
                log.warning("%s: an unreadable batch object is skipped", path)
                continue
            batch.setdefault("owner", ANONYMOUS)
            batches.append(batch)
        return batches

    # -- lookups ----------------------------------------------------------------------------------------
    def _record(self, batch_id: str, owner: str) -> dict:
        batch = self._batches.get(batch_id)
        if batch is None or batch["owner"] != owner:
            raise not_found("batch", batch_id)
        return batch

    def get(self, batch_id: str, owner: str) -> dict:
        return public(self._record(batch_id, owner))

    def list(self, owner: str, *, after: str | None = None, limit: int = 20) -> dict:
        """Newest first, as OpenAI lists batches."""
        mine = sorted((b for b in self._batches.values() if b["owner"] == owner), key=sort_key, reverse=True)
        return page(mine, after, limit, "batch")

    def reading(self, file_id: str) -> dict | None:
        """The unfinished batch that reads `file_id` as its input, if any."""
        return next((b for b in self._batches.values() if b["input_file_id"] == file_id
                     and b["status"] in UNFINISHED), None)

    def num_active(self, owner: str) -> int:
        return sum(1 for b in self._batches.values() if b["owner"] == owner and b["status"] in UNFINISHED)

    def _check_quota(self, owner: str) -> None:
        if self.num_active(owner) >= self.max_active_per_owner:
            raise quota_exceeded(f"owner {owner} has {self.max_active_per_owner} batches running, the most allowed "
                                 "(GATEWAY_MAX_ACTIVE_BATCHES_PER_OWNER); wait for one to end or cancel one",
                                 "too_many_active_batches")

    # -- create and cancel ------------------------------------------------------------------------------
    async def create(self, body: dict, owner: str, tenant: str | None = None) -> dict:
        """tenant: its requests' (the owner's key's), kept with the batch so that a resumed batch keeps it."""
        input_file_id = body.get("input_file_id")
        endpoint = body.get("endpoint")
        if not isinstance(input_file_id, str):
            raise bad_request("input_file_id is required", "input_file_id")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.get("completion_window", COMPLETION_WINDOW) != COMPLETION_WINDOW:
            raise bad_request(f"completion_window must be {COMPLETION_WINDOW}", "completion_window")
        output_expires_in = DEFAULT_EXPIRY_S
        if (policy := body.get("output_expires_after")) is not None:
            if not isinstance(policy, dict):
                raise bad_request("output_expires_after must be an object", "output_expires_after")
            output_expires_in = expiry_seconds(policy.get("anchor"), policy.get("seconds"), "output_expires_after")
        self._check_quota(owner)
        meta = self.files.get(input_file_id, owner)
        if meta["purpose"] != "batch":
            raise bad_request(f"file {input_file_id} has purpose {meta['purpose']!r}, not 'batch'", "input_file_id")
        num_lines = await asyncio.to_thread(count_lines, self.files.content_path(input_file_id, owner))
        if num_lines > self.max_lines:
            raise bad_request(f"the file has {num_lines} requests, the limit is {self.max_lines}", "input_file_id")
        # Again, now that nothing else can run before the batch is recorded: the file may have been deleted and
        # other batches created meanwhile.
        self.files.get(input_file_id, owner)
        self._check_quota(owner)
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        now = int(self.clock())
        batch = {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": COMPLETION_WINDOW, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": num_lines, "completed": 0, "failed": 0},
                 "metadata": body.get("metadata"), "owner": owner, "tenant": tenant, "created_ns": time.time_ns(),
                 "output_expires_in": output_expires_in}
        self._batches[batch_id] = batch
        try:
            await asyncio.get_running_loop().run_in_executor(self._disk, self._dir(batch_id).mkdir)
            await self._save(batch)
        except BaseException:
            self._batches.pop(batch_id, None)
            raise
        self._start(batch)
        return public(batch)

    async def cancel(self, batch_id: str, owner: str) -> dict:
        batch = self._record(batch_id, owner)
        if batch["status"] not in ACTIVE:
            raise ApiError(409, f"batch {batch_id} is {batch['status']}; it cannot be cancelled",
                           code="batch_not_cancellable")
        batch.update(status="cancelling", cancelling_at=int(self.clock()))
        runner = self._runners.get(batch_id)
        if runner is not None:
            runner.cancel()
        await self._save(batch)
        return public(batch)

    # -- running ----------------------------------------------------------------------------------------
    async def load(self) -> None:
        """At start: read every batch, pick up every one that was running."""
        for batch in await asyncio.to_thread(self._read_all):
            self._batches[batch["id"]] = batch
        for batch in list(self._batches.values()):
            if batch["status"] in ACTIVE:
                log.info("resuming %s", batch["id"])
                self._start(batch)
            elif batch["status"] == "cancelling":
                await self._finish(batch, "cancelled")

    def _start(self, batch: dict) -> None:
        self._tasks[batch["id"]] = asyncio.create_task(self._run(batch), name=f"batch-{batch['id']}")

    async def _run(self, batch: dict) -> None:
        folder = self._dir(batch["id"])
        output = errors = None
        last_save = [0.0]

        def on_progress(progress) -> None:
            batch["request_counts"].update(completed=output.num_lines, failed=errors.num_lines)
            if time.monotonic() - last_save[0] >= PROGRESS_SAVE_S:
                last_save[0] = time.monotonic()
                self._save_soon(batch)

        try:
            output = await asyncio.to_thread(AnswerFile(folder / "output.jsonl").open)
            errors = await asyncio.to_thread(AnswerFile(folder / "errors.jsonl").open)
            path = self.files.content_path(batch["input_file_id"])
            parsed = await asyncio.to_thread(lambda: parse_input(path.read_bytes(), batch["endpoint"]))
            runner = BatchRunner(self.client, self.translator, parsed, output, errors, priority=self.priority,
                                 concurrency=self.concurrency, on_progress=on_progress, refusal=self.refusal,
                                 tenant=batch.get("tenant"))
            self._runners[batch["id"]] = runner
            if batch["status"] == "cancelling":
                runner.cancel()  # cancelled while its file was read: it sends nothing
            else:
                batch.update(status="in_progress", in_progress_at=batch["in_progress_at"] or int(self.clock()))
            batch["request_counts"]["total"] = runner.progress.total
            await self._save(batch)
            await runner.run()
            self._runners.pop(batch["id"], None)
            await output.close()
            await errors.close()
            batch["request_counts"].update(completed=output.num_lines, failed=errors.num_lines)
            await self._finish(batch, "cancelled" if batch["status"] == "cancelling" else "completed")
        except asyncio.CancelledError:
            raise  # the gateway is stopping: the batch stays in progress and resumes at the next start
        except Exception as exc:
            log.exception("batch %s failed", batch["id"])
            batch.update(status="failed", failed_at=int(self.clock()),
                         errors={"object": "list", "data": [{"code": "internal", "message": str(exc)}]})
            await self._save(batch)
            await self._notify(batch)
        finally:
            self._runners.pop(batch["id"], None)
            for answers in (output, errors):
                if answers is not None:
                    try:
                        await answers.close()
                    except OSError as exc:
                        log.error("batch %s: %r", batch["id"], exc)

    async def _finish(self, batch: dict, status: str) -> None:
        folder = self._dir(batch["id"])
        now = int(self.clock())
        batch["finalizing_at"] = batch["finalizing_at"] or now
        expires_in = batch.get("output_expires_in", DEFAULT_EXPIRY_S)
        owner = batch["owner"]
        # A batch cancelled before it ran has answered nothing, and still has an (empty) output file.
        await asyncio.to_thread((folder / "output.jsonl").touch)
        output = await self.files.register(f"file-{batch['id']}-output", folder / "output.jsonl", "output.jsonl",
                                           owner, expires_in)
        batch["output_file_id"] = output["id"]
        errors = folder / "errors.jsonl"
        if await asyncio.to_thread(lambda: errors.exists() and errors.stat().st_size > 0):
            batch["error_file_id"] = (await self.files.register(f"file-{batch['id']}-errors", errors, "errors.jsonl",
                                                                owner, expires_in))["id"]
        batch.update(status=status, **{f"{status}_at": now})
        await self._save(batch)
        await self._notify(batch)

    async def _notify(self, batch: dict) -> None:
        if self.notify is not None:
            try:
                await self.notify(batch)
            except Exception:  # the batch has ended whatever its event does
                log.exception("batch %s: its webhook event could not be queued", batch["id"])

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._pending_saves:
            await asyncio.gather(*list(self._pending_saves), return_exceptions=True)
        await asyncio.to_thread(self._disk.shutdown)
