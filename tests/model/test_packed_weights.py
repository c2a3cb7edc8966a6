"""Weights packed for oneDNN at start-up (ENGINE_CPU_PACKED_WEIGHTS, worker/model/quantize.py): the packed product
against torch's plain one, and whole models in bfloat16 (the real SmolLM2 with its tied head, a tiny family with
a separate head) giving the same greedy tokens and log-probabilities packed as unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.bench_quantization import greedy_with_logprobs
from tests.model.batch import tiny_settings
from worker.model.quantize import linear, pack_for_cpu
from worker.model.runner import ModelRunner
from worker.model.tiny import build_tiny_family

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours."]


def test_the_packed_product_is_torchs_for_every_row_count():
    torch.manual_seed(0)
    w, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    packed = pack_for_cpu(w)
    assert packed is not None and packed.is_mkldnn and packed.shape == w.shape
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    for rows in (1, 2, 3, 8, 17, 40):
        got, expected = linear(x[:rows], packed, bias, None), F.linear(x[:rows], w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        # torch takes a one-row path of its own, whose sums round differently; from two rows on it is oneDNN's
        # kernel either way, with the same numbers.
        if rows == 1:
            assert (got.float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max()
        else:
            assert torch.equal(got, expected), rows


def test_only_bfloat16_weights_on_the_cpu_are_packed():
    assert pack_for_cpu(torch.randn(8, 8)) is None


def greedy(runner: ModelRunner) -> dict[str, list[tuple[int, float]]]:
    return greedy_with_logprobs(runner, runner.settings, 16, PROMPTS)


def assert_same_answers(packed: dict, plain: dict) -> None:
    """Tokens identical; log-probabilities equal but for the head's one-row rounding (a lone request's steps)."""
    for request_id, tokens in plain.items():
        assert [t for t, _ in packed[request_id]] == [t for t, _ in tokens], request_id
        for (_, logprob), (_, other) in zip(packed[request_id], tokens):
            assert abs(logprob - other) <= 0.02, request_id


@pytest.mark.slow
def test_smollm2_packed_in_bfloat16_answers_as_unpacked(smollm2_path):
    settings = tiny_settings(num_kv_blocks=256, max_model_len=1024, dtype="bfloat16")
    packed_runner = ModelRunner(smollm2_path, settings)
    layer = packed_runner.model.layers[0]
    assert layer.attn.qkv_weight.is_mkldnn and layer.mlp.down_weight.is_mkldnn
    assert packed_runner.model.packed_head is not None
    assert not packed_runner.model.embed.is_mkldnn  # the tied embedding is still read row by row
    plain_runner = ModelRunner(smollm2_path, settings.model_copy(update={"cpu_packed_weights": False}))
    assert not plain_runner.model.layers[0].attn.qkv_weight.is_mkldnn and plain_runner.model.packed_head is None
    assert_same_answers(greedy(packed_runner), greedy(plain_runner))


@pytest.mark.slow  # 1.3 s: in the full suite, not the fast subset
def test_a_separate_head_is_packed_too(smollm2_path, tmp_path):
    path = build_tiny_family(tmp_path, smollm2_path, "phi3-partial-rotary-window")
    settings = tiny_settings(dtype="bfloat16")
    packed_runner = ModelRunner(path, settings)
    assert packed_runner.model.packed_head is not None and packed_runner.model.layers[0].mlp.gate_up_weight.is_mkldnn
    plain_runner = ModelRunner(path, settings.model_copy(update={"cpu_packed_weights": False}))
    assert_same_answers(greedy(packed_runner), greedy(plain_runner))


def test_float32_weights_stay_as_they_are(smollm2_path, tmp_path):
    path = build_tiny_family(tmp_path, smollm2_path, "gemma2")
    runner = ModelRunner(path, tiny_settings(dtype="float32"))
    assert not runner.model.layers[0].attn.qkv_weight.is_mkldnn and runner.model.packed_head is None
