"""`TorchAttention`: paged attention in plain torch — the reference for the Triton kernels and the CPU default.

One step's batch mixes decode requests (one new token) and prefill chunks (many). Decode requests are
done in a few padded groups: sorted by context length and cut wherever padding to the group's longest
context would exceed `DECODE_PADDING` times the tokens really held, each group's blocks are gathered
from the paged cache (whole blocks: one index per 16 tokens, not one per token) into a [n, L] batch
and masked. That is far cheaper on the CPU than one small attention call per request and per layer, and
than one group padded to the longest context of the step: with a mix of short and long requests (a few
hundred tokens of context next to a few dozen) one padded group spent 3-5x the work of the tokens held.
Prefill chunks go one request at a time through scaled_dot_product_attention; a chunk with no cached
context (a fresh prompt) attends to its own k/v with is_causal and never touches the cache.

`fixed_kernels` (bf16 and fp16 on the CPU, with ENGINE_ROW_BUCKETS): on a CPU with AMX, torch's CPU flash
attention in those dtypes builds a kernel for each prefill shape it meets (about 100 KB each for SmolLM2) and
never frees it, so a worker would grow as new prompt lengths arrive. So a fresh prompt is padded to whole
blocks (zeros after it, which causality hides from every real query), and every padded length's kernel is
built at start-up (`fix_kernels`); a chunk after a cached context attends in float32, which goes to MKL and
keeps nothing per shape. Decode attention keeps nothing per shape either.

Decode attention in bf16 and fp16 on the CPU: torch's flash kernel takes a slow path for a single query row (a
decode request's), several times slower than for two rows or more (docs/benchmarks.md, "Decode attention in
bf16"). So `_decode` gives each KV head its query heads as rows, which is the same attention; outputs differ from
the single-row call by the order of the bf16 rounding only.

Everything derived from the metadata (slot indices, masks, host-side lengths) is computed once per step
(`_plan`) and reused by all layers: the model calls forward once per layer with the same metadata object.

Sliding windows (a query at position p sees keys in (p - window, p]): a windowed layer gathers only the blocks
from the one holding its earliest query's first key on (about window / block_size + 1 per decode request, however
long the context), masked to the window; the gather and mask are made once per step and window. The blocks before
are never read: for a model whose every layer is windowed the engine gives them back, and their block-table
entries are -1 (FREED_BLOCK), which index_select would refuse. Soft-capped scores (Gemma2: cap * tanh(score /
cap)) are not something scaled_dot_product_attention takes, so those layers attend through explicit matmuls and a
float32 softmax, as transformers' eager path does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker.model.attention import AttentionBackend
from worker.model.input import AttentionMetadata


@dataclass(slots=True)
class _Prefill:
    q_start: int
    q_end: int
    context_blocks: torch.Tensor | None
    """[ceil(seq_len / block_size)] block ids of the whole context, or None when the chunk is the whole context."""
    mask: torch.Tensor | None
    """[q_len, seq_len] bool, True where a query may attend (causal with the query offset)."""
    padded_len: int
    """q_len, or q_len padded to whole blocks (a fresh prompt under `TorchAttention.fixed_kernels`)."""
    seq_len: int
    windowed: dict[int, tuple] = field(default_factory=dict)
    """window -> (context blocks from the window's first on or None, its first key's position, [q_len, keys] bool
    mask: causal and within the window)."""

    def window_view(self, window: int, block_size: int, device) -> tuple[torch.Tensor | None, int, torch.Tensor]:
        view = self.windowed.get(window)
        if view is None:
            q_len = self.q_end - self.q_start
            first_block = 0
            if self.context_blocks is not None:  # the earliest query's window starts at its position - window + 1
                first_block = max(0, self.seq_len - q_len - window + 1) // block_size
            start = first_block * block_size
            q_pos = torch.arange(self.seq_len - q_len, self.seq_len, device=device)[:, None]
            keys = torch.arange(start, self.seq_len, device=device)[None, :]
            blocks = None if self.context_blocks is None else self.context_blocks[first_block:]
            view = self.windowed[window] = (blocks, start, (keys <= q_pos) & (keys > q_pos - window))
        return view


@dataclass(slots=True)
class _DecodeGroup:
    tokens: torch.Tensor | None
    """[n] int64: the single new token of each decode request in the group; None when the group is the
    whole step in token order (a decode-only step whose requests need one group)."""
    blocks: torch.Tensor
    """[n * nb] int64: each request's first nb block ids (nb = blocks of the group's longest context)."""
    num_blocks: int
    """nb."""
    mask: torch.Tensor | None
    """[n, 1, 1, nb * block_size] bool, True where a key is in the request's context; None if all are."""
    seq_lens: list[int]
    rows: torch.Tensor
    """[n] int64: the group's rows of `block_tables`."""
    block_tables: torch.Tensor
    """The step's [B, max_blocks] block tables."""
    windowed: dict[int, tuple] = field(default_factory=dict)
    """window -> (blocks [n * nbw], nbw, [n, 1, 1, nbw * block_size] bool mask): per request the nbw blocks from
    the one holding its window's first key, masked to the context and the window."""

    def window_view(self, window: int | None, block_size: int,
                    device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """(blocks, blocks per request, mask) that a layer with this window attends over."""
        if window is None or window >= max(self.seq_lens):
            return self.blocks, self.num_blocks, self.mask
        view = self.windowed.get(window)
        if view is None:
            # The one query of a decode request of context n sees keys [n - window, n).
            firsts = torch.tensor([max(0, n - window) // block_size for n in self.seq_lens], device=device)[:, None]
            lasts = torch.tensor([(n - 1) // block_size for n in self.seq_lens], device=device)[:, None]
            num_blocks = int((lasts - firsts).max()) + 1
            # A row spanning fewer blocks repeats its own last block, masked: it never reads past its context.
            cols = torch.minimum(firsts + torch.arange(num_blocks, device=device)[None, :], lasts)  # [n, nbw]
            blocks = self.block_tables[self.rows[:, None], cols].long().reshape(-1)
            keys = firsts * block_size + torch.arange(num_blocks * block_size, device=device)[None, :]  # positions
            lens = torch.tensor(self.seq_lens, device=device)[:, None]
            mask = ((keys < lens) & (keys >= lens - window))[:, None, None, :]
            view = self.windowed[window] = (blocks, num_blocks, mask)
        return view


FOLDED_DTYPES = (torch.bfloat16, torch.float16)
"""Decode attention on the CPU in these dtypes runs with each KV head's query heads as rows (TorchAttention._decode).
In float32 the single-row path is as fast or faster, and stays as it was."""

SHORT_CHUNK = 8
"""Under `fixed_kernels` (bf16 and fp16 on the CPU), a chunk of at most this many queries after a cached context (a
verify step's last token and its drafts, a resumed request's last few tokens) attends as that many decode rows,
each over the keys up to its own position: the decode path batches them with the step's other rows in bf16, where
such a chunk attends alone, layer by layer, in float32. The same attention (equal in float64); in float32 the chunk
path stays, whose rounding the tests hold to transformers'."""

DECODE_PADDING = 1.25
"""A decode group grows while (requests x its longest context, in whole blocks) stays within this factor
of the context tokens its requests really hold."""


def group_decodes(seq_lens: list[int], block_size: int, padding: float = DECODE_PADDING) -> list[list[int]]:
    """Indices into `seq_lens` in groups, longest contexts first; a group is cut when padding every member to
    the group's longest context (in whole blocks) would exceed `padding` x the tokens held. Pure Python."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    held = 0
    for i in order:
        if groups:
            group = groups[-1]
            padded_len = -(-seq_lens[group[0]] // block_size) * block_size
            if padded_len * (len(group) + 1) <= padding * (held + seq_lens[i]):
                group.append(i)
                held += seq_lens[i]
                continue
        groups.append([i])
        held = seq_lens[i]
    return groups


@dataclass(slots=True)
class _Plan:
    meta: AttentionMetadata
    block_size: int
    write_tokens: torch.Tensor | None
    """[T'] token indices whose K/V are written; None means all T tokens."""
    write_slots: torch.Tensor  # [T'] int64
    decode_groups: list[_DecodeGroup]
    prefills: list[_Prefill]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:  # [n, H, D] -> a new [rows, H, D], zeros after
    padded = x.new_zeros(rows, *x.shape[1:])
    padded[: x.shape[0]] = x
    return padded


def _attend(
    q: torch.Tensor,  # [..., Hq, Lq, D]
    k: torch.Tensor,  # [..., Hkv, Lk, D]
    v: torch.Tensor,  # [..., Hkv, Lk, D]
    mask: torch.Tensor | None,  # broadcastable to [..., Hq, Lq, Lk] bool, True where a query may attend
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:  # [..., Hq, Lq, D]
    gqa = q.shape[-3] != k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., Hq, Lq, Lk]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class TorchAttention(AttentionBackend):
    name = "torch"
    supports_windows = True

    def __init__(self, decode_padding: float = DECODE_PADDING, fixed_kernels: bool = False) -> None:
        self.decode_padding = decode_padding
        """math.inf: every decode row in one group padded to the step's longest context."""
        self.fixed_kernels = fixed_kernels
        """Keep prefill attention to shapes whose kernels `fix_kernels` made (module docstring)."""
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
        # Decode rows: (request, token index, keys it sees): a decode request's one token, and each query of a
        # short chunk after a cached context (SHORT_CHUNK).
        entries: list[tuple[int, int, int]] = []
        as_rows = [False] * len(q_lens)
        for b, n in enumerate(q_lens):
            if n == 1 or (self.fixed_kernels and 1 < n <= SHORT_CHUNK and seq_lens[b] > n):
                as_rows[b] = True
                entries += [(b, q_start_loc[b] + i, seq_lens[b] - n + i + 1) for i in range(n)]
        decode_groups = []
        whole_batch = len(entries) == num_tokens
        for members in group_decodes([entry[2] for entry in entries], block_size, self.decode_padding):
            # In step order: a lone group then needs no reordering.
            group = sorted((entries[i] for i in members), key=lambda entry: entry[1])
            reqs = [entry[0] for entry in group]
            lens = [entry[2] for entry in group]
            token_ids = [entry[1] for entry in group]
            num_blocks = -(-max(lens) // block_size)
            rows = torch.tensor(reqs, device=device)
            blocks = meta.block_tables[rows, :num_blocks].long().clamp_min(0).reshape(-1)
            mask = None
            if any(n != num_blocks * block_size for n in lens):
                keys = torch.arange(num_blocks * block_size, device=device)[None, :]
                mask = (keys < torch.tensor(lens, device=device)[:, None])[:, None, None, :]
            in_order = whole_batch and token_ids == list(range(num_tokens))
            tokens = None if in_order else torch.tensor(token_ids, device=device)
            decode_groups.append(_DecodeGroup(tokens, blocks, num_blocks, mask, lens, rows, meta.block_tables))

        prefills = []
        for b, q_len in enumerate(q_lens):
            if q_len == 0 or as_rows[b]:
                continue
            start, seq_len = q_start_loc[b], seq_lens[b]
            if seq_len == q_len:
                padded_len = -(-q_len // block_size) * block_size if self.fixed_kernels else q_len
                prefills.append(_Prefill(start, start + q_len, None, None, padded_len, seq_len))
                continue
            ctx = meta.block_tables[b, : -(-seq_len // block_size)].long()  # [blocks of the context]
            # Query i sits at position seq_len - q_len + i and sees every key at or before it.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos  # [q_len, seq_len]
            prefills.append(_Prefill(start, start + q_len, ctx, mask, q_len, seq_len))

        plan = _Plan(
            meta=meta,
            block_size=block_size,
            write_tokens=write_tokens,
            write_slots=write_slots,
            decode_groups=decode_groups,
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
        window: int | None = None,
        softcap: float | None = None,
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

        groups = plan.decode_groups
        if len(groups) == 1 and groups[0].tokens is None:
            return self._decode(q, k_cache, v_cache, groups[0], scale, window, softcap)
        out = torch.empty_like(q)
        for group in groups:
            out.index_copy_(0, group.tokens, self._decode(q.index_select(0, group.tokens), k_cache, v_cache, group,
                                                          scale, window, softcap))
        gqa = num_heads != num_kv_heads
        block_size = k_cache.shape[1]
        for p in plan.prefills:
            q_b = q[p.q_start : p.q_end]  # [n, Hq, D]
            q_len = p.q_end - p.q_start
            windowed = window is not None and window < p.seq_len
            if p.context_blocks is None:
                k_b, v_b = k[p.q_start : p.q_end], v[p.q_start : p.q_end]  # [n, Hkv, D]
                if windowed or softcap is not None:
                    mask = p.window_view(window, block_size, q.device)[2] if windowed else None
                    o_b = _attend(q_b.transpose(0, 1), k_b.transpose(0, 1), v_b.transpose(0, 1), mask, scale, softcap,
                                  is_causal=mask is None)
                else:
                    if self.fixed_kernels:  # the layout fix_kernels used: [padded_len, H, D], contiguous
                        q_b, k_b, v_b = (_pad_rows(x, p.padded_len) for x in (q_b, k_b, v_b))
                    o_b = F.scaled_dot_product_attention(q_b.transpose(0, 1), k_b.transpose(0, 1),
                                                         v_b.transpose(0, 1), is_causal=True, scale=scale,
                                                         enable_gqa=gqa)
            else:
                blocks, start, mask = (p.window_view(window, block_size, q.device) if windowed
                                       else (p.context_blocks, 0, p.mask))
                # Whole blocks gathered, then cut to the keys [start, seq_len): [Hkv, seq_len - start, D].
                k_b = k_cache.index_select(0, blocks).flatten(0, 1)[: p.seq_len - start].transpose(0, 1)
                v_b = v_cache.index_select(0, blocks).flatten(0, 1)[: p.seq_len - start].transpose(0, 1)
                q_b = q_b.transpose(0, 1)
                if self.fixed_kernels:
                    q_b, k_b, v_b = q_b.float(), k_b.float(), v_b.float()
                o_b = _attend(q_b, k_b, v_b, mask, scale, softcap).to(q.dtype)
            out[p.q_start : p.q_end] = o_b[:, :q_len].transpose(0, 1)
        return out

    @torch.inference_mode()
    def fix_kernels(self, num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> int:
        """Turn `fixed_kernels` on, and run a fresh prompt's attention once at every padded length up to
        `max_query_len`, in the layout forward gives it (the kernels are keyed by strides too), so that they are
        built now and memory is at its high-water mark before the first request. Calls made."""
        self.fixed_kernels = True
        calls = 0
        for q_len in range(block_size, -(-max_query_len // block_size) * block_size + 1, block_size):
            q = torch.zeros(q_len, num_heads, head_dim, device=device, dtype=dtype).transpose(0, 1)
            kv = torch.zeros(q_len, num_kv_heads, head_dim, device=device, dtype=dtype).transpose(0, 1)
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=num_heads != num_kv_heads)
            calls += 1
        return calls

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [n, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        group: _DecodeGroup,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [n, Hq, D]
        num_reqs, num_heads, _ = q.shape
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        blocks, num_blocks, mask = group.window_view(window, block_size, q.device)  # mask [n, 1, 1, L]
        ctx_len = num_blocks * block_size
        # index_select of whole blocks, not k_flat[slots]: one index per block, and advanced indexing is
        # several times slower on the CPU.
        k_ctx = k_cache.index_select(0, blocks).view(num_reqs, ctx_len, num_kv_heads, head_dim)
        v_ctx = v_cache.index_select(0, blocks).view(num_reqs, ctx_len, num_kv_heads, head_dim)
        if softcap is None and q.device.type == "cpu" and q.dtype in FOLDED_DTYPES:
            # The group of query heads that share a KV head becomes that head's rows of queries: [n, Hkv, g, D]
            # against [n, Hkv, L, D] is the same attention (one query per request, every key masked alike) with
            # no enable_gqa. torch's CPU flash kernel in bf16/fp16 takes a slow path for a single query row, so
            # folded it runs several times faster (module docstring); a lone head (g = 1) is given a second,
            # identical row for the same reason, and its result dropped.
            group = num_heads // num_kv_heads
            rows = q.view(num_reqs, num_kv_heads, group, head_dim)
            if group == 1:
                rows = rows.expand(num_reqs, num_kv_heads, 2, head_dim)
            out = F.scaled_dot_product_attention(rows, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2), attn_mask=mask,
                                                 scale=scale)  # [n, Hkv, max(g, 2), D]
            return out[:, :, :group].reshape(num_reqs, num_heads, head_dim)
        out = _attend(
            q.unsqueeze(2),  # [n, Hq, 1, D]
            k_ctx.transpose(1, 2),  # [n, Hkv, L, D]
            v_ctx.transpose(1, 2),
            mask,
            scale,
            softcap,
        )  # [n, Hq, 1, D]
        return out.squeeze(2)
