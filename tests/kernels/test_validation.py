"""The wrappers reject malformed arguments on the host with a ValueError naming the problem (the kernels
would otherwise read or write the wrong memory without a word). No kernel runs in these tests."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_write import write_kv
from kernels.paged_decode import paged_decode_attention
from kernels.ragged_prefill import ragged_prefill_attention

HKV, D, BS = 2, 64, 16


def cache(dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(4, BS, HKV, D, dtype=dtype)


def i32(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.int32)


def decode(**override):
    args = dict(q=torch.zeros(3, 4, D), k_cache=cache(), v_cache=cache(), block_tables=i32(3, 2),
                seq_lens=i32(3), scale=0.125)
    args.update(override)
    return paged_decode_attention(**args)


def prefill(**override):
    args = dict(q=torch.zeros(5, 4, D), k_cache=cache(), v_cache=cache(), query_start_loc=i32(3),
                seq_lens=i32(2), block_tables=i32(2, 2), scale=0.125, max_query_len=4)
    args.update(override)
    return ragged_prefill_attention(**args)


def write(**override):
    args = dict(k=torch.zeros(5, HKV, D), v=torch.zeros(5, HKV, D), k_cache=cache(), v_cache=cache(),
                slot_mapping=torch.zeros(5, dtype=torch.int64))
    args.update(override)
    return write_kv(**args)


@pytest.mark.parametrize(
    ("call", "override", "message"),
    [
        (decode, {"q": torch.zeros(3, 4, D, 1)}, r"q must be \[B, Hq, D\]"),
        (decode, {"q": torch.zeros(3, 3, D)}, r"multiple of the cache's KV heads"),
        (decode, {"q": torch.zeros(3, 4, 32)}, r"head dim 32"),
        (decode, {"q": torch.zeros(3, 4, D, dtype=torch.float16)}, r"differs from the KV cache dtype"),
        (decode, {"q": torch.zeros(3, 4, D, dtype=torch.int32)}, r"q dtype must be one of"),
        (decode, {"q": torch.zeros(3, D, 4).transpose(1, 2)}, r"stride 1 in its last dim"),
        (decode, {"k_cache": cache().transpose(2, 3).contiguous().transpose(2, 3)}, r"k_cache must be contiguous"),
        (decode, {"v_cache": torch.zeros(4, BS, HKV, D + 1)}, r"shapes differ"),
        (decode, {"v_cache": cache(torch.float16)}, r"dtypes differ"),
        (decode, {"k_cache": torch.zeros(4, BS, HKV * D)}, r"k_cache must be \[num_blocks, block_size, Hkv, D\]"),
        (decode, {"block_tables": torch.zeros(3, 2, dtype=torch.int64)}, r"block_tables must be torch.int32"),
        (decode, {"block_tables": i32(2, 3).t()}, r"block_tables must be contiguous"),
        (decode, {"seq_lens": i32(2)}, r"B=3 rows"),
        (decode, {"scale": 0.0}, r"scale must be a positive float"),
        (decode, {"num_splits": 0}, r"num_splits must be an int"),
        (decode, {"num_splits": 2.0}, r"num_splits must be an int"),
        (decode, {"seq_lens": i32(3).to("meta")}, r"one device"),
        (prefill, {"query_start_loc": i32(2)}, r"query_start_loc needs B \+ 1"),
        (prefill, {"block_tables": i32(3, 2)}, r"block_tables B rows"),
        (prefill, {"seq_lens": torch.zeros(2, dtype=torch.int64)}, r"seq_lens must be torch.int32"),
        (prefill, {"max_query_len": -1}, r"max_query_len must be a non-negative int"),
        (prefill, {"q": torch.zeros(5, 4)}, r"q must be \[T, Hq, D\]"),
        (write, {"v": torch.zeros(4, HKV, D)}, r"k and v shapes differ"),
        (write, {"k": torch.zeros(5, 1, D), "v": torch.zeros(5, 1, D)}, r"cache holds Hkv=2"),
        (write, {"k": torch.zeros(5, HKV, D, dtype=torch.float16)}, r"k dtype must be one of \['torch.float32'\]"),
        (write, {"slot_mapping": torch.zeros(5, dtype=torch.int32)}, r"slot_mapping must be torch.int64"),
        (write, {"slot_mapping": torch.zeros(4, dtype=torch.int64)}, r"4 entries for 5 tokens"),
    ],
)
def test_wrapper_rejects(call, override, message) -> None:
    with pytest.raises(ValueError, match=message):
        call(**override)


def test_valid_arguments_pass_validation_when_there_is_nothing_to_compute() -> None:
    # Zero tokens: the wrappers validate, allocate and return without launching a kernel.
    assert prefill(q=torch.zeros(0, 4, D), query_start_loc=i32(3)).shape == (0, 4, D)
    assert decode(q=torch.zeros(0, 4, D), block_tables=i32(0, 2), seq_lens=i32(0)).shape == (0, 4, D)
    write(k=torch.zeros(0, HKV, D), v=torch.zeros(0, HKV, D), slot_mapping=torch.zeros(0, dtype=torch.int64))
