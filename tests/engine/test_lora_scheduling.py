"""Adapter-aware admission in the pure scheduler: with every adapter slot taken, waiting requests whose adapter is
loaded go before one whose adapter would evict another, within a priority and for a bounded number of steps.
The registry is emulated as the engine drives it: an adapter a step needs is loaded, evicting the least recently
used one that no running request uses."""

from __future__ import annotations

import random
from collections import OrderedDict

from tests.engine.fake_runner import FakeRunner, make_request, make_scheduler, step


class Registry:
    """The engine's side of the adapters: loads what a step's requests name (AdapterRegistry.get's policy)."""

    def __init__(self, scheduler, loaded: list[str] = ()) -> None:
        self.scheduler = scheduler
        self.loaded: OrderedDict[str, None] = OrderedDict((name, None) for name in loaded)
        self.num_loads = 0
        scheduler.loaded_adapters = self.loaded

    def after_schedule(self, output) -> None:
        running = {r.adapter for r in self.scheduler.running if r.adapter is not None}
        wanted = {r.adapter for r in self.scheduler.waiting if r.adapter is not None}
        for entry in output.scheduled:
            name = entry.request.adapter
            if name is None:
                continue
            if name in self.loaded:
                self.loaded.move_to_end(name)
                continue
            if len(self.loaded) >= self.scheduler.max_loras:
                victim = next((n for n in self.loaded if n not in running and n not in wanted), None) or next(
                    n for n in self.loaded if n not in running)
                del self.loaded[victim]
            self.loaded[name] = None
            self.num_loads += 1


def drive(scheduler, registry: Registry, runner: FakeRunner) -> list[str]:
    output, _ = step(scheduler, runner)
    registry.after_schedule(output)
    return [e.request_id for e in output.scheduled if e.num_computed_before == 0]


def test_requests_of_loaded_adapters_go_before_one_that_would_evict():
    scheduler = make_scheduler(max_num_seqs=2, max_loras=2, lora_resident_first_steps=4)
    registry, runner = Registry(scheduler, ["a", "b"]), FakeRunner(64, 4)
    for rid, adapter in (("c1", "c"), ("a1", "a"), ("b1", "b")):
        scheduler.add_request(make_request(rid, max_new_tokens=3, adapter=adapter))
    assert drive(scheduler, registry, runner) == ["a1", "b1"]
    assert registry.num_loads == 0 and scheduler.requests["c1"].adapter_waits == 1
    while "c1" in scheduler.requests:
        drive(scheduler, registry, runner)
    assert registry.num_loads == 1  # c loaded once its turn came, nothing else


def test_a_request_waits_for_its_adapter_at_most_the_set_number_of_steps():
    scheduler = make_scheduler(max_num_seqs=1, max_loras=1, lora_resident_first_steps=3)
    registry, runner = Registry(scheduler, ["a"]), FakeRunner(64, 4)
    scheduler.add_request(make_request("c1", max_new_tokens=1, adapter="c"))
    started = []
    for n in range(12):  # a request for the loaded adapter keeps arriving behind it
        scheduler.add_request(make_request(f"a{n}", max_new_tokens=1, adapter="a"))
        started += drive(scheduler, registry, runner)
        if "c1" in started:
            break
    assert started.index("c1") == 3, started  # three requests behind it went first, then it did


def test_a_less_urgent_request_never_goes_before_a_more_urgent_one_for_its_adapter():
    scheduler = make_scheduler(max_num_seqs=1, max_loras=1, lora_resident_first_steps=8)
    registry, runner = Registry(scheduler, ["a"]), FakeRunner(64, 4)
    scheduler.add_request(make_request("urgent-c", max_new_tokens=1, adapter="c", priority=0))
    scheduler.add_request(make_request("later-a", max_new_tokens=1, adapter="a", priority=1))
    assert drive(scheduler, registry, runner) == ["urgent-c"]


def test_no_request_waits_while_a_slot_is_free_with_a_deadline_or_with_the_setting_off():
    for loaded, steps, deadline in ((["a"], 8, None), (["a", "b"], 0, None), (["a", "b"], 8, 60.0)):
        scheduler = make_scheduler(max_num_seqs=1, max_loras=2, lora_resident_first_steps=steps)
        registry, runner = Registry(scheduler, loaded), FakeRunner(64, 4)
        scheduler.add_request(make_request("c1", max_new_tokens=1, adapter="c", deadline=deadline))
        scheduler.add_request(make_request("a1", max_new_tokens=1, adapter="a"))
        assert drive(scheduler, registry, runner) == ["c1"], (loaded, steps, deadline)


def backlog_loads(steps: int, seed: int) -> tuple[int, int]:
    """Adapter loads serving a backlog of 400 requests over 16 adapters (Zipf 1), 8 slots, 8 seats; and the most
    steps any request waited on account of its adapter."""
    rng = random.Random(seed)
    names = [f"ft-{k}" for k in range(16)]
    picks = rng.choices(names, [1 / (k + 1) for k in range(16)], k=400)
    scheduler = make_scheduler(max_num_seqs=8, max_loras=8, lora_resident_first_steps=steps)
    registry, runner = Registry(scheduler), FakeRunner(512, 4)
    requests = [make_request(f"r{i}", num_prompt_tokens=4, max_new_tokens=rng.randint(1, 6), adapter=name)
                for i, name in enumerate(picks)]
    waits = 0
    for request in requests[:32]:
        scheduler.add_request(request)
    pending = requests[32:]
    while scheduler.has_unfinished():
        drive(scheduler, registry, runner)
        waits = max([waits, *(r.adapter_waits for r in scheduler.waiting)])
        while pending and len(scheduler.waiting) < 24:  # the transport keeps the engine's queue topped up
            scheduler.add_request(pending.pop(0))
    return registry.num_loads, waits


def test_a_backlog_loads_fewer_adapters_when_loaded_ones_go_first():
    for seed in range(3):
        in_order, _ = backlog_loads(0, seed)
        resident_first, most_waited = backlog_loads(16, seed)
        assert resident_first <= 0.6 * in_order, (seed, in_order, resident_first)
        assert most_waited <= 16
