"""paged_decode_attention against ref_paged_decode. Tolerances: tests/kernels/paged_case.py TOLERANCES
(fp32 1e-4, fp16 3e-3, bf16 2e-2, absolute and relative). Fast cases use D=64 and contexts up to ~150; the
2,000+ token contexts and D=128 sweeps are marked slow."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import MAX_SPLITS, choose_num_splits, paged_decode_attention
from kernels.reference import ref_paged_decode
from tests.kernels.paged_case import LONG_CONTEXT_CASES, assert_close, make_case, make_q

# context lengths: empty, one token, a non-multiple of both block sizes, past one 64-key tile, exact blocks
FAST_SEQ_LENS = [0, 1, 37, 130, 64]


def run_decode(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, num_splits=None,
               strided_q=False):
    case = make_case([0] * len(seq_lens), seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
    # [B, Hq, D]: one query per request, requests with an empty context included
    q = make_q(len(seq_lens), num_q_heads, num_kv_heads, head_dim, dtype, device,
               torch.Generator(device=device).manual_seed(7), strided_q)
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                                 num_splits=num_splits)
    ref = ref_paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    return out, ref


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "block_size", "dtype"),
    [(2, 2, 16, torch.float32), (6, 2, 32, torch.float16), (8, 1, 16, torch.bfloat16)],
    ids=["ratio1-bs16-fp32", "ratio3-bs32-fp16", "ratio8-bs16-bf16"],
)
def test_decode_matches_reference(device, num_q_heads, num_kv_heads, block_size, dtype) -> None:
    out, ref = run_decode(FAST_SEQ_LENS, num_q_heads, num_kv_heads, 64, block_size, dtype, device)
    assert_close(out, ref)
    assert not out[0].any(), "a request with seq_len 0 must give zeros"


def test_split_context_equals_single_pass(device) -> None:
    seq_lens = [0, 1, 200, 37]  # with 3 splits: empty splits (short contexts) and uneven ones
    out1, ref = run_decode(seq_lens, 6, 2, 64, 16, torch.float32, device, num_splits=1, strided_q=True)
    out3, _ = run_decode(seq_lens, 6, 2, 64, 16, torch.float32, device, num_splits=3, strided_q=True)
    assert_close(out1, ref)
    assert_close(out3, ref)
    torch.testing.assert_close(out3, out1, atol=1e-5, rtol=1e-5)


def test_choose_num_splits() -> None:
    # programs fill the GPU, or the context is short: no split
    assert choose_num_splits(num_programs=512, max_seq_len=2048, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_seq_len=200, num_sms=132) == 1
    # 4 requests x 8 KV heads on 132 SMs at 32k: about two programs per SM
    assert choose_num_splits(num_programs=32, max_seq_len=32768, num_sms=132) == 9
    # capped by length (4 tiles of 64 keys per split) and by MAX_SPLITS
    assert choose_num_splits(num_programs=1, max_seq_len=1024, num_sms=132) == 4
    assert choose_num_splits(num_programs=1, max_seq_len=1 << 20, num_sms=132) == MAX_SPLITS


@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "ratio", "block_size", "dtype"), LONG_CONTEXT_CASES)
def test_decode_long_contexts(device, head_dim, ratio, block_size, dtype) -> None:
    seq_lens = [2100, 1, 0, 777]
    out, ref = run_decode(seq_lens, ratio, 1, head_dim, block_size, dtype, device)
    assert_close(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_context_split_equals_single_pass(device, dtype) -> None:
    seq_lens = [2049, 3, 1500]
    out1, ref = run_decode(seq_lens, 4, 2, 128, 16, dtype, device, num_splits=1)
    out7, _ = run_decode(seq_lens, 4, 2, 128, 16, dtype, device, num_splits=7)
    assert_close(out1, ref)
    assert_close(out7, ref)
