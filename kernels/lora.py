"""LoRA of a step that mixes adapters, one row at a time (as Punica's BGMV kernels do): each token row names the
slot of its adapter in a stack of the loaded adapters' weights (worker/model/lora.py's LoraStack), -1 for the base.

  shrink  v[r] = x[r] @ a[slot[r]]                     a [S, in, C]: each slot's A transposed, rank padded to C
  expand  out[r, lo:lo + N] += v[r] @ b[slot[r]]        b [S, C, N]: each slot's B, scaled, zero outside its targets

One program per row (shrink) and per row and block of output columns (expand); rows of the base are skipped.
Accumulation in float32 whatever the weights' dtype. kernels.reference.ref_lora is the definition the tests hold
these to, and the torch path of worker/model/lora.py (gather, batched matmuls, scatter) computes the same sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_dtype, check_index_tensor, check_ndim, check_same_device


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, v_ptr,  # x [R, in], a [S, in, C], slot [R] int64, v [R, C] float32
    stride_xr, stride_as, stride_ak, stride_vr,
    in_size, rank,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    cols = tl.arange(0, BLOCK_C)
    # Masks instead of an early return for the base's rows: one code path for the interpreter and the compiler.
    live = (cols * 0 + slot) >= 0
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    a_base = a_ptr + tl.maximum(slot, 0) * stride_as
    for k0 in range(0, in_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xr + ks, mask=ks < in_size, other=0.0).to(tl.float32)
        mask = (ks[:, None] < in_size) & (cols[None, :] < rank) & live[None, :]
        a = tl.load(a_base + ks[:, None] * stride_ak + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None] * a, axis=0)
    tl.store(v_ptr + row.to(tl.int64) * stride_vr + cols, acc, mask=cols < rank)


@triton.jit
def _expand_kernel(
    v_ptr, b_ptr, slot_ptr, out_ptr,  # v [R, C] float32, b [S, C, N], slot [R] int64, out [R, *] (columns lo..)
    stride_vr, stride_bs, stride_bc, stride_or,
    rank, width,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + row)
    live = (ns * 0 + slot) >= 0
    cs = tl.arange(0, BLOCK_C)
    v = tl.load(v_ptr + row.to(tl.int64) * stride_vr + cs, mask=cs < rank, other=0.0)
    b_base = b_ptr + tl.maximum(slot, 0) * stride_bs
    mask = (cs[:, None] < rank) & (ns[None, :] < width) & live[None, :]
    b = tl.load(b_base + cs[:, None] * stride_bc + ns[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(v[:, None] * b, axis=0)
    keep = (ns < width) & live
    dst = out_ptr + row.to(tl.int64) * stride_or + ns
    current = tl.load(dst, mask=keep, other=0.0)
    tl.store(dst, (current.to(tl.float32) + delta).to(current.dtype), mask=keep)


def add_lora(
    x: torch.Tensor,  # [R, in]
    slots: torch.Tensor,  # [R] int64, -1 = the base (nothing added)
    a: torch.Tensor,  # [S, in, C]
    b: torch.Tensor,  # [S, C, N]
    out: torch.Tensor,  # [R, N] (a column range of a wider output is fine: its rows may be strided)
) -> torch.Tensor:
    """out[r] += x[r] @ a[slots[r]] @ b[slots[r]] for every row with a slot; returns out (changed in place)."""
    check_ndim("x", x, 2, "[R, in]")
    check_ndim("a", a, 3, "[S, in, C]")
    check_ndim("b", b, 3, "[S, C, N]")
    check_ndim("out", out, 2, "[R, N]")
    num_rows, in_size = x.shape
    num_slots, _, rank = a.shape
    width = b.shape[2]
    if a.shape[1] != in_size or b.shape[:2] != (num_slots, rank) or tuple(out.shape) != (num_rows, width):
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"out {tuple(out.shape)}")
    check_dtype("a", a, (x.dtype,))
    check_dtype("b", b, (x.dtype,))
    check_dtype("out", out, (x.dtype,))
    check_index_tensor("slots", slots, 1, "[R]", torch.int64)
    if slots.shape[0] != num_rows:
        raise ValueError(f"slots has {slots.shape[0]} entries for {num_rows} rows")
    for name, t in (("x", x), ("a", a), ("b", b), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_same_device(x=x, slots=slots, a=a, b=b, out=out)
    if num_rows == 0 or num_slots == 0:
        return out
    v = torch.empty(num_rows, rank, device=x.device, dtype=torch.float32)
    block_c = triton.next_power_of_2(rank)
    _shrink_kernel[(num_rows,)](
        x, a, slots, v, x.stride(0), a.stride(0), a.stride(1), v.stride(0), in_size, rank,
        BLOCK_K=min(128, triton.next_power_of_2(in_size)), BLOCK_C=block_c)
    block_n = min(128, triton.next_power_of_2(width))
    _expand_kernel[(num_rows, triton.cdiv(width, block_n))](
        v, b, slots, out, v.stride(0), b.stride(0), b.stride(1), out.stride(0), rank, width,
        BLOCK_C=block_c, BLOCK_N=block_n)
    return out
