"""What the engine hands the model runner for one step, as plain Python ints: no tensor exists yet.

The engine fills a `StepBatch` from its scheduler's output without torch; the model runner turns it into
the tensors of one forward pass on its own device (worker/model/input.py). The batch is flat and ragged (no
padding): T = tokens scheduled this step (all requests' new tokens concatenated, request after request),
B = requests in the step, S = rows that get a next token sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepBatch:
    input_ids: list[int] = field(default_factory=list)
    """[T]"""
    positions: list[int] = field(default_factory=list)
    """[T]: position of each token in its own request."""
    slot_mapping: list[int] = field(default_factory=list)
    """[T]: flat KV slot (block_id * block_size + offset) each new token's K/V is written to; -1 skips."""
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    """[B + 1]: cumulative new-token counts; request b's tokens are [qsl[b], qsl[b+1])."""
    seq_lens: list[int] = field(default_factory=list)
    """[B]: context length of each request after this step (cached tokens + new tokens)."""
    block_table_rows: list[list[int]] = field(default_factory=list)
    """[B] rows of block ids: the blocks each request's context spans, unpadded (the tensor pads them)."""
    logits_indices: list[int] = field(default_factory=list)
    """[S]: indices into T whose logits are computed (last token of each request that samples)."""
