"""Config parsing and the architecture variants: each tiny random model, built and saved by transformers,
gives the same logits through our loader and forward; what we do not implement fails clearly."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.model.batch import BLOCK, Chunk, assert_logits_close, hf_logits, make_input, random_tokens, tiny_settings
from worker.model.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError, parse_config, rope_inv_freq
from worker.model.runner import ModelRunner
from worker.model.tiny import build_tiny_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# Features are combined so that each extra model (about a second to build and load) tests several.
VARIANTS = {
    "mha-untied-biases": ("LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=False,
                                                   attention_bias=True, mlp_bias=True)),
    "mqa-llama3-rope": ("LlamaForCausalLM", dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE)),
    "linear-rope": ("LlamaForCausalLM", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                             "factor": 4.0})),
    "qwen2": ("Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
}


@pytest.mark.slow  # each variant builds a model and runs transformers beside it: ~0.5-2 s apiece
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_logits_match_transformers(variant, smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[variant]
    path = build_tiny_model(tmp_path / variant, smollm2_path, arch, seed=3, num_hidden_layers=2, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(path, tiny_settings(num_kv_blocks=32))
    assert runner.config.architecture == arch
    if "untied" in variant:
        assert runner.model.lm_head is not runner.model.embed and runner.config.o_bias

    # Long enough (40 > original_max_position_embeddings 16) that llama3 scaling changes the result.
    prompt = random_tokens(40, seed=5)
    table = [3, 1, 4, 15, 9, 2, 6, 5, 8, 7, 10, 11]
    first = runner.execute(make_input([Chunk(prompt[:30], 0, table)], BLOCK, all_logits=True))
    rest = runner.execute(make_input([Chunk(prompt[30:], 30, table)], BLOCK, all_logits=True))
    assert_logits_close(torch.cat([first, rest]), hf_logits(hf_model, prompt))


def test_llama31_rope_frequencies_equal_transformers():
    # Llama 3.1's real parameters: some frequencies are kept, some divided by 8, some interpolated.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_parameters=rope,
                            max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    raw = hf_config.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    ours = rope_inv_freq(parse_config(raw))
    assert torch.equal(ours, ref)
    plain = rope_inv_freq(parse_config(raw | {"rope_parameters": {"rope_theta": 500000.0}}))
    ratio = plain / ours
    assert ratio[0] == 1.0 and ratio[-1] == 8.0 and ((ratio > 1.0) & (ratio < 8.0)).any()


def _raw_config(**changes) -> dict:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256}
    raw.update(changes)
    return raw


def test_legacy_rope_layout_and_defaults_parse():
    config = parse_config(_raw_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    assert config.rope_theta == 5e5 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.head_dim == 16 and not config.tie_word_embeddings and config.sliding_window is None


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "DeepseekV3ForCausalLM", "Gemma3ForConditionalGeneration", None])
def test_unsupported_architecture_names_the_supported_ones(arch):
    raw = _raw_config(architectures=[arch] if arch else [])
    with pytest.raises(UnsupportedModelError, match="supported: " + ", ".join(SUPPORTED_ARCHITECTURES)):
        parse_config(raw)


def test_every_supported_architecture_has_a_model_class_and_a_tiny_builder():
    from worker.model.models import MODEL_CLASSES
    from worker.model.tiny import CONFIG_CLASSES

    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES) == set(CONFIG_CLASSES)


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0],
                                                           "short_factor": [1.0]}}, "longrope"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"architectures": ["Gemma3ForCausalLM"], "text_config": {}}, "text-only"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
])
def test_unsupported_features_are_refused(changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_config(_raw_config(**changes))


def test_layer_windows_follow_each_family():
    mistral = parse_config(_raw_config(architectures=["MistralForCausalLM"], sliding_window=128))
    assert mistral.layer_windows == (128, 128) and mistral.sliding_window == 128
    mistral.check_max_model_len(256)  # windows are attended exactly: no cap below max_position_embeddings
    qwen = parse_config(_raw_config(architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False))
    assert qwen.sliding_window is None and qwen.layer_windows == (None, None) and qwen.qkv_bias and not qwen.o_bias
    qwen = parse_config(_raw_config(architectures=["Qwen3ForCausalLM"], sliding_window=64, use_sliding_window=True,
                                    max_window_layers=1, num_hidden_layers=3))
    assert qwen.layer_windows == (None, 64, 64) and qwen.qk_norm
    llama = parse_config(_raw_config(sliding_window=64))
    assert llama.layer_windows == (None, None)
    # Gemma's own defaults: Gemma2 alternates from the first layer; Gemma3 has five windowed layers per global one.
    gemma2 = parse_config(_raw_config(architectures=["Gemma2ForCausalLM"], sliding_window=32, num_hidden_layers=4))
    assert gemma2.layer_windows == (32, None, 32, None) and gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = parse_config(_raw_config(architectures=["Gemma3ForCausalLM"], sliding_window=32, num_hidden_layers=7,
                                      rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=256))
    assert gemma3.layer_windows == (32,) * 5 + (None, 32) and gemma3.local_rope_theta == 1e4
    assert gemma3.rope_theta == 1e6 and gemma3.attn_scale == 256**-0.5 and gemma3.tie_word_embeddings


def test_moe_layers_follow_qwen3_moe_sparse_step_and_dense_layers():
    raw = _raw_config(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=4, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])
    config = parse_config(raw)
    assert config.moe_layers == (False, True, False, False) and not config.norm_topk_prob
    mixtral = parse_config(_raw_config(architectures=["MixtralForCausalLM"], num_local_experts=8,
                                       num_experts_per_tok=2))
    assert mixtral.moe_layers == (True, True) and mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 128


def test_a_windowed_model_runs_triton_only_when_asked():
    from worker.model.runner import make_backend

    assert make_backend("triton", torch.device("cpu"), needs_windows=True).supports_windows
    assert make_backend("auto", torch.device("cuda"), needs_windows=True).name == "torch"


def test_missing_tensor_fails_loading(tiny_model_path, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(tiny_model_path, path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        ModelRunner(path, tiny_settings())


def test_tensor_of_the_wrong_shape_fails_loading_naming_it(tiny_model_path, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "reshaped"
    shutil.copytree(tiny_model_path, path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:64]  # one KV head where the config says two
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ": checkpoint shape"):
        ModelRunner(path, tiny_settings())


@pytest.mark.slow  # 4 s: transformers saves the shards
def test_a_sharded_checkpoint_loads_every_shard_as_one(tiny_model_path, tmp_path):
    """transformers' sharded save (an index and several files, q/k/v of a layer possibly in different files):
    the same weights as the single file."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "sharded"
    shutil.copytree(tiny_model_path, path)
    (path / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).save_pretrained(
        path, max_shard_size="1MB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) >= 3
    single = ModelRunner(tiny_model_path, tiny_settings()).model.state_dict()
    sharded = ModelRunner(path, tiny_settings()).model.state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)


def test_unknown_model_name_is_a_clear_error(tmp_path):
    from worker.paths import PathSettings
    from worker.model.pull import resolve_model

    with pytest.raises(FileNotFoundError, match="llm-worker model pull"):
        resolve_model("no-such-model", PathSettings(home=tmp_path))
