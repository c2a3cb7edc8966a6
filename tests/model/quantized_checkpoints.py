"""Quantized checkpoints written by compressed-tensors itself (the library llm-compressor saves with and vLLM and
transformers load with), from a float Hugging Face folder: what a user downloads as `-FP8-dynamic` or
`-quantized.w8a8`, without the calibration data (weight scales need none: each row's largest |w|, computed by the
library's own `calculate_qparams`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def write_compressed(source: Path, out: Path, preset: str | None = None, **weights) -> Path:
    """`source` quantized by the library's scheme `preset` (e.g. "FP8_DYNAMIC", "INT8"), or by a scheme of int
    weights only with `weights` as its arguments (e.g. strategy="channel" for W8A16 per channel), every Linear
    but the LM head, saved compressed to `out` with the tokenizer files beside."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config, preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if preset is not None:
        scheme = preset_name_to_scheme(preset, ["Linear"])
    else:
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{"num_bits": 8, **weights}))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                args = module.quantization_scheme.weights
                w = module.weight.float()
                if args.group_size:  # a scale per group of inputs in each row: [N, K / group]
                    w = w.unflatten(1, (-1, args.group_size))
                scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out / file.name)
    return out


def decompressed_weights(path: Path) -> dict[str, torch.Tensor]:
    """The float weights compressed-tensors itself makes of the checkpoint at `path` (transformers loads it, the
    library decompresses every layer), by Hugging Face name."""
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ModelCompressor.from_pretrained_model(model).decompress_model(model)
    return {name: tensor.detach().float() for name, tensor in model.state_dict().items() if name.endswith(".weight")}
