"""Rotary position embedding applied in place to q and k (the rotate_half convention of Llama/transformers).

For each token t at position p = positions[t], each head's vector x = [x1, x2] (halves of D) becomes
[x1 cos - x2 sin, x2 cos + x1 sin] with cos/sin = cos_cache[p, :D/2], sin_cache[p, :D/2]. The caches are
[max_positions, D] with halves repeated (worker.model.config.rope_cos_sin), so the first half is read.
In place on q and k, which may be views into the fused qkv projection: nothing is allocated. The math is
fp32 with one rounding to the input dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import ATTENTION_DTYPES, check_dtype, check_index_tensor, check_last_dim_contiguous
from kernels._checks import check_ndim, check_same_device


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, num_heads, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)  # [BLOCK_H, BLOCK_HALF]
    first = x_ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr,  # [T, Hq, D], [T, Hkv, D]: rotated in place
    cos_ptr, sin_ptr,  # [P, D] contiguous
    positions_ptr,  # [T] int64
    stride_qt, stride_qh, stride_kt, stride_kh,
    num_q_heads, num_kv_heads, head_dim,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    pos = tl.load(positions_ptr + token)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * head_dim + cols, mask=cols < half, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    sin = tl.load(sin_ptr + pos * head_dim + cols, mask=cols < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, num_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, num_kv_heads, cos, sin, half, BLOCK_HKV, BLOCK_HALF)


def apply_rotary_(
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos_cache: torch.Tensor,  # [P, D], halves repeated
    sin_cache: torch.Tensor,  # [P, D]
    positions: torch.Tensor,  # [T] int64, each < P (not checked: it would need a device sync)
) -> None:
    check_ndim("q", q, 3, "[T, Hq, D]")
    check_ndim("k", k, 3, "[T, Hkv, D]")
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} must have q's token count and head dim ({num_tokens}, {head_dim})")
    if head_dim % 2:
        raise ValueError(f"head dim must be even for rotary, got {head_dim}")
    check_dtype("q", q, ATTENTION_DTYPES)
    check_dtype("k", k, (q.dtype,))
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_ndim(name, cache, 2, "[max_positions, D]")
        if cache.shape[1] != head_dim or not cache.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [max_positions, {head_dim}] tensor, got "
                             f"{tuple(cache.shape)} with strides {cache.stride()}")
        check_dtype(name, cache, ATTENTION_DTYPES)
    check_index_tensor("positions", positions, 1, "[T]", torch.int64)
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    check_same_device(q=q, k=k, cos_cache=cos_cache, sin_cache=sin_cache, positions=positions)
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, cos_cache, sin_cache, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_q_heads, k.shape[1], head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )
