"""TritonAttention.forward (write_kv, then the decode or the ragged kernel) against the reference path
(ref_write_kv, then ref_ragged_attention). Tolerances: paged_case.TOLERANCES."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import ref_ragged_attention, ref_write_kv
from tests.kernels.paged_case import assert_close, make_case
from worker.model.input import AttentionMetadata
from worker.model.triton_attention import TritonAttention


@pytest.mark.parametrize(
    "requests",
    [[(1, 5), (1, 33), (1, 1)], [(9, 9), (1, 40), (4, 21)]],
    ids=["decode-only", "mixed"],
)
def test_forward_writes_new_kv_then_attends(device: str, requests: list[tuple[int, int]]) -> None:
    num_q_heads, num_kv_heads, head_dim = 6, 2, 64
    q_lens, seq_lens = [q for q, _ in requests], [s for _, s in requests]
    case = make_case(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, 16, torch.float32, device)
    # The new tokens' K/V arrive with the step: poison their cache slots so attention must read what
    # forward wrote, and send one token with slot -1 (its slot keeps the K/V already there).
    new_slots = [slot for (q_len, _), slots in zip(requests, case.slots) for slot in slots[len(slots) - q_len :]]
    k_new = torch.randn(len(new_slots), num_kv_heads, head_dim, device=device)
    v_new = torch.randn(len(new_slots), num_kv_heads, head_dim, device=device)
    slot_mapping = torch.tensor(new_slots, dtype=torch.int64, device=device)
    slot_mapping[0] = -1
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slot_mapping[1:]] = float("nan")
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=case.query_start_loc, seq_lens=case.seq_lens,
        block_tables=case.block_tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    ref_write_kv(k_new, v_new, k_ref, v_ref, slot_mapping)
    ref = ref_ragged_attention(case.q, k_ref, v_ref, case.query_start_loc, case.seq_lens, case.block_tables,
                               case.scale)

    out = TritonAttention().forward(case.q, k_new, v_new, case.k_cache, case.v_cache, meta, case.scale)

    assert TritonAttention.name == "triton"
    assert torch.equal(case.k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(case.v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert_close(out, ref)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "max_query_len"),
                         [(9, 3, 64, 2048), (32, 8, 128, 2048), (9, 3, 64, 40), (8, 8, 64, 5), (64, 1, 64, 512),
                          (9, 3, 64, 2), (9, 3, 64, 1)])
def test_prompt_lengths_to_compile_meet_each_tile_height_of_a_prompt_step_once(
        num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int) -> None:
    from kernels.ragged_prefill import prefill_block_sizes

    group = num_heads // num_kv_heads
    lengths = TritonAttention().prompt_lengths_to_compile(num_heads, num_kv_heads, head_dim, max_query_len)
    heights = [prefill_block_sizes(group, length, head_dim)[0] for length in lengths]
    assert len(set(heights)) == len(heights) and all(2 <= length <= max_query_len for length in lengths)
    # Every step that reaches the prefill kernel has a longest request of 2 to max_query_len tokens (a step of
    # one-token requests alone goes to the decode kernel).
    assert set(heights) == {prefill_block_sizes(group, n, head_dim)[0] for n in range(2, max_query_len + 1)}
