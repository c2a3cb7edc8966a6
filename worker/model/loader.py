"""Fill a `LlamaModel` from a Hugging Face folder's safetensors files (single or sharded with an index).

Tensors stream one at a time from the memory-mapped files into the (possibly fused) destination
parameter, so peak memory stays near the model's own size. Every destination row range must be written
exactly once: a checkpoint missing a tensor fails loudly instead of leaving uninitialized weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel

# Tensors some checkpoints carry that hold nothing we need (RoPE tables are recomputed).
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


def safetensors_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    single = model_path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_path} (pytorch .bin files are not supported)")
    return files


def _destinations(model: LlamaModel) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF tensor name -> (destination parameter, first row, row count) within our fused layout."""
    c = model.config
    dest: dict[str, tuple[torch.Tensor, int, int]] = {
        "model.embed_tokens.weight": (model.embed, 0, c.vocab_size),
        "model.norm.weight": (model.final_norm, 0, c.hidden_size),
    }
    if not c.tie_word_embeddings:
        dest["lm_head.weight"] = (model.lm_head, 0, c.vocab_size)
    qkv_rows = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.kv_size), "v_proj": (c.q_size + c.kv_size, c.kv_size)}
    gate_up_rows = {"gate_proj": (0, c.intermediate_size), "up_proj": (c.intermediate_size, c.intermediate_size)}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        dest[p + "input_layernorm.weight"] = (layer.input_norm, 0, c.hidden_size)
        dest[p + "post_attention_layernorm.weight"] = (layer.post_attn_norm, 0, c.hidden_size)
        for name, (start, rows) in qkv_rows.items():
            dest[f"{p}self_attn.{name}.weight"] = (layer.qkv_weight, start, rows)
            if layer.qkv_bias is not None:
                dest[f"{p}self_attn.{name}.bias"] = (layer.qkv_bias, start, rows)
        dest[p + "self_attn.o_proj.weight"] = (layer.o_weight, 0, c.hidden_size)
        if layer.o_bias is not None:
            dest[p + "self_attn.o_proj.bias"] = (layer.o_bias, 0, c.hidden_size)
        for name, (start, rows) in gate_up_rows.items():
            dest[f"{p}mlp.{name}.weight"] = (layer.gate_up_weight, start, rows)
            if layer.gate_up_bias is not None:
                dest[f"{p}mlp.{name}.bias"] = (layer.gate_up_bias, start, rows)
        dest[p + "mlp.down_proj.weight"] = (layer.down_weight, 0, c.hidden_size)
        if layer.down_bias is not None:
            dest[p + "mlp.down_proj.bias"] = (layer.down_bias, 0, c.hidden_size)
    return dest


def load_weights(model: LlamaModel, model_path: str | Path) -> None:
    model_path = Path(model_path)
    dest = _destinations(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in dest:
                    # A tied checkpoint may still store lm_head; it equals the embedding we already use.
                    if not (name == "lm_head.weight" or _IGNORED.search(name)):
                        unexpected.append(name)
                    continue
                param, start, rows = dest[name]
                tensor = f.get_tensor(name)
                target = param.data.narrow(0, start, rows)
                if tensor.shape != target.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} "
                                     f"!= expected {tuple(target.shape)}")
                target.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(dest) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_path} does not match {model.config.architecture}: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )


def load_model(
    config: ModelConfig,
    model_path: str | Path,
    backend: AttentionBackend,
    max_positions: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> LlamaModel:
    model = LlamaModel(config, backend, max_positions, device=device, dtype=dtype)
    load_weights(model, model_path)
    return model.eval()
