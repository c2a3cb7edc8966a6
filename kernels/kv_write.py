"""Scatter this step's new K/V into the paged KV cache.

Cache layout (fixed): k_cache, v_cache [num_blocks, block_size, Hkv, D], contiguous, so a token's flat slot
(block_id * block_size + offset) times Hkv * D is its element offset. One program per token copies all of its
heads; slot -1 marks a token whose K/V must not be written (e.g. a padded or already-cached position).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_dtype, check_index_tensor, check_kv_cache, check_last_dim_contiguous
from kernels._checks import check_ndim, check_same_device


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D], last dim contiguous
    k_cache_ptr, v_cache_ptr,  # [num_blocks * block_size, Hkv, D] viewed flat, contiguous
    slot_ptr,  # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)  # int64 scalar; -1 = skip
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # A masked store instead of an early return: one code path for the interpreter and the compiler. The
    # skip flag is broadcast through arithmetic first: Triton 3.9's interpreter turns `scalar & block` of
    # booleans into integers, which tl.load then rejects as a mask.
    keep = (heads * 0 + slot) >= 0  # [BLOCK_H]
    mask = keep[:, None] & (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    token64 = token.to(tl.int64)
    k = tl.load(k_ptr + token64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    # int64 offsets: num_slots * Hkv * D passes 2**31 in a large cache.
    dst = slot * num_kv_heads * head_dim + heads[:, None] * head_dim + dims[None, :]  # [BLOCK_H, BLOCK_D]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Write k[t], v[t] into the caches at flat slot slot_mapping[t] (in place). Slots must lie in
    [-1, num_blocks * block_size); that range is not checked on the host because it would need a device sync."""
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_ndim("k", k, 3, "[T, Hkv, D]")
    check_ndim("v", v, 3, "[T, Hkv, D]")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k is [T, Hkv, D] = {tuple(k.shape)} but the cache holds Hkv={num_kv_heads}, D={head_dim}")
    check_dtype("k", k, (k_cache.dtype,))
    check_dtype("v", v, (k_cache.dtype,))
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    num_tokens = k.shape[0]
    check_index_tensor("slot_mapping", slot_mapping, 1, "[T]", torch.int64)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
