"""The default dtype: bfloat16 on CUDA and on CPUs with bf16 matrix units, float32 on other CPUs; and what the
real model generates in it on this machine. (The other tests pin float32 through the root conftest.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.model import runner as runner_module
from worker.model.runner import cpu_has_native_bf16, pick_dtype

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
           "How many legs does a spider have?"]


def test_auto_is_bf16_on_cuda_and_on_cpus_with_bf16_units(monkeypatch):
    monkeypatch.setattr(runner_module, "cpu_has_native_bf16", lambda: True)
    assert pick_dtype("auto", torch.device("cpu")) is torch.bfloat16
    monkeypatch.setattr(runner_module, "cpu_has_native_bf16", lambda: False)
    assert pick_dtype("auto", torch.device("cpu")) is torch.float32
    assert pick_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert pick_dtype("float32", torch.device("cpu")) is torch.float32


def test_native_bf16_follows_the_cpu_flags():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo")
    flags = cpuinfo.read_text().split()
    assert cpu_has_native_bf16() == ("amx_bf16" in flags or "avx512_bf16" in flags)


def _prompts(model_path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for p in PROMPTS]


def _greedy(model_path: Path, dtype: str, prompts: list[list[int]]) -> tuple[torch.dtype, list[list[int]]]:
    from worker.model.settings import EngineSettings
    from worker.engine.api import EngineRequest, SamplingParams
    from worker.engine.engine import LLMEngine

    engine = LLMEngine(EngineSettings(model=str(model_path), device="cpu", dtype=dtype))
    requests = [EngineRequest(request_id=str(i), prompt_token_ids=ids, sampling=SamplingParams(max_new_tokens=12))
                for i, ids in enumerate(prompts)]
    done = engine.generate(requests)
    return engine.runner.dtype, [list(done[str(i)].token_ids) for i in range(len(prompts))]


@pytest.mark.slow  # ~10 s: two engines and transformers on the real model
def test_the_default_dtype_on_this_cpu_generates_near_float32s_greedy_text(smollm2_path: Path, monkeypatch):
    """In bfloat16 greedy decoding may take another path than float32 where two tokens nearly tie; every token
    it picks must still be one float32 ranks among its top 3 at that position (teacher-forced on the bf16
    text), and most completions must be the same."""
    from transformers import AutoModelForCausalLM

    monkeypatch.delenv("ENGINE_DTYPE", raising=False)
    prompts = _prompts(smollm2_path)
    dtype, default = _greedy(smollm2_path, "auto", prompts)
    assert dtype is (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    _, reference = _greedy(smollm2_path, "float32", prompts)
    assert sum(a == b for a, b in zip(default, reference)) >= len(prompts) // 2
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, default):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]  # [len(tokens), V]
        top3 = logits.topk(3, dim=-1).indices.tolist()
        assert all(token in top for token, top in zip(tokens, top3)), (tokens, top3)
