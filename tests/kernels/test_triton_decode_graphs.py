"""The Triton backend over the bucketed decode path's static buffers (ENGINE_CUDA_GRAPHS=on): padding rows of
one token in the reserved block, block tables as wide as max_model_len allows, the split count fixed by
max_model_len. Interpreted on the CPU here (the same path, not captured), compiled and captured on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_engine_correctness import run_trace
from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine

# r0 and r1 decode together (bucket 2), then r2 joins (3 rows padded to 4) and r3 (4 rows); r1 ends first.
TRACE = [
    (step, EngineRequest(rid, prompt_token_ids=prompt, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)))
    for step, rid, prompt, n in [
        (0, "r0", list(range(1000, 1021)), 9), (0, "r1", list(range(5000, 5005)), 3),
        (3, "r2", list(range(3000, 3018)), 5), (5, "r3", [4242], 4),
    ]
]


def generate(model_path: Path, cuda_graphs: str) -> tuple[dict[str, list[int]], LLMEngine]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = EngineSettings(
        model=str(model_path), device=device, dtype="float32", attention_backend="triton", block_size=16,
        num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256, cuda_graphs=cuda_graphs,
    )
    engine = LLMEngine(settings)
    return run_trace(engine, TRACE), engine


@pytest.mark.slow  # interpreted kernels, about 10 s
def test_bucketed_triton_decode_generates_the_tokens_of_the_normal_path(tiny_model_path: Path) -> None:
    bucketed, engine = generate(tiny_model_path, "on")
    graphs = engine.runner.graphs
    assert graphs.replay == torch.cuda.is_available()
    assert {2, 4} <= set(graphs.steps_by_bucket) and graphs.num_padding_rows > 0
    normal, _ = generate(tiny_model_path, "off")
    assert bucketed == normal
