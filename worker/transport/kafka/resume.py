"""Where the streams of a partition that comes to this worker stopped: read back at takeover, so its unfinished
requests continue from there instead of starting over (schemas/progress.py).

Two reads, both after the previous owner is fenced (its open transaction aborted, so nothing of it is pending):

1. The progress topic's partition of the same number, from the resume point committed in the offset's
   metadata (kafka/progress.py) to its end, read_committed: the latest record of each request.
2. The tail: chunks the previous owner had acknowledged after its last record, read from the record's
   destination partition (from the record's time, less the publisher's send bound and a second for clocks) to
   its end. They are what a client may already have, so the stream must go on after them: each request's
   chunks of that attempt that follow its record without a gap extend it. A destination that cannot be read
   (no READ permission, gone) leaves its requests as the record says: their resumed streams may then repeat
   those chunks' seqs, with the same tokens where the output is greedy or seeded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from schemas.decode import decode_result
from schemas.progress import CompletionProgress, ProgressRecord, decode_progress
from schemas.result import StreamChunk

log = logging.getLogger(__name__)

TAIL_CLOCK_SLACK_MS = 1000
"""Added to the publisher's send bound when the tail is looked for by time: chunk timestamps are the previous
owner's clock, the record's too, but a chunk may have been made a little before the record that precedes it
in the log."""


async def _read_to_end(consumer: AIOKafkaConsumer, starts: dict[TopicPartition, int],
                       on_record: Callable[[TopicPartition, object], None]) -> None:
    """Read each partition from its start to the end offset it had when the read began."""
    if not starts:
        return
    consumer.assign(list(starts))
    ends = await consumer.end_offsets(list(starts))
    remaining = set()
    for tp, start in starts.items():
        if ends[tp] > start:
            consumer.seek(tp, start)
            remaining.add(tp)
    if remaining != set(starts):
        consumer.pause(*(set(starts) - remaining))
    while remaining:
        batches = await consumer.getmany(*remaining, timeout_ms=200, max_records=2000)
        for tp, records in batches.items():
            for record in records:
                if record.offset < ends[tp]:
                    on_record(tp, record)
        for tp in list(remaining):
            if await consumer.position(tp) >= ends[tp]:
                remaining.discard(tp)
                consumer.pause(tp)


async def read_progress(client_kwargs: dict, topic: str,
                        starts: dict[int, int]) -> dict[int, dict[str, ProgressRecord]]:
    """{request partition: {request id: its latest progress record}} read from these progress partitions, each
    from its resume point. Among records of one id the highest attempt wins, then the later one."""
    found: dict[int, dict[str, ProgressRecord]] = {p: {} for p in starts}

    def take(tp: TopicPartition, record) -> None:
        try:
            progress = decode_progress(record.value)
        except (msgspec.DecodeError, TypeError):
            return  # not ours: a progress topic holds nothing else, but a stray record must not stop the takeover
        known = found[tp.partition].get(progress.id)
        if known is None or progress.attempt >= known.attempt:
            found[tp.partition][progress.id] = progress

    consumer = AIOKafkaConsumer(**client_kwargs, enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        await _read_to_end(consumer, {TopicPartition(topic, p): offset for p, offset in starts.items()}, take)
    finally:
        await consumer.stop()
    return found


async def extend_with_tails(client_kwargs: dict, records: list[ProgressRecord],
                            partition_of: Callable[[str, bytes], Awaitable[int]],
                            send_wait_s: float) -> list[ProgressRecord]:
    """The records, each extended by the chunks of its attempt that follow it in its destination partition."""
    streaming = [r for r in records if r.topic and any(c.seq for c in r.completions)]
    if not streaming:
        return records
    by_partition: dict[TopicPartition, list[ProgressRecord]] = defaultdict(list)
    for record in streaming:
        try:
            tp = TopicPartition(record.topic, await partition_of(record.topic, record.id.encode()))
        except Exception as exc:  # noqa: BLE001 - a destination gone: its requests resume as recorded
            log.warning("cannot find the partition of %r to read the tail of %s's stream (%r)", record.topic,
                        record.id, exc)
            continue
        by_partition[tp].append(record)
    chunks: dict[tuple[str, int, int], dict[int, StreamChunk]] = defaultdict(dict)
    wanted = {(r.id, r.attempt) for r in streaming}

    def take(tp: TopicPartition, record) -> None:
        if record.key is None:
            return
        try:
            result = decode_result(record.value)
        except (msgspec.DecodeError, TypeError, ValueError):
            return
        if isinstance(result, StreamChunk) and (result.id, result.attempt) in wanted:
            chunks[(result.id, result.attempt, result.index)][result.seq] = result

    consumer = AIOKafkaConsumer(**client_kwargs, enable_auto_commit=False)
    await consumer.start()
    try:
        slack_ms = int(send_wait_s * 1000) + TAIL_CLOCK_SLACK_MS
        for tp, group in by_partition.items():
            since = min(r.ts_ms for r in group) - slack_ms
            try:
                found = await consumer.offsets_for_times({tp: max(since, 0)})
                start = found[tp].offset if found.get(tp) is not None else None
                if start is None:
                    continue  # nothing written there since: no tail
                await _read_to_end(consumer, {tp: start}, take)
            except Exception as exc:  # noqa: BLE001 - unreadable (ACL, gone): those requests resume as recorded
                log.warning("cannot read the tail of the streams on %s (%r): %d resumed streams may repeat the "
                            "chunks sent after their last progress record", tp, exc, len(group))
            finally:
                consumer.unsubscribe()
    finally:
        await consumer.stop()
    return [_extended(r, chunks) for r in records]


def _extended(record: ProgressRecord, chunks: dict[tuple[str, int, int], dict[int, StreamChunk]]) -> ProgressRecord:
    completions = []
    changed = False
    for done in record.completions:
        after = chunks.get((record.id, record.attempt, done.index), {})
        seq, token_ids, text, call_ids = done.seq, list(done.token_ids), done.text, list(done.tool_call_ids)
        while seq in after:
            chunk = after[seq]
            token_ids += chunk.token_ids
            text += chunk.text
            call_ids += [d.id for d in chunk.tool_calls or () if d.id]
            seq += 1
        if seq != done.seq:
            changed = True
            done = CompletionProgress(index=done.index, seq=seq, token_ids=token_ids, text=text, tool_call_ids=call_ids)
        completions.append(done)
    return msgspec.structs.replace(record, completions=completions) if changed else record


async def takeover_progress(client_kwargs: dict, topic: str, starts: dict[int, int],
                            partition_of: Callable[[str, bytes], Awaitable[int]], send_wait_s: float,
                            timeout_s: float) -> dict[int, dict[str, ProgressRecord]]:
    """read_progress, then extend_with_tails; {} (every moved request starts over) when it cannot finish in
    `timeout_s`."""
    started = time.monotonic()

    async def both() -> dict[int, dict[str, ProgressRecord]]:
        found = await read_progress(client_kwargs, topic, starts)
        records = [r for by_id in found.values() for r in by_id.values()]
        extended = await extend_with_tails(client_kwargs, records, partition_of, send_wait_s)
        out: dict[int, dict[str, ProgressRecord]] = {p: {} for p in found}
        for record in extended:
            out[record.partition][record.id] = record
        return out

    try:
        out = await asyncio.wait_for(both(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - the takeover goes on; its requests start over
        log.warning("could not read the progress of partitions %s (%r): their unfinished requests start over",
                    sorted(starts), exc)
        return {}
    num = sum(len(v) for v in out.values())
    if num:
        log.info("progress of %d unfinished requests read back in %.2f s (partitions %s)", num,
                 time.monotonic() - started, sorted(starts))
    return out
