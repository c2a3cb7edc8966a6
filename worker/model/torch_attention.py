"""`TorchAttention`: paged attention in plain torch — the reference for the Triton kernels and the CPU default.

One step's batch mixes decode requests (one new token) and prefill chunks (many). Decode requests are
done together: their contexts are gathered from the paged cache into one padded [Bd, L] batch and
masked, which on the CPU is far cheaper than one small attention call per request and per layer.
Prefill chunks go one request at a time through scaled_dot_product_attention; a chunk with no cached
context (a fresh prompt) attends to its own k/v with is_causal and never touches the cache.

Everything derived from the metadata (slot indices, masks, host-side lengths) is computed once per step
(`_plan`) and reused by all layers: the model calls forward once per layer with the same metadata object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.attention import AttentionBackend
from worker.model.input import AttentionMetadata


@dataclass(slots=True)
class _Prefill:
    q_start: int
    q_end: int
    context_slots: torch.Tensor | None
    """[seq_len] flat cache slots of the whole context, or None when the chunk is the whole context."""
    mask: torch.Tensor | None
    """[q_len, seq_len] bool, True where a query may attend (causal with the query offset)."""


@dataclass(slots=True)
class _Plan:
    meta: AttentionMetadata
    block_size: int
    write_tokens: torch.Tensor | None
    """[T'] token indices whose K/V are written; None means all T tokens."""
    write_slots: torch.Tensor  # [T'] int64
    decode_tokens: torch.Tensor | None  # [Bd] int64: the single new token of each decode request
    decode_slots: torch.Tensor | None  # [Bd, L] int64: context slots, padded with slot 0 past seq_len
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L] bool
    decode_is_whole_batch: bool
    prefills: list[_Prefill]


def _context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    # block_table: [..., max_blocks] -> [..., length] flat slot of each position 0..length-1
    pos = torch.arange(length, device=block_table.device)
    blocks = block_table[..., (pos // block_size).clamp_max(block_table.shape[-1] - 1)].long()
    return blocks * block_size + pos % block_size


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._plan_cache: _Plan | None = None

    def _plan(self, meta: AttentionMetadata, num_tokens: int, block_size: int) -> _Plan:
        cached = self._plan_cache
        if cached is not None and cached.meta is meta and cached.block_size == block_size:
            return cached
        device = meta.slot_mapping.device
        slots = meta.slot_mapping.long()
        valid = slots >= 0
        if bool(valid.all()):
            write_tokens, write_slots = None, slots
        else:
            write_tokens = valid.nonzero().squeeze(1)
            write_slots = slots[write_tokens]

        q_start_loc = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        q_lens = [q_start_loc[b + 1] - q_start_loc[b] for b in range(len(seq_lens))]
        decode_reqs = [b for b, n in enumerate(q_lens) if n == 1]
        decode_tokens = decode_slots = decode_mask = None
        if decode_reqs:
            reqs = torch.tensor(decode_reqs, device=device)
            decode_tokens = torch.tensor([q_start_loc[b] for b in decode_reqs], device=device)
            max_len = max(seq_lens[b] for b in decode_reqs)
            decode_slots = _context_slots(meta.block_tables[reqs], max_len, block_size)  # [Bd, L]
            lens = meta.seq_lens[reqs].long()  # [Bd]
            decode_mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]

        prefills = []
        for b, q_len in enumerate(q_lens):
            if q_len <= 1:
                continue
            start, seq_len = q_start_loc[b], seq_lens[b]
            if seq_len == q_len:
                prefills.append(_Prefill(start, start + q_len, None, None))
                continue
            ctx = _context_slots(meta.block_tables[b], seq_len, block_size)  # [seq_len]
            # Query i sits at position seq_len - q_len + i and sees every key at or before it.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos  # [q_len, seq_len]
            prefills.append(_Prefill(start, start + q_len, ctx, mask))

        plan = _Plan(
            meta=meta,
            block_size=block_size,
            write_tokens=write_tokens,
            write_slots=write_slots,
            decode_tokens=decode_tokens,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            decode_is_whole_batch=len(decode_reqs) == num_tokens,
            prefills=prefills,
        )
        self._plan_cache = plan
        return plan

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        plan = self._plan(meta, num_tokens, k_cache.shape[1])
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        if plan.write_tokens is None:
            k_flat.index_copy_(0, plan.write_slots, k)
            v_flat.index_copy_(0, plan.write_slots, v)
        else:
            k_flat.index_copy_(0, plan.write_slots, k.index_select(0, plan.write_tokens))
            v_flat.index_copy_(0, plan.write_slots, v.index_select(0, plan.write_tokens))

        if plan.decode_is_whole_batch:
            return self._decode(q, k_flat, v_flat, plan, scale)
        out = torch.empty_like(q)
        if plan.decode_tokens is not None:
            decode_q = q.index_select(0, plan.decode_tokens)
            out.index_copy_(0, plan.decode_tokens, self._decode(decode_q, k_flat, v_flat, plan, scale))
        gqa = num_heads != num_kv_heads
        for p in plan.prefills:
            q_b = q[p.q_start : p.q_end].transpose(0, 1)  # [Hq, n, D]
            if p.context_slots is None:
                k_b = k[p.q_start : p.q_end].transpose(0, 1)  # [Hkv, n, D]
                v_b = v[p.q_start : p.q_end].transpose(0, 1)
                o_b = F.scaled_dot_product_attention(q_b, k_b, v_b, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                k_b = k_flat.index_select(0, p.context_slots).transpose(0, 1)  # [Hkv, seq_len, D]
                v_b = v_flat.index_select(0, p.context_slots).transpose(0, 1)
                o_b = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=p.mask, scale=scale, enable_gqa=gqa)
            out[p.q_start : p.q_end] = o_b.transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [Bd, Hq, D]
        k_flat: torch.Tensor,  # [num_slots, Hkv, D]
        v_flat: torch.Tensor,
        plan: _Plan,
        scale: float,
    ) -> torch.Tensor:  # [Bd, Hq, D]
        num_reqs, num_heads, head_dim = q.shape
        num_kv_heads = k_flat.shape[1]
        ctx_len = plan.decode_slots.shape[1]
        flat = plan.decode_slots.reshape(-1)
        # index_select, not k_flat[flat]: advanced indexing is several times slower on the CPU.
        k_ctx = k_flat.index_select(0, flat).view(num_reqs, ctx_len, num_kv_heads, head_dim)  # [Bd, L, Hkv, D]
        v_ctx = v_flat.index_select(0, flat).view(num_reqs, ctx_len, num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [Bd, Hq, 1, D]
            k_ctx.transpose(1, 2),  # [Bd, Hkv, L, D]
            v_ctx.transpose(1, 2),
            attn_mask=plan.decode_mask,  # [Bd, 1, 1, L]
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [Bd, Hq, 1, D]
        return out.squeeze(2)
