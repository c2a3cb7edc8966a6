"""The hostile-format benchmark's comparison: each mixed run against the alone runs either side of it."""

from __future__ import annotations

from benchmarks.bench_hostile_formats import mixed_ratios


def test_a_mixed_run_is_held_against_its_neighbouring_alone_runs():
    order = [("alone", False), ("mixed a", True), ("mixed b", True), ("alone #2", False), ("mixed a #2", True),
             ("alone again", False)]
    rates = {"alone": 100.0, "mixed a": 90.0, "mixed b": 110.0, "alone #2": 140.0, "mixed a #2": 126.0,
             "alone again": 140.0}
    assert mixed_ratios(order, rates) == {"mixed a": 0.75, "mixed b": 0.917, "mixed a #2": 0.9}


def test_a_mixed_run_with_an_alone_run_on_one_side_only_is_held_against_that_one():
    assert mixed_ratios([("mixed", True), ("alone", False)], {"mixed": 50.0, "alone": 100.0}) == {"mixed": 0.5}
    assert mixed_ratios([("mixed", True)], {"mixed": 50.0}) == {}
