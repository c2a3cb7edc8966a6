"""Sliding windows and soft-capped scores in the Triton attention kernels, against the reference: decode (one
split and several) and ragged prefill, windows shorter and longer than the contexts, block-table entries before
every window freed (-1, as the engine leaves them for a model windowed on every layer), and Gemma2's cap."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import paged_decode_attention
from kernels.ragged_prefill import ragged_prefill_attention
from kernels.reference import ref_paged_decode, ref_ragged_attention
from tests.kernels.paged_case import assert_close, make_case, make_q

FREED_BLOCK = -1


def free_before_windows(case, q_lens: list[int], seq_lens: list[int], window: int) -> torch.Tensor:
    """The block tables with every block wholly before the window of a request's earliest new token set to -1."""
    tables = case.block_tables.clone()
    block_size = case.k_cache.shape[1]
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        first_key = max(0, seq_len - q_len - window + 1)
        tables[b, : first_key // block_size] = FREED_BLOCK
    return tables


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("window", "softcap"), [(24, None), (None, 5.0), (40, 2.0), (500, None)],
                         ids=["window", "softcap", "both", "window-past-context"])
def test_decode_with_a_window_and_a_soft_cap(device, window, softcap, num_splits) -> None:
    seq_lens = [0, 1, 37, 130, 64, 23]
    case = make_case([0] * len(seq_lens), seq_lens, 6, 2, 64, 16, torch.float32, device)
    q = make_q(len(seq_lens), 6, 2, 64, torch.float32, device, torch.Generator(device=device).manual_seed(3)) * 4
    tables = case.block_tables if window is None else free_before_windows(case, [1] * len(seq_lens), seq_lens,
                                                                           window)
    out = paged_decode_attention(q, case.k_cache, case.v_cache, tables, case.seq_lens, case.scale,
                                 num_splits=num_splits, window=window, softcap=softcap)
    ref = ref_paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                           window or 0, softcap or 0.0)
    assert_close(out, ref)
    if window is not None and window < 130:
        unwindowed = ref_paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
        assert not torch.allclose(out[3], unwindowed[3].to(out.dtype), atol=1e-3)  # the window changed the answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(24, None), (None, 5.0), (40, 2.0)], ids=["window", "softcap", "both"])
def test_ragged_prefill_with_a_window_and_a_soft_cap(device, window, softcap, dtype) -> None:
    # (q_len, seq_len): a whole prompt longer than the window, a decode row, a chunk after a cached prefix, a
    # prompt shorter than the window, and a request with no new tokens.
    requests = [(70, 70), (1, 90), (13, 90), (5, 5), (0, 33)]
    q_lens, seq_lens = [q for q, _ in requests], [s for _, s in requests]
    case = make_case(q_lens, seq_lens, 6, 2, 64, 16, dtype, device)
    tables = case.block_tables if window is None else free_before_windows(case, q_lens, seq_lens, window)
    out = ragged_prefill_attention(case.q * 4, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                                   tables, case.scale, max(q_lens), window=window, softcap=softcap)
    ref = ref_ragged_attention(case.q * 4, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                               case.block_tables, case.scale, window or 0, softcap or 0.0)
    assert_close(out, ref)


def test_bad_windows_and_caps_are_refused(device) -> None:
    case = make_case([0], [10], 2, 2, 64, 16, torch.float32, device)
    q = make_q(1, 2, 2, 64, torch.float32, device, torch.Generator(device=device).manual_seed(0))
    for bad in ({"window": 0}, {"window": 2.5}, {"softcap": 0.0}, {"softcap": -1.0}):
        with pytest.raises(ValueError):
            paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale, **bad)
