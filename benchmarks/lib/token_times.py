"""When each request's tokens arrived, and the TTFT and inter-token latency percentiles read from that.

Pure bookkeeping (no Kafka, no engine), shared by both sides of `bench_sim_kafka`: the engine's outputs (one
token per request per decode step) and the client's stream chunks (one per engine step, or several steps'
tokens coalesced over WORKER_CHUNK_INTERVAL_MS) are both "n tokens arrived at t".

ITL, per token: a delivery of n tokens that arrived g seconds after the request's previous delivery counts n
samples of g / n (the first delivery counts in TTFT, not here). On the engine's outputs (n = 1) these are the
gaps between a request's decode steps; on coalesced chunks they are the same average rate, so the chunk gaps
themselves (what a reader of the stream waits between updates) are reported apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.lib.stats import percentile

QUANTILES = (50, 90, 99)


@dataclass(slots=True)
class TokenTimes:
    """Per request id: (seconds since the start of the run, tokens) of each delivery, in arrival order."""

    deliveries: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def add(self, request_id: str, t: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.deliveries.setdefault(request_id, []).append((t, num_tokens))

    @property
    def num_tokens(self) -> int:
        return sum(n for ds in self.deliveries.values() for _, n in ds)

    @property
    def num_deliveries(self) -> int:
        return sum(len(ds) for ds in self.deliveries.values())

    def ttfts(self, arrival_s: dict[str, float] | None = None) -> list[float]:
        """First delivery minus arrival (0 when `arrival_s` does not name the request: an offline trace)."""
        arrival_s = arrival_s or {}
        return [ds[0][0] - arrival_s.get(rid, 0.0) for rid, ds in self.deliveries.items()]

    def itls(self) -> list[float]:
        """Per-token inter-token latencies (see the module docstring)."""
        samples = []
        for ds in self.deliveries.values():
            for (t0, _), (t1, n) in zip(ds, ds[1:]):
                samples += [(t1 - t0) / n] * n
        return samples

    def delivery_gaps(self) -> list[float]:
        """Seconds between a request's consecutive deliveries (chunks)."""
        return [t1 - t0 for ds in self.deliveries.values() for (t0, _), (t1, _) in zip(ds, ds[1:])]

    def summary(self) -> dict:
        """TTFT, ITL and delivery gap p50/p90/p99 in milliseconds, and the counts they rest on."""
        out = {"num_requests": len(self.deliveries), "num_tokens": self.num_tokens,
               "num_deliveries": self.num_deliveries}
        for name, values in (("ttft", self.ttfts()), ("itl", self.itls()), ("gap", self.delivery_gaps())):
            for q in QUANTILES:
                out[f"{name}_p{q}_ms"] = 1e3 * percentile(values, q)
        return out
