"""Fair share across the fleet: the tokens other workers served each tenant, charged to this worker's counters.

Each worker's fair share (tenants.FairShare) counts only what it served, and sees only its partitions: a tenant
whose requests reach every partition is served by every worker, one on a few partitions by a few, and each
worker splitting its own service evenly gives the first the larger share of the fleet. Every worker publishes,
per tenant label and priority, the tokens it served since it started and the tokens charged on entry to the
requests in its engine now (the status topic's `tenants[].served_by_priority` and `in_flight_by_priority`);
each worker reads the others' records and charges the growth of their sum since the last one to the tenant's
counter at that priority, as if it had served those tokens itself. That sum moves as the publishing worker's own
counter does (a request counts when it enters the engine, corrected when it ends), so a request running
elsewhere counts here from its start, not only once it ends. A tenant served elsewhere then waits here behind
one that is not, and the fleet converges on the weighted split. What it costs: one status record per worker per
WORKER_STATUS_INTERVAL_S read by every worker, and a staleness of that interval. Tenants summed as "other" (past
WORKER_TENANT_MAX_LABELS) are not charged: only labelled tenants share the fleet's counters.

Pure: fed decoded status records by the worker's status reader (kafka/status_reader.py).
"""

from __future__ import annotations

from worker.transport.load.tenant_book import TenantBook
from worker.transport.load.tenants import DEFAULT_TENANT, NO_TENANT_LABEL, OTHER_LABEL

MAX_TRACKED = 10_000
"""(worker, tenant, priority) entries remembered; past it the table starts again (one record of each worker
then only sets a baseline)."""


class FleetShare:
    def __init__(self, book: TenantBook, worker_id: str) -> None:
        self.book = book
        self.worker_id = worker_id
        self._last: dict[tuple[str, str, int], tuple[float, float]] = {}
        """(worker, tenant label, priority) -> (tokens served, tokens in flight) there when last heard from."""
        self._workers: set[str] = set()
        """Workers heard from."""
        self.num_charged_tokens = 0.0
        """Tokens served elsewhere and charged here, since the start."""

    def observe(self, status) -> None:
        """A worker's status record (schemas.status.WorkerStatus): charge what it served since its last one."""
        if status.worker_id == self.worker_id:
            return
        if len(self._last) > MAX_TRACKED:
            self._last.clear()
            self._workers.clear()
        # The first record of a worker only sets where it stands: what it served before this worker heard of it
        # is not charged. After that, a tenant label it had not reported yet starts from 0.
        baseline = status.worker_id not in self._workers
        self._workers.add(status.worker_id)
        num_priorities = self.book.fair.num_priorities
        for tenant_status in status.tenants or ():
            label = tenant_status.tenant
            if label == OTHER_LABEL:
                continue
            tenant = DEFAULT_TENANT if label == NO_TENANT_LABEL else label
            served_by = tenant_status.served_by_priority
            in_flight_by = tenant_status.in_flight_by_priority
            for priority in range(min(num_priorities, max(len(served_by), len(in_flight_by)))):
                served = served_by[priority] if priority < len(served_by) else 0.0
                in_flight = in_flight_by[priority] if priority < len(in_flight_by) else 0.0
                key = (status.worker_id, label, priority)
                last_served, last_in_flight = self._last.get(key, (0.0, 0.0))
                self._last[key] = (served, in_flight)
                # A smaller served figure: the label was dropped and given again (its counts restart).
                if baseline or served < last_served:
                    continue
                grown = served - last_served + in_flight - last_in_flight  # < 0: requests ended under their charge
                if grown:
                    self.book.fair.charge(priority, tenant, grown)
                    self.num_charged_tokens += grown
