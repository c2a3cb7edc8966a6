"""The autoscaling simulation (benchmarks/sim_autoscale.py): the estimate follows a load step within a few
seconds and settles near the workers the offered load needs, and the fleet it sizes never lets a priority's
estimated wait pass its budget (nothing would be shed). On the shipped budgets (the bulk priority unbounded)
and with every priority bounded."""

import pytest

from benchmarks.sim_autoscale import Scenario, simulate


@pytest.mark.parametrize("budgets, follow_s", [
    # Shipped: half the load is the unbounded bulk priority, whose backlog asks for nothing; only the arrival
    # rate (a 10 s window) and the bounded priorities' backlog move the estimate.
    (None, 25.0),
    # Every priority bounded: the backlog built during the step pushes the estimate up sooner.
    ((10.0, 30.0, 60.0), 15.0),
])
def test_the_estimate_follows_a_load_step_and_the_fleet_keeps_the_budgets(budgets, follow_s):
    scenario = Scenario() if budgets is None else Scenario(budgets_s=budgets)
    summary = simulate(scenario)["summary"]
    assert summary["step_up_estimate_90pct_s"] < follow_s
    assert summary["step_down_estimate_110pct_s"] < 15.0
    assert summary["steady_high_median_error"] < 0.1
    assert summary["steady_after_median_error"] < 0.15
    # The step triples the load on 2 workers; 6 are ready a load time (60 s) and at most two polls after it.
    assert summary["step_up_ready_s"] <= 60.0 + 2 * 15.0
    assert all(ratio < 1.0 for ratio in summary["max_est_wait_over_budget"] if ratio is not None)
