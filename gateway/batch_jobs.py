"""OpenAI's Files and Batch APIs on disk: uploaded batch files, batch jobs and their output and error files.

Layout under GATEWAY_DATA_DIR: `files/<file id>.json` (the file object) beside `files/<file id>.jsonl` (an
upload), and `batches/<batch id>/batch.json` (the batch object), `output.jsonl`, `errors.jsonl`. A batch's
progress is its two answer files (batch_run.py), so a gateway that restarts resumes every batch that was
validating, in progress or finalizing, sending only the lines without an answer; a batch that was cancelling
ends cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from pathlib import Path

import msgspec

from gateway.batch_run import AnswerFile, BatchRunner, Progress, Translator, parse_input
from gateway.openai_api import ENDPOINTS, ApiError, bad_request
from producer_examples.client import LLMClient

log = logging.getLogger(__name__)

COMPLETION_WINDOW = "24h"
PROGRESS_SAVE_S = 1.0
ACTIVE = ("validating", "in_progress", "finalizing")


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(value))
    os.replace(tmp, path)  # a reader never sees half a file, a crash never leaves one


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"No such {what}: {ident}", code="not_found", param="id")


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "files"
        self.root.mkdir(parents=True, exist_ok=True)

    def create(self, data: bytes, filename: str, purpose: str) -> dict:
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        (self.root / f"{file_id}.jsonl").write_bytes(data)
        meta = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
                "status_details": None}
        _write_json(self.root / f"{file_id}.json", meta)
        return meta

    def register(self, file_id: str, path: Path, filename: str, purpose: str = "batch_output") -> dict:
        """A file whose content lives elsewhere (a batch's output or error file)."""
        meta = {"id": file_id, "object": "file", "bytes": path.stat().st_size if path.exists() else 0,
                "created_at": int(time.time()), "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": None, "status_details": None, "path": str(path)}
        _write_json(self.root / f"{file_id}.json", meta)
        return meta

    def _meta(self, file_id: str) -> dict:
        path = self.root / f"{Path(file_id).name}.json"
        if not path.is_file():
            raise not_found("file", file_id)
        return msgspec.json.decode(path.read_bytes())

    def content_path(self, file_id: str) -> Path:
        meta = self._meta(file_id)
        return Path(meta["path"]) if "path" in meta else self.root / f"{meta['id']}.jsonl"

    def get(self, file_id: str) -> dict:
        meta = self._meta(file_id)
        meta["bytes"] = self.content_path(file_id).stat().st_size
        meta.pop("path", None)
        return meta


class BatchJobs:
    def __init__(self, root: Path, files: FileStore, client: LLMClient, translator: Translator, *, priority: int,
                 concurrency: int, max_lines: int, refusal) -> None:
        self.root = Path(root) / "batches"
        self.root.mkdir(parents=True, exist_ok=True)
        self.files = files
        self.client = client
        self.translator = translator
        self.priority = priority
        self.concurrency = concurrency
        self.max_lines = max_lines
        self.refusal = refusal
        self._runners: dict[str, BatchRunner] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def _dir(self, batch_id: str) -> Path:
        return self.root / Path(batch_id).name

    def get(self, batch_id: str) -> dict:
        path = self._dir(batch_id) / "batch.json"
        if not path.is_file():
            raise not_found("batch", batch_id)
        return msgspec.json.decode(path.read_bytes())

    def _save(self, batch: dict) -> None:
        _write_json(self._dir(batch["id"]) / "batch.json", batch)

    def create(self, body: dict) -> dict:
        input_file_id = body.get("input_file_id")
        endpoint = body.get("endpoint")
        if not isinstance(input_file_id, str):
            raise bad_request("input_file_id is required", "input_file_id")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.get("completion_window", COMPLETION_WINDOW) != COMPLETION_WINDOW:
            raise bad_request(f"completion_window must be {COMPLETION_WINDOW}", "completion_window")
        meta = self.files.get(input_file_id)
        if meta["purpose"] != "batch":
            raise bad_request(f"file {input_file_id} has purpose {meta['purpose']!r}, not 'batch'", "input_file_id")
        data = self.files.content_path(input_file_id).read_bytes()
        num_lines = sum(1 for raw in data.splitlines() if raw.strip())
        if num_lines > self.max_lines:
            raise bad_request(f"the file has {num_lines} requests, the limit is {self.max_lines}", "input_file_id")
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        self._dir(batch_id).mkdir(parents=True)
        now = int(time.time())
        batch = {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": COMPLETION_WINDOW, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": num_lines, "completed": 0, "failed": 0},
                 "metadata": body.get("metadata")}
        self._save(batch)
        self._start(batch)
        return batch

    def cancel(self, batch_id: str) -> dict:
        batch = self.get(batch_id)
        if batch["status"] not in ACTIVE:
            raise ApiError(409, f"batch {batch_id} is {batch['status']}; it cannot be cancelled",
                           code="batch_not_cancellable")
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        self._save(batch)
        runner = self._runners.get(batch_id)
        if runner is not None:
            runner.cancel()
        return batch

    def resume_all(self) -> None:
        """After a restart: pick up every batch that was running."""
        for path in sorted(self.root.glob("*/batch.json")):
            batch = msgspec.json.decode(path.read_bytes())
            if batch["status"] in ACTIVE:
                log.info("resuming %s", batch["id"])
                self._start(batch)
            elif batch["status"] == "cancelling":
                self._finish(batch, Progress(total=batch["request_counts"]["total"]), "cancelled")

    def _start(self, batch: dict) -> None:
        self._tasks[batch["id"]] = asyncio.create_task(self._run(batch), name=f"batch-{batch['id']}")

    async def _run(self, batch: dict) -> None:
        folder = self._dir(batch["id"])
        output, errors = AnswerFile(folder / "output.jsonl").open(), AnswerFile(folder / "errors.jsonl").open()
        last_save = [0.0]

        def on_progress(progress: Progress) -> None:
            if time.monotonic() - last_save[0] >= PROGRESS_SAVE_S:
                last_save[0] = time.monotonic()
                self._save_counts(batch, output, errors)

        try:
            data = self.files.content_path(batch["input_file_id"]).read_bytes()
            runner = BatchRunner(self.client, self.translator, parse_input(data, batch["endpoint"]), output, errors,
                                 priority=self.priority, concurrency=self.concurrency, on_progress=on_progress,
                                 refusal=self.refusal)
            self._runners[batch["id"]] = runner
            batch.update(status="in_progress", in_progress_at=batch["in_progress_at"] or int(time.time()))
            batch["request_counts"]["total"] = runner.progress.total
            self._save(batch)
            progress = await runner.run()
            current = self.get(batch["id"])
            self._save_counts(batch, output, errors)
            self._finish(batch, progress, "cancelled" if current["status"] == "cancelling" else "completed")
        except asyncio.CancelledError:
            raise  # the gateway is stopping: the batch stays in progress and resumes at the next start
        except Exception as exc:
            log.exception("batch %s failed", batch["id"])
            batch.update(status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": [{"code": "internal", "message": str(exc)}]})
            self._save(batch)
        finally:
            await output.close()
            await errors.close()
            self._runners.pop(batch["id"], None)

    def _save_counts(self, batch: dict, output: AnswerFile, errors: AnswerFile) -> None:
        batch["request_counts"].update(completed=output.num_lines, failed=errors.num_lines)
        self._save(batch)

    def _finish(self, batch: dict, progress: Progress, status: str) -> None:
        folder = self._dir(batch["id"])
        now = int(time.time())
        batch["finalizing_at"] = batch["finalizing_at"] or now
        batch["output_file_id"] = self.files.register(f"file-{batch['id']}-output", folder / "output.jsonl",
                                                      "output.jsonl")["id"]
        if (folder / "errors.jsonl").exists() and (folder / "errors.jsonl").stat().st_size:
            batch["error_file_id"] = self.files.register(f"file-{batch['id']}-errors", folder / "errors.jsonl",
                                                         "errors.jsonl")["id"]
        batch.update(status=status, **{f"{status}_at": now})
        self._save(batch)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
