"""Fused per-layer chains for a GPU step: residual add with RMSNorm, and the gated activation.

Each replaces a chain of elementwise torch operations (on a GPU, a launch and a round trip through memory each)
with one kernel that reads its inputs once and writes its outputs once. Both round where the torch chain rounds,
so in bf16 and fp16 they give the same values (the norm's sum of squares aside, whose order differs), and in
float32 the same tokens:

- `add_rms_norm(x, residual, weight, eps)`: h = x + residual in the activation dtype, then the Llama RMSNorm of
  h (statistics in float32, cast back, then times the weight), as worker/model/layers.py's rms_norm; returns
  (normed, h). One program per row.
- `act_mul(gate_up, act)`: act(gate) * up for gate_up = [gate | up] along the last dimension, SiLU or GELU (tanh
  approximation), the activation computed in float32 and rounded before the product as F.silu(gate) * up is.
- `rope_kv_write(qk, v, cos, signed_sin, k_cache, v_cache, slot_mapping, num_q_heads)`: the rotary embedding of
  every query and key head (rotate_half, as worker/model/layers.py's apply_rope, each product and the sum rounded
  as torch rounds them) and the step's K/V written into the paged cache at their slots (as kernels/kv_write.py),
  in one launch that reads q|k|v once; returns the rotated queries. One program per token, all its heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_dtype, check_ndim, check_same_device

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


@triton.jit
def _round_to(x, dtype: tl.constexpr, BF16: tl.constexpr):
    """float32 -> dtype, to nearest (ties to even). bf16 by hand: Triton's interpreter truncates a float32
    to bfloat16, where torch and the GPU round; the same integer steps give the GPU's result compiled."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, h_ptr,  # [R, H] each but the weight [H]; rows contiguous
    stride_x, stride_res, stride_out, stride_h,
    hidden, eps,
    BLOCK: tl.constexpr, BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    h = _round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype, BF16)  # rounds to the activation dtype, as torch
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h32 * h32, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    normed = _round_to(h32 * inv, x.dtype, BF16)
    tl.store(out_ptr + row * stride_out + cols, _round_to(w.to(tl.float32) * normed.to(tl.float32), x.dtype, BF16),
             mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for x, residual [R, H] and weight [H], one dtype."""
    check_ndim("x", x, 2, "[R, H]")
    check_ndim("weight", weight, 1, "[H]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("residual", residual, (x.dtype,))
    check_dtype("weight", weight, (x.dtype,))
    if residual.shape != x.shape or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and weight {tuple(weight.shape)} "
                         "do not match")
    if x.stride(1) != 1 or residual.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("add_rms_norm needs rows with contiguous last dimensions")
    check_same_device(x=x, residual=residual, weight=weight)
    num_rows, hidden = x.shape
    out, summed = torch.empty_like(x), torch.empty_like(x)
    if num_rows:
        _add_rms_norm_kernel[(num_rows,)](
            x, residual, weight, out, summed, x.stride(0), residual.stride(0), out.stride(0), summed.stride(0),
            hidden, eps, BLOCK=triton.next_power_of_2(hidden), BF16=x.dtype == torch.bfloat16)
    return out, summed


@triton.jit
def _act_mul_kernel(
    gate_up_ptr, out_ptr,  # [R, 2I], [R, I]; rows contiguous
    stride_in, stride_out, inter,
    ACT: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    else:
        # torch's tanh-approximate GELU, 0.5 g (1 + tanh(u)), with tanh(u) = 2 / (1 + exp(-2u)) - 1
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        u = tl.minimum(tl.maximum(u, -15.0), 15.0)  # tanh is +-1 in float32 beyond; exp(30) stays finite
        a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0))
    a = _round_to(a, gate.dtype, BF16)  # the activation's output rounds before the product, as in act(gate) * up
    tl.store(out_ptr + row * stride_out + cols, _round_to(a.to(tl.float32) * up.to(tl.float32), gate.dtype, BF16),
             mask=mask)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for gate_up = [R, 2I] holding gate then up: [R, I]. act: silu or gelu_pytorch_tanh."""
    check_ndim("gate_up", gate_up, 2, "[R, 2I]")
    check_dtype("gate_up", gate_up, FLOAT_DTYPES)
    if act not in ACTS:
        raise ValueError(f"act_mul takes {sorted(ACTS)}, not {act!r}")
    if gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [R, 2I] with contiguous rows, not {tuple(gate_up.shape)}")
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, triton.next_power_of_2(inter))
    if num_rows:
        _act_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, ACT=ACTS[act], BLOCK=block,
            BF16=gate_up.dtype == torch.bfloat16)
    return out


@triton.jit
def _rope_kv_write_kernel(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr,  # qk [T, Hq + Hkv, D], v [T, Hkv, D], cos/sin [T, D], q_out [T, Hq, D]
    k_cache_ptr, v_cache_ptr, slot_ptr,  # caches [num_slots, Hkv, D] viewed flat, contiguous; slots [T] int64
    stride_qk_t, stride_qk_h, stride_v_t, stride_v_h, stride_cos, stride_sin, stride_out_t, stride_out_h,
    num_q_heads, num_kv_heads, head_dim,
    BLOCK_QK: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    in_head = dims < head_dim
    slot = tl.load(slot_ptr + token)  # -1: a token whose K/V is not written
    # Every query and key head of the token: rows [0, Hq) are queries, [Hq, Hq + Hkv) keys.
    heads = tl.arange(0, BLOCK_QK)
    mask = (heads[:, None] < num_q_heads + num_kv_heads) & in_head[None, :]  # [BLOCK_QK, BLOCK_D]
    rows = qk_ptr + token * stride_qk_t + heads[:, None] * stride_qk_h
    x = tl.load(rows + dims[None, :], mask=mask, other=0.0)
    half = head_dim // 2
    swapped = tl.load(rows + ((dims + half) % head_dim)[None, :], mask=mask, other=0.0)  # cat(x2, x1)
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=in_head, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=in_head, other=0.0).to(tl.float32)  # first half negated
    a = _round_to(x.to(tl.float32) * cos[None, :], x.dtype, BF16)
    b = _round_to(swapped.to(tl.float32) * sin[None, :], x.dtype, BF16)
    out = _round_to(a.to(tl.float32) + b.to(tl.float32), x.dtype, BF16)
    is_query = heads[:, None] < num_q_heads
    tl.store(q_out_ptr + token * stride_out_t + heads[:, None] * stride_out_h + dims[None, :], out,
             mask=mask & is_query)
    # The skip flag broadcast through arithmetic first: see kernels/kv_write.py.
    keep = (heads * 0 + slot) >= 0  # [BLOCK_QK]
    k_dst = slot * num_kv_heads * head_dim + (heads[:, None] - num_q_heads) * head_dim + dims[None, :]
    tl.store(k_cache_ptr + k_dst, out, mask=mask & ~is_query & keep[:, None])
    kv_heads = tl.arange(0, BLOCK_KV)
    v_mask = (kv_heads[:, None] < num_kv_heads) & in_head[None, :] & ((kv_heads * 0 + slot) >= 0)[:, None]
    value = tl.load(v_ptr + token * stride_v_t + kv_heads[:, None] * stride_v_h + dims[None, :], mask=v_mask)
    tl.store(v_cache_ptr + slot * num_kv_heads * head_dim + kv_heads[:, None] * head_dim + dims[None, :], value,
             mask=v_mask)


def rope_kv_write(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_q_heads: int) -> torch.Tensor:
    """qk [T, Hq + Hkv, D] (queries then keys, rows may be strided: a view of q|k|v), v [T, Hkv, D], cos and
    signed_sin [T, D] or [T, 1, D] (the whole head rotates; first half of sin negated, see apply_rope): writes the
    rotated keys and v into the caches [num_blocks, block_size, Hkv, D] at slot_mapping [T] (int64, -1 = skip)
    and returns the rotated queries [T, Hq, D]."""
    check_ndim("qk", qk, 3, "[T, Hq + Hkv, D]")
    check_ndim("v", v, 3, "[T, Hkv, D]")
    check_dtype("qk", qk, FLOAT_DTYPES)
    for name, tensor in (("v", v), ("cos", cos), ("signed_sin", signed_sin), ("k_cache", k_cache),
                         ("v_cache", v_cache)):
        check_dtype(name, tensor, (qk.dtype,))
    num_tokens, num_heads, head_dim = qk.shape
    num_kv_heads = num_heads - num_q_heads
    cos, signed_sin = cos.reshape(num_tokens, -1), signed_sin.reshape(num_tokens, -1)
    if (v.shape != (num_tokens, num_kv_heads, head_dim) or cos.shape[1] != head_dim or signed_sin.shape[1] != head_dim
            or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape
            or head_dim % 2 or slot_mapping.shape != (num_tokens,)):
        raise ValueError(f"rope_kv_write: qk {tuple(qk.shape)} with {num_q_heads} query heads, v {tuple(v.shape)}, "
                         f"cos {tuple(cos.shape)}, caches {tuple(k_cache.shape)}, slots {tuple(slot_mapping.shape)} "
                         "do not match")
    if (qk.stride(2) != 1 or v.stride(2) != 1 or cos.stride(1) != 1 or signed_sin.stride(1) != 1
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or slot_mapping.dtype != torch.int64):
        raise ValueError("rope_kv_write needs contiguous heads, rows of cos and sin, contiguous caches and int64 slots")
    check_same_device(qk=qk, v=v, cos=cos, signed_sin=signed_sin, k_cache=k_cache, v_cache=v_cache,
                      slot_mapping=slot_mapping)
    q = torch.empty(num_tokens, num_q_heads, head_dim, device=qk.device, dtype=qk.dtype)
    if num_tokens:
        _rope_kv_write_kernel[(num_tokens,)](
            qk, v, cos, signed_sin, q, k_cache, v_cache, slot_mapping,
            qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), signed_sin.stride(0),
            q.stride(0), q.stride(1), num_q_heads, num_kv_heads, head_dim,
            BLOCK_QK=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim), BF16=qk.dtype == torch.bfloat16)
    return q
