"""OpenAI's Files API on disk: uploads streamed to disk under a byte bound, per-owner files, expiry.

Layout under GATEWAY_DATA_DIR: `files/<file id>.json` (the file object, with its owner) beside
`files/<file id>.jsonl` (an upload's content); a batch's output and error files are registered here with their
content left under `batches/<batch id>/`. The objects are held in memory (loaded once at start), so listing,
quotas and lookups never touch the disk; every read and write of the disk runs in a thread, never on the event
loop the HTTP side and the Kafka client share.

An upload is counted as it arrives, chunked or not: past the limit (plus `FRAMING_BYTES` for the multipart
framing and the small fields) it is refused with 413 at once, the rest unread, and the connection closed. The
file part goes to disk a megabyte at a time, so memory stays flat whatever the upload's size.

A file belongs to the owner that uploaded it (a batch's output files to the batch's owner); any other owner is
told it does not exist. Files of purpose `batch` and batch output files expire 30 days after creation unless
`expires_after` says otherwise (OpenAI's default and bounds); an expired file answers 404 at once and is
deleted by the sweeper, except while an active batch still reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.openai_api import ApiError, bad_request

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
"""The owner of everything written before owners were recorded, and of every request until keys name one."""
DAY_S = 24 * 3600
DEFAULT_EXPIRY_S = 30 * DAY_S
"""OpenAI's default for files of purpose batch and for batch output files."""
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * DAY_S
"""OpenAI's bounds on `expires_after.seconds` and `output_expires_after.seconds`."""
FRAMING_BYTES = 64 * 1024
"""What an upload's body may carry beyond the file's own bytes: boundaries, part headers, the small fields."""
FIELD_BYTES = 4096
"""Largest form field that is not the file (purpose, expires_after[...])."""
WRITE_BYTES = 1 << 20
"""File data gathered before one write in a thread: few thread hops, a megabyte of memory at most."""
PRIVATE = ("owner", "tenant", "path", "created_ns", "output_expires_in")
"""Fields of a stored file or batch object that are not shown."""


def write_json(path: Path, value: dict | bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(value if isinstance(value, bytes) else msgspec.json.encode(value))
    os.replace(tmp, path)  # a reader never sees half a file, a crash never leaves one


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"No such {what}: {ident}", code="not_found", param="id")


def too_large(limit: int) -> ApiError:
    # The rest of the body is left unread, so the connection cannot carry another request.
    return ApiError(413, f"the upload exceeds the limit of {limit} bytes (GATEWAY_MAX_UPLOAD_BYTES)",
                    code="file_too_large", headers={"connection": "close"})


def quota_exceeded(message: str, code: str) -> ApiError:
    return ApiError(429, message, "rate_limit_error", code)


def expiry_seconds(anchor, seconds, param: str) -> int:
    """`{anchor, seconds}` within OpenAI's bounds, else 400."""
    if anchor != "created_at":
        raise bad_request(f"{param}.anchor must be 'created_at'", f"{param}.anchor")
    if isinstance(seconds, str) and seconds.strip().isdigit():
        seconds = int(seconds)
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise bad_request(f"{param}.seconds must be an integer", f"{param}.seconds")
    value = seconds
    if not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise bad_request(f"{param}.seconds must be between {MIN_EXPIRY_S} and {MAX_EXPIRY_S}", f"{param}.seconds")
    return value


def public(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in PRIVATE}


def sort_key(record: dict) -> tuple[int, str]:
    """Creation order; objects written before `created_ns` was recorded sort by their second."""
    return record.get("created_ns", record["created_at"] * 1_000_000_000), record["id"]


def page(records: list[dict], after: str | None, limit: int, what: str) -> dict:
    """OpenAI's list object over records already in order: the `limit` after the one with id `after`."""
    start = 0
    if after is not None:
        ids = [r["id"] for r in records]
        if after not in ids:
            raise bad_request(f"after: no {what} {after} to list after", "after")
        start = ids.index(after) + 1
    data = [public(r) for r in records[start:start + limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(records)}


def int_param(value: str | None, name: str, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    if not value.isdigit() or not low <= int(value) <= high:
        raise bad_request(f"{name} must be an integer between {low} and {high}", name)
    return int(value)


class _Form:
    """multipart/form-data fed as it arrives: the small fields kept, the file part's bytes handed out in
    pieces for the disk; refuses a file part over `limit` as soon as it passes it."""

    def __init__(self, content_type: str, limit: int) -> None:
        kind, params = parse_options_header(content_type)
        if kind != b"multipart/form-data" or b"boundary" not in params:
            raise bad_request("the upload must be multipart/form-data with a boundary")
        self.limit = limit
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_bytes = 0
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self._header_name = self._header_value = b""
        self._disposition = b""
        self._name: str | None = None
        self._in_file = False
        self._value = bytearray()
        self._parser = MultipartParser(params[b"boundary"], {
            "on_part_begin": self._part_begin, "on_part_data": self._part_data, "on_part_end": self._part_end,
            "on_header_field": self._header_field, "on_header_value": self._header_value_cb,
            "on_header_end": self._header_end, "on_headers_finished": self._headers_finished})

    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - python-multipart's errors: the framing is broken
            raise bad_request(f"the multipart body is malformed: {exc}") from None

    def finish(self) -> None:
        self.feed(b"")
        try:
            self._parser.finalize()
        except Exception as exc:  # noqa: BLE001
            raise bad_request(f"the multipart body is malformed: {exc}") from None

    def take(self) -> list[bytes]:
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        return pending

    def _part_begin(self) -> None:
        self._disposition, self._name, self._in_file = b"", None, False
        self._value = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_cb(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise bad_request("a multipart part has no name")
        self._name = options[b"name"].decode("utf-8", "replace")
        if self._name == "file" and b"filename" in options:
            if self.filename is not None:
                raise bad_request("one file per upload", "file")
            self._in_file = True
            self.filename = options[b"filename"].decode("utf-8", "replace") or "upload.jsonl"

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.file_bytes += end - start
            if self.file_bytes > self.limit:
                raise too_large(self.limit)
            self.pending.append(data[start:end])
            self.pending_bytes += end - start
            return
        self._value += data[start:end]
        if len(self._value) > FIELD_BYTES:
            raise bad_request(f"the form field {self._name} exceeds {FIELD_BYTES} bytes", self._name)

    def _part_end(self) -> None:
        if not self._in_file and self._name is not None:
            self.fields[self._name] = self._value.decode("utf-8", "replace")


class FileStore:
    def __init__(self, root: Path, *, max_files_per_owner: int = 100, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root) / "files"
        self.max_files_per_owner = max_files_per_owner
        self.clock = clock
        self.in_use: Callable[[str], dict | None] = lambda file_id: None
        """The active batch that still reads a file, if any (set by the batch jobs)."""
        self._files: dict[str, dict] = {}
        self._uploading: Counter[str] = Counter()

    # -- start ------------------------------------------------------------------------------------------
    async def load(self) -> None:
        self._files = await asyncio.to_thread(self._read_all)

    def _read_all(self) -> dict[str, dict]:
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(".upload-*"):  # an upload a kill interrupted
            leftover.unlink(missing_ok=True)
        files = {}
        for path in self.root.glob("*.json"):
            try:
                record = msgspec.json.decode(path.read_bytes())
            except (OSError, msgspec.DecodeError):
                log.warning("%s: an unreadable file object is skipped", path)
                continue
            record.setdefault("owner", ANONYMOUS)
            files[record["id"]] = record
        return files

    # -- lookups ----------------------------------------------------------------------------------------
    def _expired(self, record: dict) -> bool:
        return record.get("expires_at") is not None and record["expires_at"] <= self.clock()

    def _record(self, file_id: str, owner: str) -> dict:
        record = self._files.get(file_id)
        if record is None or record["owner"] != owner or self._expired(record):
            raise not_found("file", file_id)
        return record

    def get(self, file_id: str, owner: str) -> dict:
        return public(self._record(file_id, owner))

    def content_path(self, file_id: str, owner: str | None = None) -> Path:
        """Where a file's content lives; owner None: the gateway's own use (a batch reading its input, which an
        expiry while the batch runs must not take away)."""
        record = self._files.get(file_id) if owner is None else self._record(file_id, owner)
        if record is None:
            raise not_found("file", file_id)
        return Path(record["path"]) if "path" in record else self.root / f"{record['id']}.jsonl"

    def list(self, owner: str, *, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
             order: str = "desc") -> dict:
        records = sorted((r for r in self._files.values() if r["owner"] == owner and not self._expired(r)
                          and (purpose is None or r["purpose"] == purpose)), key=sort_key, reverse=order == "desc")
        return page(records, after, limit, "file")

    def count(self, owner: str) -> int:
        return sum(1 for r in self._files.values() if r["owner"] == owner and not self._expired(r))

    # -- upload -----------------------------------------------------------------------------------------
    async def upload(self, chunks: AsyncIterator[bytes], content_type: str, owner: str, *, max_bytes: int) -> dict:
        """Streams a multipart upload (fields `file`, `purpose`, optional `expires_after[anchor]` and
        `expires_after[seconds]`) to disk; 413 as soon as it passes `max_bytes`, 429 past the owner's quota."""
        form = _Form(content_type, max_bytes)
        if self.count(owner) + self._uploading[owner] >= self.max_files_per_owner:
            raise quota_exceeded(f"owner {owner} keeps {self.max_files_per_owner} files, the most allowed "
                                 "(GATEWAY_MAX_FILES_PER_OWNER); delete some first", "too_many_files")
        self._uploading[owner] += 1
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        tmp = self.root / f".upload-{file_id}"
        out = None
        try:
            out = await asyncio.to_thread(open, tmp, "wb")
            received = 0
            async for chunk in chunks:
                received += len(chunk)
                if received > max_bytes + FRAMING_BYTES:
                    raise too_large(max_bytes)
                form.feed(chunk)
                if form.fields.get("purpose", "batch") != "batch":  # known before the file: refuse it unread
                    self._check_fields(form)
                if form.pending_bytes >= WRITE_BYTES:
                    await asyncio.to_thread(out.writelines, form.take())
            form.finish()
            await asyncio.to_thread(_finish_write, out, form.take())
            purpose, expires_in = self._check_fields(form)
            now = self.clock()
            record = {"id": file_id, "object": "file", "bytes": form.file_bytes, "created_at": int(now),
                      "filename": form.filename, "purpose": purpose, "status": "processed",
                      "expires_at": int(now) + expires_in, "status_details": None, "owner": owner,
                      "created_ns": time.time_ns()}
            await asyncio.to_thread(self._commit, tmp, record)
        except BaseException:
            await asyncio.to_thread(_discard, out, tmp)
            raise
        finally:
            self._uploading[owner] -= 1
        self._files[file_id] = record
        return public(record)

    def _check_fields(self, form: _Form) -> tuple[str, int]:
        purpose = form.fields.get("purpose")
        if purpose != "batch":
            raise bad_request("purpose must be 'batch' (the only one this gateway serves)", "purpose")
        if form.filename is None:
            raise bad_request("file is required (multipart form field `file`)", "file")
        anchor, seconds = form.fields.get("expires_after[anchor]"), form.fields.get("expires_after[seconds]")
        if anchor is None and seconds is None:
            return purpose, DEFAULT_EXPIRY_S
        return purpose, expiry_seconds(anchor, seconds, "expires_after")

    def _commit(self, tmp: Path, record: dict) -> None:
        os.replace(tmp, self.root / f"{record['id']}.jsonl")
        write_json(self.root / f"{record['id']}.json", record)

    async def register(self, file_id: str, path: Path, filename: str, owner: str, expires_in: int,
                       purpose: str = "batch_output") -> dict:
        """A file whose content lives elsewhere (a batch's output or error file)."""
        size = await asyncio.to_thread(lambda: path.stat().st_size if path.exists() else 0)
        now = self.clock()
        record = {"id": file_id, "object": "file", "bytes": size, "created_at": int(now), "filename": filename,
                  "purpose": purpose, "status": "processed", "expires_at": int(now) + expires_in,
                  "status_details": None, "path": str(path), "owner": owner, "created_ns": time.time_ns()}
        await asyncio.to_thread(write_json, self.root / f"{file_id}.json", record)
        self._files[file_id] = record
        return public(record)

    # -- delete and expiry ------------------------------------------------------------------------------
    async def delete(self, file_id: str, owner: str) -> dict:
        record = self._record(file_id, owner)
        batch = self.in_use(file_id)
        if batch is not None:
            raise ApiError(409, f"file {file_id} is the input of batch {batch['id']}, which is {batch['status']}; "
                                "cancel the batch or wait for it to end", code="file_in_use", param="file_id")
        await self._remove(record)
        return {"id": file_id, "object": "file", "deleted": True}

    async def _remove(self, record: dict) -> None:
        self._files.pop(record["id"], None)
        await asyncio.to_thread(self._unlink, record)

    def _unlink(self, record: dict) -> None:
        (self.root / f"{record['id']}.json").unlink(missing_ok=True)
        content = Path(record["path"]) if "path" in record else self.root / f"{record['id']}.jsonl"
        content.unlink(missing_ok=True)

    async def sweep(self) -> list[str]:
        """Deletes the expired files that no active batch reads; their ids."""
        gone = [r for r in list(self._files.values()) if self._expired(r) and self.in_use(r["id"]) is None]
        for record in gone:
            await self._remove(record)
        if gone:
            log.info("deleted %d expired files", len(gone))
        return [r["id"] for r in gone]

    async def sweep_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep()
            except OSError as exc:  # a full or read-only disk: try again at the next round
                log.warning("the expiry sweep failed: %r", exc)


def _finish_write(out, pieces: list[bytes]) -> None:
    out.writelines(pieces)
    out.flush()
    os.fsync(out.fileno())
    out.close()


def _discard(out, tmp: Path) -> None:
    if out is not None:
        with contextlib.suppress(OSError):
            out.close()
    tmp.unlink(missing_ok=True)
