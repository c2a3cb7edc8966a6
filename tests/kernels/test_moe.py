"""kernels.moe.fused_moe against kernels.reference.ref_moe and against the grouped torch path the model runs on a
CPU (worker/model/models/moe.py), on random weights: experts that no token chose, runs longer than a block, top-k of
2 and 4, widths that are not multiples of a block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import align, fused_moe
from kernels.reference import ref_moe


def case(device: str, dtype: torch.dtype, num_tokens: int = 37, hidden: int = 80, size: int = 48, num_experts: int = 8,
         top_k: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    gate_up = (torch.randn(num_experts, 2 * size, hidden, generator=gen) * 0.1).to(dtype).to(device)
    down = (torch.randn(num_experts, hidden, size, generator=gen) * 0.1).to(dtype).to(device)
    # Experts 0 and 5 get no token; expert 2 gets more than a block's worth.
    choices = torch.tensor([e for e in range(num_experts) if e not in (0, 5)])
    ids = torch.stack([choices[torch.randperm(len(choices), generator=gen)[:top_k]] for _ in range(num_tokens)])
    ids[:20, 0] = 2
    ids[:20, 1:] = torch.where(ids[:20, 1:] == 2, torch.full_like(ids[:20, 1:], 3), ids[:20, 1:])
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), -1)
    return x, gate_up, down, weights.to(device), ids.to(device)


def test_align_lays_each_experts_assignments_out_in_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # assignments 0..5: experts 2, 0, 2, 1, 0, 2
    sorted_ids, block_expert = align(ids, num_experts=4, block_m=2)
    pad = 6
    # Expert 0: 1, 4; expert 1: 3 (+ pad); expert 2: 0, 2, 5 (+ pad); expert 3: none.
    assert sorted_ids.tolist()[:8] == [1, 4, 3, pad, 0, 2, 5, pad]
    assert sorted_ids.tolist()[8:] == [pad] * (len(sorted_ids) - 8)
    assert block_expert.tolist() == [0, 1, 2, 2] + [-1] * (len(block_expert) - 4)


@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fused_moe_matches_the_reference(device: str, dtype: torch.dtype, tolerance: float, top_k: int):
    x, gate_up, down, weights, ids = case(device, dtype, top_k=top_k)
    got = fused_moe(x, gate_up, down, weights, ids, F.silu)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), ref_moe(x, gate_up, down, weights, ids, F.silu), atol=tolerance,
                               rtol=tolerance)


def test_one_token_and_the_torch_path_of_the_model(device: str):
    """A decode step of one token, and a step of many, through the kernel and through SparseMoE's grouped torch
    path on the same weights and routing."""
    from types import SimpleNamespace

    from worker.model.models.moe import SparseMoE

    for num_tokens in (1, 37):
        x, gate_up, down, weights, ids = case(device, torch.float32, num_tokens=num_tokens, seed=num_tokens)
        config = SimpleNamespace(architecture="MixtralForCausalLM", hidden_size=80, moe_intermediate_size=48,
                                 num_experts=8, num_experts_per_tok=2, hidden_act="silu", norm_topk_prob=True)
        moe = SparseMoE(config, "cpu", torch.float32)
        moe.gate_up_weight.data.copy_(gate_up.cpu())
        moe.down_weight.data.copy_(down.cpu())
        moe.route = lambda _x: (weights.cpu(), ids.cpu())
        expected = moe.forward(x.cpu())
        got = fused_moe(x, gate_up, down, weights, ids, F.silu)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_shapes_that_do_not_chain_are_refused(device: str):
    x, gate_up, down, weights, ids = case(device, torch.float32)
    with pytest.raises(ValueError, match="do not chain"):
        fused_moe(x, gate_up, down[:, :, :40], weights, ids, F.silu)
    with pytest.raises(ValueError, match=r"\[N, k\]"):
        fused_moe(x, gate_up, down, weights[:, :1], ids, F.silu)
