"""The model's shape, read from a Hugging Face `config.json`, and the RoPE frequencies it implies.

Supported: the Llama family with a plain SwiGLU MLP and RMSNorm — LlamaForCausalLM (SmolLM2 is one),
MistralForCausalLM and Qwen2ForCausalLM (bias on q/k/v). Anything else raises `UnsupportedModelError`
naming what is supported, rather than loading into the wrong graph.

Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is not implemented. It is exact
to ignore the window while no sequence is longer than it, so the runner accepts such a model only when
max_model_len <= sliding_window (`check_max_model_len`), and says so otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its features is outside what our model code implements."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    """None for plain RoPE; else {"rope_type": "linear"|"llama3", "factor": ..., ...}."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    """Only set when the model really uses a window (Mistral, Qwen2 with use_sliding_window)."""
    torch_dtype: torch.dtype | None
    """The checkpoint's own dtype, when config.json states one."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_max_model_len(self, max_model_len: int) -> None:
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise UnsupportedModelError(
                f"{self.architecture} uses sliding-window attention (window {self.sliding_window}), which this "
                f"worker does not implement; set ENGINE_MAX_MODEL_LEN <= {self.sliding_window} (full attention "
                f"is then exact) instead of {max_model_len}"
            )
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{self.max_position_embeddings}"
            )


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_params(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either layout: transformers 5 writes `rope_parameters` (theta inside),
    older configs write `rope_theta` plus `rope_scaling` (whose type key was once `type`)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    if rope_type == "default":
        return theta, None
    required = ("factor",) if rope_type == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in required if k not in params]
    if missing:
        raise UnsupportedModelError(f"{rope_type} RoPE scaling lacks {missing}")
    return theta, {"rope_type": rope_type, **{k: params[k] for k in required}}


def parse_config(raw: dict) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} (model_type {raw.get('model_type')!r}) is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (SmolLM2 is a LlamaForCausalLM)"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only the SwiGLU 'silu' MLP)")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    theta, scaling = _rope_params(raw)

    window = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a window value that is off unless use_sliding_window is set.
    if arch == "LlamaForCausalLM":
        window = None
    attention_bias = bool(raw.get("attention_bias", False))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and no o_proj bias; Llama's attention_bias covers all four.
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=int(window) if window else None,
        torch_dtype=_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
    )


def load_config(model_path: str | Path) -> ModelConfig:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model folder")
    return parse_config(json.loads(path.read_text()))


def load_eos_token_ids(model_path: str | Path, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what `generate` stops on) joined with config.json's."""
    ids = list(config.eos_token_ids)
    gen_path = Path(model_path) / "generation_config.json"
    if gen_path.is_file():
        ids += _eos_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def load_tokenizer(model_path: str | Path):
    """The model's Hugging Face tokenizer, without its word cache. A fast tokenizer's BPE (or Unigram) model
    keeps every distinct word it has split, up to 10,000, and then stops adding: a worker whose prompts carry
    ids, numbers or names meets new words with every request, so that cache fills over its first quarter hour
    or so, and its thousands of small long-lived entries, allocated between each step's temporaries, keep
    pages of the heap from going back to the kernel (docs/memory.md). Splitting a word again costs about
    0.2 us a token (a 91-token prompt: 191 us against 169 with the cache), nothing beside a forward pass."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    if model is not None and hasattr(model, "_resize_cache"):  # tokenizers >= 0.20
        model._resize_cache(0)
    return tokenizer


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    """Inverse frequencies computed exactly as transformers does, so fp32 logits match bit for bit."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen = old_len / scaling["low_freq_factor"]
    high_wavelen = old_len / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = ((old_len / wavelen - scaling["low_freq_factor"])
              / (scaling["high_freq_factor"] - scaling["low_freq_factor"]))
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim] float32, halves repeated (the rotate_half convention)."""
    inv_freq = rope_inv_freq(config)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()
