"""Files and batches without Kafka: uploads bounded as they stream, owners who see only their own files and
batches, per-owner quotas, expiry with a clock moved forward, and the sweeper deleting what expired (but not
what a running batch still reads). The batch jobs here send to a client that never answers, so a batch stays
running until it is cancelled."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.batch_jobs import BatchJobs
from gateway.batch_run import AnswerFile, BatchRunner, Translator, parse_input
from gateway.files import DEFAULT_EXPIRY_S, FRAMING_BYTES, FileStore
from gateway.openai_api import ApiError, Tiers, TokenText

BOUNDARY = "test-boundary-7f3a"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def form(data: bytes, purpose: str = "batch", **fields: str) -> bytes:
    parts = [("purpose", purpose), *fields.items()]
    out = b""
    for name, value in parts:
        out += (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").encode()
    out += (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "content-type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{BOUNDARY}--\r\n".encode()
    return out


class Chunks:
    """The body as an ASGI server hands it over, in pieces; counts how much was taken."""

    def __init__(self, body: bytes, size: int = 65536) -> None:
        self.body, self.size, self.taken = body, size, 0

    async def __aiter__(self):
        for start in range(0, len(self.body), self.size):
            piece = self.body[start:start + self.size]
            self.taken += len(piece)
            yield piece


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class NeverAnswers:
    """A client whose requests are never answered: a batch keeps running until cancelled."""

    def __init__(self) -> None:
        self.submitted = 0

    async def submit(self, request, priority, timeout_s=None):
        self.submitted += 1
        await asyncio.Event().wait()


def batch_line(i: int) -> bytes:
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}}).encode()


LINES = b"\n".join(batch_line(i) for i in range(3)) + b"\n"


async def upload(store: FileStore, owner: str, data: bytes = LINES, limit: int = 1 << 20, **fields) -> dict:
    return await store.upload(Chunks(form(data, **fields)), CONTENT_TYPE, owner, max_bytes=limit)


@pytest.fixture
async def store(tmp_path):
    clock = Clock()
    files = FileStore(tmp_path, max_files_per_owner=3, clock=clock)
    await files.load()
    files.clock_ = clock
    return files


@pytest.fixture
async def jobs(store, tmp_path):
    batches = BatchJobs(tmp_path, store, NeverAnswers(), Translator(["m"], Tiers(3, 1), TokenText(None)),
                        priority=2, concurrency=2, max_lines=100, refusal=lambda priority: None,
                        max_active_per_owner=2, clock=store.clock_)
    await batches.load()
    yield batches
    await batches.stop()


def leftovers(store: FileStore) -> list:
    return sorted(p.name for p in store.root.iterdir() if p.name.startswith(".upload"))


async def test_an_upload_lands_on_disk_whole_and_one_past_the_limit_is_refused_unread(store):
    data = b"".join(batch_line(i) + b"\n" for i in range(20_000))  # about 2 MB, many pieces
    meta = await upload(store, "alice", data, limit=len(data))
    assert meta["bytes"] == len(data) and meta["purpose"] == "batch" and "owner" not in meta
    assert store.content_path(meta["id"], "alice").read_bytes() == data

    big = Chunks(form(b"x" * (64 << 20)))
    with pytest.raises(ApiError) as info:
        await store.upload(big, CONTENT_TYPE, "alice", max_bytes=1 << 20)
    error = info.value
    assert error.status == 413 and error.body()["error"]["code"] == "file_too_large"
    assert error.headers.get("connection") == "close"
    # Refused at the limit: what was taken is the limit and a piece or two, not the 64 MiB.
    assert big.taken <= (1 << 20) + FRAMING_BYTES + 2 * big.size
    assert leftovers(store) == []
    assert [f["id"] for f in store.list("alice")["data"]] == [meta["id"]]


async def test_an_upload_without_purpose_batch_or_file_is_refused(store):
    wrong = Chunks(form(b"x" * (8 << 20), purpose="fine-tune"))
    with pytest.raises(ApiError) as info:
        await store.upload(wrong, CONTENT_TYPE, "alice", max_bytes=16 << 20)
    assert info.value.status == 400 and info.value.param == "purpose"
    assert wrong.taken <= wrong.size  # the purpose came first: the file was not read
    body = f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{BOUNDARY}--\r\n"
    with pytest.raises(ApiError) as info:
        await store.upload(Chunks(body.encode()), CONTENT_TYPE, "alice", max_bytes=1 << 20)
    assert info.value.status == 400 and info.value.param == "file"
    with pytest.raises(ApiError) as info:
        await store.upload(Chunks(b"{}"), "application/json", "alice", max_bytes=1 << 20)
    assert info.value.status == 400
    assert leftovers(store) == [] and store.list("alice")["data"] == []


async def test_an_owner_sees_and_deletes_only_its_own_files(store):
    mine = await upload(store, "alice")
    theirs = await upload(store, "bob")
    assert [f["id"] for f in store.list("alice")["data"]] == [mine["id"]]
    for call in (lambda: store.get(mine["id"], "bob"), lambda: store.content_path(mine["id"], "bob")):
        with pytest.raises(ApiError) as info:
            call()
        assert info.value.status == 404
    with pytest.raises(ApiError) as info:
        await store.delete(mine["id"], "bob")
    assert info.value.status == 404
    assert await store.delete(mine["id"], "alice") == {"id": mine["id"], "object": "file", "deleted": True}
    assert not (store.root / f"{mine['id']}.jsonl").exists() and not (store.root / f"{mine['id']}.json").exists()
    with pytest.raises(ApiError):
        store.get(mine["id"], "alice")
    assert store.get(theirs["id"], "bob")["id"] == theirs["id"]


async def test_the_files_quota_is_per_owner_and_frees_on_delete(store):
    kept = [await upload(store, "alice") for _ in range(3)]
    with pytest.raises(ApiError) as info:
        await upload(store, "alice")
    assert info.value.status == 429 and info.value.body()["error"]["code"] == "too_many_files"
    assert "GATEWAY_MAX_FILES_PER_OWNER" in info.value.message
    assert (await upload(store, "bob"))["id"]  # another owner's files are not counted
    await store.delete(kept[0]["id"], "alice")
    assert (await upload(store, "alice"))["id"]


async def test_listing_files_pages_newest_first(store):
    ids = [(await upload(store, "alice"))["id"] for _ in range(3)]
    first = store.list("alice", limit=2)
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"]
    assert first["first_id"] == ids[2] and first["last_id"] == ids[1]
    rest = store.list("alice", limit=2, after=first["last_id"])
    assert [f["id"] for f in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert [f["id"] for f in store.list("alice", order="asc")["data"]] == ids


async def test_expiry_bounds_the_default_and_the_sweeper(store, jobs):
    clock = store.clock_
    for seconds in ("3599", "2592001", "soon"):
        with pytest.raises(ApiError) as info:
            await upload(store, "alice", **{"expires_after[anchor]": "created_at", "expires_after[seconds]": seconds})
        assert info.value.status == 400 and info.value.param == "expires_after.seconds"
    with pytest.raises(ApiError):
        await upload(store, "alice", **{"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"})
    hour = await upload(store, "alice", **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"})
    assert hour["expires_at"] == int(clock.now) + 3600
    month = await upload(store, "alice")
    assert month["expires_at"] == int(clock.now) + DEFAULT_EXPIRY_S
    read_by_a_batch = await upload(store, "bob", **{"expires_after[anchor]": "created_at",
                                                  "expires_after[seconds]": "3600"})
    batch = await jobs.create({"input_file_id": read_by_a_batch["id"], "endpoint": "/v1/chat/completions"}, "bob")

    sweeper = asyncio.create_task(store.sweep_every(0.02))
    try:
        await asyncio.sleep(0.1)
        assert (store.root / f"{hour['id']}.jsonl").exists()  # not expired yet: the sweeper leaves it
        clock.now += 3600
        # Expired: gone for the owner at once, then from disk.
        with pytest.raises(ApiError) as info:
            store.get(hour["id"], "alice")
        assert info.value.status == 404
        assert [f["id"] for f in store.list("alice")["data"]] == [month["id"]]
        async with asyncio.timeout(5):
            while (store.root / f"{hour['id']}.jsonl").exists():
                await asyncio.sleep(0.02)
        assert not (store.root / f"{hour['id']}.json").exists()
        assert (store.root / f"{month['id']}.jsonl").exists()
        # The batch still reads its expired input: kept until the batch ends, then swept.
        await asyncio.sleep(0.1)
        assert (store.root / f"{read_by_a_batch['id']}.jsonl").exists()
        await jobs.cancel(batch["id"], "bob")
        async with asyncio.timeout(5):
            while (store.root / f"{read_by_a_batch['id']}.jsonl").exists():
                await asyncio.sleep(0.02)
    finally:
        sweeper.cancel()


async def test_batches_belong_to_their_owner_and_the_active_quota_is_per_owner(store, jobs):
    file_a = await upload(store, "alice")
    file_b = await upload(store, "bob")
    body = {"input_file_id": file_a["id"], "endpoint": "/v1/chat/completions"}
    with pytest.raises(ApiError) as info:  # bob cannot use alice's file
        await jobs.create(dict(body), "bob")
    assert info.value.status == 404
    first = await jobs.create(dict(body), "alice")
    second = await jobs.create(dict(body), "alice")
    with pytest.raises(ApiError) as info:
        await jobs.create(dict(body), "alice")
    assert info.value.status == 429 and info.value.body()["error"]["code"] == "too_many_active_batches"
    assert (await jobs.create({"input_file_id": file_b["id"], "endpoint": "/v1/chat/completions"}, "bob"))["id"]
    for call in (lambda: jobs.get(first["id"], "bob"), lambda: jobs.cancel(first["id"], "bob")):
        with pytest.raises(ApiError) as info:
            result = call()
            if asyncio.iscoroutine(result):
                await result
        assert info.value.status == 404
    assert [b["id"] for b in jobs.list("bob")["data"]] != [] and first["id"] not in \
        [b["id"] for b in jobs.list("bob")["data"]]
    # A file a running batch reads cannot be deleted; the refusal names the batch.
    with pytest.raises(ApiError) as info:
        await store.delete(file_a["id"], "alice")
    assert info.value.status == 409 and info.value.body()["error"]["code"] == "file_in_use"
    assert first["id"] in info.value.message or second["id"] in info.value.message
    # Cancelling one frees a place; once none reads the file, it can be deleted.
    await jobs.cancel(first["id"], "alice")
    async with asyncio.timeout(5):
        while jobs.get(first["id"], "alice")["status"] != "cancelled":
            await asyncio.sleep(0.02)
    assert (await jobs.create(dict(body), "alice"))["id"]
    for batch in jobs.list("alice")["data"]:
        if batch["status"] != "cancelled":
            await jobs.cancel(batch["id"], "alice")
    async with asyncio.timeout(5):
        while any(b["status"] != "cancelled" for b in jobs.list("alice")["data"]):
            await asyncio.sleep(0.02)
    assert (await store.delete(file_a["id"], "alice"))["deleted"]


async def test_listing_batches_pages_newest_first(store, jobs):
    jobs.max_active_per_owner = 10
    file = await upload(store, "alice")
    ids = [(await jobs.create({"input_file_id": file["id"], "endpoint": "/v1/chat/completions"}, "alice"))["id"]
           for _ in range(5)]
    seen, after = [], None
    while True:
        listed = jobs.list("alice", after=after, limit=2)
        seen += [b["id"] for b in listed["data"]]
        assert listed["object"] == "list" and len(listed["data"]) <= 2
        if not listed["has_more"]:
            break
        after = listed["last_id"]
    assert seen == ids[::-1]
    assert jobs.list("bob")["data"] == [] and jobs.list("bob")["has_more"] is False
    with pytest.raises(ApiError) as info:
        jobs.list("alice", after="batch_nope")
    assert info.value.status == 400


async def test_output_expiry_bounds_and_the_output_file_expires(store, jobs):
    file = await upload(store, "alice")
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions"}
    for policy in ({"anchor": "created_at", "seconds": 60}, {"anchor": "nope", "seconds": 7200}, "soon"):
        with pytest.raises(ApiError) as info:
            await jobs.create({**body, "output_expires_after": policy}, "alice")
        assert info.value.status == 400
    batch = await jobs.create({**body, "output_expires_after": {"anchor": "created_at", "seconds": 7200}}, "alice")
    await jobs.cancel(batch["id"], "alice")
    async with asyncio.timeout(5):
        while (batch := jobs.get(batch["id"], "alice"))["status"] != "cancelled":
            await asyncio.sleep(0.02)
    output = store.get(batch["output_file_id"], "alice")
    assert output["purpose"] == "batch_output" and output["expires_at"] == int(store.clock_.now) + 7200
    with pytest.raises(ApiError):
        store.get(batch["output_file_id"], "bob")
    store.clock_.now += 7200
    assert batch["output_file_id"] in await store.sweep()
    assert not (jobs.root / batch["id"] / "output.jsonl").exists()


async def test_files_and_batches_from_before_owners_belong_to_anonymous(tmp_path):
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "file-old.json").write_text(json.dumps({
        "id": "file-old", "object": "file", "bytes": 3, "created_at": 1, "filename": "in.jsonl", "purpose": "batch",
        "status": "processed", "expires_at": None, "status_details": None}))
    (tmp_path / "files" / "file-old.jsonl").write_bytes(b"{}\n")
    (tmp_path / "batches" / "batch_old").mkdir(parents=True)
    (tmp_path / "batches" / "batch_old" / "batch.json").write_text(json.dumps({
        "id": "batch_old", "object": "batch", "input_file_id": "file-old", "status": "completed", "created_at": 1}))
    files = FileStore(tmp_path)
    await files.load()
    jobs = BatchJobs(tmp_path, files, NeverAnswers(), Translator(["m"], Tiers(3, 1), TokenText(None)),
                     priority=2, concurrency=1, max_lines=10, refusal=lambda priority: None)
    await jobs.load()
    try:
        assert files.get("file-old", "anonymous")["id"] == "file-old"
        assert [b["id"] for b in jobs.list("anonymous")["data"]] == ["batch_old"]
        with pytest.raises(ApiError):
            files.get("file-old", "someone")
        assert jobs.list("someone")["data"] == []
    finally:
        await jobs.stop()


async def test_a_batch_cancelled_before_its_requests_start_still_ends(tmp_path):
    # The cancel lands after the runner made its first requests' tasks and before any of them ran.
    client = NeverAnswers()
    output, errors = AnswerFile(tmp_path / "out.jsonl").open(), AnswerFile(tmp_path / "err.jsonl").open()
    runner = BatchRunner(client, Translator(["m"], Tiers(3, 1), TokenText(None)), parse_input(LINES), output,
                         errors, priority=2, concurrency=2)
    running = asyncio.create_task(runner.run())
    await asyncio.sleep(0)
    runner.cancel()
    async with asyncio.timeout(5):
        progress = await running
    assert progress.completed == 0 and client.submitted == 0
    await output.close()
    await errors.close()
