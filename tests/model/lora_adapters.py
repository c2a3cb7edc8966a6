"""LoRA adapters made by PEFT on a test model, with weights large enough to change its greedy output (PEFT starts
B at zero, which would leave the model as it is), and transformers + PEFT as the reference they are served against."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: Path, folder: Path, seed: int, rank: int = 8, targets: list[str] | None = None,
                 alpha: float = 16.0, use_rslora: bool = False, scale: float = 0.15) -> Path:
    """An adapter saved by PEFT into `folder` (its name is the adapter's): A and B drawn from N(0, scale^2)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL, lora_dropout=0.0,
                        use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(folder)
    return folder


def reference_model(base_path: Path, adapter: Path | None):
    """transformers' model of the base, with the adapter applied by PEFT (unmerged, as PEFT serves it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval()


def greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (no EOS stop) and each one's log-probability, one full forward per token."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(float(lp[token]))
    return tokens[len(prompt):], logprobs
