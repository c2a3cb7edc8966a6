"""The engine's internal request: what the scheduler and block pool track per request.

Neither the wire object (schemas/) nor the engine's input (`EngineRequest`, api.py): the transport turns a
decoded wire request into an EngineRequest, and the engine tokenizes that into this.
Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from worker.engine.api import SamplingParams


MAX_DRAFT_TOKENS = 16
"""The most speculative tokens one step verifies for a request (ENGINE_SPECULATIVE_NGRAM_TOKENS's limit)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    """EOS, a stop token id or a stop string."""
    FINISHED_LENGTH = "length"
    """max_new_tokens or max_model_len reached."""
    FINISHED_ABORTED = "abort"
    FINISHED_DEADLINE = "deadline"
    """Dropped while waiting because its deadline had passed."""

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "deadline")


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    """Lower is more urgent."""
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    prefix_leader: str | None = None
    """A request with the same prompt that this one waits for (api.EngineRequest.prefix_leader)."""
    cache_salt: bytes = b""
    """Parent key of its first block (block_pool.salt_key): requests share cached blocks only with the same."""
    fair_tag: float = 0.0
    """Waiting order within a priority before arrival time (api.EngineRequest.fair_tag)."""
    tenant: str = ""
    """api.EngineRequest.tenant: fair preemption happens only between tenants."""
    adapter: str | None = None
    """The LoRA adapter it runs with (None: the base model); the scheduler bounds the distinct adapters running."""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens of prompt + output whose K/V are in the cache."""
    num_inflight_tokens: int = 0
    """Tokens scheduled in a step whose results update() has not consumed yet: their K/V are being computed. 0
    between steps in the synchronous loop; with async scheduling, the step in flight while the next is
    scheduled (engine.py)."""
    num_pending_samples: int = 0
    """1 while a step in flight samples this request's next token (the token is not in output_token_ids yet)."""
    block_ids: list[int] = field(default_factory=list)
    """The block table: block_ids[i] holds positions [i*block_size, (i+1)*block_size). Its first
    num_freed_blocks entries are block_pool.FREED_BLOCK: no layer's window reaches them any more."""
    num_freed_blocks: int = 0
    """Leading block-table entries given back to the pool (a model whose every layer has a sliding window)."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at the first admission (resumes after preemption not counted)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Prefix-cache keys of this request's full blocks, chained over the tokens (block_pool.hash_block).

    Filled lazily by the block pool; tokens never change once appended, so the list only grows."""
    num_preemptions: int = 0
    seat_wait_step: int | None = None
    """The scheduler step at which it first found every seat taken (it may preempt for one a step later)."""
    adapter_waits: int = 0
    """Steps in which requests behind it went first because its adapter was not loaded (lora_resident_first_steps)."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative tokens (ngram.py) the next step verifies after the request's last token; the scheduler hands
    them to that step and clears them."""
    stop_reason: int | str | None = None
    """The EOS or stop token id, or the stop string, that finished the request (None for other endings)."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens whose K/V are computed or being computed."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_known_tokens(self) -> int:
        """num_tokens plus the token a step in flight is sampling."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_samples

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole prompt and output."""
        assert 0 <= start <= end <= self.num_tokens, (start, end, self.num_tokens)
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
