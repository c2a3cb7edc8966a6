"""Mixture-of-experts MLP in two grouped matmuls (as vLLM's fused_moe does): each token's k (token, expert)
assignments are laid out by expert, each expert's run padded to whole blocks of BLOCK_M rows, so that one program
multiplies a block of rows that all use the same expert's weights.

  up    h[a] = x[a // k] @ gate_up[e(a)].T              gate_up [E, 2I, H]; a = token * k + j, its j-th expert
  act   g[a] = act(h[a, :I]) * h[a, I:]                  (torch, between the two)
  down  y[a] = (g[a] @ down[e(a)].T) * weight[a]          down [E, H, I]
  sum   out[t] = sum over j of y[t * k + j]

The layout (`align`) is made with torch ops on the device, with no copy to the host: `sorted_ids` lists each
expert's assignments in row order and pads its run with a sentinel (E.k, past every assignment), and
`block_expert` names each block's expert (-1 past the last block used, where programs write nothing).
Accumulation in float32; h and y are stored in the activation dtype, as the torch path computes them.
kernels.reference.ref_moe is the definition the tests hold this to, and worker/model/models/moe.py's grouped torch
path computes the same sums (the CPU's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._checks import check_dtype, check_last_dim_contiguous, check_ndim, check_same_device
from kernels._dot import dot_options


@triton.jit
def _grouped_matmul_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr, weight_ptr,
    # a [rows of A, K], w [E, N, K], c [num assignments, N], sorted [num blocks * BLOCK_M], block_expert [blocks],
    # weight [num assignments] float32 (read only with MUL_WEIGHT)
    stride_am, stride_we, stride_wn, stride_cm,
    num_assignments, n_size, k_size, top_k,
    GATHER: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ptr + offs_m)
    # Padding rows, and whole blocks past the last one used (expert -1), are masked rather than returned from:
    # one code path for the interpreter and the compiler.
    live = (assignment < num_assignments) & ((offs_m * 0 + expert) >= 0)
    if GATHER:
        a_rows = assignment // top_k  # the token whose hidden state feeds this assignment
    else:
        a_rows = assignment
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    has_expert = (offs_n * 0 + expert) >= 0
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :],
                    mask=live[:, None] & (offs_k[None, :] < k_size), other=0.0)
        w = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=((offs_n < n_size) & has_expert)[None, :] & (offs_k[:, None] < k_size), other=0.0)
        if UPCAST:  # interpreter only, see kernels/_dot.py
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    if MUL_WEIGHT:
        scale = tl.load(weight_ptr + assignment, mask=live, other=0.0)
        acc = acc * scale[:, None]
    keep = live[:, None] & (offs_n[None, :] < n_size)
    tl.store(c_ptr + assignment.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=keep)


def align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [num blocks * block_m], block_expert [num blocks]) for `expert_ids` [N, k]: each expert's
    assignments (token * k + j) in row order, its run padded to whole blocks with N * k. The number of blocks is
    the bound cdiv(N k, block_m) + E, so nothing is read back to the host."""
    flat = expert_ids.reshape(-1)
    num_assignments = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, row order within each
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    sorted_experts = flat[order]
    rank = torch.arange(num_assignments, device=device) - start[sorted_experts]
    num_blocks = triton.cdiv(num_assignments, block_m) + num_experts
    sorted_ids = torch.full((num_blocks * block_m,), num_assignments, dtype=torch.int64, device=device)
    sorted_ids[padded_start[sorted_experts] + rank] = order
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_ids, block_expert


def _blocks(n_size: int, k_size: int) -> tuple[int, int]:
    return min(64, max(16, triton.next_power_of_2(n_size))), min(64, max(16, triton.next_power_of_2(k_size)))


def _grouped(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
             top_k: int, gather: bool, weights: torch.Tensor | None, block_m: int) -> None:
    n_size, k_size = w.shape[1], w.shape[2]
    block_n, block_k = _blocks(n_size, k_size)
    grid = (block_expert.shape[0], triton.cdiv(n_size, block_n))
    _grouped_matmul_kernel[grid](
        a, w, out, sorted_ids, block_expert, weights if weights is not None else out,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        out.shape[0], n_size, k_size, top_k,
        GATHER=gather, MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **dot_options(a.dtype, _grouped_matmul_kernel))


def fused_moe(
    x: torch.Tensor,  # [N, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [N, k] routing weights (float32, or the model dtype where the family casts them)
    expert_ids: torch.Tensor,  # [N, k] int64
    act: Callable[[torch.Tensor], torch.Tensor],
    block_m: int = 16,
) -> torch.Tensor:  # [N, H]
    for name, t, layout in (("x", x, "[N, H]"), ("gate_up", gate_up, "[E, 2I, H]"), ("down", down, "[E, H, I]"),
                            ("expert_ids", expert_ids, "[N, k]")):
        check_ndim(name, t, len(layout.split(",")), layout)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    size = two_i // 2
    if gate_up.shape[2] != hidden or tuple(down.shape) != (num_experts, hidden, size):
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)}")
    if tuple(weights.shape) != tuple(expert_ids.shape) or expert_ids.shape[0] != num_tokens:
        raise ValueError(f"weights {tuple(weights.shape)} and expert_ids {tuple(expert_ids.shape)} must be [N, k]")
    check_dtype("gate_up", gate_up, (x.dtype,))
    check_dtype("down", down, (x.dtype,))
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        check_last_dim_contiguous(name, t)
    check_same_device(x=x, gate_up=gate_up, down=down, weights=weights, expert_ids=expert_ids)
    top_k = expert_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    sorted_ids, block_expert = align(expert_ids.long(), num_experts, block_m)
    h = torch.empty(num_tokens * top_k, two_i, device=x.device, dtype=x.dtype)
    _grouped(x, gate_up, h, sorted_ids, block_expert, top_k, True, None, block_m)
    g = act(h[:, :size]) * h[:, size:]  # [N k, I]
    y = torch.empty(num_tokens * top_k, hidden, device=x.device, dtype=x.dtype)
    _grouped(g, down, y, sorted_ids, block_expert, top_k, False, weights.reshape(-1).float().contiguous(), block_m)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
