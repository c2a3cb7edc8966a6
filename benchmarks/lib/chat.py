"""What the engine-level benchmarks of the default model share: open-ended chat prompts (little to copy from the
prompt), a chat request of them, and the start every such benchmark makes (torch threads, the model provisioned)."""

from __future__ import annotations

from pathlib import Path

from worker.engine.api import EngineRequest, SamplingParams
from worker.model.pull import ensure_default_model

OPEN_PROMPTS = [
    "Tell me a story about a dragon who learns to bake bread.",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short poem about autumn in a city.",
    "Give me three ideas for a weekend trip and why each is fun.",
]


def chat_request(prompt: str, request_id: str, max_new_tokens: int, **sampling) -> EngineRequest:
    return EngineRequest(request_id, messages=[{"role": "user", "content": prompt}],
                         sampling=SamplingParams(max_new_tokens=max_new_tokens, **sampling))


def default_model(threads: int | None) -> Path:
    """The default model's folder, provisioned if need be, with torch on `threads` threads when given."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return ensure_default_model()
