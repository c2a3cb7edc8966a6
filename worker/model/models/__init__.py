"""One module per model family over the shared layers (worker/model/layers.py, models/base.py); `MODEL_CLASSES`
says which class runs each supported architecture (config.SUPPORTED_ARCHITECTURES lists the same names)."""

from __future__ import annotations

from worker.model.models.gemma import GemmaModel
from worker.model.models.llama import LlamaModel
from worker.model.models.phi3 import Phi3Model

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
    "MixtralForCausalLM": LlamaModel,
    "Qwen3MoeForCausalLM": LlamaModel,
    "Phi3ForCausalLM": Phi3Model,
    "Gemma2ForCausalLM": GemmaModel,
    "Gemma3ForCausalLM": GemmaModel,
}
