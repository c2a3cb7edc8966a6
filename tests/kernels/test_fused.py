"""The fused per-layer chains (kernels/fused.py) against the torch operations they replace, on random inputs in
every activation dtype (interpreted on the CPU here, compiled on CUDA), and end to end: greedy generation with
them (ENGINE_FUSED_KERNELS=on) gives the tokens of the unfused path in float32 and of transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.fused import act_mul, add_rms_norm
from worker.model.layers import gelu_tanh, rms_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_close_in(dtype: torch.dtype, got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: to rounding; bf16 and fp16: the same values but for a few elements a unit in the last place
    apart (a sum or an exponential taken in another order), near zero within a little of the largest."""
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    scale = expected.abs().max().item()
    if dtype is torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale)
        return
    torch.testing.assert_close(got, expected, rtol=1e-2 if dtype is torch.bfloat16 else 1e-3, atol=1e-3 * scale)
    assert (got == expected).float().mean() >= 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 576), (33, 100)])
def test_add_rms_norm_is_the_residual_add_then_the_layers_norm(device, dtype, rows, hidden):
    torch.manual_seed(rows * hidden)
    # x a view into a wider tensor: rows need not be packed, only their last dimension contiguous.
    x = (torch.randn(rows, 2 * hidden) * 3).to(dtype).to(device)[:, :hidden]
    residual = (torch.randn(rows, hidden) * 2).to(dtype).to(device)
    weight = (torch.rand(hidden) + 0.5).to(dtype).to(device)
    normed, summed = add_rms_norm(x, residual, weight, 1e-5)
    expected_sum = residual + x
    assert torch.equal(summed, expected_sum)  # one rounding of a sum: exact in every dtype
    assert_close_in(dtype, normed, rms_norm(expected_sum, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act,torch_act", [("silu", F.silu), ("gelu_pytorch_tanh", gelu_tanh)])
@pytest.mark.parametrize("rows,inter", [(1, 64), (7, 1536), (3, 1500)])
def test_act_mul_is_the_activation_of_the_gate_times_up(device, dtype, act, torch_act, rows, inter):
    torch.manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(dtype).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close_in(dtype, act_mul(gate_up, act), torch_act(gate) * up)


def test_wrong_shapes_and_activations_are_refused(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm(x, torch.randn(4, 8, device=device), torch.ones(9, device=device), 1e-5)
    with pytest.raises(ValueError, match="relu"):
        act_mul(torch.randn(4, 8, device=device), "relu")
    with pytest.raises(ValueError, match=r"\[R, 2I\]"):
        act_mul(torch.randn(4, 7, device=device), "silu")


@pytest.mark.slow  # about 15 s of interpreted kernels
def test_fused_kernels_generate_the_tokens_of_the_unfused_path_and_transformers(tiny_model_path: Path) -> None:
    from tests.engine.test_engine_correctness import hf_reference, run_trace
    from tests.kernels.test_triton_generation import TRACE
    from worker.engine.engine import LLMEngine
    from worker.model.settings import EngineSettings

    tokens = {}
    for fused in ("on", "off"):
        engine = LLMEngine(EngineSettings(
            model=str(tiny_model_path), device="cpu", dtype="float32", attention_backend="triton",
            fused_kernels=fused, block_size=16, num_kv_blocks=32, max_num_batched_tokens=32, max_num_seqs=4))
        model = engine.runner.model
        assert (model.fused_add_norm is not None) == (fused == "on")
        assert (model.layers[0].mlp.fused_act_mul is not None) == (fused == "on")
        tokens[fused] = run_trace(engine, TRACE)
    assert tokens["on"] == tokens["off"] == hf_reference(tiny_model_path, TRACE, set(engine.runner.eos_token_ids))


@pytest.mark.slow  # interpreted kernels: about 15 s
def test_a_moe_family_with_qk_norms_generates_the_same_tokens_fused(smollm2_path: Path, tmp_path: Path) -> None:
    """Qwen3-MoE (per-head q/k norms, experts in place of the MLP, whose output is handed on unadded all the
    same): the fused path's tokens are the unfused path's."""
    from tests.engine.test_engine_correctness import run_trace
    from tests.kernels.test_triton_generation import TRACE
    from worker.engine.engine import LLMEngine
    from worker.model.settings import EngineSettings
    from worker.model.tiny import build_tiny_family

    path = build_tiny_family(tmp_path, smollm2_path, "qwen3-moe")
    tokens = {}
    for fused in ("on", "off"):
        engine = LLMEngine(EngineSettings(
            model=str(path), device="cpu", dtype="float32", attention_backend="triton", fused_kernels=fused,
            block_size=16, num_kv_blocks=32, max_num_batched_tokens=32, max_num_seqs=4))
        assert (engine.runner.model.fused_add_norm is not None) == (fused == "on")
        tokens[fused] = run_trace(engine, TRACE)
    assert tokens["on"] == tokens["off"]


@pytest.mark.slow  # a runner on the Triton backend under the interpreter: about 16 s
def test_families_outside_the_llama_graph_keep_their_own_path(smollm2_path: Path, tmp_path: Path) -> None:
    from worker.model.runner import ModelRunner
    from worker.model.settings import EngineSettings
    from worker.model.tiny import build_tiny_family

    path = build_tiny_family(tmp_path, smollm2_path, "gemma2")
    runner = ModelRunner(str(path), EngineSettings(model=str(path), device="cpu", dtype="float32",
                                                   attention_backend="triton", fused_kernels="on", num_kv_blocks=16))
    assert runner.model.fused_add_norm is None


def test_auto_fuses_where_attention_runs_in_triton_on_cuda_and_on_without_triton_fails_fast(monkeypatch):
    from worker.model.runner import use_fused_kernels

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_fused_kernels("auto", cuda, "triton") and not use_fused_kernels("auto", cuda, "torch")
    assert not use_fused_kernels("auto", cpu, "torch") and not use_fused_kernels("off", cuda, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_fused_kernels("on", cpu, "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="ENGINE_FUSED_KERNELS=on.*runs on cpu"):
        use_fused_kernels("on", cpu, "torch")
