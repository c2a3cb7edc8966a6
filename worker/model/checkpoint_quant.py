"""Checkpoints whose weights are quantized already: the compressed-tensors format that llm-compressor writes and
vLLM loads (the `-FP8-dynamic` and `-quantized.w8a8` folders on the Hugging Face Hub), with 8-bit weights and
one scale per output channel (or one per tensor).

What loads, and into which kernel (worker/model/quantize.py):

- FP8 e4m3 weights (`float-quantized`, llm-compressor's FP8_DYNAMIC and FP8 schemes): the FP8 product, the
  activations quantized per token at each step. A static per-tensor input scale (the FP8 scheme) is not used:
  per-token scales fit each row at least as well.
- int8 weights (`int-quantized`, `naive-quantized`, or 8-bit `pack-quantized`: W8A8 with channel weights, or
  W8A16 with channel weights): torch's weight-only int8 product on the CPU. W8A8's activations stay in the model
  dtype, which is more precise than the int8 activations the checkpoint was tuned for.

Where the device has no kernel for the weights (FP8 on the CPU or on a GPU older than Ada; int8 on a GPU, or
with float32 activations), they are widened to the model dtype as they load: the model runs, without the
savings. Anything else (group-wise scales as in W4A16 or GPTQ-style W8A16, 4-bit or asymmetric weights, block
FP8, NVFP4/MXFP4, a quantized KV cache, sparsity, transforms) is refused with a line naming what it holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model.quantize import FP8

FORMATS = {"int-quantized": "int8", "naive-quantized": None, "pack-quantized": "int8", "float-quantized": "fp8"}
"""compressed-tensors' formats we read -> the kind they hold (naive: by the weights' type)."""

@dataclass(frozen=True)
class CheckpointQuantization:
    kind: str
    """"int8" or "fp8": what the weights are stored as."""
    description: str
    """For the log: the format and the activations' scheme the checkpoint was made for."""


def _refuse(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: {what}; only compressed-tensors checkpoints with 8-bit int or FP8 weights, one "
                      "scale per output channel or per tensor, load (docs/quantization.md)")


def read_checkpoint_quantization(model_path: str | Path) -> CheckpointQuantization | None:
    """The quantization the folder's config.json declares (None: plain float weights), checked against what loads."""
    path = Path(model_path) / "config.json"
    raw = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "compressed-tensors":
        raise _refuse(path, f"quantization_config's quant_method is {method!r}")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if raw.get(key):
            raise _refuse(path, f"it sets {key} (not supported)")
    kinds, activations = set(), set()
    for name, group in (raw.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        form = group.get("format") or raw.get("format")
        if form not in FORMATS:
            raise _refuse(path, f"config group {name!r} has format {form!r}")
        kind = {"int": "int8", "float": "fp8"}.get(weights.get("type"))
        if (kind is None or weights.get("num_bits") != 8 or FORMATS[form] not in (None, kind)
                or not weights.get("symmetric", False) or weights.get("dynamic")):
            raise _refuse(path, f"config group {name!r} holds {weights.get('num_bits')}-bit "
                                f"{weights.get('type')} weights (symmetric {weights.get('symmetric')}, "
                                f"dynamic {weights.get('dynamic')}) in format {form!r}")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise _refuse(path, f"config group {name!r} scales its weights by {weights.get('strategy')!r} "
                                f"(group size {weights.get('group_size')})")
        kinds.add(kind)
        inputs = group.get("input_activations")
        activations.add("weights only" if not inputs else
                        f"{inputs.get('num_bits')}-bit {inputs.get('type')} activations per {inputs.get('strategy')}"
                        f"{', dynamic' if inputs.get('dynamic') else ', static'}")
    if len(kinds) != 1:
        raise _refuse(path, f"its config groups hold {sorted(kinds) or 'no'} weight kinds")
    kind = kinds.pop()
    return CheckpointQuantization(kind, f"compressed-tensors {kind} weights ({'; '.join(sorted(activations))})")


def unpack_int8(packed: torch.Tensor, shape: torch.Tensor | tuple[int, ...]) -> torch.Tensor:
    """pack-quantized's 8-bit weights: four per int32 along each row, element i in bits 8i..8i+7, stored with
    128 added -> int8 [N, K]."""
    rows, cols = (int(n) for n in shape)
    # A word's bytes in memory, least significant first: every host torch runs on here is little-endian.
    unsigned = packed.contiguous().view(torch.uint8).view(rows, -1)[:, :cols]
    return (unsigned.to(torch.int16) - 128).to(torch.int8)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int8 or FP8 weight [N, K] with scales [N, 1], [N] or one -> the float weight in `dtype`."""
    scale = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
    return (weight.float() * scale).to(dtype)


def quantized_dtype(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.int8, FP8)
