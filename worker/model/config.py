"""The model's shape, read from a Hugging Face `config.json`, and the RoPE frequencies it implies.

Supported (docs/model-families.md): the pre-norm decoder family — LlamaForCausalLM (SmolLM2 is one),
MistralForCausalLM, Qwen2ForCausalLM (bias on q/k/v), Qwen3ForCausalLM (per-head q/k RMSNorm), Phi3ForCausalLM
(fused q|k|v and gate|up in the checkpoint, partial rotary) — its mixture-of-experts members MixtralForCausalLM
and Qwen3MoeForCausalLM, and Gemma2ForCausalLM / Gemma3ForCausalLM (text only). Anything else raises
`UnsupportedModelError` naming what is supported, rather than loading into the wrong graph.

Sliding-window attention is per layer (`layer_windows`): every layer of Mistral, Mixtral and Phi-3 when the
config sets a window, the layers from max_window_layers on for Qwen2/Qwen3 with use_sliding_window, and the
layers config.json's `layer_types` (or Gemma's pattern) names "sliding_attention".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_QWEN_WINDOWED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""Their config carries a window that is off unless use_sliding_window, and then only from max_window_layers on."""
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
    """The widest window of any layer (None: every layer attends to the whole context)."""
    torch_dtype: torch.dtype | None
    """The checkpoint's own dtype, when config.json states one."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: a query at position p sees keys in (p - window, p]; None sees the whole context. Empty: all None."""
    hidden_act: str = "silu"
    """The gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)."""
    qk_norm: bool = False
    """RMSNorm over each q and k head before RoPE (Qwen3, Gemma3)."""
    rotary_dim: int = 0
    """Leading dims of each head that RoPE rotates (partial_rotary_factor x head_dim); 0 means head_dim."""
    attn_scale: float = 0.0
    """Scale of q.k: head_dim ** -0.5, or query_pre_attn_scalar ** -0.5 (Gemma). 0 means head_dim ** -0.5."""
    attn_logit_softcap: float | None = None
    """Attention scores become cap * tanh(score / cap) before the mask (Gemma2)."""
    final_logit_softcap: float | None = None
    """Logits become cap * tanh(logit / cap) (Gemma2)."""
    local_rope_theta: float | None = None
    """Gemma3: windowed layers use plain RoPE of this base instead of the global rope_theta and scaling."""
    num_experts: int = 0
    """Mixture of experts: experts per MoE layer (0: a dense MLP everywhere)."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    """Renormalize the top-k routing weights to sum to 1 (Mixtral always; Qwen3-MoE when its config says so)."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer, whether its MLP is the mixture of experts (Qwen3-MoE can keep some dense). Empty: none."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_gemma(self) -> bool:
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def kv_window(self) -> int | None:
        """The widest layer window when every layer has one: no query reads a key further back, so the engine
        gives back the KV blocks behind it. None when some layer attends to the whole context."""
        windows = self.layer_windows
        if not windows or None in windows:
            return None
        return max(windows)

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def check_max_model_len(self, max_model_len: int) -> None:
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


def _rope_params(raw: dict, params: dict | None = None) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either layout: transformers 5 writes `rope_parameters` (theta inside),
    older configs write `rope_theta` plus `rope_scaling` (whose type key was once `type`)."""
    if params is None:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    params = dict(params)
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # read by _rotary_dim
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    required = ("factor",) if rope_type == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in required if k not in params]
    if missing:
        raise UnsupportedModelError(f"{rope_type} RoPE scaling lacks {missing}")
    return theta, {"rope_type": rope_type, **{k: params[k] for k in required}}


def _rotary_dim(raw: dict, head_dim: int) -> int:
    params = raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    dim = int(head_dim * factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise UnsupportedModelError(f"partial_rotary_factor {factor} gives an odd or empty rotary dim {dim}")
    return dim


def _layer_windows(raw: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window, the way transformers decides it for `arch`."""
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM" or (arch in _QWEN_WINDOWED and not raw.get("use_sliding_window", False)):
        window = None
    if arch in GEMMA_ARCHITECTURES and raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention (an encoder's attention) is not supported")
    if not window:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None and arch in GEMMA_ARCHITECTURES:
        pattern = int(raw.get("sliding_window_pattern", 2 if arch == "Gemma2ForCausalLM" else 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if layer_types is None and arch in _QWEN_WINDOWED:
        first = int(raw.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if layer_types is None:  # Mistral, Mixtral, Phi-3: a window on every layer
        return (int(window),) * num_layers
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"layer_types names {len(layer_types)} layers, the model has {num_layers}")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _moe_fields(raw: dict, arch: str, num_layers: int) -> dict:
    if arch == "MixtralForCausalLM":
        return dict(num_experts=int(raw["num_local_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=(True,) * num_layers)
    if arch == "Qwen3MoeForCausalLM":
        dense = set(raw.get("mlp_only_layers") or ())
        step = int(raw.get("decoder_sparse_step", 1))
        # Hub checkpoints write num_experts; transformers 5 saves it as num_local_experts.
        num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)))
        return dict(num_experts=num_experts, num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["moe_intermediate_size"]),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                    moe_layers=tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                                     for i in range(num_layers)))
    return {}


def parse_config(raw: dict) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} (model_type {raw.get('model_type')!r}) is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (SmolLM2 is a LlamaForCausalLM)"
        )
    if arch == "Gemma3ForCausalLM" and "text_config" in raw:
        raise UnsupportedModelError("Gemma3ForCausalLM with a text_config (the multimodal checkpoint) is not "
                                    "supported; use a text-only checkpoint (model_type gemma3_text)")
    gemma = arch in GEMMA_ARCHITECTURES
    if gemma:  # Gemma names it hidden_activation; hidden_act, where also present, is the older key
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    else:
        act = raw.get("hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu' and 'gelu_pytorch_tanh' "
                                    "gated MLPs)")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    num_layers = int(raw["num_hidden_layers"])
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        # transformers 5 writes one rope_parameters entry per layer type; older configs rope_local_base_freq.
        params = raw.get("rope_parameters") or {}
        if "full_attention" in params:
            theta, scaling = _rope_params(raw, params["full_attention"])
            local_theta, local_scaling = _rope_params(raw, params.get("sliding_attention") or {"rope_theta": 10000.0})
            if local_scaling is not None:
                raise UnsupportedModelError("RoPE scaling on Gemma3's sliding layers is not supported")
        else:
            theta, scaling = _rope_params(raw | {"rope_theta": raw.get("rope_theta", 1_000_000.0)})
            local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    else:
        theta, scaling = _rope_params(raw)
    rotary_dim = _rotary_dim(raw, head_dim)
    windows = _layer_windows(raw, arch, num_layers)
    attention_bias = bool(raw.get("attention_bias", False))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    query_scalar = raw.get("query_pre_attn_scalar") if gemma else None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        # Qwen2 always has q/k/v bias and no o_proj bias; Llama's attention_bias covers all four.
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=max((w for w in windows if w is not None), default=None),
        torch_dtype=_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        layer_windows=windows,
        hidden_act=act,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        rotary_dim=rotary_dim,
        attn_scale=float(query_scalar) ** -0.5 if query_scalar else head_dim**-0.5,
        attn_logit_softcap=raw.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcap=raw.get("final_logit_softcapping") if gemma else None,
        local_rope_theta=local_theta,
        **_moe_fields(raw, arch, num_layers),
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


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:  # [rotary_dim // 2] float32
    """Inverse frequencies computed exactly as transformers does, so fp32 logits match bit for bit. `local`:
    Gemma3's windowed layers' own plain RoPE."""
    dim = config.rotary_dim or config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = None if local else config.rope_scaling
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


def rope_cos_sin(config: ModelConfig, max_positions: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, rotary_dim] float32, halves repeated (the rotate_half convention)."""
    inv_freq = rope_inv_freq(config, local)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()
