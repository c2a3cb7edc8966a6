"""What the scheduler hands the engine each step (`SchedulerOutput`) and what `update()` reports back."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_before, num_computed_before + num_new_tokens)."""

    request: Request
    num_new_tokens: int
    num_computed_before: int
    """Tokens whose K/V were already in the cache before this step (prefix-cache hits included)."""
    samples: bool
    """True when the step computes the request's last known token, so a next token is sampled from it."""
    request_id: str
    """request.request_id (a field, not a property: the engine reads it several times per request and step)."""
    draft_token_ids: list[int] | None = None
    """Speculative tokens verified in this step after the request's last token (the last of num_new_tokens);
    the step samples a token after each of its last 1 + len(draft_token_ids) inputs."""

    @property
    def seq_len(self) -> int:
        """Context length after this step: the attention span of the step's last token."""
        return self.num_computed_before + self.num_new_tokens

    @property
    def num_logits(self) -> int:
        """Rows of logits the step computes for this request."""
        return (1 + len(self.draft_token_ids)) if self.draft_token_ids else int(self.samples)

    def token_ids(self) -> list[int]:
        """Input ids of this step: all_token_ids[num_computed_before : seq_len], then its drafts."""
        if self.draft_token_ids:
            known = self.seq_len - len(self.draft_token_ids)
            return self.request.token_slice(self.num_computed_before, known) + self.draft_token_ids
        return self.request.token_slice(self.num_computed_before, self.seq_len)

    def positions(self) -> range:
        return range(self.num_computed_before, self.seq_len)

    def slot_mapping(self, block_size: int) -> list[int]:
        """Flat KV slot (block_id * block_size + offset) of each new token."""
        block_ids = self.request.block_ids
        return [block_ids[pos // block_size] * block_size + pos % block_size for pos in self.positions()]


@dataclass(slots=True)
class SchedulerOutput:
    block_size: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """In batch order: running requests first (admission order), then the ones admitted this step."""
    num_batched_tokens: int = 0
    """Sum of num_new_tokens over `scheduled`; never above max_num_batched_tokens."""
    preempted_request_ids: list[str] = field(default_factory=list)
    """Requests preempted by recompute this step: blocks freed, back in the waiting queue."""
    deadline_dropped: list[Request] = field(default_factory=list)
    """Waiting requests dropped this step because their deadline had passed (status FINISHED_DEADLINE)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    """A request that sampled a token in the step that update() consumed (several: drafts it accepted, and the
    token after them)."""

    request: Request
    new_token_ids: list[int]
    finish_status: RequestStatus | None = None
    """Set when this token finished the request. With FINISHED_STOPPED, request.stop_reason is the stop or EOS
    token id that ended it (the last of new_token_ids), which is not part of the output text."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.finish_status is not None
