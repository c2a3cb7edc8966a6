"""Paged decode attention: one new query token per request over its whole cached context.

Grid (B, Hkv, num_splits). A program takes one request, one KV head and all G = Hq / Hkv query heads that
share it, so each K/V tile is read from memory once per group; the G heads form the rows of a tl.dot
(padded to 16, the smallest dot tile; decode is memory-bound so the padding costs no bandwidth).

Split-context (flash-decoding): with few programs (B * Hkv small next to the SM count) and long contexts, one
program per (request, KV head) leaves most SMs idle. The context is then cut into num_splits pieces, each
program writes its partial max / sum / unnormalized output in fp32 and a second kernel merges them.
Split boundaries are computed per request inside the kernel from its own seq_len, so no host sync is needed.
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

BLOCK_N = 64  # keys per inner-loop tile
MIN_TILES_PER_SPLIT = 4  # a split shorter than 4 tiles (256 keys) costs more in the merge than it saves
MAX_SPLITS = 64
LOG2E = 1.4426950408889634


# The block table's row stride is the step's longest context in blocks: specialized, each class of it (1, a
# multiple of 16, other) would be a compile of its own the first time an eager decode step met it.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D] contiguous
    block_tables_ptr,  # [B, M] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D] (NUM_SPLITS == 1)
    part_m_ptr, part_l_ptr,  # [B, Hq, NUM_SPLITS] fp32 (NUM_SPLITS > 1)
    part_acc_ptr,  # [B, Hq, NUM_SPLITS, D] fp32 (NUM_SPLITS > 1)
    qk_scale,  # softmax scale * log2(e): scores live in base 2 so exp2 can be used
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    group_size, head_dim,
    window,  # HAS_WINDOW: the query (at seq_len - 1) sees keys in (seq_len - 1 - window, seq_len - 1]
    softcap2,  # HAS_SOFTCAP: the soft cap in base-2 units (softcap * log2(e))
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_heads = kv_head * group_size + g  # [BLOCK_G]
    g_mask = g < group_size
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + b64 * stride_qb + q_heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    # A windowed layer starts at the tile of its first key: the blocks before it may be freed (-1 in the table).
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    first_tile = first_key // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(tile_start, tile_end):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_mask = (n < seq_len) & (n >= first_key)
        block_ids = tl.load(block_tables_ptr + b64 * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE  # [BLOCK_N]
        kv_off = (slots[:, None] * NUM_KV_HEADS + kv_head) * head_dim + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:  # interpreter only, see kernels/_dot.py
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N] fp32
        if HAS_SOFTCAP:  # cap * tanh(score / cap), with tanh(y) = 2 / (1 + e^-2y) - 1
            s = softcap2 * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap2)) - 1.0)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Every tile in range holds >= 1 valid key, so m_new is finite; the guard keeps exp2 NaN-free regardless.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_low = p.to(k_cache_ptr.dtype.element_ty).to(v.dtype)  # P rounded to the cache dtype, as tensor cores take it
        acc = acc * alpha[:, None] + tl.dot(p_low, v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        # seq_len 0 leaves l_i == 0 and acc == 0: the output row is zeros.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + b64 * stride_ob + q_heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        row = (b64 * (NUM_KV_HEADS * group_size) + q_heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * head_dim + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr,  # [B, Hq, NUM_SPLITS] fp32
    part_acc_ptr,  # [B, Hq, NUM_SPLITS, D] fp32
    out_ptr,  # [B, Hq, D]
    stride_ob, stride_oh, num_q_heads, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    row = (b.to(tl.int64) * num_q_heads + h) * NUM_SPLITS + s  # [BLOCK_S]
    # Empty splits (short contexts) carry m = -inf, l = 0, acc = 0 and drop out with weight 0.
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_split = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * head_dim + d[None, :],
                  mask=s_mask[:, None] & (d[None, :] < head_dim), other=0.0)  # [BLOCK_S, BLOCK_D]
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: seq_len 0
    w = tl.exp2(m - m_max)  # [BLOCK_S]
    l_sum = tl.sum(l_split * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(l_sum == 0.0, 1.0, l_sum)  # [BLOCK_D]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """How many pieces to cut each context into. Aim for about two programs per SM; never split when the
    (request, KV head) programs alone fill the GPU, nor into pieces shorter than MIN_TILES_PER_SPLIT tiles."""
    if num_programs <= 0 or num_programs >= num_sms:
        return 1
    max_by_length = triton.cdiv(max(max_seq_len, 0), BLOCK_N) // MIN_TILES_PER_SPLIT
    wanted = triton.cdiv(2 * num_sms, num_programs)
    return max(1, min(wanted, max_by_length, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the CPU interpreter runs programs one by one: splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of each request's single new query over its first seq_lens[b] cached tokens; with `window`, over
    its last `window` of them only (block-table entries before the window's first block are never read, so they
    may be freed); with `softcap`, scores become softcap * tanh(score / softcap) first.

    num_splits None picks the split count from the SM count and max_seq_len (default: the most the block
    table can address, M * block_size). Rows with seq_len 0 come out as zeros. Each seq_lens[b] must be
    <= M * block_size (not checked: it would need a device sync)."""
    block_size, num_kv_heads, head_dim, group_size = check_query_and_cache(q, k_cache, v_cache, "[B, Hq, D]")
    batch, num_q_heads, _ = q.shape
    check_index_tensor("block_tables", block_tables, 2, "[B, M]", torch.int32)
    check_index_tensor("seq_lens", seq_lens, 1, "[B]", torch.int32)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"q has B={batch} rows but block_tables has {block_tables.shape[0]} and seq_lens {seq_lens.shape[0]}"
        )
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    qk_scale = check_scale(scale) * LOG2E
    if num_splits is None:
        bound = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
        num_splits = choose_num_splits(batch * num_kv_heads, bound, _num_sms(q.device))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}] or None, got {num_splits!r}")

    out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits > 1:
        part_m = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused by the kernel when NUM_SPLITS == 1
    block_d = triton.next_power_of_2(head_dim)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_m, part_l, part_acc, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        group_size, head_dim, window_arg(window), softcap_arg(softcap),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)), BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits, **dot_options(q.dtype, _decode_kernel),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_q_heads)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), num_q_heads, head_dim,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out
