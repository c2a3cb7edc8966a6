"""End to end: greedy generation with the Triton attention backend (interpreted on the CPU here, compiled on
CUDA) gives exactly the tokens of the torch backend and of transformers on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_engine_correctness import hf_reference, run_trace
from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine

# Prefill chunks, a prefix-cache hit (r2 repeats r0's first 32 tokens) and decode-only steps.
PROMPTS = {
    "r0": list(range(1000, 1040)),
    "r1": list(range(5000, 5007)),
    "r2": list(range(1000, 1032)) + [77, 78, 79],
    "r3": [4242],
}
TRACE = [
    (step, EngineRequest(rid, prompt_token_ids=prompt, sampling=SamplingParams(max_new_tokens=6)))
    for step, (rid, prompt) in zip([0, 0, 3, 4], PROMPTS.items())
]


def generate(model_path: Path, backend: str) -> tuple[dict[str, list[int]], LLMEngine]:
    settings = EngineSettings(
        model=str(model_path), device="cpu", dtype="float32", attention_backend=backend, block_size=16,
        num_kv_blocks=32, max_num_batched_tokens=32, max_num_seqs=4,
    )
    engine = LLMEngine(settings)
    return run_trace(engine, TRACE), engine


@pytest.mark.slow  # about 15 s of interpreted kernels
def test_triton_backend_generates_the_tokens_of_torch_and_transformers(tiny_model_path: Path) -> None:
    triton_tokens, engine = generate(tiny_model_path, "triton")
    assert engine.runner.backend.name == "triton"
    assert engine.scheduler.pool.hit_rate > 0
    torch_tokens, _ = generate(tiny_model_path, "torch")
    expected = hf_reference(tiny_model_path, TRACE, set(engine.runner.eos_token_ids))
    assert triton_tokens == torch_tokens == expected


@pytest.mark.slow  # interpreted kernels on two tiny families: about half a minute
@pytest.mark.parametrize("family", ["mistral-windowed", "gemma2"])
def test_windowed_and_capped_families_generate_the_tokens_of_torch(family: str, smollm2_path: Path,
                                                                   tmp_path: Path) -> None:
    """Mistral windowed on every layer (window 8: the prompts and chunks run past it, and blocks behind the window
    are given back, so the kernels meet freed block-table entries) and Gemma2 (windows alternating with global
    layers, attention soft-capping): the Triton backend gives the torch backend's tokens."""
    from worker.model.tiny import build_tiny_family

    path = build_tiny_family(tmp_path / family, smollm2_path, family)
    triton_tokens, engine = generate(path, "triton")
    assert engine.runner.backend.name == "triton" and engine.runner.config.sliding_window is not None
    torch_tokens, _ = generate(path, "torch")
    assert triton_tokens == torch_tokens
