"""Ragged (varlen) causal attention over the paged KV cache: prefill, chunked prefill, prefix-cache hits and
mixed prefill + decode batches in one launch, with no padding.

Requests' new tokens are packed flat: request b owns q rows [qsl[b], qsl[b+1]); its token i sits at position
seq_lens[b] - q_len_b + i and attends to positions 0..that one, read from the cache (write_kv ran first).

Tiling: a tile is BLOCK_Q tokens of one request times the G = Hq / Hkv query heads sharing one KV head, so a
tile has BLOCK_M = BLOCK_Q * G rows (row r = token r // G, head r % G) and each K/V tile is loaded once per
group. Short requests (decode rows in a mixed batch) then waste G times less of a tile than one head per row.

Grid (Hkv, virtual tiles). Request b's tiles are numbered from qsl[b] // BLOCK_Q + b: that start is
increasing in b and leaves room for cdiv(q_len_b, BLOCK_Q) tiles, so T // BLOCK_Q + B virtual tiles cover
every request with no host-side prefix sum (no device sync) and a program finds its request by binary
search over query_start_loc. Virtual tiles past a request's end do no work. KV head is the fastest grid
axis so programs reading the same request's K/V run side by side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    check_index_tensor,
    check_query_and_cache,
    check_same_device,
    check_scale,
    softcap_arg,
    window_arg,
)
from kernels._dot import dot_options

LOG2E = 1.4426950408889634


# Triton compiles a kernel per specialization of its integer arguments (equal to 1, a multiple of 16, other).
# num_requests and the block table's row stride (the step's longest context in blocks) change from step to step,
# so left specialized they would cost a compile (0.4 to 1.1 s on an H200) the first time a step met each class;
# only the tile sizes pick the kernel, and the runner builds one per tile height at start-up.
@triton.jit(do_not_specialize=["num_requests", "stride_bt"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D] contiguous
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, M] int32
    out_ptr,  # [T, Hq, D]
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    num_requests, head_dim,
    window,  # HAS_WINDOW: a query at position p sees keys in (p - window, p]
    softcap2,  # HAS_SOFTCAP: the soft cap in base-2 units (softcap * log2(e))
    GROUP_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    kv_head = tl.program_id(0)
    virtual_tile = tl.program_id(1)

    # Largest b with qsl[b] // BLOCK_Q + b <= virtual_tile (b = 0 always qualifies).
    lo = 0
    hi = num_requests - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= virtual_tile
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    b = lo
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    tile = virtual_tile - (q_start // BLOCK_Q + b)

    r = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + r // GROUP_SIZE  # [BLOCK_M] token index within the request
    q_heads = kv_head * GROUP_SIZE + r % GROUP_SIZE  # [BLOCK_M]
    row_mask = (r < BLOCK_Q * GROUP_SIZE) & (tok < q_len)
    pos = seq_len - q_len + tok  # [BLOCK_M] absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    row_off_q = (q_start + tok).to(tl.int64) * stride_qt + q_heads * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + row_off_q[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys 0 .. last valid row's position; a tile past the request's end has no valid rows and runs no loop.
    last_tok = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = tl.where(last_tok >= 0, seq_len - q_len + last_tok + 1, 0)
    # A windowed layer starts at the first key of the tile's earliest query: the blocks before it may be freed.
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - q_len + tile * BLOCK_Q - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kv_tile in range(kv_start // BLOCK_N, tl.cdiv(kv_end, BLOCK_N)):
        n = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_mask = (n < kv_end) & (n >= kv_start)
        block_ids = tl.load(block_tables_ptr + b.to(tl.int64) * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_off = (slots[:, None] * NUM_KV_HEADS + kv_head) * head_dim + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:  # interpreter only, see kernels/_dot.py
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        if HAS_SOFTCAP:  # cap * tanh(score / cap), with tanh(y) = 2 / (1 + e^-2y) - 1
            s = softcap2 * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap2)) - 1.0)
        causal = n_mask[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            causal = causal & (n[None, :] > pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Each row sees a key in the first tile (without a window: key 0), so m_new is finite from then on; a
        # windowed row may see none in a tile before its window starts, and the guard keeps exp2 NaN-free then
        # (and for metadata that breaks the preconditions, seq_len < q_len).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_low = p.to(k_cache_ptr.dtype.element_ty).to(v.dtype)  # P rounded to the cache dtype, as tensor cores take it
        acc = acc * alpha[:, None] + tl.dot(p_low, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    row_off_o = (q_start + tok).to(tl.int64) * stride_ot + q_heads * stride_oh
    tl.store(out_ptr + row_off_o[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def prefill_block_sizes(group_size: int, max_query_len: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_N keys). Rows shrink to fit short queries (16 is tl.dot's smallest tile) so a
    batch of short requests does not fill 128-row tiles with padding."""
    rows_needed = max(1, max_query_len) * group_size
    block_m = min(128 if head_dim <= 64 else 64, max(16, triton.next_power_of_2(rows_needed)))
    block_m = max(block_m, triton.next_power_of_2(group_size))  # at least one token per tile
    return block_m, 64


def ragged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    max_query_len: int,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each request's new tokens over its cached context plus themselves; with `window`, a
    query at position p sees keys in (p - window, p] only (block-table entries before the window of a request's
    earliest new token are never read, so they may be freed); with `softcap`, scores become
    softcap * tanh(score / softcap) first.

    Preconditions not checked (they would need a device sync): query_start_loc is non-decreasing from 0 to
    T, q_len_b <= seq_lens[b] <= M * block_size; max_query_len only sizes tiles, any value stays correct."""
    block_size, num_kv_heads, head_dim, group_size = check_query_and_cache(q, k_cache, v_cache, "[T, Hq, D]")
    num_tokens, num_q_heads, _ = q.shape
    check_index_tensor("query_start_loc", query_start_loc, 1, "[B + 1]", torch.int32)
    check_index_tensor("seq_lens", seq_lens, 1, "[B]", torch.int32)
    check_index_tensor("block_tables", block_tables, 2, "[B, M]", torch.int32)
    num_requests = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_requests + 1 or block_tables.shape[0] != num_requests:
        raise ValueError(
            f"seq_lens has B={num_requests} entries, so query_start_loc needs B + 1 (has "
            f"{query_start_loc.shape[0]}) and block_tables B rows (has {block_tables.shape[0]})"
        )
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=query_start_loc,
                      seq_lens=seq_lens, block_tables=block_tables)
    qk_scale = check_scale(scale) * LOG2E

    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    block_m, block_n = prefill_block_sizes(group_size, max_query_len, head_dim)
    block_q = block_m // group_size
    num_virtual_tiles = num_tokens // block_q + num_requests
    _prefill_kernel[(num_kv_heads, num_virtual_tiles)](
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        num_requests, head_dim, window_arg(window), softcap_arg(softcap),
        GROUP_SIZE=group_size, BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        **dot_options(q.dtype, _prefill_kernel), HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        num_warps=4 if block_m <= 64 else 8,
    )
    return out
