"""The floors a benchmark report is checked against, read from the medians over repetitions.

Each floor is a dict: check (what is compared), rate (None: the offline point; "–": not per rate), value
(None when it could not be measured), floor (the threshold as text), pass, and a note. benchmarks/README.md
lists them with their reasons.
"""

from __future__ import annotations

import math

from benchmarks.lib.render import rate_label
from benchmarks.lib.stats import ratio

STATIC_P99_LIMIT_S = 10.0
"""Issue #7: the p99 end-to-end latency (s) under which a rate counts as served (see _slo_floor)."""
KAFKA_FLOOR = 0.90
"""Issue #5: Kafka-path output tok/s / in-process output tok/s must stay at or above this."""


def _median(summary: dict, key: str) -> float:
    stat = summary.get(key)
    value = stat.get("median") if stat else None
    return math.nan if value is None else value


def _rate_order(rate: float | None) -> float:
    return math.inf if rate is None else rate  # None: offline, beyond every finite rate


def p99_e2e(summary: dict) -> float:
    """Median p99 end-to-end latency over all requests; where that was not recorded, the worse of short and
    long (both must stay under a limit)."""
    value = _median(summary, "all_e2e_p99")
    if not math.isnan(value):
        return value
    values = [v for v in (_median(summary, f"{kind}_e2e_p99") for kind in ("short", "long")) if not math.isnan(v)]
    return max(values, default=math.nan)


def check_floors(points: list[dict], overhead: dict | None, systems: list[str] | None = None,
                 kv_capacity: dict | None = None, offline: list[str] | None = None) -> list[dict]:
    """The floors, from the medians over repetitions (a point with rate None ran offline, the highest load):

    - continuous/static output tok/s >= 2 and short e2e p99 <= 1/3 of static's, at every rate where both ran;
    - issue #7's form of the throughput floor (see _slo_floor), once for the all-requests p99 and once for
      short requests' p99; recorded as failed, value None, where no rate qualifies;
    - continuous/hf-cb output tok/s >= 1.5 at saturation: the highest rate where both ran (offline, when
      both ran it);
    - kafka/continuous output tok/s >= 0.90 (issue #5) at every rate where both ran; with `systems` naming kafka
      (`offline` for the offline point, when given), a rate where continuous ran but no kafka run completed is
      recorded as failed;
    - paged KV holds >= 3x the requests of max-length contiguous reservation in the same KV budget (requests
      of the trace's lengths in whole blocks, against max_model_len each);
    - engine overhead <= 10% (last)."""
    medians = _Medians(points)
    return (_static_floors(medians) + _hf_cb_floor(medians) + _kafka_floors(medians, systems, offline)
            + _kv_floor(kv_capacity) + _overhead_floor(overhead))


class _Medians:
    """The points' summaries (medians over repetitions) by (system, rate)."""

    def __init__(self, points: list[dict]) -> None:
        self.by = {(p["system"], p["rate"]): p["summary"] for p in points}

    def rates_with(self, *names: str) -> list[float | None]:
        """Rates where every one of `names` ran, finite rates in order and offline (None) last."""
        rates = {rate for (_, rate) in self.by}
        return sorted((r for r in rates if all((n, r) in self.by for n in names)), key=_rate_order)

    def tok_s_ratio(self, num: str, den: str, rate: float | None) -> float:
        return ratio(_median(self.by[(num, rate)], "output_tokens_per_s"),
                     _median(self.by[(den, rate)], "output_tokens_per_s"))


def _static_floors(medians: _Medians) -> list[dict]:
    """Issue #3's per-rate floors against static, then issue #7's two sustained-throughput forms."""
    floors = []
    with_static = medians.rates_with("continuous", "static")
    for rate in with_static:
        tput = medians.tok_s_ratio("continuous", "static", rate)
        floors.append({"check": "continuous/static output tok/s", "rate": rate, "value": tput, "floor": ">= 2",
                       "pass": tput >= 2, "note": "issue #3"})
        p99 = ratio(_median(medians.by[("continuous", rate)], "short_e2e_p99"),
                    _median(medians.by[("static", rate)], "short_e2e_p99"))
        floors.append({"check": "continuous/static short e2e p99", "rate": rate, "value": p99, "floor": "<= 0.333",
                       "pass": p99 <= 1 / 3, "note": "issue #3"})
    if with_static:
        for label, p99_of in (("p99 e2e", p99_e2e), ("short p99 e2e", lambda m: _median(m, "short_e2e_p99"))):
            floors.append(_slo_floor(medians.by, with_static, medians.rates_with("continuous"), label, p99_of))
    return floors


def _hf_cb_floor(medians: _Medians) -> list[dict]:
    with_hf_cb = medians.rates_with("continuous", "hf-cb")
    if not with_hf_cb:
        return []
    rate = with_hf_cb[-1]
    tput = medians.tok_s_ratio("continuous", "hf-cb", rate)
    return [{"check": "continuous/hf-cb output tok/s at saturation", "rate": rate, "value": tput,
             "floor": ">= 1.5", "pass": tput >= 1.5, "note": "saturation: the highest rate where both ran"}]


def _kafka_floors(medians: _Medians, systems: list[str] | None, offline: list[str] | None) -> list[dict]:
    floors = []
    check = "kafka/continuous output tok/s"
    for rate in medians.rates_with("continuous"):
        if ("kafka", rate) in medians.by:
            value = medians.tok_s_ratio("kafka", "continuous", rate)
            floors.append({"check": check, "rate": rate, "value": value, "floor": f">= {KAFKA_FLOOR:g}",
                           "pass": value >= KAFKA_FLOOR, "note": "issue #5"})
        elif "kafka" in ((offline if rate is None and offline is not None else systems) or ()):
            floors.append({"check": check, "rate": rate, "value": None, "floor": f">= {KAFKA_FLOOR:g}",
                           "pass": False, "note": "no Kafka run completed at this rate"})
    return floors


def _kv_floor(kv: dict | None) -> list[dict]:
    if not (kv and kv.get("contiguous_max_len_capacity")):
        return []
    value = ratio(kv["paged_capacity_at_trace_lengths"], kv["contiguous_max_len_capacity"])
    observed = kv.get("paged_observed_max_concurrent")
    return [{"check": "paged / contiguous max-length KV: requests that fit", "rate": "–", "value": value,
             "floor": ">= 3", "pass": value >= 3,
             "note": f"{kv['paged_capacity_at_trace_lengths']} vs {kv['contiguous_max_len_capacity']} in "
                     f"{kv['kv_budget_bytes'] / 2**20:.0f} MiB"
                     + (f"; {observed} ran at once in the sweep" if observed else "")}]


def _overhead_floor(overhead: dict | None) -> list[dict]:
    if not overhead:
        return []
    value = overhead["overhead_fraction"]["median"]
    return [{"check": f"engine overhead at {overhead['num_running']} running", "rate": "–",
             "value": value, "floor": "<= 0.10", "pass": value <= 0.10}]


def _slo_floor(by: dict, with_static: list, with_continuous: list, label: str, p99_of) -> dict:
    """Issue #7: r* = the highest rate where static keeps its p99 (`p99_of`) under the limit; continuous's
    sustained throughput (its highest output tok/s at a rate where its own p99 stays under the same limit)
    must be >= 2x static's output tok/s at r*. Comparing both at r* itself would say nothing: below
    saturation every system's throughput is the offered load."""
    check = f"continuous sustained / static output tok/s, {label} < {STATIC_P99_LIMIT_S:g} s"
    under = [r for r in with_static if p99_of(by[("static", r)]) < STATIC_P99_LIMIT_S]
    if not under:
        return {"check": check, "rate": "–", "value": None, "floor": ">= 2", "pass": False,
                "note": f"static {label} ≥ {STATIC_P99_LIMIT_S:g} s at every rate measured"}
    rate = under[-1]
    sustained = [(_median(by[("continuous", r)], "output_tokens_per_s"), r) for r in with_continuous
                 if p99_of(by[("continuous", r)]) < STATIC_P99_LIMIT_S]
    if not sustained:
        return {"check": check, "rate": rate, "value": None, "floor": ">= 2", "pass": False,
                "note": f"continuous {label} ≥ {STATIC_P99_LIMIT_S:g} s at every rate measured"}
    best, best_rate = max(sustained, key=lambda x: x[0])
    value = ratio(best, _median(by[("static", rate)], "output_tokens_per_s"))
    return {"check": check, "rate": rate, "value": value, "floor": ">= 2", "pass": value >= 2,
            "note": f"static at {rate_label(rate)} req/s ({label} {p99_of(by[('static', rate)]):.2f} s) vs "
                    f"continuous at {rate_label(best_rate)} req/s"}
