"""An online model of engine step time against batched tokens: time ≈ base + per_token × num_tokens.

Admission control uses it to predict whether a request's deadline is reachable and whether adding its
prefill to the running batch would break a more urgent request's inter-token latency target. Recursive
least squares with exponential forgetting, so it follows load and thermal drift without storing history.
Pure Python: the transport reads it through EngineStats.

A prior (`set_prior`, from the start-up calibration in calibrate.py: steps of a few sizes up to the token
budget) is added to the online sums with a fixed weight and never forgotten. It matters where the online
samples cannot tell: before the first step, and when every recent step had the same size (an idle worker
decoding one request), which alone says nothing about how the time grows with the tokens batched.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepTimeModel:
    forgetting: float = 0.98
    """Weight of the past at each new sample (0.98 ≈ the last 50 steps matter)."""
    # Exponentially weighted sums of the normal equations of y = a + b·x.
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    num_samples: int = 0
    _prior: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    """(w, sx, sy, sxx, sxy) of the prior points."""

    def set_prior(self, points: list[tuple[int, float]], weight: float = 1.0) -> None:
        """(num_tokens, seconds) samples that keep `weight` each forever (weight 1 ≈ one recent step)."""
        w = sx = sy = sxx = sxy = 0.0
        for num_tokens, seconds in points:
            x = float(num_tokens)
            w += weight
            sx += weight * x
            sy += weight * seconds
            sxx += weight * x * x
            sxy += weight * x * seconds
        self._prior = (w, sx, sy, sxx, sxy)

    def observe(self, num_tokens: int, seconds: float) -> None:
        f = self.forgetting
        x = float(num_tokens)
        self._w = f * self._w + 1.0
        self._sx = f * self._sx + x
        self._sy = f * self._sy + seconds
        self._sxx = f * self._sxx + x * x
        self._sxy = f * self._sxy + x * seconds
        self.num_samples += 1

    def coefficients(self) -> tuple[float, float]:
        """(base seconds, seconds per token), both ≥ 0; (0, 0) before the first sample."""
        pw, psx, psy, psxx, psxy = self._prior
        w, sx, sy, sxx, sxy = self._w + pw, self._sx + psx, self._sy + psy, self._sxx + psxx, self._sxy + psxy
        if w == 0.0:
            return 0.0, 0.0
        mean_x, mean_y = sx / w, sy / w
        var_x = sxx / w - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            # Every step had the same size: attribute the time to tokens so bigger batches predict longer.
            return 0.0, mean_y / mean_x if mean_x > 0 else 0.0
        slope = (sxy / w - mean_x * mean_y) / var_x
        slope = max(slope, 0.0)
        base = max(mean_y - slope * mean_x, 0.0)
        return base, slope
