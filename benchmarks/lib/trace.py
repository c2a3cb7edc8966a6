"""Synthetic request traces: Poisson arrivals, a mix of short and long requests, a mix of priorities.

A trace is plain data (no torch, no tokenizer), deterministic by seed, saved as JSON so every system of a
benchmark replays exactly the same requests. Prompts are token ids drawn uniformly from the tokenizer's
ordinary vocabulary (ids at or above `min_token_id`, which skips SmolLM2's 17 special tokens): random
tokens share no prefix, so prefix caching cannot flatter one system over another.

Length profiles:
  full  the workload as specified: ~80% short (prompt 16-128, output 16-64 tokens), ~20% long (prompt
        256-1024, output 128-256).
  cpu   the same shape scaled down ~1/2 to ~1/4 so a sweep fits a 2-core CPU (the default of the report):
        ~80% short (prompt 16-64, output 8-32), ~20% long (prompt 128-384, output 64-128).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True, frozen=True)
class LengthClass:
    name: str
    weight: float
    """Relative share of requests in this class."""
    prompt_len: tuple[int, int]
    """Inclusive range of prompt lengths in tokens, drawn uniformly."""
    output_len: tuple[int, int]
    """Inclusive range of output lengths (max_new_tokens; the benchmark ignores EOS)."""


PROFILES: dict[str, tuple[LengthClass, ...]] = {
    "full": (LengthClass("short", 0.8, (16, 128), (16, 64)), LengthClass("long", 0.2, (256, 1024), (128, 256))),
    "cpu": (LengthClass("short", 0.8, (16, 64), (8, 32)), LengthClass("long", 0.2, (128, 384), (64, 128))),
    # Seconds-long smoke runs (report --quick).
    "tiny": (LengthClass("short", 0.8, (8, 24), (4, 12)), LengthClass("long", 0.2, (48, 96), (16, 32))),
}


@dataclass(slots=True)
class TraceConfig:
    rate: float
    """Mean arrival rate in requests per second; 0 or inf means all requests arrive at t=0 (offline)."""
    num_requests: int
    profile: str = "cpu"
    priority_weights: tuple[float, ...] = (0.2, 0.5, 0.3)
    """Share of priority 0 (most urgent), 1, 2, ..."""
    seed: int = 0
    min_token_id: int = 17
    vocab_size: int = 49152


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    """Seconds after the start of the replay."""
    prompt_token_ids: list[int]
    max_new_tokens: int
    priority: int
    kind: str
    """Length class name: short or long."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class Trace:
    config: TraceConfig
    requests: list[TraceRequest] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def to_json(self) -> dict:
        config = asdict(self.config)
        config["rate"] = None if self.config.rate == float("inf") else self.config.rate
        return {"config": config, "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_json(cls, data: dict) -> "Trace":
        config = dict(data["config"])
        config["rate"] = float("inf") if config["rate"] is None else config["rate"]
        config["priority_weights"] = tuple(config["priority_weights"])
        return cls(TraceConfig(**config), [TraceRequest(**r) for r in data["requests"]])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_json(json.loads(Path(path).read_text()))


def is_offline(rate: float) -> bool:
    return rate <= 0 or rate == float("inf")


def generate_trace(config: TraceConfig) -> Trace:
    """Requests sorted by arrival; the same config always gives the same trace."""
    classes = PROFILES[config.profile]
    assert config.num_requests >= 0 and config.min_token_id < config.vocab_size
    rng = random.Random(config.seed)
    requests = []
    # Unit-rate exponential gaps scaled by 1/rate (a Poisson process), drawn even offline: one seed gives the
    # same requests at every rate, only their arrival times differ.
    scale = 0.0 if is_offline(config.rate) else 1.0 / config.rate
    unit_time = 0.0
    for index in range(config.num_requests):
        gap = rng.expovariate(1.0)
        if index > 0:
            unit_time += gap
        now = unit_time * scale
        cls = rng.choices(classes, weights=[c.weight for c in classes])[0]
        prompt_len = rng.randint(*cls.prompt_len)
        output_len = rng.randint(*cls.output_len)
        priority = rng.choices(range(len(config.priority_weights)), weights=config.priority_weights)[0]
        prompt = [rng.randrange(config.min_token_id, config.vocab_size) for _ in range(prompt_len)]
        requests.append(TraceRequest(f"r{index:05d}", now, prompt, output_len, priority, cls.name))
    return Trace(config, requests)


def max_request_len(profile: str) -> int:
    """Longest prompt + output a profile can produce (the engine's max_model_len must allow it)."""
    return max(c.prompt_len[1] + c.output_len[1] for c in PROFILES[profile])
