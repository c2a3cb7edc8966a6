"""Random paged-attention inputs for the kernel tests.

Block ids are a random permutation (a request's blocks are neither contiguous nor in order) and every cache
slot that no request owns is NaN, as is every slot past a request's seq_len in its last block: a kernel that
reads a wrong block, a padded block-table entry or a position past the context turns its output NaN and fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# tests/kernels/conftest.py has set TRITON_INTERPRET by the time a test module imports this.
COMPILED_ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "on")
needs_compiled_cuda = pytest.mark.skipif(
    not COMPILED_ON_CUDA, reason="needs CUDA and compiled Triton (TRITON_INTERPRET unset or 0)"
)

# (atol, rtol) for kernel output vs the fp32 reference run on the same (rounded) inputs. fp32 inputs use an
# exact ("ieee") dot; fp16/bf16 kernels round the softmax probabilities to the input dtype before P @ V and
# round the output, so the bounds are a few units in the last place of an O(1) output.
# Long-context sweeps (2,000+ tokens) under the interpreter cost about 10 s each, so instead of the full
# product (head dim x ratio x block size x dtype = 24 cases per kernel) the slow tests run a pairwise covering
# set: every pair of values of any two factors appears in at least one case.
LONG_CONTEXT_CASES = [
    (64, 1, 16, torch.float32),
    (128, 1, 32, torch.bfloat16),
    (64, 3, 32, torch.bfloat16),
    (128, 3, 16, torch.float32),
    (64, 8, 16, torch.bfloat16),
    (128, 8, 32, torch.float32),
]

TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D] (decode cases: T == B)
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, M] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    slots: list[list[int]]  # flat slot of every position of every request
    scale: float

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max().item()) if len(self.seq_lens) else 0


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    strided_q: bool = False,
) -> PagedCase:
    assert len(q_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)  # CPU: block-id permutation
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # values, drawn where they live
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # 3 blocks no request owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max([1, *blocks_per_req])
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[list[int]] = []
    for b, seq_len in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(blocks_per_req[b])]
        block_tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots.append([ids[p // block_size] * block_size + p % block_size for p in range(seq_len)])
    owned = torch.tensor([slot for req in slots for slot in req], dtype=torch.int64, device=device)
    caches = []
    for _ in range(2):
        cache = torch.full((num_blocks * block_size, num_kv_heads, head_dim), float("nan"), device=device)
        cache[owned] = torch.randn(len(owned), num_kv_heads, head_dim, generator=dev_gen, device=device)
        caches.append(cache.view(num_blocks, block_size, num_kv_heads, head_dim).to(dtype))
    q = make_q(sum(q_lens), num_q_heads, num_kv_heads, head_dim, dtype, device, dev_gen, strided_q)
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return PagedCase(
        q=q,
        k_cache=caches[0],
        v_cache=caches[1],
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        slots=slots,
        scale=head_dim**-0.5,
    )


def make_q(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, gen, strided=False) -> torch.Tensor:
    # strided: q as the model runner sees it, a view into a fused qkv projection num_q_heads + 2 Hkv wide
    width = num_q_heads + 2 * num_kv_heads if strided else num_q_heads
    q = torch.randn(num_tokens, width, head_dim, generator=gen, device=device).to(dtype)
    return q[:, :num_q_heads]


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    atol, rtol = TOLERANCES[out.dtype]
    assert not out.isnan().any(), "kernel output has NaN: it read a slot outside the context"
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)
