"""int8 weights (ENGINE_QUANTIZATION=int8): the per-channel quantization and its matmul against the product with
the dequantized weight; whole models quantized: the real SmolLM2 keeps its greedy answers and log-probabilities
close to the float model's, a MoE family keeps its experts in the model dtype and still generates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.bench_quantization import greedy_with_logprobs
from tests.model.batch import tiny_settings
from worker.model.quantize import linear, quantize_int8
from worker.model.runner import ModelRunner
from worker.model.tiny import build_tiny_family


def test_int8_rounds_each_weight_to_within_half_its_rows_scale():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    w[7] = 0.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64,) and scale.dtype == w.dtype
    error = (w - q.float() * scale[:, None]).abs()
    assert (error <= scale[:, None] / 2 + 1e-9).all()
    nonzero = torch.arange(64) != 7
    assert (q[nonzero].abs().amax(dim=1) == 127).all()  # each row uses the whole range: one scale per row
    assert (q[7] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_matmul_is_the_product_with_the_dequantized_weight(dtype):
    torch.manual_seed(1)
    x, w, bias = torch.randn(5, 96).to(dtype), torch.randn(48, 96).to(dtype), torch.randn(48).to(dtype)
    q, scale = quantize_int8(w)
    got = linear(x, q, bias, scale)
    expected = F.linear(x.float(), q.float() * scale.float()[:, None], bias.float())
    assert got.dtype == dtype and got.shape == (5, 48)
    tolerance = 1e-4 if dtype is torch.float32 else 3e-2
    assert (got.float() - expected).abs().max() <= tolerance * expected.abs().max()
    assert torch.equal(linear(x, w, bias, None), F.linear(x, w, bias))  # no scale: the float matmul


def greedy(runner: ModelRunner, prompts: list[str], max_new_tokens: int) -> dict[str, list[tuple[int, float]]]:
    return greedy_with_logprobs(runner, runner.settings, max_new_tokens, prompts)


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours.",
           "How many legs does a spider have?"]


@pytest.mark.slow
def test_smollm2_in_int8_keeps_its_greedy_answers_and_log_probabilities_close(smollm2_path):
    """Against the same model in bf16: the first token of every answer is the bf16 model's, and over the tokens
    before any difference the chosen tokens' log-probabilities stay within 0.1 on average (docs/quantization.md:
    0.04 over sixteen prompts, twice what bf16 itself differs from float32)."""
    settings = tiny_settings(num_kv_blocks=256, max_model_len=1024, dtype="bfloat16")
    reference = greedy(ModelRunner(smollm2_path, settings), PROMPTS, 24)
    quantized_runner = ModelRunner(smollm2_path, settings.model_copy(update={"quantization": "int8"}))
    assert quantized_runner.model.layers[0].attn.qkv_weight.dtype == torch.int8
    assert quantized_runner.model.lm_head.dtype == torch.bfloat16
    assert quantized_runner.model.packed_head is not None  # the bf16 head, packed for steps of several rows
    quantized = greedy(quantized_runner, PROMPTS, 24)
    diffs = []
    for request_id, tokens in reference.items():
        got = quantized[request_id]
        assert got[0][0] == tokens[0][0], request_id
        for (token, logprob), (other, other_logprob) in zip(tokens, got):
            if token != other:
                break
            diffs.append(abs(logprob - other_logprob))
    assert len(diffs) >= 24 and sum(diffs) / len(diffs) <= 0.1, diffs


@pytest.mark.slow
def test_a_moe_family_keeps_its_experts_in_the_model_dtype_and_generates(smollm2_path, tmp_path):
    path = build_tiny_family(tmp_path, smollm2_path, "qwen3-moe")
    runner = ModelRunner(path, tiny_settings(quantization="int8", dtype="bfloat16"))
    layer = runner.model.layers[0]
    assert layer.attn.qkv_weight.dtype == torch.int8 and layer.mlp.gate_up_weight.dtype == torch.bfloat16
    out = greedy(runner, PROMPTS[:2], 8)
    assert all(len(tokens) == 8 for tokens in out.values())


def test_int8_with_float32_activations_is_refused_naming_the_setting(smollm2_path, tmp_path):
    path = build_tiny_family(tmp_path, smollm2_path, "qwen3-moe")
    with pytest.raises(ValueError, match="ENGINE_DTYPE bfloat16"):
        ModelRunner(path, tiny_settings(quantization="int8", dtype="float32"))
