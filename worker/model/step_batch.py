"""What the engine hands the model runner for one step, as plain Python ints: no tensor exists yet.

The engine fills a `StepRequests` (per request: id, block table, token counts; the step's input ids) from its
scheduler's output without torch; the model runner turns it into the tensors of one forward pass on its own
device, from buffers it keeps between steps (worker/model/input.py). `StepBatch` lays out every token
explicitly: the reference the runner's input is tested against, and what model tests build by hand. The batch
is flat and ragged (no padding): T = tokens scheduled this step (all requests' new tokens concatenated, request
after request), B = requests in the step, S = rows that get a next token sampled.
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
    """[S]: indices into T whose logits are computed (last token of each request that samples; with speculative
    tokens, the last 1 + drafts tokens of that request)."""


@dataclass(slots=True)
class StepRequests:
    """One step per request, for the runner's persistent input buffers (worker/model/input.py): B entries,
    request after request, plus the step's input ids. Per-token positions, slots and padded block tables are
    derived on the runner's side in vectorized form; a block table is copied only where it grew.

    `block_ids[b]` is the engine's own block-table list of request b, passed by reference and read only while
    the runner prepares this step. Between a request's release (finish or preemption: the engine calls the
    runner's `release`) and its next appearance, its list only grows, so the runner may keep what it copied.
    """

    request_ids: list[str] = field(default_factory=list)
    """[B]"""
    block_ids: list[list[int]] = field(default_factory=list)
    """[B] each request's whole block table (it may already hold blocks for later tokens)."""
    num_computed: list[int] = field(default_factory=list)
    """[B] tokens whose K/V were in the cache before this step."""
    num_new: list[int] = field(default_factory=list)
    """[B] tokens computed this step (>= 1)."""
    samples: list[bool] = field(default_factory=list)
    """[B] whether the step reaches the request's last token, so a next token is sampled from it."""
    input_ids: list[int] = field(default_factory=list)
    """[T] the new tokens, request after request."""
    num_freed: list[int] = field(default_factory=list)
    """[B] leading entries of each block table given back to the pool (block_pool.FREED_BLOCK, -1): they only
    grow until the request's release. Empty: none anywhere."""
    adapters: list[str | None] = field(default_factory=list)
    """[B] the LoRA adapter each request runs with (None: the base model); empty when none uses one."""
    num_logits: list[int] = field(default_factory=list)
    """[B] rows of logits per request, in its last num_logits tokens: 1 + its drafts for a request verifying
    speculative tokens, else 1 if it samples, 0 if not. Empty: `samples` says (no request has drafts)."""
    pending: list[tuple[int, str]] = field(default_factory=list)
    """(index into input_ids, request id) of each input that is the token a step still in flight samples for
    that request (async scheduling): input_ids holds 0 there until the engine writes the sampled token into the
    prepared arrays, before the step launches."""
