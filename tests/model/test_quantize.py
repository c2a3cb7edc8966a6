"""8-bit weights (ENGINE_QUANTIZATION=int8, fp8): the per-channel quantization and its matmul against the product
with the dequantized weight; whole models quantized: the real SmolLM2 keeps its greedy answers and
log-probabilities close to the float model's, a MoE family keeps its experts in the model dtype and still
generates. Checkpoints quantized already, written by compressed-tensors itself: an FP8 one generates
transformers' tokens (which runs it through that library), every format's weights load as the library reads
them, and what has no kernel here is refused with a line naming it."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from benchmarks.bench_quantization import greedy_with_logprobs
from tests.model.batch import tiny_settings
from tests.engine.test_engine_correctness import TRACE
from tests.model.quantized_checkpoints import decompressed_weights, write_compressed
from worker.engine.engine import LLMEngine
from worker.model.checkpoint_quant import CheckpointQuantization, read_checkpoint_quantization
from worker.model.models.base import INT8_HEAD_MAX_ROWS
from worker.model.quantize import FP8, FP8_MAX, linear, quantize_fp8, quantize_int8, quantize_param
from worker.model.runner import ModelRunner, pick_quantization
from worker.model.settings import EngineSettings
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
    assert quantized_runner.model.int8_head is not None  # and an int8 one for steps sampling a few
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
def test_a_moe_familys_experts_go_int8_and_compute_with_their_dequantized_weights(smollm2_path, tmp_path):
    """int8: the experts too (most of a MoE model's weights), the router not; each expert's product is the
    product with its dequantized weights, and the model generates. FP8 leaves the experts in bf16."""
    path = build_tiny_family(tmp_path, smollm2_path, "qwen3-moe")
    runner = ModelRunner(path, tiny_settings(quantization="int8", dtype="bfloat16"))
    layer = runner.model.layers[0]
    moe = layer.mlp
    assert layer.attn.qkv_weight.dtype == torch.int8 and moe.gate_up_weight.dtype == torch.int8
    assert moe.down_weight.dtype == torch.int8 and moe.router_weight.dtype == torch.bfloat16
    float_moe = copy.deepcopy(moe)
    for name, scale in (("gate_up_weight", moe.gate_up_scale), ("down_weight", moe.down_scale)):
        dequantized = getattr(moe, name).float() * scale.float()[..., None]
        setattr(float_moe, name, torch.nn.Parameter(dequantized.to(torch.bfloat16), requires_grad=False))
    float_moe.gate_up_scale = float_moe.down_scale = None
    x = torch.randn(7, moe.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got, expected = moe(x).float(), float_moe(x).float()
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()
    out = greedy(runner, PROMPTS[:2], 8)
    assert all(len(tokens) == 8 for tokens in out.values())
    fp8 = ModelRunner(path, tiny_settings(quantization="fp8", dtype="bfloat16")).model.layers[0]
    assert fp8.attn.qkv_weight.dtype == FP8 and fp8.mlp.gate_up_weight.dtype == torch.bfloat16


def test_int8_steps_sampling_a_few_rows_take_the_int8_head_and_larger_ones_the_model_dtypes(tiny_model_path):
    """With int8 weights the LM head gets an int8 copy (ENGINE_QUANTIZE_LM_HEAD, on by default): a step sampling
    up to INT8_HEAD_MAX_ROWS rows gets logits within half a scale step of each weight from the bf16 head's, written
    into the kept logits buffer; a larger step, and every step with the setting off, gets the bf16 head's."""
    runner = ModelRunner(tiny_model_path, tiny_settings(quantization="int8", dtype="bfloat16"))
    model = runner.model
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(INT8_HEAD_MAX_ROWS + 4, model.config.hidden_size, generator=generator).to(torch.bfloat16)
    head = model.lm_head.float()
    exact = hidden.float() @ head.t()  # [R, V]
    # Rounding each weight moves a logit by at most half its row's step times the row's |hidden| sum.
    q_bound = (head.abs().amax(dim=1) / 254)[None, :] * hidden.float().abs().sum(dim=1, keepdim=True)
    out = torch.empty(16, model.config.vocab_size, dtype=torch.bfloat16)
    few = model.lm_head_logits(hidden[:INT8_HEAD_MAX_ROWS], out)
    assert few.data_ptr() == out.data_ptr()
    q_error = (few.float() - exact[:INT8_HEAD_MAX_ROWS]).abs()
    assert (q_error <= 1.05 * q_bound[:INT8_HEAD_MAX_ROWS] + 0.02 * exact[:INT8_HEAD_MAX_ROWS].abs() + 1e-2).all()
    q, scale = model.int8_head
    assert torch.equal(few, torch._weight_int8pack_mm(hidden[:INT8_HEAD_MAX_ROWS], q, scale))
    many = model.lm_head_logits(hidden)
    assert torch.allclose(many.float(), exact, rtol=2e-2, atol=2e-2)
    assert not torch.equal(many[:INT8_HEAD_MAX_ROWS], few)  # not the int8 product
    off = ModelRunner(tiny_model_path, tiny_settings(quantization="int8", dtype="bfloat16", quantize_lm_head=False))
    assert off.model.int8_head is None
    assert torch.allclose(off.model.lm_head_logits(hidden[:1]).float(), exact[:1], rtol=2e-2, atol=2e-2)
    assert not torch.equal(off.model.lm_head_logits(hidden[:1]), few[:1])


def test_int8_with_float32_activations_is_refused_naming_the_setting(smollm2_path, tmp_path):
    path = build_tiny_family(tmp_path, smollm2_path, "qwen3-moe")
    with pytest.raises(ValueError, match="ENGINE_DTYPE bfloat16"):
        ModelRunner(path, tiny_settings(quantization="int8", dtype="float32"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_matmul_is_the_product_of_per_row_quantized_activations_and_the_dequantized_weight(dtype):
    torch.manual_seed(2)
    x, w = (torch.randn(5, 96) * torch.logspace(-2, 1, 5)[:, None]).to(dtype), torch.randn(48, 96).to(dtype)
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and (q.float().abs().amax(dim=1) == FP8_MAX).all()
    x_scale = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX  # each row its own scale
    x_q = (x.float() / x_scale).to(FP8).float() * x_scale
    expected = x_q @ (q.float() * scale[:, None]).t()
    got = linear(x, q, None, scale)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype is torch.float32 else 1e-2
    assert (got.float() - expected).abs().max() <= tolerance * expected.abs().max()


def test_an_fp8_weight_of_a_shape_the_product_does_not_take_stays_in_float():
    layer = torch.nn.Module()
    layer.w = torch.nn.Parameter(torch.randn(40, 24), requires_grad=False)  # 24 is not a multiple of 16
    assert quantize_param(layer, "w", "fp8") is None and layer.w.dtype == torch.float32


INT8, FP8_CKPT = CheckpointQuantization("int8", ""), CheckpointQuantization("fp8", "")
CPU = torch.device("cpu")


@pytest.mark.parametrize(("setting", "checkpoint", "dtype", "expected"), [
    ("none", None, torch.bfloat16, "none"),
    ("none", INT8, torch.bfloat16, "int8"),  # a checkpoint's int8 runs as int8 where the kernel is
    ("none", INT8, torch.float32, "none"),  # widened: torch's int8 kernel is slow with float32 activations
    ("none", FP8_CKPT, torch.bfloat16, "none"),  # widened: no FP8 hardware on a CPU
    ("fp8", FP8_CKPT, torch.float32, "fp8"),  # asked for: the reference product
    ("fp8", None, torch.bfloat16, "fp8"),
    ("int8", INT8, torch.float16, "int8"),
])
def test_the_kernel_follows_the_setting_the_checkpoint_and_the_device(setting, checkpoint, dtype, expected):
    assert pick_quantization(setting, checkpoint, CPU, dtype) == expected


@pytest.mark.parametrize(("setting", "checkpoint", "dtype", "message"), [
    ("int8", FP8_CKPT, torch.bfloat16, "checkpoint holds fp8 weights"),
    ("fp8", INT8, torch.bfloat16, "checkpoint holds int8 weights"),
    ("int8", None, torch.float32, "ENGINE_DTYPE bfloat16"),
])
def test_a_setting_the_checkpoint_or_device_cannot_run_is_refused_naming_it(setting, checkpoint, dtype, message):
    with pytest.raises(ValueError, match=message):
        pick_quantization(setting, checkpoint, CPU, dtype)


def _config_with(tmp_path, quantization_config: dict):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization_config}))
    return tmp_path


def _ct_group(**weights) -> dict:
    args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "gptq", "bits": 4}, "quant_method is 'gptq'"),
    (_ct_group(num_bits=4), "4-bit int"),
    (_ct_group(symmetric=False), "symmetric False"),
    (_ct_group(strategy="block"), "'block'"),
    ({**_ct_group(), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
])
def test_a_quantization_without_a_kernel_here_is_refused_naming_it(tmp_path, config, named):
    with pytest.raises(ValueError, match=named):
        read_checkpoint_quantization(_config_with(tmp_path, config))


@pytest.fixture(scope="module")
def compressed(tiny_model_path, tmp_path_factory):
    """The tiny model as compressed-tensors writes it: FP8 dynamic, int8 W8A8 (int-quantized) and int8 weights
    only per channel (8-bit pack-quantized)."""
    root = tmp_path_factory.mktemp("compressed")
    return {"fp8": write_compressed(tiny_model_path, root / "fp8", "FP8_DYNAMIC"),
            "w8a8": write_compressed(tiny_model_path, root / "w8a8", "INT8"),
            "w8a16": write_compressed(tiny_model_path, root / "w8a16", type="int", symmetric=True,
                                      strategy="channel")}


@pytest.mark.slow
def test_an_fp8_dynamic_checkpoint_chooses_the_tokens_transformers_forward_does(compressed):
    """transformers runs the checkpoint through compressed-tensors: each layer on the FP8 weights with the
    activations quantized per token, as our FP8 product does (float32 here, where the two differ by the order of
    additions). Over a trace with preemption and prefix hits, every token our engine chose is the argmax of
    transformers' forward over the same tokens, and its log-probability is transformers' within 0.01 on average
    (an activation near an FP8 rounding boundary may round the other way: 0.0015 measured, at most 0.11).
    Comparing with transformers' own generate instead would test its KV cache's rounding as much as ours."""
    from transformers import AutoModelForCausalLM

    path = compressed["fp8"]
    settings = EngineSettings(model=str(path), device="cpu", dtype="float32", attention_backend="torch",
                              block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                              quantization="fp8")
    engine = LLMEngine(settings)
    assert engine.runner.quantization == "fp8" and engine.runner.model.layers[0].mlp.down_weight.dtype == FP8
    trace = [(at, dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, logprobs=True)))
             for at, request in TRACE]
    chosen = {request.request_id: [] for _, request in trace}
    pending, step = list(trace), 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        for out in engine.step():
            chosen[out.request_id] += [(lp.token_id, lp.logprob) for lp in out.new_logprobs or ()]
        step += 1
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diffs = []
    for _, request in trace:
        tokens = [token for token, _ in chosen[request.request_id]]
        with torch.inference_mode():
            logits = reference(torch.tensor([request.prompt_token_ids + tokens])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(request.prompt_token_ids) - 1:-1], dim=-1)  # [len(tokens), V]
        assert logprobs.argmax(dim=-1).tolist() == tokens, request.request_id
        diffs += [abs(logprobs[i, token].item() - logprob)
                  for i, (token, logprob) in enumerate(chosen[request.request_id])]
    assert len(diffs) >= 200 and sum(diffs) / len(diffs) <= 0.01, max(diffs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8", "w8a8", "w8a16"])
def test_a_quantized_checkpoints_weights_load_as_the_library_reads_them(compressed, name):
    """Widened (float32: no kernel for them), every weight equals compressed-tensors' own decompression of it,
    bit for bit; kept as int8 (bf16 activations), the int8 values are the checkpoint's and the product with
    them is the product with the library's weight, but for the scales' rounding to bf16."""
    path = compressed[name]
    reference = decompressed_weights(path)
    widened = ModelRunner(path, tiny_settings(dtype="float32"))
    assert widened.quantization == "none"
    ours = widened.model.checkpoint_tensors()
    assert set(reference) - {"lm_head.weight"} <= set(ours)
    for tensor_name, weight in reference.items():
        if tensor_name in ours:
            assert torch.equal(ours[tensor_name].float(), weight), tensor_name
    if name == "fp8":
        return
    kept = ModelRunner(path, tiny_settings(dtype="bfloat16"))
    assert kept.quantization == "int8"
    mlp = kept.model.layers[1].mlp
    assert mlp.gate_up_weight.dtype == torch.int8
    with safe_open(str(path / "model.safetensors"), framework="pt") as checkpoint:
        scales = torch.cat([checkpoint.get_tensor(f"model.layers.1.mlp.{part}_proj.weight_scale").float().reshape(-1)
                            for part in ("gate", "up")])
    library = torch.cat([reference[f"model.layers.1.mlp.{part}_proj.weight"] for part in ("gate", "up")])
    assert torch.equal(mlp.gate_up_weight.float() * scales[:, None], library)  # the checkpoint's int8 values
    assert torch.equal(mlp.gate_up_scale, scales.to(torch.bfloat16))


@pytest.mark.slow
def test_group_wise_scales_written_by_the_library_are_refused_naming_the_strategy(tiny_model_path, tmp_path):
    """GPTQ-style int8 weights with a scale per 32 inputs of each row: torch's int8 product takes one scale a row."""
    path = write_compressed(tiny_model_path, tmp_path / "w8a16-g32", type="int", symmetric=True, strategy="group",
                            group_size=32)
    with pytest.raises(ValueError, match="scales its weights by 'group' \\(group size 32\\)"):
        ModelRunner(path, tiny_settings(dtype="bfloat16"))


@pytest.mark.slow
def test_a_moe_checkpoint_with_int8_attention_and_float_experts_runs_all_int8(smollm2_path, tmp_path):
    """compressed-tensors quantizes the Linear layers; transformers holds a Qwen3-MoE's experts in one fused
    module, which it leaves in float. Loaded for the int8 kernel, the experts are quantized per row as they load
    (from the checkpoint's float32, as at start-up), the int8 attention is taken as it is, and the router, int8 in
    the checkpoint, is widened back to the model dtype."""
    source = build_tiny_family(tmp_path / "source", smollm2_path, "qwen3-moe")
    path = write_compressed(source, tmp_path / "w8a8", "INT8")
    runner = ModelRunner(path, tiny_settings(dtype="bfloat16"))
    assert runner.quantization == "int8"
    moe = runner.model.layers[0].mlp
    assert runner.model.layers[0].attn.qkv_weight.dtype == torch.int8 and moe.router_weight.dtype == torch.bfloat16
    with safe_open(str(path / "model.safetensors"), framework="pt") as checkpoint:
        expert = checkpoint.get_tensor("model.layers.0.mlp.experts.1.down_proj.weight")
    assert expert.dtype == torch.float32
    q, scale = quantize_int8(expert)
    assert torch.equal(moe.down_weight[1], q) and torch.equal(moe.down_scale[1], scale.to(torch.bfloat16))
    assert all(len(tokens) == 4 for tokens in greedy(runner, PROMPTS[:2], 4).values())
