"""Hand-built step batches for model tests, independent of the engine's own batch builder, turned into
tensors by the model side's `build_model_input`; plus the transformers reference the model is compared with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.model.settings import EngineSettings
from worker.model.input import ModelInput, build_model_input
from worker.model.step_batch import StepBatch

BLOCK = 4
ATOL, RTOL = 1e-4, 1e-5
"""float32: the tiny models' logits reach about 40 and two correct implementations differ by up to about 1e-4
there (relative 3e-6); a real mistake (wrong position, mask or weight) moves logits by far more than 1e-3."""


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def tiny_settings(**overrides) -> EngineSettings:
    values = dict(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=64, block_size=BLOCK,
                  max_model_len=512)
    return EngineSettings(**{**values, **overrides})


@dataclass
class Chunk:
    """One request's share of a step: new tokens after `num_computed` cached ones."""

    new_token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    sample: bool = True
    skip_write: list[int] = field(default_factory=list)
    """Indices into new_token_ids whose slot is -1 (not written)."""


def make_input(chunks: list[Chunk], block_size: int, all_logits: bool = False) -> ModelInput:
    batch = StepBatch()
    for chunk in chunks:
        start = len(batch.input_ids)
        for i, token in enumerate(chunk.new_token_ids):
            pos = chunk.num_computed + i
            batch.input_ids.append(token)
            batch.positions.append(pos)
            block = chunk.block_ids[pos // block_size]
            batch.slot_mapping.append(-1 if i in chunk.skip_write else block * block_size + pos % block_size)
        end = len(batch.input_ids)
        batch.query_start_loc.append(end)
        batch.seq_lens.append(chunk.num_computed + len(chunk.new_token_ids))
        batch.block_table_rows.append(list(chunk.block_ids))
        if all_logits:
            batch.logits_indices.extend(range(start, end))
        elif chunk.sample:
            batch.logits_indices.append(end - 1)
    return build_model_input(batch, "cpu")


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:  # [len(token_ids), V] float32
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def random_tokens(n: int, seed: int, vocab: int = 49152) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
