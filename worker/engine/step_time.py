"""An online model of engine step time against batched tokens: time ≈ base + per_token × num_tokens.

Admission control uses it to predict whether a request's deadline is reachable and whether adding its
prefill to the running batch would break a more urgent request's inter-token latency target. Recursive
least squares with exponential forgetting, so it follows load and thermal drift without storing history.
Pure Python: the transport reads it through EngineStats.
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
        if self._w == 0.0:
            return 0.0, 0.0
        mean_x, mean_y = self._sx / self._w, self._sy / self._w
        var_x = self._sxx / self._w - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            # Every step had the same size: attribute the time to tokens so bigger batches predict longer.
            return 0.0, mean_y / mean_x if mean_x > 0 else 0.0
        slope = (self._sxy / self._w - mean_x * mean_y) / var_x
        slope = max(slope, 0.0)
        base = max(mean_y - slope * mean_x, 0.0)
        return base, slope
