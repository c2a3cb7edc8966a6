"""Each model family beside Llama, as a tiny random model of its real config's layout (head_dim from the config,
windows alternating with global layers, soft-caps, expert counts) built and saved by transformers: our loader and
forward give transformers' logits and log-probs over paged, chunked, windowed steps, and our engine's greedy tokens
equal transformers' `generate` through preemption, prefix-cache hits and chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_engine_correctness import TRACE, check_policy
from tests.model.batch import BLOCK, Chunk, assert_logits_close, hf_logits, make_input, random_tokens, tiny_settings
from worker.model.config import load_config
from worker.model.runner import ModelRunner
from worker.model.tiny import FAMILIES, build_tiny_family



@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, smollm2_path, tmp_path_factory) -> tuple[str, Path, object]:
    from transformers import AutoModelForCausalLM

    name = request.param
    path = build_tiny_family(tmp_path_factory.mktemp(name), smollm2_path, name)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return name, path, hf_model


@pytest.mark.slow  # builds each family's model beside transformers': about a second apiece
def test_logits_and_logprobs_match_transformers_past_the_window(family):
    name, path, hf_model = family
    runner = ModelRunner(path, tiny_settings(num_kv_blocks=64))
    c = runner.config
    assert c.architecture == FAMILIES[name][0]
    if "windowed" in name or name.startswith(("gemma", "phi3")):
        assert c.sliding_window is not None and c.sliding_window < 40
    prompts = [random_tokens(n, seed=n) for n in (40, 23, 3)]
    ref = [hf_logits(hf_model, p) for p in prompts]
    tables = [list(range(0, 14)), list(range(20, 28)), list(range(30, 40))]
    # Step 1: request 0's first chunk, request 1 whole; step 2: request 0's next chunk beside request 2 fresh;
    # then request 0 finishes its prompt alone, and all three decode together over mixed context lengths.
    first = runner.execute(make_input([Chunk(prompts[0][:17], 0, tables[0]), Chunk(prompts[1], 0, tables[1])],
                                      BLOCK, all_logits=True))
    second = runner.execute(make_input([Chunk(prompts[0][17:33], 17, tables[0]), Chunk(prompts[2], 0, tables[2])],
                                       BLOCK, all_logits=True))
    third = runner.execute(make_input([Chunk(prompts[0][33:], 33, tables[0])], BLOCK, all_logits=True))
    ours = torch.cat([first[:17], second[:16], third])
    assert_logits_close(ours, ref[0])
    assert_logits_close(first[17:], ref[1])
    assert_logits_close(second[16:], ref[2])
    torch.testing.assert_close(torch.log_softmax(ours, -1), torch.log_softmax(ref[0], -1), atol=1e-4, rtol=1e-5)

    seqs = [list(p) for p in prompts]
    logits = torch.stack([ours[-1], first[-1], second[-1]])
    for _ in range(6):
        chunks = []
        for seq, table, token in zip(seqs, tables, logits.argmax(-1).tolist()):
            chunks.append(Chunk([token], len(seq), table))
            seq.append(token)
        logits = runner.execute(make_input(chunks, BLOCK))
        assert_logits_close(logits, torch.stack([hf_logits(hf_model, s)[-1] for s in seqs]))


@pytest.mark.slow  # transformers' generate for the whole trace: a few seconds per family
def test_engine_greedy_matches_generate_with_preemption_and_prefix_cache(family):
    _, path, _ = family
    # A model windowed on every layer gives back blocks behind its window: a smaller pool still preempts.
    windowed = load_config(path).kv_window is not None
    engine = check_policy(path, "continuous", num_kv_blocks=10 if windowed else 20)
    assert (engine.scheduler.pool.num_window_freed > 0) == windowed
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemptions"
    assert engine.scheduler.pool.hit_rate > 0, "the shared prefixes were meant to hit the prefix cache"
    assert max(len(r.prompt_token_ids) for _, r in TRACE) > 3 * (engine.runner.config.sliding_window or 0)


@pytest.mark.parametrize("arch, norm_topk_prob", [("MixtralForCausalLM", True), ("Qwen3MoeForCausalLM", False)])
def test_moe_runs_each_expert_only_on_its_tokens(arch, norm_topk_prob, monkeypatch):
    """The grouped path gives what every expert on every token, weighted by the routing, gives; and its expert
    matmuls see N x k rows in all, not N x E."""
    import worker.model.models.moe as moe
    from worker.model.config import parse_config

    num_tokens, num_experts, k, hidden, size = 37, 8, 2, 16, 24
    raw = {"architectures": [arch], "vocab_size": 10, "hidden_size": hidden, "intermediate_size": size,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_local_experts": num_experts,
           "num_experts": num_experts,
           "num_experts_per_tok": k, "moe_intermediate_size": size, "norm_topk_prob": norm_topk_prob}
    block = moe.SparseMoE(parse_config(raw), "cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    for weight in (block.router_weight, block.gate_up_weight, block.down_weight):
        weight.data.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    x = torch.randn(num_tokens, hidden, generator=generator)

    rows_seen = []
    linear = moe.F.linear

    def counting_linear(inp, weight, bias=None):
        if weight.shape == (2 * size, hidden):
            rows_seen.append(inp.shape[0])
        return linear(inp, weight, bias)

    monkeypatch.setattr(moe.F, "linear", counting_linear)
    out = block.forward(x)
    monkeypatch.undo()
    assert sum(rows_seen) == num_tokens * k and len(rows_seen) <= num_experts

    weights, expert_ids = block.route(x)
    dense = torch.zeros_like(x)
    for e in range(num_experts):
        gate, up = linear(x, block.gate_up_weight[e]).chunk(2, dim=-1)
        y = linear(torch.nn.functional.silu(gate) * up, block.down_weight[e])  # [N, H], every token
        dense += y * (weights * (expert_ids == e)).sum(-1, keepdim=True)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == norm_topk_prob
