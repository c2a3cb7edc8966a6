"""Per-partition commit watermark: which offset is safe to commit when requests finish out of order.

Kafka's committed value is the *next* offset to read, so after a restart the group resumes exactly there.
Under continuous batching request 7 may finish before request 5; committing 8 then would lose 5 if the
worker died. The watermark is therefore the lowest offset consumed but not yet done, or one past the
highest consumed offset when nothing is pending. "Done" means the request's final record (or dead-letter
record, for records that never reach the engine) was acknowledged by Kafka, not merely produced.

Pure Python, no aiokafka: partitions are any hashable key (the transport uses TopicPartition).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if self.floor < 0:
            self.floor = self.last_committed if self.last_committed is not None else self.next_offset
        self.behind_since = time.monotonic()

    def track(self, offset: int) -> bool:
        if offset < self.next_offset:
            # Below next_offset and not pending means done already (a refetch after a seek back): tracking it
            # again could move the watermark backwards, which Kafka would honour.
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

    def watermark(self) -> int:
        while self.heap and self.heap[0] not in self.pending:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else self.next_offset


class OffsetTracker:
    """Watermarks of every assigned partition; the transport calls it from the event loop only."""

    def __init__(self) -> None:
        self._partitions: dict[Hashable, PartitionWatermark] = {}

    def assign(self, partition: Hashable, position: int, committed: int | None = None) -> None:
        """Start tracking a partition whose next record to read is `position`."""
        self._partitions[partition] = PartitionWatermark(next_offset=position, last_committed=committed)

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
