"""The ids this worker knows to be cancelled: a bounded map with a time to live. Pure (no Kafka, no asyncio).

Fed by the control reader (control.py) with every cancel record of the control topic, whichever worker holds
the request; asked by lifecycle.py, which decides what a cancel does wherever its request is.

An entry lives `ttl_s` from its record's timestamp (bounded by now, so a producer clock running ahead cannot
make one live longer), and at most `max_ids` entries are kept (the oldest go first). Both bounds only ever
forget cancels; a forgotten cancel means the request runs, never that another one is cancelled.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str
    reason: str
    """The producer's free text ('' when none)."""
    timestamp_ms: float
    """The cancel record's timestamp (epoch ms), bounded by the time it was read."""
    expires_ms: float


class CancelledIds:
    def __init__(self, ttl_s: float, max_ids: int) -> None:
        if ttl_s <= 0 or max_ids < 1:
            raise ValueError(f"ttl_s must be > 0 and max_ids >= 1, got {ttl_s}, {max_ids}")
        self.ttl_ms = ttl_s * 1000.0
        self.max_ids = max_ids
        self._entries: OrderedDict[str, Cancel] = OrderedDict()
        """In the order added; expiry times nearly follow it (record timestamps of several partitions interleave)."""
        self.num_added = 0
        self.num_expired = 0
        self.num_evicted = 0
        """Dropped before their time because max_ids was reached."""

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, timestamp_ms: float, now_ms: float, reason: str = "") -> Cancel | None:
        """Remember a cancel read now; returns it, or None when it had expired already (an old record read back
        at start-up). A repeated cancel of the same id keeps the first one's reason and renews the time."""
        timestamp_ms = min(timestamp_ms, now_ms)
        expires_ms = timestamp_ms + self.ttl_ms
        if expires_ms <= now_ms:
            return None
        self.expire(now_ms)
        old = self._entries.pop(request_id, None)
        cancel = Cancel(request_id, old.reason if old is not None and not reason else reason, timestamp_ms,
                        max(expires_ms, old.expires_ms if old is not None else 0.0))
        self._entries[request_id] = cancel
        self.num_added += old is None
        while len(self._entries) > self.max_ids:
            self._entries.popitem(last=False)
            self.num_evicted += 1
        return cancel

    def get(self, request_id: str, now_ms: float) -> Cancel | None:
        """The live cancel of this id, if any."""
        cancel = self._entries.get(request_id)
        if cancel is None:
            return None
        if cancel.expires_ms <= now_ms:
            del self._entries[request_id]
            self.num_expired += 1
            return None
        return cancel

    def expire(self, now_ms: float) -> None:
        """Drop expired entries from the oldest on (an entry behind a live one waits for it: harmless)."""
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires_ms > now_ms:
                return
            self._entries.popitem(last=False)
            self.num_expired += 1
