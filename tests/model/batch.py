"""Hand-built `ModelInput`s for model tests, independent of the engine's own batch builder, plus the
transformers reference the model is compared with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.config import EngineSettings
from worker.model.input import AttentionMetadata, ModelInput

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
    input_ids, positions, slots, logits_indices, q_start_loc, seq_lens = [], [], [], [], [0], []
    for chunk in chunks:
        start = len(input_ids)
        for i, token in enumerate(chunk.new_token_ids):
            pos = chunk.num_computed + i
            input_ids.append(token)
            positions.append(pos)
            block = chunk.block_ids[pos // block_size]
            slots.append(-1 if i in chunk.skip_write else block * block_size + pos % block_size)
        end = len(input_ids)
        q_start_loc.append(end)
        seq_lens.append(chunk.num_computed + len(chunk.new_token_ids))
        if all_logits:
            logits_indices.extend(range(start, end))
        elif chunk.sample:
            logits_indices.append(end - 1)
    max_blocks = max(len(c.block_ids) for c in chunks)
    block_tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]
    q_lens = [len(c.new_token_ids) for c in chunks]
    return ModelInput(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        attn=AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(q_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(block_tables, dtype=torch.int32),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        ),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:  # [len(token_ids), V] float32
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def random_tokens(n: int, seed: int, vocab: int = 49152) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
