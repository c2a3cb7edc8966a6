"""Fill a model (worker/model/models/) from a Hugging Face folder's safetensors files (single or sharded with an index).

Tensors stream one at a time from the memory-mapped files into the (possibly fused) destination
parameter, so peak memory stays near the model's own size. Every destination (`checkpoint_tensors`, a view of
our parameters per Hugging Face name) must be written exactly once: a checkpoint missing a tensor, or holding
one of another shape, fails loudly naming it instead of leaving uninitialized weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.models import MODEL_CLASSES
from worker.model.models.base import CausalLM

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


def load_weights(model: CausalLM, model_path: str | Path) -> None:
    model_path = Path(model_path)
    dest = model.checkpoint_tensors()
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
                tensor = f.get_tensor(name)
                target = dest[name]
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
) -> CausalLM:
    model = MODEL_CLASSES[config.architecture](config, backend, max_positions, device=device, dtype=dtype)
    load_weights(model, model_path)
    return model.eval()
