"""rms_norm (plain and fused with the residual add) and apply_rotary_ against kernels/reference.py.
Tolerances: paged_case.TOLERANCES (fp32 1e-4, fp16 3e-3, bf16 2e-2); the fused residual sum is one rounded
add, so compiled it must equal the reference's exactly. Triton 3.9's interpreter truncates fp32 -> bf16 casts
(the GPU rounds to nearest even), so under the interpreter a bf16 residual is held to one bf16 ulp instead."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import ref_rms_norm, ref_rotary
from kernels.rmsnorm import rms_norm
from kernels.rotary import apply_rotary_
from tests.kernels.paged_case import COMPILED_ON_CUDA, assert_close


@pytest.mark.parametrize(("hidden", "dtype"), [(200, torch.bfloat16), (64, torch.float32), (100, torch.float16)])
def test_rms_norm(device: str, hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    # x as a strided view (every other row of a bigger tensor) and a weight far from 1
    x = (torch.randn(10, hidden, generator=gen, device=device) * 3).to(dtype)[::2]
    weight = torch.rand(hidden, generator=gen, device=device).to(dtype) + 0.5
    assert_close(rms_norm(x, weight, 1e-5), ref_rms_norm(x, weight, 1e-5))

    residual = torch.randn(5, hidden, generator=gen, device=device).to(dtype)
    expected_residual = residual.clone()
    expected = ref_rms_norm(x, weight, 1e-5, residual=expected_residual)
    out = rms_norm(x, weight, 1e-5, residual=residual)
    if dtype == torch.bfloat16 and not COMPILED_ON_CUDA:
        torch.testing.assert_close(residual, expected_residual, atol=0.0, rtol=2.0**-7)
    else:
        assert torch.equal(residual, expected_residual)
    assert_close(out, expected)


def rope_tables(max_positions: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D], halves repeated
    return emb.cos(), emb.sin()


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim", "dtype"),
                         [(9, 3, 64, torch.bfloat16), (4, 4, 128, torch.float32), (8, 1, 64, torch.float16)])
def test_rotary_in_place_on_fused_qkv_views(device, num_q_heads, num_kv_heads, head_dim, dtype) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    num_tokens = 6
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    q, k = qkv[:, :num_q_heads], qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    v_before = qkv[:, num_q_heads + num_kv_heads :].clone()
    cos, sin = (t.to(dtype).to(device) for t in rope_tables(4096, head_dim))
    positions = torch.tensor([0, 1, 2, 3000, 7, 4095], device=device)
    expected_q, expected_k = ref_rotary(q, cos, sin, positions), ref_rotary(k, cos, sin, positions)

    apply_rotary_(q, k, cos, sin, positions)

    assert_close(q.contiguous(), expected_q)
    assert_close(k.contiguous(), expected_k)
    assert torch.equal(qkv[:, num_q_heads + num_kv_heads :], v_before), "v must be left alone"
    assert not torch.equal(q[1:], qkv.new_zeros(q[1:].shape))  # non-trivial rotation happened


def test_validation() -> None:
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        rms_norm(x, torch.zeros(7), 1e-5)
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm(x, torch.zeros(8), 1e-5, residual=torch.zeros(3, 8, dtype=torch.float16))
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    cos = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="positions must be torch.int64"):
        apply_rotary_(q, k, cos, cos, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cos_cache must be a contiguous"):
        apply_rotary_(q, k, torch.zeros(16, 4), cos, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="head dim must be even"):
        apply_rotary_(torch.zeros(2, 4, 7), torch.zeros(2, 2, 7), cos, cos, torch.zeros(2, dtype=torch.int64))
