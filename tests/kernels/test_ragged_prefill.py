"""ragged_prefill_attention against ref_ragged_attention. Tolerances: tests/kernels/paged_case.py TOLERANCES
(fp32 1e-4, fp16 3e-3, bf16 2e-2, absolute and relative). A batch mixes the shapes one step can hold:
a whole prompt, a prompt of one token, a decode row, a chunk after a cached prefix (chunked prefill or a
prefix-cache hit) and a request with no new tokens. Contexts beyond 2,000 and D=128 are marked slow."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import paged_decode_attention
from kernels.ragged_prefill import prefill_block_sizes, ragged_prefill_attention
from kernels.reference import ref_ragged_attention
from tests.kernels.paged_case import LONG_CONTEXT_CASES, assert_close, make_case

# (q_len, seq_len) per request
MIXED_BATCH = [(20, 20), (1, 1), (1, 40), (13, 90), (0, 33), (0, 0), (70, 75)]


def run_prefill(requests, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, **kw):
    q_lens, seq_lens = [q for q, _ in requests], [s for _, s in requests]
    case = make_case(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, **kw)
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale)
    out = ragged_prefill_attention(*args, max(q_lens))
    return out, ref_ragged_attention(*args), case


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "block_size", "dtype"),
    [(2, 2, 16, torch.float32), (6, 2, 32, torch.float16), (8, 1, 16, torch.bfloat16), (3, 1, 16, torch.float32)],
    ids=["ratio1-bs16-fp32", "ratio3-bs32-fp16", "ratio8-bs16-bf16", "ratio3-bs16-fp32"],
)
def test_mixed_batch_matches_reference(device, num_q_heads, num_kv_heads, block_size, dtype) -> None:
    out, ref, _ = run_prefill(MIXED_BATCH, num_q_heads, num_kv_heads, 64, block_size, dtype, device,
                              strided_q=dtype == torch.float32)
    assert_close(out, ref)


def test_decode_only_batch_matches_decode_kernel(device) -> None:
    requests = [(1, 1), (1, 17), (1, 100)]
    out, ref, case = run_prefill(requests, 6, 2, 64, 16, torch.float32, device)
    assert_close(out, ref)
    decode = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    torch.testing.assert_close(out, decode, atol=1e-5, rtol=1e-5)


def test_understated_max_query_len_only_changes_tiling(device) -> None:
    # max_query_len sizes the tiles; a smaller value than the truth gives more, smaller tiles, same answer
    out, ref, case = run_prefill([(40, 50), (3, 3)], 2, 1, 64, 16, torch.float32, device)
    small = ragged_prefill_attention(case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                                     case.block_tables, case.scale, max_query_len=1)
    assert_close(out, ref)
    assert_close(small, ref)


def test_prefill_block_sizes() -> None:
    assert prefill_block_sizes(group_size=1, max_query_len=1, head_dim=64) == (16, 64)
    assert prefill_block_sizes(group_size=3, max_query_len=7, head_dim=64) == (32, 64)
    assert prefill_block_sizes(group_size=8, max_query_len=2048, head_dim=128) == (64, 64)
    assert prefill_block_sizes(group_size=1, max_query_len=2048, head_dim=64) == (128, 64)
    assert prefill_block_sizes(group_size=256, max_query_len=1, head_dim=64) == (256, 64)


@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "ratio", "block_size", "dtype"), LONG_CONTEXT_CASES)
def test_long_contexts(device, head_dim, ratio, block_size, dtype) -> None:
    # a 150-token chunk after 1,950 cached tokens, a fresh 130-token prompt, a decode row at 2,049
    requests = [(150, 2100), (130, 130), (1, 2049), (0, 0)]
    out, ref, _ = run_prefill(requests, ratio, 1, head_dim, block_size, dtype, device)
    assert_close(out, ref)


@pytest.mark.slow
def test_fp16_long_prompt_many_query_tiles(device) -> None:
    out, ref, _ = run_prefill([(300, 300), (257, 2060)], 4, 2, 128, 16, torch.float16, device)
    assert_close(out, ref)
