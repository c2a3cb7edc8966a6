"""The real SmolLM2-135M-Instruct through our runner equals transformers (float32, CPU). Slow: 135 M parameters."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model.batch import Chunk, make_input
from worker.model.settings import EngineSettings
from worker.model.runner import ModelRunner

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def runner(smollm2_path) -> ModelRunner:
    settings = EngineSettings(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=32,
                              block_size=BLOCK, max_model_len=512)
    return ModelRunner(smollm2_path, settings)


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(runner) -> list[int]:
    text = runner.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        tokenize=False, add_generation_prompt=True,
    )
    return runner.tokenizer.encode(text, add_special_tokens=False)


def test_provisioned_folder_is_complete(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert json.loads((smollm2_path / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (smollm2_path / "chat_template.jinja").is_file() and (smollm2_path / ".complete").is_file()


def test_prompt_logits_equal_transformers(runner, hf_model, prompt_ids):
    table = list(range(8))
    ours = runner.execute(make_input([Chunk(prompt_ids, 0, table)], BLOCK, all_logits=True))
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt_ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3  # logits up to ~30 over 30 layers
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_20_tokens_equal_transformers_generate(runner, hf_model, prompt_ids):
    table = list(range(8, 16))
    logits = runner.execute(make_input([Chunk(prompt_ids, 0, table)], BLOCK))
    seq = list(prompt_ids)
    for _ in range(20):
        token = int(logits.argmax(-1)[0])
        seq.append(token)
        logits = runner.execute(make_input([Chunk([token], len(seq) - 1, table)], BLOCK))
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                pad_token_id=2)
    assert seq == ref[0].tolist()
    answer = runner.tokenizer.decode(seq[len(prompt_ids):], skip_special_tokens=True)
    assert "Paris" in answer
