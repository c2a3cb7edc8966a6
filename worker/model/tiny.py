"""A tiny random Llama on SmolLM2's real tokenizer, for fast tests of the whole stack.

About 3.6 M parameters, nearly all of them the tied 49152 x 64 embedding, so a CPU forward takes a few
milliseconds. head_dim stays 64 (as in SmolLM2) so attention kernels see a realistic head size, with GQA
(4 query heads over 2 KV heads).

Random models with the usual small init (std 0.02) produce near-flat logits: the top two tokens often
differ by less than float32 noise, so two correct implementations can pick different greedy tokens.
Weights here are drawn with std init_std/sqrt(fan_in) (init_std 2, the embedding std 1), so logits spread
with a std near 8 and the top-two gap of greedy steps is rarely below 1e-3, while float32 differences
between implementations are near 1e-5: greedy argmax is stable. With init_std 1 the tied embedding
dominates the residual stream and greedy output repeats one token; 2 gives varied output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Phi3ForCausalLM": "Phi3Config",
    "MixtralForCausalLM": "MixtralConfig",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "Gemma2ForCausalLM": "Gemma2Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
}
"""Each architecture our models run -> the transformers config class its tiny random model is built from."""

FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3-windowed": ("Qwen3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, num_key_value_heads=2, use_sliding_window=True, sliding_window=12,
        max_window_layers=1)),
    "phi3-partial-rotary-window": ("Phi3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=32, hidden_size=128, num_attention_heads=4, partial_rotary_factor=0.5,
        sliding_window=10, tie_word_embeddings=False)),
    "gemma2": ("Gemma2ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=48, sliding_window=8, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=64, sliding_window=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_theta=1_000_000.0,
        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "mixtral-windowed": ("MixtralForCausalLM", dict(
        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, sliding_window=24)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
        num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3-moe-normed": ("Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True)),
    "mistral-windowed": ("MistralForCausalLM", dict(sliding_window=8)),
    "qwen2-windowed": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}
"""Each family beside Llama at a small size in its real layout (head layout, windows alternating with global
layers, soft-caps, expert counts): name -> (architecture, overrides of TINY_CONFIG, two layers unless named).
Windows are small (8 to 24 tokens) so prompts of 40 tokens and the engine tests' (up to 130) run far past them,
both smaller than a block of 16 and spanning several."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> tuple[int, dict[str, int]]:
    """Copy the tokenizer's files (a load and save through transformers costs seconds per model) and
    return (vocab size, bos/eos/pad token ids) for the config."""
    import tokenizers

    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    settings = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    special_ids = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        token = settings.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and tokenizer.token_to_id(token) is not None:
            special_ids[f"{key}_id"] = tokenizer.token_to_id(token)
    return tokenizer.get_vocab_size(with_added_tokens=True), special_ids


def _init_weights(model: torch.nn.Module, seed: int, init_std: float, embed_std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Sorted names: the draw order, hence the weights, never depend on module registration order.
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                # Not all ones, so a forward that forgets a norm weight fails the comparison.
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(embed_std * torch.randn(param.shape, generator=generator))
            else:
                fan_in = param.shape[-1]
                param.copy_(init_std / fan_in**0.5 * torch.randn(param.shape, generator=generator))


def build_tiny_model(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    init_std: float = 2.0,
    embed_std: float = 1.0,
    **overrides,
) -> Path:
    """Save a random model of `architecture` (a key of CONFIG_CLASSES, built by transformers' own class) with the
    tokenizer found in tokenizer_dir; `overrides` change TINY_CONFIG (e.g. rope_scaling, num_key_value_heads)."""
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size, special_ids = _copy_tokenizer(Path(tokenizer_dir), out_dir)
    config_cls = getattr(transformers, CONFIG_CLASSES[architecture])
    config = config_cls(**{**TINY_CONFIG, **overrides}, vocab_size=vocab_size, **special_ids)
    # transformers' own init draws from the global RNG; fork it so building a model leaves callers' RNG alone.
    with torch.random.fork_rng(devices=[]):
        model = getattr(transformers, architecture)(config).to(torch.float32)
    _init_weights(model, seed, init_std, embed_std)
    model.save_pretrained(out_dir)
    return out_dir


def build_tiny_llama(out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """The default tiny test model: a 4-layer GQA Llama, ~3.6 M parameters, SmolLM2's tokenizer."""
    return build_tiny_model(out_dir, tokenizer_dir, "LlamaForCausalLM", seed=seed, **overrides)


def build_tiny_family(out_dir: str | Path, tokenizer_dir: str | Path, name: str, seed: int = 7) -> Path:
    """The tiny random model of FAMILIES[name]."""
    architecture, overrides = FAMILIES[name]
    return build_tiny_model(out_dir, tokenizer_dir, architecture, seed=seed, **{"num_hidden_layers": 2, **overrides})
