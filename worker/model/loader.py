"""Fill a model (worker/model/models/) from a Hugging Face folder's safetensors files (single or sharded with an index).

Tensors stream one at a time from the memory-mapped files into the (possibly fused) destination
parameter, so peak memory stays near the model's own size. Every destination (`checkpoint_tensors`, a view of
our parameters per Hugging Face name) must be written exactly once: a checkpoint missing a tensor, or holding
one of another shape, fails loudly naming it instead of leaving uninitialized weights. A checkpoint quantized
already (worker/model/checkpoint_quant.py) fills int8 or FP8 destinations as it is and float ones widened.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.attention import AttentionBackend
from worker.model.checkpoint_quant import dequantize, quantized_dtype, unpack_int8
from worker.model.config import ModelConfig
from worker.model.models import MODEL_CLASSES
from worker.model.models.base import CausalLM
from worker.model.quantize import FP8, quantize_fp8, quantize_int8

# Tensors some checkpoints carry that hold nothing we need (RoPE tables are recomputed).
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")
COMPANIONS = (".weight_scale", ".weight_zero_point", ".weight_shape")
"""Tensors a quantized checkpoint keeps beside a weight, read with it."""


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


def _write(name: str, tensor: torch.Tensor, scale: torch.Tensor | None, dest: dict[str, torch.Tensor]) -> list[str]:
    """Copy one checkpoint weight (with its quantization scale, if it has one) into its destination: as it is
    where both are quantized alike; quantized per row where only the destination is (a part the checkpoint
    left in float, or one quantized otherwise: per-row scales make each fused part's rows its own); widened
    to the destination's dtype where only the checkpoint's is. The destination names written."""
    target = dest[name]
    if tensor.shape != target.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
    if scale is not None and scale.numel() not in (1, tensor.shape[0]):
        raise ValueError(f"{name}_scale: {scale.numel()} scales for {tensor.shape[0]} rows (only per output "
                         "channel or per tensor load)")
    if not quantized_dtype(target):
        target.copy_(tensor if scale is None else dequantize(tensor, scale, target.dtype))
        return [name]
    scale_target = dest[name + "_scale"]
    if tensor.dtype != target.dtype or scale is None:
        float_weight = tensor if scale is None else dequantize(tensor, scale, torch.float32)
        tensor, scale = (quantize_fp8 if target.dtype == FP8 else quantize_int8)(float_weight)
    target.copy_(tensor)
    scale_target.copy_(scale.reshape(-1).expand(scale_target.shape[0]))
    return [name, name + "_scale"]


def load_weights(model: CausalLM, model_path: str | Path) -> None:
    model_path = Path(model_path)
    dest = model.checkpoint_tensors()
    loaded: set[str] = set()
    unexpected: list[str] = []
    with ExitStack() as stack:
        files = {}  # name -> the open file holding it
        for file in safetensors_files(model_path):
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            files.update(dict.fromkeys(handle.keys(), handle))

        def get(name: str) -> torch.Tensor | None:
            return files[name].get_tensor(name) if name in files else None

        for name in files:
            if name.endswith(".input_scale") or name.endswith(COMPANIONS):
                continue  # read with its weight; a static input scale is not used (checkpoint_quant.py)
            base = name.removesuffix("_packed")
            if base not in dest:
                # A tied checkpoint may still store lm_head; it equals the embedding we already use.
                if not (base == "lm_head.weight" or _IGNORED.search(base)):
                    unexpected.append(name)
                continue
            tensor = get(name)
            if name.endswith(".weight_packed"):  # pack-quantized: the int8 weight, four to an int32
                tensor = unpack_int8(tensor, get(base + "_shape"))
            zero_point = get(base + "_zero_point")
            if zero_point is not None and zero_point.any():
                raise ValueError(f"{base}_zero_point: asymmetric weights (nonzero zero points) do not load")
            loaded.update(_write(base, tensor, get(base + "_scale"), dest))
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
    checkpoint_kind: str | None = None,
) -> CausalLM:
    """`checkpoint_kind` ("int8", "fp8"): the layers' projections take the checkpoint's quantized weights as
    they are (worker/model/checkpoint_quant.py); None: float weights (a quantized checkpoint's are widened)."""
    model = MODEL_CLASSES[config.architecture](config, backend, max_positions, device=device, dtype=dtype)
    if checkpoint_kind is not None:
        model.quantize(checkpoint_kind, from_checkpoint=True)
    load_weights(model, model_path)
    return model.eval()
