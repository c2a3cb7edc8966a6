"""The fused per-layer chains (kernels/fused.py) against the torch operations they replace, on random inputs in
every activation dtype (interpreted on the CPU here, compiled on CUDA), and end to end: greedy generation with
them (ENGINE_FUSED_KERNELS=on) gives the tokens of the unfused path in float32 and of transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.fused import act_mul, add_rms_norm, rope_kv_write
from worker.model.layers import apply_rope, gelu_tanh, rms_norm

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (9, 3, 64), (8, 8, 128)])
def test_rope_kv_write_rotates_like_apply_rope_and_writes_the_cache_like_write_kv(device, dtype, heads, kv_heads,
                                                                                 head_dim):
    """q|k|v as the layer has it (one [T, (Hq + 2 Hkv) D] matrix, q|k and v views of it): the rotated queries
    are apply_rope's to the last bit (each product and the sum rounded as torch rounds them), the rotated keys
    and the values land in the caches at their slots, and a token with slot -1 writes nothing."""
    torch.manual_seed(heads * head_dim)
    tokens, num_blocks, block_size = 6, 8, 4
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 2).to(dtype).to(device)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 30, 31], device=device)
    cos_table, sin_table = _rope(head_dim, 64, dtype, device)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)  # [T, 1, D], as the layer's
    slots = torch.tensor([5, 6, -1, 0, 17, 31], device=device)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    q = rope_kv_write(qk, v, cos, sin, k_cache, v_cache, slots, heads)
    rotated = apply_rope(qk, cos, sin)
    assert torch.equal(q, rotated[:, :heads])
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    written = [i for i, slot in enumerate(slots.tolist()) if slot >= 0]
    assert torch.equal(flat_k[slots[written]], rotated[written, heads:])
    assert torch.equal(flat_v[slots[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written].cpu()] = False
    assert not flat_k[untouched.to(device)].any() and not flat_v[untouched.to(device)].any()


def _rope(head_dim: int, positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    signed = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)
    return emb.cos().to(dtype).to(device), signed.to(dtype).to(device)


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
        assert (model.layers[0].attn.fused_rope_kv is not None) == (fused == "on")
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
        assert (engine.runner.model.layers[0].attn.fused_rope_kv is not None) == (fused == "on")
        tokens[fused] = run_trace(engine, TRACE)
    assert tokens["on"] == tokens["off"]


@pytest.mark.parametrize(("family", "backend", "rope_fused"), [
    ("llama", "triton", True), ("llama", "torch", False),  # the torch backend writes its KV itself
    # A partly rotated head keeps apply_rope (building the family's folder: 4 s, in the full suite).
    pytest.param("phi3-partial-rotary-window", "triton", False, marks=pytest.mark.slow),
])
def test_rope_joins_the_kv_write_only_with_the_triton_backend_and_a_wholly_rotated_head(
        tiny_model_path: Path, smollm2_path: Path, tmp_path: Path, family, backend, rope_fused) -> None:
    from types import SimpleNamespace

    from worker.model.config import load_config
    from worker.model.models import MODEL_CLASSES
    from worker.model.tiny import build_tiny_family

    path = tiny_model_path if family == "llama" else build_tiny_family(tmp_path, smollm2_path, family)
    config = load_config(path)
    model = MODEL_CLASSES[config.architecture](config, SimpleNamespace(name=backend), 64)
    assert model.use_fused_kernels() == config.num_layers
    assert all((layer.attn.fused_rope_kv is not None) == rope_fused for layer in model.layers)


@pytest.mark.slow  # building the family's folder: 4 s
def test_families_outside_the_llama_graph_keep_their_own_path(smollm2_path: Path, tmp_path: Path) -> None:
    """Gemma 2's norms and soft caps are not the Llama graph's: nothing fuses, with the Triton backend either."""
    from types import SimpleNamespace

    from worker.model.config import load_config
    from worker.model.models import MODEL_CLASSES
    from worker.model.tiny import build_tiny_family

    config = load_config(build_tiny_family(tmp_path, smollm2_path, "gemma2"))
    model = MODEL_CLASSES[config.architecture](config, SimpleNamespace(name="triton"), 64)
    assert model.use_fused_kernels() == 0 and model.fused_add_norm is None
    assert all(layer.attn.fused_rope_kv is None for layer in model.layers)


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
