"""The step-time model: online least squares with forgetting, and a calibration prior that never fades."""

import pytest

from worker.engine.step_time import StepTimeModel


def test_fits_a_line_from_varied_steps():
    model = StepTimeModel()
    for n in (1, 50, 100, 200, 400) * 5:
        model.observe(n, 0.02 + 0.001 * n)
    base, per_token = model.coefficients()
    assert base == pytest.approx(0.02, rel=1e-6) and per_token == pytest.approx(0.001, rel=1e-6)


def test_same_size_steps_alone_say_nothing_about_the_slope_but_the_prior_does():
    # An idle worker decoding one request: 200 steps of 1 token at 50 ms.
    alone = StepTimeModel()
    for _ in range(200):
        alone.observe(1, 0.05)
    base, per_token = alone.coefficients()
    assert base + per_token * 500 == pytest.approx(25.0)  # 50 ms a token: a 500-token step "takes 25 s"
    calibrated = StepTimeModel()
    calibrated.set_prior([(16, 0.06), (128, 0.17), (512, 0.6)])
    for _ in range(200):
        calibrated.observe(1, 0.05)
    base, per_token = calibrated.coefficients()
    assert base == pytest.approx(0.05, abs=0.01)
    assert 0.4 < base + per_token * 500 < 0.8  # the prior's slope survives 200 same-size steps


def test_prior_alone_before_any_step():
    model = StepTimeModel()
    assert model.coefficients() == (0.0, 0.0)
    model.set_prior([(10, 0.03), (110, 0.13)])
    base, per_token = model.coefficients()
    assert base == pytest.approx(0.02) and per_token == pytest.approx(0.001)
