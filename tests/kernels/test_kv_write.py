"""write_kv against ref_write_kv: exact equality (a copy involves no arithmetic)."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_write import write_kv
from kernels.reference import ref_write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_minus_one(device: str, dtype: torch.dtype) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 64
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    # k and v as views of a fused [T, Hq + 2 Hkv, D] projection: token stride != Hkv * D.
    qkv = torch.randn(7, 2 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    k, v = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    # first and last slot of the cache, a mid-block slot, and two skipped tokens
    slot_mapping = torch.tensor([0, -1, 95, 17, 40, -1, 33], dtype=torch.int64, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref_write_kv(k, v, expected_k, expected_v, slot_mapping)
    untouched = k_cache.clone()

    write_kv(k, v, k_cache, v_cache, slot_mapping)

    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    written = {0, 95, 17, 40, 33}
    flat_before, flat_after = untouched.view(-1, num_kv_heads, head_dim), k_cache.view(-1, num_kv_heads, head_dim)
    for slot in range(num_blocks * block_size):
        if slot not in written:  # skipped tokens and unlisted slots stay as they were
            assert torch.equal(flat_after[slot], flat_before[slot])


def test_write_kv_with_no_tokens_is_a_no_op(device: str) -> None:
    cache = torch.zeros(2, 16, 1, 64, device=device)
    empty = torch.zeros(0, 1, 64, device=device)
    write_kv(empty, empty, cache, cache.clone(), torch.zeros(0, dtype=torch.int64, device=device))
    assert not cache.any()
