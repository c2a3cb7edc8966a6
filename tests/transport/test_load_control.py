"""Load decisions from lag, the local queue and KV usage (pure: no Kafka)."""

from __future__ import annotations

from worker.worker_settings import WorkerSettings
from worker.transport.load.backpressure import Backpressure
from worker.transport.load.load_control import LoadControl
from worker.transport.load.service_model import ServiceModel
from worker.transport.load.shedding import Shedder


def make(rate_per_s: float = 0.0, **overrides) -> LoadControl:
    """Requests of 10 tokens each; capacity rate_per_s requests/s (measured while saturated), or none."""
    settings = WorkerSettings(metrics_port=0, pause_dwell_s=0.0, **overrides)
    service = ServiceModel(3, 64, 512)
    for priority in range(3):
        service.observe_read(priority, 2, 8)
    service.rate.rate = rate_per_s * 10
    return LoadControl(Shedder(list(settings.max_queue_time_s), 3), Backpressure.from_settings(settings, 3), service)


def test_nothing_unread_and_nothing_waiting_is_the_end_of_input():
    control = make()
    assert control.decide([0, 0, 0], [0, 0, 0], 0.0, 0.0).input_ended
    assert not control.decide([0, 1, 0], [0, 0, 0], 0.0, 0.1).input_ended
    assert not control.decide([0, 0, 0], [0, 0, 2], 0.0, 0.2).input_ended


def test_a_cold_worker_sheds_nothing_and_newly_shed_is_reported_once():
    assert make().decide([0, 500, 5000], [0, 0, 0], 0.0, 0.0).shed_priorities == frozenset()
    control = make(rate_per_s=10, max_queue_time_s=[10.0, 10.0, 10.0])
    first = control.decide([0, 50, 200], [0, 0, 0], 0.0, 0.0)
    assert first.newly_shed == {2} and first.shed_priorities == {2}  # (0+50+200)/10 = 25 s > 10 s; p1: 5 s
    again = control.decide([0, 50, 200], [0, 0, 0], 0.0, 0.1)
    assert again.newly_shed == frozenset() and again.shed_priorities == {2}
    assert "priority 2 shed" in again.shed_message(2) and "~2000 tokens" in again.shed_message(2)


def test_shedding_counts_tokens_not_requests():
    control = make(rate_per_s=10, max_queue_time_s=[10.0, 10.0, 10.0])  # 100 tokens/s
    for _ in range(200):  # priority 2's requests now cost about 1000 tokens each
        control.service.observe_read(2, 992, 8)
    decision = control.decide([0, 0, 5], [0, 0, 0], 0.0, 0.0)  # 5 requests of ~1000 tokens: ~50 s
    assert decision.shed_priorities == {2} and decision.shed.est_wait_s[2] > 40
    assert control.decide([0, 50, 0], [0, 0, 0], 0.0, 0.1).shed_priorities == frozenset()  # 500 tokens: 5 s


def test_kv_pressure_pauses_the_least_urgent_priority_but_never_a_shed_one():
    control = make(rate_per_s=10, max_queue_time_s=[10.0, 10.0, 10.0], kv_pause_threshold=0.9)
    decision = control.decide([0, 0, 0], [0, 0, 0], 0.95, 0.0)
    assert decision.pause_reasons == {2: "kv"}
    decision = control.decide([0, 0, 500], [0, 0, 0], 0.95, 1.0)
    assert 2 in decision.shed_priorities and 2 not in decision.pause_reasons
