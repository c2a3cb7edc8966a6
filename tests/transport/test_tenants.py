"""Tenants: fair share inside a priority, quotas, labels of bounded cardinality, cache namespaces. Pure parts on
their own, then the intake and dispatcher against in-memory Kafka clients (test_intake.build)."""

from __future__ import annotations

import math
import random
import time

import pytest

from worker.engine.api import RequestOutput
from worker.transport.load.tenant_book import cache_salt_of
from worker.transport.load.tenants import OTHER_LABEL, FairShare, Quota, Quotas, TenantLabels
from tests.transport.test_intake import build, send


# ---- fair share (pure) ------------------------------------------------------------------------------------


def serve_backlogged(fair: FairShare, tenants: list[str], cost: dict[str, float], num: int) -> dict[str, float]:
    """Pick `num` times among always-backlogged tenants, charging each pick its tenant's cost."""
    served = dict.fromkeys(tenants, 0.0)
    for tenant in tenants:
        fair.lift(1, tenant, [t for t in tenants if t != tenant])
    for _ in range(num):
        tenant = fair.pick(1, tenants)
        fair.start_tag(1, tenant)
        fair.charge(1, tenant, cost[tenant])
        served[tenant] += cost[tenant]
    return served


def test_backlogged_tenants_get_equal_tokens_whatever_their_request_sizes():
    served = serve_backlogged(FairShare(3), ["a", "b", "c"], {"a": 1000, "b": 100, "c": 10}, 30_000)
    total = sum(served.values())
    for tenant in "abc":
        assert served[tenant] / total == pytest.approx(1 / 3, abs=0.02)


def test_weights_divide_the_tokens():
    served = serve_backlogged(FairShare(3, weights={"a": 2.0}), ["a", "b"], {"a": 100, "b": 100}, 30_000)
    assert served["a"] / served["b"] == pytest.approx(2.0, rel=0.02)


def test_an_idle_tenant_banks_at_most_the_credit():
    fair = FairShare(3, max_credit_tokens=500)
    fair.lift(1, "busy", [])
    fair.charge(1, "busy", 100_000)  # served alone for a long time
    fair.start_tag(1, "busy")
    fair.lift(1, "back", ["busy"])
    assert fair.counter(1, "back") == fair.counter(1, "busy") - 500
    # It is served first, but only for about the credit's worth before they alternate.
    num_first = 0
    while fair.pick(1, ["busy", "back"]) == "back":
        fair.charge(1, "back", 100)
        num_first += 1
    assert num_first == 5


def test_tenants_arriving_together_start_even_and_the_credit_does_not_compound():
    """Each tenant that becomes backlogged is lifted at most the credit below where service has reached, not below
    the lowest counter of the others: one still spending its own credit would otherwise pass that credit on to
    each tenant after it, one bound lower each time (the fourth of four tenants arriving together started 6,144
    tokens ahead of the first, and with a worker serving ~150 tokens/s the first waited 40 s)."""
    fair = FairShare(3, max_credit_tokens=2048)
    tenants = ["a", "b", "c", "d"]
    for i, tenant in enumerate(tenants):
        fair.lift(1, tenant, tenants[:i])
    assert {fair.counter(1, t) for t in tenants} == {-2048.0}
    served = dict.fromkeys(tenants, 0.0)
    for _ in range(400):  # 100-token requests: each tenant gets its turn from the start
        tenant = fair.pick(1, tenants)
        fair.start_tag(1, tenant)
        fair.charge(1, tenant, 100)
        served[tenant] += 100
        assert max(served.values()) - min(served.values()) <= 100
    # A new tenant now: the credit below the others, who are in step.
    fair.lift(1, "e", tenants)
    assert fair.counter(1, "e") == min(fair.counter(1, t) for t in tenants) - 2048


def test_a_tenant_that_becomes_backlogged_goes_ahead_of_a_floods_requests_not_started():
    """A flood keeps the engine full: 16 requests running, 16 more charged on entry but waiting for a seat. A calm
    tenant's request must be tagged ahead of every one of those waiting (the engine orders by the tag) and of the
    newest running one (its preemption victim), not behind the charges of requests that have not run."""
    from worker.engine.api import EngineRequest, fair_preempts

    fair = FairShare(3, max_credit_tokens=2048)
    fair.lift(1, "flood", [])
    cost = 136.0
    running, waiting = [], []
    for i in range(32):
        tag = fair.start_tag(1, "flood")
        fair.charge(1, "flood", cost)
        fair.add_pending(1, "flood", cost)
        (running if i < 16 else waiting).append(EngineRequest(f"f{i}", fair_tag=tag, tenant="flood"))
    for _ in running:
        fair.started(1, "flood", cost)
    fair.lift(1, "calm", ["flood"])
    calm = EngineRequest("c", fair_tag=fair.start_tag(1, "calm"), tenant="calm")
    assert all(calm.fair_tag < w.fair_tag for w in waiting)
    assert fair_preempts(calm, running[-1], [r.tenant for r in running])
    # Counting the waiting ones' charges in, the calm request would be tagged after every running one: it could
    # preempt none, and would wait for seats behind a waiting one.
    counted = FairShare(3, max_credit_tokens=2048)
    counted.lift(1, "flood", [])
    for _ in range(32):
        counted.start_tag(1, "flood")
        counted.charge(1, "flood", cost)
    counted.lift(1, "calm", ["flood"])
    late = EngineRequest("c", fair_tag=counted.start_tag(1, "calm"), tenant="calm")
    assert not fair_preempts(late, running[-1], [r.tenant for r in running])
    assert late.fair_tag > waiting[0].fair_tag
    # A request that ends without starting gives its pending charge back too, once.
    fair.started(1, "flood", cost * 16)
    fair.started(1, "flood", cost)
    assert fair._pending[1] == {}


def test_over_share_and_contention_follow_recent_reads():
    fair = FairShare(3, contention_window_s=30)
    assert not fair.contended(1, 0.0)
    fair.seen(1, "flood", 100, 0.0)
    assert fair.over_share(1, "flood", 0.0) and not fair.contended(1, 0.0)  # alone: at its share
    for i in range(100):
        fair.seen(1, "flood", 100, i * 0.1)
        if i % 10 == 0:
            fair.seen(1, "small", 100, i * 0.1)
    assert fair.contended(1, 10.0)
    assert fair.over_share(1, "flood", 10.0) and not fair.over_share(1, "small", 10.0)
    assert not fair.over_share(1, "never-seen", 10.0)
    assert not fair.contended(1, 100.0)  # both quiet for longer than the window


def test_two_tenants_of_nearly_equal_rates_share_the_shedding():
    """Neither of two tenants reading at nearly the same rate is over its share, so shedding falls on both alike:
    compared with the mean exactly, the one a little ahead by chance had every new request shed, the other none."""
    fair = FairShare(3)
    for i in range(200):
        fair.seen(1, "a", 100, i * 0.05)
        if i % 30 != 0:  # b reads about 3 % less
            fair.seen(1, "b", 100, i * 0.05 + 0.01)
    assert fair.over_share(1, "a", 10.0) and fair.over_share(1, "b", 10.0)
    fair.seen(1, "flood", 100_000, 10.0)  # now one far ahead: only it is over
    assert fair.over_share(1, "flood", 10.0) and not fair.over_share(1, "a", 10.0)


def test_fair_share_state_stays_bounded_under_distinct_tenant_names():
    fair = FairShare(3, max_tenants=100)
    rng = random.Random(0)
    for i in range(5000):
        tenant = f"t{rng.randrange(10**9)}"
        fair.lift(1, tenant, [])
        fair.charge(1, tenant, 10)
        fair.seen(1, tenant, 10, i * 0.001)
    assert fair.num_tenants() <= 100 and len(fair._seen[1]) <= 65


# ---- quotas and labels (pure) -----------------------------------------------------------------------------


def test_a_token_bucket_refills_at_its_rate_up_to_its_burst():
    quotas = Quotas({"a": Quota(rate_tokens_per_s=100, burst_tokens=1000)})
    assert quotas.wait_s("a", 1000, 0.0) == 0 and quotas.wait_s("nobody", 10**9, 0.0) == 0
    quotas.take("a", 1000, 0.0)
    assert quotas.wait_s("a", 200, 0.0) == pytest.approx(2.0)
    assert quotas.wait_s("a", 200, 2.0) == 0
    assert quotas.level("a", 100.0) == 1000  # never above the burst
    quotas.take("a", 1500, 100.0)  # a correction may take it below zero
    assert quotas.over_quota("a", 100.0) and quotas.wait_s("a", 5000, 100.0) == pytest.approx(15.0)
    frozen = Quotas(default=Quota(rate_tokens_per_s=0, burst_tokens=10))
    frozen.take("anyone", 5, 0.0)
    assert math.isinf(frozen.wait_s("anyone", 10, 1000.0))


def test_labels_name_the_top_tenants_and_the_rest_share_other():
    labels = TenantLabels(max_labels=2, refresh_s=0.0)
    for i in range(50):
        labels.observe(f"small-{i}", 1, 0.0)
    labels.observe("big", 1000, 1.0)
    labels.observe("bigger", 5000, 2.0)
    assert labels.labelled == {"big", "bigger"}
    assert labels.label("small-3") == OTHER_LABEL and labels.label("") == "none"
    assert len(labels._traffic) <= labels.max_tracked


def test_cache_namespaces_are_unambiguous():
    assert cache_salt_of("", None) is None
    names = {cache_salt_of(t, s) for t, s in [("a", None), ("", "a"), ("a", "b"), ("a\"", "b"), ("a", "\"b")]}
    assert len(names) == 5


# ---- through the intake and the dispatcher ----------------------------------------------------------------


async def flood_then_calm(w):
    """Eight requests of a flood, then three of a calm tenant, read and admitted as far as the engine's cap."""
    for i in range(8):
        send(w, 1, f"flood-{i}", tenant="flood")
    for i in range(3):
        send(w, 1, f"calm-{i}", tenant="calm")
    await w.intake.fetch_once()
    w.dispatcher.admit()
    return w


async def test_the_engine_takes_tenants_in_turn_not_in_arrival_order():
    w = await flood_then_calm(build(max_in_engine=6))
    tenants = [r.request_id.split("-")[0] for r in w.engine.added]
    assert tenants.count("calm") == 3, tenants  # served in step with the flood, not after its eight
    tags = {r.request_id.split("#")[0]: r.fair_tag for r in w.engine.added}
    third_flood = sorted(tag for request_id, tag in tags.items() if request_id.startswith("flood"))[2]
    assert tags["calm-2"] <= third_flood  # the engine's waiting order keeps the fair order too (in step: a tie)


async def test_without_credit_backlogged_tenants_alternate_request_by_request():
    w = await flood_then_calm(build(max_in_engine=6, tenant_max_credit_tokens=0))
    tenants = [r.request_id.split("-")[0] for r in w.engine.added]
    assert tenants == ["flood", "calm"] * 3, tenants


async def test_a_full_contended_queue_sheds_the_tenant_holding_most_of_it():
    w = build(max_in_engine=0, max_waiting=4, resume_waiting=2)
    for i in range(6):
        send(w, 1, f"flood-{i}", tenant="flood")
    await w.intake.fetch_once()  # one tenant: the poll overshoots, nothing shed (pausing is the backpressure)
    assert len(w.queue) == 6 and not w.publisher.finals()
    assert w.lifecycle.overflow_priorities(0.0) == frozenset()
    send(w, 0, "urgent", tenant="calm")  # a second tenant, read at another priority: not contention at 1
    await w.intake.fetch_once()
    assert w.lifecycle.overflow_priorities(time.monotonic()) == frozenset()
    # Two tenants read at priority 1 (it was read before the queue filled): the queue overflows.
    w = build(max_in_engine=0, max_waiting=4, resume_waiting=2)
    for i in range(5):
        send(w, 1, f"flood-{i}", tenant="flood")
    send(w, 1, "calm-0", tenant="calm")
    await w.intake.fetch_once()
    assert w.lifecycle.overflow_priorities(time.monotonic()) == {0, 1, 2} - {0, 2}
    for i in range(5, 9):
        send(w, 1, f"flood-{i}", tenant="flood")
    send(w, 1, "calm-1", tenant="calm")
    await w.intake.fetch_once()
    finals = w.publisher.finals()
    queued = [q.request.id for q in w.queue]
    assert "calm-0" in queued and "calm-1" in queued  # read past the full queue, and kept
    shed = sorted(rid for rid, f in finals.items() if f.reason == "shed")
    assert len(shed) >= 4 and all(rid.startswith("flood") for rid in shed), finals
    assert {f"flood-{i}" for i in range(5, 9)} <= set(shed)  # read while it was full: the flood's own go
    assert "over its fair share" in finals[shed[0]].message
    assert len(w.queue) <= 5


async def test_shedding_spares_tenants_under_their_share():
    w = build(max_queue_time_s=[10.0, 1.0, 1.0])
    for i in range(20):
        send(w, 1, f"flood-{i}", tenant="flood")
    send(w, 1, "calm-0", tenant="calm")
    await w.intake.fetch_once()
    w.service.rate.rate = w.service.mean_cost(1) / 10  # ten seconds a request: priority 1 is hopeless
    decision = w.load_control.decide([0, 50, 0], w.queue.num_waiting_by_priority(), 0.0, now=1.0,
                                     waiting_tokens=w.queue.tokens_by_priority())
    assert 1 in decision.newly_shed
    w.intake.apply(decision)
    finals = w.publisher.finals()
    assert all(finals[f"flood-{i}"].reason == "shed" for i in range(20))
    assert "calm-0" not in finals and [q.request.id for q in w.queue] == ["calm-0"]
    send(w, 1, "calm-1", tenant="calm")
    send(w, 1, "flood-x", tenant="flood")
    await w.intake.fetch_once()
    finals = w.publisher.finals()
    assert finals["flood-x"].reason == "shed" and "calm-1" not in finals


async def test_over_quota_is_rejected_with_when_to_retry():
    w = build(tenant_quotas={"small": {"rate_tokens_per_s": 10, "burst_tokens": 300}})
    for i in range(3):
        send(w, 1, f"small-{i}", tenant="small", max_new_tokens=100)
    send(w, 1, "other-0", tenant="other", max_new_tokens=100)
    await w.intake.fetch_once()
    finals = w.publisher.finals()
    over = [rid for rid, f in finals.items() if f.reason == "quota_exceeded"]
    assert over and all(rid.startswith("small") for rid in over)
    assert finals[over[0]].status == "rejected" and " s" in finals[over[0]].message
    assert "other-0" in [q.request.id for q in w.queue]
    snap = {t.label: t for t in w.tenants.snapshot(0.0, w.queue.num_waiting_by_tenant())}
    assert snap["small"].num_over_quota == len(over) and snap["small"].num_finals == {"rejected": len(over)}


async def test_over_quota_deferred_waits_for_its_bucket():
    w = build(tenant_quotas={"small": {"rate_tokens_per_s": 1000, "burst_tokens": 150}},
              tenant_quota_action="defer")
    send(w, 1, "small-0", tenant="small", max_new_tokens=100)
    send(w, 1, "small-1", tenant="small", max_new_tokens=100)
    send(w, 1, "other-0", tenant="other", max_new_tokens=100)
    await w.intake.fetch_once()
    assert not w.publisher.finals()
    w.dispatcher.admit()
    added = sorted(r.request_id.split("#")[0] for r in w.engine.added)
    assert added == ["other-0", "small-0"]  # small-1 waits for its bucket
    import asyncio
    await asyncio.sleep(0.15)
    w.dispatcher.admit()
    assert "small-1" in [r.request_id.split("#")[0] for r in w.engine.added]


async def test_the_engine_gets_the_cache_namespace_and_tokens_served_correct_the_charge():
    w = build()
    send(w, 1, "a", tenant="acme")
    send(w, 1, "b", tenant="acme", cache_salt="secret")
    send(w, 1, "c")
    await w.intake.fetch_once()
    w.dispatcher.admit()
    salts = {r.request_id.split("#")[0]: r.cache_salt for r in w.engine.added}
    assert salts["c"] is None and salts["a"] != salts["b"] and None not in (salts["a"], salts["b"])
    charged = w.tenants.fair.counter(1, "acme")
    engine_id = next(r.request_id for r in w.engine.added if r.request_id.startswith("a#"))
    await w.streamer.handle([RequestOutput(engine_id, [1, 2, 3], "abc", True, "length", num_prompt_tokens=2,
                                           num_output_tokens=3)])
    # 5 tokens served, far fewer than the expected output it was charged on entry: the counter gives back.
    assert w.tenants.fair.counter(1, "acme") < charged


async def test_tenant_series_and_status_are_bounded_by_the_label_count():
    from worker.transport.metrics import WorkerMetrics
    from worker.transport.status_report import TenantCollector

    w = build(tenant_max_labels=2)
    metrics = WorkerMetrics.create()
    TenantCollector(metrics.registry, w.tenants)
    for i in range(30):
        send(w, 1, f"r-{i}", tenant="big" if i < 20 else f"small-{i}")
    send(w, 1, "anon")
    await w.intake.fetch_once()
    snapshot = w.tenants.snapshot(time.monotonic(), w.queue.num_waiting_by_tenant())
    labels = {t.label for t in snapshot}
    assert "big" in labels and labels <= {"big", "other", "none"} | {f"small-{i}" for i in range(20, 30)}
    assert len(labels) <= 2 + 2
    assert sum(t.num_waiting for t in snapshot) == 31
    text = metrics.exposition()
    assert 'llm_worker:tenant_waiting{tenant="big"} 20.0' in text
    assert len({line.split("}")[0] for line in text.splitlines() if line.startswith("llm_worker:tenant_waiting")}) <= 4


async def test_each_tenants_wait_before_its_first_step_is_split_by_stage():
    """Where a tenant's time goes (tenant_wait_seconds{tenant, stage}): unread in Kafka, in the local queue, in
    the engine's waiting queue. A flood's requests held in the local queue show there, a calm tenant's do not."""
    from worker.transport.metrics import WorkerMetrics
    from worker.transport.status_report import TenantCollector

    w = build(max_in_engine=3)
    metrics = WorkerMetrics.create()
    TenantCollector(metrics.registry, w.tenants)
    for i in range(6):
        send(w, 1, f"flood-{i}", tenant="flood")
    await w.intake.fetch_once()
    w.dispatcher.admit()  # three flood requests enter the engine; three wait in the local queue
    first = [r.request_id for r in w.engine.added]
    assert len(first) == 3
    # The three in the engine were half a second old when read.
    for queued in (s.queued for s in w.streamer.streams.values()):
        queued.timestamp_ms, queued.read_ms = queued.read_ms - 500.0, queued.read_ms
    w.engine.added.clear()
    await w.streamer.handle([RequestOutput(rid, [1], "a", True, "length", num_prompt_tokens=1, num_output_tokens=1,
                                           first_scheduled_time=time.monotonic()) for rid in first])
    for queued in w.queue:  # read as soon as written, 2 s ago
        queued.timestamp_ms, queued.read_ms = queued.timestamp_ms - 2000, queued.read_ms - 2000.0
    send(w, 1, "calm-0", tenant="calm")
    await w.intake.fetch_once()
    w.dispatcher.admit()
    later = [r.request_id for r in w.engine.added]
    assert len(later) == 3 and any(r.startswith("calm") for r in later)
    await w.streamer.handle([RequestOutput(rid, [1], "a", True, "length", num_prompt_tokens=1, num_output_tokens=1,
                                           first_scheduled_time=time.monotonic() + 0.3) for rid in later])
    w.tenants.snapshot(time.monotonic(), w.queue.num_waiting_by_tenant())
    text = metrics.exposition()

    def sample(name: str, tenant: str, stage: str) -> float:
        prefix = f'llm_worker:tenant_wait_seconds_{name}{{stage="{stage}",tenant="{tenant}"}} '
        return next(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))

    assert sample("count", "flood", "kafka") == 5 and sample("count", "calm", "kafka") == 1
    assert 1.5 - 0.1 < sample("sum", "flood", "kafka") < 1.5 + 0.1  # three records half a second old
    assert sample("sum", "flood", "local_queue") > 2 * 2.0 - 0.2  # two of them held 2 s
    assert sample("sum", "calm", "local_queue") < 0.2  # the calm one went ahead of the flood's held ones
    assert 0.25 < sample("sum", "calm", "engine") < 0.4  # scheduled 0.3 s after it was handed over


def test_what_other_workers_served_a_tenant_counts_against_it_here():
    """The fleet's fair share (load/fleet_share.py): another worker's status says it served tenant a 5,000 tokens
    since its last record; here a then waits behind b, which no worker served. A worker's first record only sets
    where it stands (a tenant it reports later starts from 0), its own records are not charged, a smaller figure
    is no service, and "other" is never charged."""
    from schemas.status import TenantStatus, WorkerStatus
    from worker.transport.load.fleet_share import FleetShare
    from worker.transport.load.tenant_book import TenantBook
    from worker.worker_settings import WorkerSettings

    book = TenantBook.from_settings(WorkerSettings(), 3)
    share = FleetShare(book, "here")

    def status(worker: str, served: dict[str, float]) -> WorkerStatus:
        return WorkerStatus(worker_id=worker, ts_ms=1, tenants=[
            TenantStatus(tenant=t, served_by_priority=[0.0, tokens]) for t, tokens in served.items()])

    for tenant in ("a", "b"):
        book.fair.charge(1, tenant, 0.0)  # both even, where this worker alone would leave them
    before = {t: book.fair.counter(1, t) for t in ("a", "b")}
    assert book.fair.pick(1, ["a", "b"]) == "a"  # even: the first given
    share.observe(status("w2", {"a": 10_000, "other": 50_000}))  # a baseline
    share.observe(status("here", {"a": 99_000}))  # its own record
    assert {t: book.fair.counter(1, t) for t in ("a", "b")} == before
    share.observe(status("w2", {"a": 15_000, "other": 90_000}))
    assert book.fair.counter(1, "a") == before["a"] + 5_000 and book.fair.counter(1, "b") == before["b"]
    assert book.fair.pick(1, ["a", "b"]) == "b"
    share.observe(status("w2", {"a": 100}))  # the label given up and given again: counting from 100
    share.observe(status("w2", {"a": 600, "b": 300}))  # b reported for the first time: all 300 are new
    assert book.fair.counter(1, "a") == before["a"] + 5_500 and book.fair.counter(1, "b") == before["b"] + 300
    assert share.num_charged_tokens == 5_800
    assert book.fair.counter(1, "other") == book.fair.counter(1, "never-seen")  # "other" is never charged


def test_a_request_running_on_another_worker_counts_from_its_start():
    """Another worker's status carries the tokens charged to the requests in its engine (in_flight_by_priority):
    they count here as soon as they enter there, and when they end the figure moves to served without counting
    twice; a request that ended under its charge gives the difference back."""
    from schemas.status import TenantStatus, WorkerStatus
    from worker.transport.load.fleet_share import FleetShare
    from worker.transport.load.tenant_book import TenantBook
    from worker.worker_settings import WorkerSettings

    book = TenantBook.from_settings(WorkerSettings(), 2)
    share = FleetShare(book, "here")

    def status(served: float, in_flight: float) -> WorkerStatus:
        return WorkerStatus(worker_id="w2", ts_ms=1, tenants=[
            TenantStatus(tenant="a", served_by_priority=[0.0, served], in_flight_by_priority=[0.0, in_flight])])

    book.fair.charge(1, "a", 0.0)
    start = book.fair.counter(1, "a")
    share.observe(status(1_000, 200))  # a baseline
    share.observe(status(1_000, 500))  # three hundred tokens' worth entered its engine there
    assert book.fair.counter(1, "a") == start + 300
    share.observe(status(1_500, 0))  # all ended: 500 charged, 500 served
    assert book.fair.counter(1, "a") == start + 300
    share.observe(status(1_560, 0.0))  # a request charged 100 ... ended after 60 (entered and ended unseen)
    assert book.fair.counter(1, "a") == start + 360
    share.observe(status(1_560, 100))
    share.observe(status(1_590, 0))  # charged 100, served 30: 70 given back
    assert book.fair.counter(1, "a") == start + 390


def test_the_book_reports_what_its_engine_holds_per_tenant():
    """TenantSnapshot.in_flight_by_priority: the streamer's charges of the requests in the engine, summed per
    label and priority; the served figures only once requests end."""
    from worker.transport.load.tenant_book import TenantBook
    from worker.worker_settings import WorkerSettings

    book = TenantBook.from_settings(WorkerSettings(), 3)

    def in_flight(charged: dict[tuple[str, int], float]) -> dict[str, tuple[float, ...]]:
        return {s.label: s.in_flight_by_priority for s in book.snapshot(0.0, {}, charged)}

    for tenant in ("a", "b"):
        book.note_read(1, tenant, 100.0, 0.0)  # read first: each gets its own label
    for priority, tenant, tokens in ((1, "a", 120.0), (2, "a", 30.0), (1, "b", 50.0)):
        book.dispatched(priority, tenant, tokens, 0.0)
    got = in_flight({("a", 1): 120.0, ("a", 2): 30.0, ("b", 1): 50.0})
    assert got["a"] == (0.0, 120.0, 30.0) and got["b"] == (0.0, 50.0)
    book.served(1, "a", 10, 40, 120.0, 0.0)  # a's first request ended; b's left with its partition
    got = in_flight({("a", 2): 30.0})
    assert got["a"] == (0.0, 0.0, 30.0) and got["b"] == ()
    assert [s.served_by_priority for s in book.snapshot(0.0, {}) if s.label == "a"] == [(0.0, 50.0)]


def test_with_the_fleets_counters_an_idle_tenant_banks_no_credit_unless_asked():
    """A tenant idle on this worker may be busy on another: with WORKER_TENANT_FLEET_SHARE the credit defaults to
    0 (pure VTC), without it to 2,048; a value set explicitly holds either way."""
    from worker.transport.load.tenant_book import TenantBook
    from worker.worker_settings import WorkerSettings

    def credit(**fields) -> float:
        return TenantBook.from_settings(WorkerSettings(**fields), 3).fair.max_credit_tokens
    assert credit() == 2048.0 and credit(tenant_fleet_share=True) == 0.0
    assert credit(tenant_fleet_share=True, tenant_max_credit_tokens=500) == 500.0
    assert credit(tenant_max_credit_tokens=0) == 0.0
