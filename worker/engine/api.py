"""The boundary between the transport (asyncio, Kafka) and the engine (its own thread, torch inside).

Only plain Python objects cross it, so the Kafka loop never touches a tensor. The transport builds an
`EngineRequest` from a decoded wire request; the engine answers with `RequestOutput`s from `step()`.
Prompt text and chat messages are tokenized on the engine side (it owns the tokenizer and its chat
template), which is also where "prompt too long" is decided.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


MIN_BUDGET_FRACTION = 0.25
"""Deadline-aware steps keep at least this share of max_num_batched_tokens (small steps cost throughput)."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for at each step (as OpenAI's API)."""


def fair_preempts(request, victim, running_tenants: Iterable[str]) -> bool:
    """Whether `request` may take the place of `victim`, running at its priority (engine requests or the
    scheduler's): another tenant's request with a larger fair tag (the request is owed service before it),
    whose tenant runs at least two more requests of the priority than the request's tenant
    (`running_tenants`: the tenant of each running request of the priority, counted only when the cheap
    checks pass: this runs whenever the seats are full). The second rule makes a swap one-way: after
    it the other tenant still runs no fewer, so it never preempts back, and tenants in step never trade
    places and their recompute; a tenant that holds every seat gives one up to a tenant holding none."""
    if request.tenant == victim.tenant or request.fair_tag >= victim.fair_tag:
        return False
    num_running = Counter(running_tenants)
    return num_running[request.tenant] + 1 < num_running[victim.tenant]


STRUCTURED_KINDS = ("json_schema", "regex", "grammar")


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A grammar the output must follow, token by token (the wire's `response_format`). The output ends (stop)
    as soon as the grammar is complete and admits nothing more."""

    kind: str
    """json_schema (a JSON object is {"type": "object"}), regex, or grammar (a Lark grammar, llguidance's
    dialect)."""
    spec: str
    """The JSON Schema as JSON text, the regular expression, or the grammar. Equal specs share one compiled
    grammar."""
    field: str = "response_format"
    """The request field the format comes from (response_format, or tools for a forced call): a refusal names
    it."""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Besides the model's EOS token ids; the stop token is not part of the output text."""
    stop: tuple[str, ...] = ()
    """Stop strings; generation ends before them and they are not emitted."""
    ignore_eos: bool = False
    min_tokens: int = 0
    """EOS and stop tokens cannot be generated before this many output tokens (stop strings still apply)."""
    presence_penalty: float = 0.0
    """In [-2, 2]: logit -= presence_penalty for every token already in the output."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: logit -= frequency_penalty * (times the token occurs in the output so far)."""
    repetition_penalty: float = 1.0
    """> 0; 1 means none. Tokens of the prompt or output: logit > 0 ? logit / p : logit * p."""
    logprobs: bool = False
    """Return each output token's log-probability (`TokenLogprobs`)."""
    top_logprobs: int = 0
    """With logprobs: also the most likely alternatives at each step, 0 to 20."""
    structured: StructuredOutput | None = None
    """Constrain the output to a grammar (structured output); None: free text."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """One generated token's log-probability under the model's distribution after penalties and min_tokens
    masking, before temperature, top-k and top-p; and the top alternatives (descending)."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    """Unique inside one engine; the transport uses "<wire id>#<attempt>@<partition>:<offset>"."""
    prompt: str | None = None
    messages: list[dict] | None = None
    """Chat messages [{"role": ..., "content": ...}] (with tool_calls or tool_call_id where the wire has them),
    rendered with the model's chat template (worker/tools/render.py)."""
    tools: list[dict] | None = None
    """The wire's tools, shown to the model with the messages; None: none shown."""
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    deadline: float | None = None
    """time.monotonic() seconds; a request still waiting past it is dropped with reason "deadline"."""
    arrival_time: float | None = None
    """time.monotonic() seconds; defaults to when the engine receives it."""
    resume_token_ids: list[int] | None = None
    """Output tokens an earlier run of this request already generated and delivered (its stream resumes on
    this worker): they are computed with the prompt, as after a recompute preemption, and generation goes on
    after them. No output repeats them; a request they already end (an EOS, a stop string, its length, a
    complete grammar) finishes at once."""
    prefix_leader: str | None = None
    """Another request with the same prompt (a sibling completion of n > 1): this one starts only once that
    one's prompt is computed, so its full blocks come from the prefix cache instead of being computed twice."""
    cache_salt: str | None = None
    """Prefix-cache namespace: blocks are shared only among requests with the same salt (None: the shared
    namespace). The transport makes it from the tenant and the request's cache_salt."""
    fair_tag: float = 0.0
    """Order among the waiting requests of one priority, before arrival time: the tenant's virtual token counter
    when the request entered the engine (fair share, transport/load/tenants.py); 0 for all when unused."""
    tenant: str = ""
    """Whose request it is: within a priority, a request may preempt another tenant's running one (fair_preempts),
    never its own tenant's."""
    model: str | None = None
    """The wire's `model`: a LoRA adapter's name (a folder under ENGINE_ADAPTERS_DIR), or None or the base
    model's name for the base model."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None
    """stop | length | abort | deadline | error (with error_code)."""
    error_code: str | None = None
    """prompt_too_long | invalid_request | poison_request | internal, when finish_reason is "error".
    poison_request: the engine fails whenever this request is in it (found by retrying it alone)."""
    error_message: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    """Aligned with new_token_ids when the request asked for logprobs; None otherwise."""
    replayed: bool = False
    """Set on an output with no tokens that says: this request starts over from its first token (the engine
    failed on a step it was in, and it was not the cause); the outputs that follow repeat what was sent."""


@dataclass(slots=True)
class EngineStats:
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    """Fraction of KV blocks referenced by requests (0..1)."""
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    num_batched_tokens: int = 0
    """Tokens computed (prompt and output) by every step so far."""
    busy_s: float = 0.0
    """Seconds spent in steps so far (forward and sampling): with num_steps and num_batched_tokens, what a
    reader turns into step sizes and tokens per busy second over any interval."""
    last_step_num_tokens: int = 0
    last_step_num_seqs: int = 0
    last_step_s: float = 0.0
    """How long the last step took (forward and sampling)."""
    step_time_base_s: float = 0.0
    """Online linear model of step time: base + per_token * num_batched_tokens."""
    step_time_per_token_s: float = 0.0
    max_model_len: int = 0
    """Prompt + max_new_tokens the engine accepts (0: unknown); longer requests end in prompt_too_long."""
    protected_priorities: int = 0
    """Priorities below this get deadline-aware step sizes (scheduler.py), so admission may count on them."""
    num_waiting_by_priority: tuple[int, ...] = ()
    """Requests in the scheduler's waiting queue (not started, or preempted), by priority 0, 1, ...; () where
    an engine does not count them."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters this worker can serve (the folders under ENGINE_ADAPTERS_DIR)."""
    loaded_adapters: tuple[str, ...] = ()
    """The adapters loaded now, least recently used first."""
    num_adapter_loads: int = 0
    """Adapter loads since the engine started (a reload after an eviction counts again)."""
    num_compiling: int = 0
    """Structured-output requests held outside the scheduler while their grammars compile (in num_waiting too):
    they hold no seat yet, and most hostile formats end there."""
    num_draft_tokens: int = 0
    """Speculative draft tokens verified since the engine started (ENGINE_SPECULATIVE_NGRAM_TOKENS)."""
    num_accepted_draft_tokens: int = 0
    """Of those, the ones kept: each saved a step of its request."""


class Engine(Protocol):
    """What the transport's engine thread drives: the real LLMEngine, or a model-free engine for benchmarks."""

    def add_request(self, request: EngineRequest) -> list[RequestOutput]:
        """Queue a request; returns an immediate final output when it is rejected (e.g. prompt too long)."""

    def abort(self, request_ids: list[str]) -> list[RequestOutput]: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def wake_time(self) -> float | None:
        """When step() next has something to do without new input (time.monotonic() seconds): now or earlier
        when it has work now; a later time when nothing can run until then (a batch window closing, a waiting
        request's deadline passing); None when nothing can run until a request arrives or input ends. The
        engine thread steps when this is due and otherwise sleeps until it or a new command, never polls."""

    def set_input_ended(self, ended: bool = True) -> None:
        """End of input: True when no more requests are expected for now (a trace is over, or the Kafka
        consumer has caught up with its partitions), so a static batch may start with fewer than
        max_batch_size members; False when requests flow again."""
