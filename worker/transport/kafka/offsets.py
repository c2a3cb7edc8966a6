"""Per-partition commit watermark: which offset is safe to commit when requests finish out of order.

Kafka's committed value is the *next* offset to read, so after a restart the group resumes exactly there.
Under continuous batching request 7 may finish before request 5; committing 8 then would lose 5 if the
worker died. The watermark is therefore the lowest offset consumed but not yet done, or one past the
highest consumed offset when nothing is pending. "Done" means the request's final record (or dead-letter
record, for records that never reach the engine) was acknowledged by Kafka, not merely produced.

With exactly-once finals a commit also says which offsets above the watermark are already answered
(progress.py): `progress` gives those runs, and a partition whose previous owner left some (`assign`'s
`answered`) skips them when it reads them (`track` returns False) and keeps them in its own commits until the
watermark passes them.

Pure Python, no aiokafka: partitions are any hashable key (the transport uses TopicPartition).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from worker.transport.kafka.progress import Runs, runs_of


@dataclass(slots=True)
class PartitionWatermark:
    next_offset: int
    """One past the highest offset consumed (or the start position when nothing was consumed)."""
    pending: set[int] = field(default_factory=set)
    heap: list[int] = field(default_factory=list)
    """Min-heap over pending offsets with lazy deletion: done offsets are popped when they reach the top."""
    last_committed: int | None = None
    floor: int = -1
    """Where a restart would resume: the last committed offset, or where reading started before any commit."""
    behind_since: float = 0.0
    """Monotonic time since which records past `floor` have waited with `floor` not moving: the last commit
    that moved it, or the first record consumed after the partition was caught up."""
    answered: set[int] = field(default_factory=set)
    """Offsets at or past next_offset that a previous owner answered and committed as such (progress.py): not
    read yet; skipped when read, and kept in this worker's commits until the watermark passes them."""
    progress_bytes: int = 0
    """The size of the last progress metadata committed for the partition (set by whoever commits)."""
    progress_full: bool = False
    """The last commit had to leave answers out: the progress metadata would have passed its limit."""

    def __post_init__(self) -> None:
        if self.floor < 0:
            self.floor = self.last_committed if self.last_committed is not None else self.next_offset
        self.behind_since = time.monotonic()

    def track(self, offset: int) -> bool:
        if offset < self.next_offset:
            # Below next_offset and not pending means done already (a refetch after a seek back): tracking it
            # again could move the watermark backwards, which Kafka would honour.
            return False
        if offset in self.answered:  # a previous owner's answer is committed: never answered again
            self.answered.discard(offset)
            self.next_offset = offset + 1
            return False
        if self.next_offset <= self.floor:  # caught up until this record: its wait for a commit starts now
            self.behind_since = time.monotonic()
        self.pending.add(offset)
        heapq.heappush(self.heap, offset)
        self.next_offset = offset + 1
        return True

    def done(self, offset: int) -> bool:
        if offset not in self.pending:
            return False
        self.pending.discard(offset)
        return True

    def watermark(self, also_done: frozenset[int] = frozenset()) -> int:
        """The offset to commit; `also_done`: pending offsets to count as done (a commit being prepared)."""
        while self.heap and self.heap[0] not in self.pending:
            heapq.heappop(self.heap)
        if also_done:
            below = [offset for offset in self.pending if offset not in also_done]
            mark = min(below) if below else self.next_offset
        else:
            mark = self.heap[0] if self.heap else self.next_offset
        while mark >= self.next_offset and mark in self.answered:  # the previous owner's answers just above
            mark += 1
        return mark

    def progress(self, also_done: frozenset[int] = frozenset()) -> tuple[int, Runs]:
        """(the watermark, the answered runs above it): what a commit records (progress.py). Answered: read and
        not pending (gaps in the offsets count too, harmlessly: no record is there), plus the previous
        owner's `answered` not read yet."""
        mark = self.watermark(also_done)
        waiting = sorted(offset for offset in self.pending if offset > mark and offset not in also_done)
        runs: Runs = []
        start = mark + 1
        for offset in waiting:
            if offset > start:
                runs.append((start, offset - 1))
            start = offset + 1
        if start < self.next_offset:
            runs.append((start, self.next_offset - 1))
        for first, last in runs_of(offset for offset in self.answered if offset > mark):
            if runs and first == runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], last)
            else:
                runs.append((first, last))
        return mark, runs


class OffsetTracker:
    """Watermarks of every assigned partition; the transport calls it from the event loop only."""

    def __init__(self) -> None:
        self._partitions: dict[Hashable, PartitionWatermark] = {}

    def assign(self, partition: Hashable, position: int, committed: int | None = None,
               answered: Runs = ()) -> None:
        """Start tracking a partition whose next record to read is `position`; `answered`: runs above it already
        answered by a previous owner (the committed progress), skipped when read."""
        self._partitions[partition] = PartitionWatermark(
            next_offset=position, last_committed=committed,
            answered={offset for first, last in answered for offset in range(first, last + 1) if offset >= position})

    def progress(self, partition: Hashable, also_done: frozenset[int] = frozenset()) -> tuple[int, Runs] | None:
        state = self._partitions.get(partition)
        return state.progress(also_done) if state is not None else None

    def state(self, partition: Hashable) -> PartitionWatermark | None:
        return self._partitions.get(partition)

    def progress_full(self, partition: Hashable, limit_bytes: int) -> bool:
        """Whether reading more records of the partition should wait for its watermark to move: the last commit
        left answers out for want of room in its progress metadata, or that metadata is past half its limit.
        Every record read may add a run to it (a request that finishes before the ones below it)."""
        state = self._partitions.get(partition)
        return state is not None and (state.progress_full or 2 * state.progress_bytes > limit_bytes)

    def revoke(self, partition: Hashable) -> None:
        self._partitions.pop(partition, None)

    def track(self, partition: Hashable, offset: int) -> bool:
        """A record was consumed; it stays pending until `done`. False for a refetch of a done offset."""
        state = self._partitions.get(partition)
        if state is None:
            # First record of a partition we were never told about: its own offset is the safe start.
            state = self._partitions[partition] = PartitionWatermark(next_offset=offset)
        return state.track(offset)

    def done(self, partition: Hashable, offset: int) -> bool:
        """The record's final record was acknowledged. False when unknown (e.g. the partition was revoked)."""
        state = self._partitions.get(partition)
        return state.done(offset) if state is not None else False

    def on_acked(self, partition: Hashable, offset: int) -> Callable[[], None]:
        """The acknowledgement callback of the records that answer one request record: marks it done. Every
        final record (engine or not) and dead-letter record is published with one of these."""
        return lambda: self.done(partition, offset)

    def watermark(self, partition: Hashable) -> int | None:
        state = self._partitions.get(partition)
        return state.watermark() if state is not None else None

    def next_offset(self, partition: Hashable) -> int | None:
        """One past the highest offset consumed; None for a partition with no record consumed yet."""
        state = self._partitions.get(partition)
        return state.next_offset if state is not None else None

    def num_pending(self, partition: Hashable | None = None) -> int:
        if partition is not None:
            state = self._partitions.get(partition)
            return len(state.pending) if state is not None else 0
        return sum(len(s.pending) for s in self._partitions.values())

    def to_commit(self) -> dict[Hashable, int]:
        """Watermarks that moved past what was last committed; commit these, then call `committed`."""
        out = {}
        for partition, state in self._partitions.items():
            mark = state.watermark()
            if state.last_committed is None or mark > state.last_committed:
                out[partition] = mark
        return out

    def committed(self, offsets: dict[Hashable, int]) -> None:
        for partition, offset in offsets.items():
            state = self._partitions.get(partition)
            if state is not None and (state.last_committed is None or offset > state.last_committed):
                state.last_committed = offset
                if offset > state.floor:
                    state.floor = offset
                    state.behind_since = time.monotonic()

    def commit_progress(self) -> list[tuple[Hashable, int, int, float]]:
        """(partition, committed offset, consumed offset, seconds stalled) of every partition: the consumed
        offset is one past the highest record read; stalled is how long records past the committed offset have
        waited without it moving (0 while everything read is committed). Read from the metrics thread: the
        copy of the table is one C call, atomic under the GIL."""
        now = time.monotonic()
        return [(partition, state.floor, state.next_offset,
                 now - state.behind_since if state.next_offset > state.floor else 0.0)
                for partition, state in list(self._partitions.items())]
