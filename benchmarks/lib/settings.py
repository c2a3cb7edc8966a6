"""Settings every benchmark shares: the systems' names, the engine limits, the model runner and torch threads.

Every system (the engine's policies, transformers' baselines, the Kafka worker) takes the same limits, so
they live here and nowhere else; benchmarks/README.md documents them. The CLI modules (bench_engine,
report, bench_kafka_path, bench_decode_attention) import them from here, never from one another.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from benchmarks.lib.trace import max_request_len
from worker.model.settings import EngineSettings
from worker.model.runner import ModelRunner

ENGINE_POLICIES = ("continuous", "dynamic", "static")
"""Systems that are LLMEngine with this policy (benchmarks/bench_engine.py)."""
HF_SYSTEMS = ("hf-static", "hf-cb")
"""transformers' baselines (benchmarks/lib/hf_systems.py)."""
ALL_SYSTEMS = ENGINE_POLICIES + HF_SYSTEMS
"""Every system that runs in the benchmark's own process (the Kafka path runs a worker subprocess)."""
DEFAULT_MODEL = "smollm2-135m-instruct"
"""The model every benchmark loads unless --model names another."""

MAX_NUM_SEQS = 64
"""Requests running at once: LLMEngine's max_num_seqs, hf-cb's max_requests_per_batch."""
MAX_NUM_BATCHED_TOKENS = 512
"""Tokens one step may compute: LLMEngine's max_num_batched_tokens, hf-cb's max_batch_tokens."""
MAX_BATCH_SIZE = 16
"""Batch size of the dynamic and static policies and of hf-static."""
BLOCK_SIZE = 16
"""Tokens per KV block (hf-cb: page_size)."""
KV_CACHE_BYTES = 256 * 1024**2
"""KV budget of LLMEngine; hf-cb gets as many tokens' worth of pages."""


def engine_settings(policy: str, max_model_len: int, **overrides) -> EngineSettings:
    """Identical limits for every policy; prefix caching off (random prompts share nothing anyway, and a
    repeated trace must not hit the previous repetition's cache)."""
    values = dict(
        policy=policy, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_batch_size=MAX_BATCH_SIZE, block_size=BLOCK_SIZE, kv_cache_bytes=KV_CACHE_BYTES,
        max_model_len=max_model_len, enable_prefix_caching=False, device="cpu", dtype="float32",
    )
    values.update(overrides)
    return EngineSettings(**values)


def bench_max_model_len(profile: str) -> int:
    """The engine's max_model_len: a power of two (at least 1024) that the profile's longest request fits;
    it is also what a contiguous-cache system would reserve per request."""
    return max(1024, 1 << (max_request_len(profile) - 1).bit_length())


def min_token_id(tokenizer) -> int:
    """First id above every special token: prompts are drawn from the ordinary vocabulary."""
    return max(tokenizer.all_special_ids + list(tokenizer.added_tokens_decoder)) + 1


def set_threads(threads: int | None) -> int:
    """torch intra-op threads for every system. None: one thread when the machine is already oversubscribed
    (1-minute load >= cores: OpenMP workers then spin against other processes and a step slows ~8x), else
    torch's default."""
    import torch

    if threads is None:
        threads = 1 if os.getloadavg()[0] >= (os.cpu_count() or 1) else torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def load_runner(model: str, profile: str, **overrides) -> ModelRunner:
    """The one ModelRunner (weights and KV memory) that every engine run of a process shares; `overrides`:
    EngineSettings fields of the runner itself (dtype, row_buckets)."""
    return ModelRunner(model, engine_settings("continuous", bench_max_model_len(profile), **overrides))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
