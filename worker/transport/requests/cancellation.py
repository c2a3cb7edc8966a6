"""Where a request's cancel is decided (docs/delivery.md, "Cancellation"), wherever the request is:

- read after its cancel (or redelivered after one), or at the head of the local queue with a live cancel:
  answered `cancelled` and never run (`stops`);
- waiting in the local queue when the cancel arrives, or set aside during a rebalance and back in the queue:
  answered at once (`arrived`, `sweep`);
- in the engine, waiting or running: its streams are marked and the engine thread aborts them before its next
  step, which frees their KV blocks; the abort's output ends each `cancelled` with the text so far (streamer.py).

Not here (not read yet, finished, another worker's): the id stays in CancelledIds (cancels.py) for a request
read later.
"""

from __future__ import annotations

import time

from worker.transport.requests.answers import Answers
from worker.transport.requests.cancels import Cancel, CancelledIds
from worker.transport.requests.engine_client import EngineClient
from worker.transport.requests.local_queue import LocalQueue, QueuedRequest
from worker.transport.requests.streamer import Streamer


class Cancellations:
    def __init__(self, ids: CancelledIds, queue: LocalQueue, streamer: Streamer, engine: EngineClient,
                 answers: Answers) -> None:
        self.ids, self.queue, self.streamer, self.engine, self.answers = ids, queue, streamer, engine, answers

    def of(self, request_id: str) -> Cancel | None:
        """The live cancel of a wire request id, if any."""
        return self.ids.get(request_id, time.time() * 1000.0)

    def stops(self, queued: QueuedRequest) -> bool:
        """A request about to be queued or handed to the engine: True, and it is answered `cancelled`, when its
        cancel is known."""
        cancel = self.of(queued.request.id)
        if cancel is None:
            return False
        self.answers.cancelled(queued, cancel.reason, "before it ran")
        return True

    def arrived(self, cancel: Cancel) -> None:
        """A cancel record was read: its request stops wherever it is here."""
        for queued in self.queue.take_where(lambda queued: queued.request.id == cancel.request_id):
            self.answers.cancelled(queued, cancel.reason, "while it waited in the local queue")
        self.engine.abort(self.streamer.cancel(cancel.request_id, cancel.reason))

    def sweep(self) -> None:
        """Answer every request of the local queue whose cancel is known (requests set aside during a rebalance
        come back to the queue without being looked at)."""
        for queued in self.queue.take_where(lambda queued: self.of(queued.request.id) is not None):
            cancel = self.of(queued.request.id)
            self.answers.cancelled(queued, cancel.reason if cancel else "", "while it waited in the local queue")
