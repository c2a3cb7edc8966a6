"""The autoscaling simulation (benchmarks/sim_autoscale.py): the estimate follows a load step within a few
seconds and settles near the workers the offered load needs, and the fleet it sizes never lets a priority's
estimated wait pass its budget (nothing would be shed)."""

from benchmarks.sim_autoscale import Scenario, simulate


def test_the_estimate_follows_a_load_step_and_the_fleet_keeps_the_budgets():
    summary = simulate(Scenario())["summary"]
    assert summary["step_up_estimate_90pct_s"] < 15.0  # the arrival window is 10 s
    assert summary["step_down_estimate_110pct_s"] < 15.0
    assert summary["steady_high_median_error"] < 0.1
    assert summary["steady_after_median_error"] < 0.15
    # The step triples the load on 2 workers; 6 are ready a load time (60 s) and a poll after it.
    assert summary["step_up_ready_s"] < 60.0 + 2 * 15.0
    assert all(ratio < 1.0 for ratio in summary["max_est_wait_over_budget"])
