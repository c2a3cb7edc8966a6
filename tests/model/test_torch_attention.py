"""TorchAttention against a naive float64 attention over each request's dense context (no model involved)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.model.batch import Chunk, make_input
from worker.model.torch_attention import DECODE_PADDING, SHORT_CHUNK, TorchAttention, group_decodes

BLOCK, NUM_BLOCKS, HQ, HKV, D = 4, 40, 6, 2, 16


def naive_attention(q_b, k_ctx, v_ctx, scale):  # [n, Hq, D], [L, Hkv, D], [L, Hkv, D] -> [n, Hq, D]
    n, L = q_b.shape[0], k_ctx.shape[0]
    group = q_b.shape[1] // k_ctx.shape[1]
    k = k_ctx.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v_ctx.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q_b.double(), k) * scale  # [Hq, n, L]
    query_pos = torch.arange(L - n, L)[:, None]
    scores = scores.masked_fill(torch.arange(L)[None, :] > query_pos, -math.inf)
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).float()


def run_case(history: list[list[Chunk]], seed: int, dtype: torch.dtype = torch.float32, hkv: int = HKV,
             fixed_kernels: bool = False) -> None:
    """Every step of `history` runs through TorchAttention; a dense copy of each request's K/V checks it."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, hkv, D, generator=gen).to(dtype)  # garbage where nothing was written
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, hkv, D, generator=gen).to(dtype)
    dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # first block id -> all K, V so far
    backend, scale = TorchAttention(fixed_kernels=fixed_kernels), D**-0.5
    # bf16 inputs are exact in float64; what is left is the kernels' bf16 rounding (of the output, mostly).
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for step in history:
        model_input = make_input(step, BLOCK)
        num_tokens = model_input.input_ids.shape[0]
        q = torch.randn(num_tokens, HQ, D, generator=gen).to(dtype)
        k = torch.randn(num_tokens, hkv, D, generator=gen).to(dtype)
        v = torch.randn(num_tokens, hkv, D, generator=gen).to(dtype)
        out = backend.forward(q, k, v, k_cache, v_cache, model_input.attn, scale)
        assert out.dtype == dtype and out.shape == q.shape
        start = 0
        for chunk in step:
            n = len(chunk.new_token_ids)
            key = chunk.block_ids[0]
            old_k, old_v = dense.get(key, (torch.empty(0, hkv, D, dtype=dtype), torch.empty(0, hkv, D, dtype=dtype)))
            assert old_k.shape[0] == chunk.num_computed
            dense[key] = (torch.cat([old_k, k[start : start + n]]), torch.cat([old_v, v[start : start + n]]))
            ref = naive_attention(q[start : start + n], *dense[key], scale)
            torch.testing.assert_close(out[start : start + n].float(), ref, atol=tolerance, rtol=tolerance)
            start += n


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_then_mixed_then_decode_only(seed):
    a, b, c = [1, 7, 3, 9], [20, 2, 31], [15, 16, 17, 18, 19]
    run_case([
        [Chunk([0] * 5, 0, a), Chunk([0] * 3, 0, b)],  # two fresh prefills
        [Chunk([0], 5, a), Chunk([0] * 6, 3, b), Chunk([0] * 9, 0, c)],  # decode + chunk + fresh prefill
        [Chunk([0], 6, a), Chunk([0], 9, b), Chunk([0], 9, c)],  # decode only, ragged lengths
        [Chunk([0], 7, a), Chunk([0], 10, b), Chunk([0], 10, c)],
    ], seed)


@pytest.mark.parametrize("hkv", [HKV, HQ, 1], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_in_reduced_precision_with_query_heads_as_rows(dtype, hkv):
    # In bf16 and fp16 on the CPU, decode rows attend with each KV head's query heads as rows of queries (a lone
    # head given a second row): the same attention as the single-row call, checked against float64.
    a, b, c = [1, 7, 3, 9], [20, 2, 31], [15, 16, 17, 18, 19]
    run_case([
        [Chunk([0] * 5, 0, a), Chunk([0] * 3, 0, b)],
        [Chunk([0], 5, a), Chunk([0] * 6, 3, b), Chunk([0] * 9, 0, c)],
        [Chunk([0], 6, a), Chunk([0], 9, b), Chunk([0], 9, c)],
        [Chunk([0], 7, a), Chunk([0], 10, b), Chunk([0], 10, c)],
    ], seed=5, dtype=dtype, hkv=hkv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_chunks_after_a_context_attend_as_decode_rows(dtype):
    # Under fixed_kernels (bf16 and fp16 on the CPU) a chunk of up to SHORT_CHUNK queries after a cached context (a
    # verify step's last token and drafts, a resumed tail) attends as decode rows, each seeing the keys up to its
    # own position, grouped with the step's decode rows; a longer chunk and a fresh prompt keep their paths.
    a, b, c, d = [1, 7, 3, 9, 10], [20, 2, 31], [15, 16, 17, 18, 19, 27, 28], [21, 22, 23, 24, 25, 26]
    history = [
        [Chunk([0] * 5, 0, a), Chunk([0] * 3, 0, b), Chunk([0] * 9, 0, c)],
        [Chunk([0] * 5, 5, a), Chunk([0], 3, b), Chunk([0] * 3, 9, c), Chunk([0] * 4, 0, d)],
        [Chunk([0] * SHORT_CHUNK, 10, a), Chunk([0] * 2, 4, b), Chunk([0] * (SHORT_CHUNK + 1), 12, c)],
    ]
    run_case(history, seed=6, dtype=dtype, fixed_kernels=True)
    backend = TorchAttention(fixed_kernels=True)
    plan = backend._plan(make_input(history[1], BLOCK).attn, 13, BLOCK)
    assert [p.q_end - p.q_start for p in plan.prefills] == [4]  # only the fresh prompt
    assert sum(len(g.seq_lens) for g in plan.decode_groups) == 9  # 5 + 1 + 3 rows
    plan = backend._plan(make_input(history[2], BLOCK).attn, 2 * SHORT_CHUNK + 3, BLOCK)
    assert [p.q_end - p.q_start for p in plan.prefills] == [SHORT_CHUNK + 1]


def test_single_token_prompts_take_the_decode_path():
    # A one-token prompt is a "decode" row with an empty history: it must attend only to itself.
    run_case([[Chunk([0], 0, [5]), Chunk([0], 0, [6])], [Chunk([0], 1, [5]), Chunk([0] * 4, 1, [6, 8])]], seed=2)


def test_plan_is_rebuilt_for_each_new_metadata():
    backend = TorchAttention()
    first = make_input([Chunk([0] * 3, 0, [1])], BLOCK).attn
    second = make_input([Chunk([0], 3, [1])], BLOCK).attn
    assert backend._plan(first, 3, BLOCK) is backend._plan(first, 3, BLOCK)
    assert backend._plan(second, 1, BLOCK).meta is second


def test_decode_groups_cover_every_request_once_within_the_padding_bound():
    lens = [300, 12, 13, 290, 40, 41, 5, 280, 64, 1, 17]
    groups = group_decodes(lens, 16)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert len(groups) > 1  # 300 next to 1: one padded group would be ~10x the tokens held
    for g in groups:
        padded = -(-max(lens[i] for i in g) // 16) * 16 * len(g)
        assert len(g) == 1 or padded <= DECODE_PADDING * sum(lens[i] for i in g)
    assert group_decodes([48, 48, 48], 16) == [[0, 1, 2]]  # equal lengths: one group, no padding
    assert group_decodes([], 16) == []


@pytest.mark.parametrize("seed", [3, 4])
def test_decode_rows_of_very_different_lengths_split_into_groups(seed):
    # Contexts from 1 to 61 tokens with 4-token blocks: several decode groups, each padded and masked, and
    # a prefill chunk in the same step; every row checked against its own dense context.
    blocks = iter(range(NUM_BLOCKS))
    lengths = [61, 2, 33, 1, 9, 30]
    tables = [[next(blocks) for _ in range(-(-(n + 3) // BLOCK))] for n in lengths]
    run_case([
        [Chunk([0] * n, 0, t) for n, t in zip(lengths, tables)],
        [Chunk([0], n, t) for n, t in zip(lengths, tables)],
        [Chunk([0], n + 1, t) for n, t in zip(lengths[:-1], tables[:-1])]
        + [Chunk([0, 0], lengths[-1] + 1, tables[-1])],
    ], seed)
    step = [Chunk([0], n + 2, t) for n, t in zip(lengths[:-1], tables[:-1])]
    assert len(TorchAttention()._plan(make_input(step, BLOCK).attn, len(step), BLOCK).decode_groups) > 1
