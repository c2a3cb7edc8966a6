"""A model folder with random weights in a real model's shape, built where it runs.

Only 64 MiB of the working tree travels to a lent GPU machine, and nothing there can be downloaded, so the
GPU check (benchmarks/gpu_engine_check.py) builds its models on the spot from a config.json
(worker/model/configs/): safetensors drawn on the device in Hugging Face's tensor names (so transformers
loads the same folder), and a synthetic byte-level BPE tokenizer with one token per id of the vocabulary (the
engine's detokenizer and transformers' loader need one; its text is meaningless, as are the weights).

Weights are drawn as worker/model/tiny.py draws them (std init_std / sqrt(fan_in), embedding std 1, norm weights
near 1): logits then spread widely, so greedy argmax is rarely decided by rounding noise, and two paths that
compute the same thing pick the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.model.config import ModelConfig, parse_config
from worker.model.sim import CONFIGS_DIR


def load_shape(name_or_path: str) -> dict:
    """A shipped config (worker/model/configs/<name>.json) or a config.json path, as a dict."""
    path = CONFIGS_DIR / f"{name_or_path}.json"
    if not path.is_file():
        path = Path(name_or_path)
    return json.loads(path.read_text())


def hf_tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama tensor names and shapes of a config (what worker/model/loader.py reads)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                          "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for name, rows in (("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size)):
            shapes[f"{p}self_attn.{name}.weight"] = (rows, c.hidden_size)
            if c.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        for name in ("gate_proj", "up_proj"):
            shapes[f"{p}mlp.{name}.weight"] = (c.intermediate_size, c.hidden_size)
            if c.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (c.intermediate_size,)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        if c.mlp_bias:
            shapes[p + "mlp.down_proj.bias"] = (c.hidden_size,)
    return shapes


@torch.inference_mode()
def random_weights(c: ModelConfig, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                   init_std: float = 2.0, embed_std: float = 1.0) -> dict[str, torch.Tensor]:
    """Every tensor drawn on `device` (fast on a GPU: a 1B model in well under a second), returned on the CPU."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in sorted(hf_tensor_shapes(c).items()):
        x = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        elif name.endswith("bias"):
            x = 0.1 * x
        elif "embed_tokens" in name:
            x = embed_std * x
        else:
            x = init_std / shape[-1] ** 0.5 * x
        tensors[name] = x.to(dtype).cpu()
    return tensors


def _token_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def write_synthetic_tokenizer(out_dir: Path, vocab_size: int, bos_id: int | None, eos_ids: tuple[int, ...],
                              max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json: a byte-level BPE of exactly `vocab_size` ids. Special tokens sit at
    the config's bos/eos ids; the 256 byte characters and then made-up words ("Ġ" + letters) fill the rest."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = {i: f"<|special_{i}|>" for i in {*eos_ids, *(() if bos_id is None else (bos_id,))} if i < vocab_size}
    ordinary = iter(_token_alphabet())
    n = 0
    vocab: dict[str, int] = {}
    for token_id in range(vocab_size):
        if token_id in specials:
            vocab[specials[token_id]] = token_id
            continue
        token = next(ordinary, None)
        if token is None:
            word, k = "", n
            n += 1
            for _ in range(3):
                word += "abcdefghijklmnopqrstuvwxyz"[k % 26]
                k //= 26
            token = "Ġ" + word + (str(k) if k else "")
        vocab[token] = token_id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials.values()))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos = specials.get(eos_ids[0]) if eos_ids else None
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                "clean_up_tokenization_spaces": False, "bos_token": specials.get(bos_id), "eos_token": eos,
                "pad_token": eos}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))


def build_random_model(out_dir: str | Path, shape: str | dict, seed: int = 0, device: str = "cpu",
                       dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """A loadable model folder (config.json, model.safetensors, tokenizer) of `shape` (a shipped config name, a
    config.json path or a dict), with `overrides` applied to the config (e.g. max_position_embeddings)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = {**(load_shape(shape) if isinstance(shape, str) else shape), **overrides}
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    config = parse_config(raw)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=1))
    save_file(random_weights(config, seed, device, dtype), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    write_synthetic_tokenizer(out_dir, config.vocab_size, config.bos_token_id, config.eos_token_ids,
                              config.max_position_embeddings)
    return out_dir
