"""Pure-torch references for the kernels: plain loops over requests through the block tables, fp32 math.

Written for clarity, not speed: the kernel tests compare against these, so they follow the definitions
(flat slot = block_id * block_size + offset; token i of request b sits at seq_lens[b] - q_len_b + i and sees
positions <= its own) as literally as possible.
"""

from __future__ import annotations

import torch


def ref_write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [M] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, Hkv, D]
    block_size = cache.shape[1]
    positions = torch.arange(seq_len)
    block_ids = block_table.cpu().long()[positions // block_size]
    return cache[block_ids.to(cache.device), (positions % block_size).to(cache.device)]


def attend_one_request(
    q: torch.Tensor,  # [q_len, Hq, D]: the request's new tokens
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [M] int32
    seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [q_len, Hq, D] fp32
    """`window` > 0: a query at position p sees keys in (p - window, p]. `softcap` > 0: scores become
    softcap * tanh(score / softcap) before the mask."""
    q_len = q.shape[0]
    group_size = q.shape[1] // k_cache.shape[2]
    # [seq_len, Hq, D]: each KV head repeated for the G query heads that share it
    k = gather_context(k_cache, block_table, seq_len).float().repeat_interleave(group_size, dim=1)
    v = gather_context(v_cache, block_table, seq_len).float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, q_len, seq_len]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    positions = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
    keys = torch.arange(seq_len, device=q.device)[None, :]
    visible = keys <= positions[:, None]  # [q_len, seq_len]
    if window > 0:
        visible &= keys > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def ref_ragged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [T, Hq, D], q's dtype
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        if qsl[b + 1] > qsl[b]:
            out[qsl[b] : qsl[b + 1]] = attend_one_request(
                q[qsl[b] : qsl[b + 1]], k_cache, v_cache, block_tables[b], seq_len, scale, window, softcap
            )
    return out.to(q.dtype)


def ref_paged_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [B, Hq, D]; seq_len 0 rows are zeros
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len > 0:
            out[b] = attend_one_request(q[b : b + 1], k_cache, v_cache, block_tables[b], seq_len, scale, window,
                                        softcap)[0]
    return out.to(q.dtype)



def ref_lora(
    x: torch.Tensor,  # [R, in]
    slots: torch.Tensor,  # [R] int64, -1 = the base
    a: torch.Tensor,  # [S, in, C]
    b: torch.Tensor,  # [S, C, N]
    out: torch.Tensor,  # [R, N]
) -> None:
    """out[r] += x[r] @ a[slot] @ b[slot] in fp32 for each row whose slot is not -1 (in place)."""
    for r, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        delta = (x[r].float() @ a[slot].float()) @ b[slot].float()
        out[r] = (out[r].float() + delta).to(out.dtype)


def ref_moe(
    x: torch.Tensor,  # [N, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [N, k]
    expert_ids: torch.Tensor,  # [N, k]
    act,
) -> torch.Tensor:  # [N, H], fp32
    """out[t] = sum over j of weights[t, j] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])), e = expert_ids[t, j],
    in fp32, one token and one expert at a time."""
    size = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j, e in enumerate(expert_ids[t].tolist()):
            h = gate_up[e].float() @ x[t].float()
            out[t] += float(weights[t, j]) * (down[e].float() @ (act(h[:size]) * h[size:]))
    return out
