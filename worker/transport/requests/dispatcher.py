"""Into the engine: move requests from the local queue to the engine thread, most urgent first, while fewer
than `max_in_engine` are in it (or past that, while less urgent ones are in it: see `_has_room`); convert
each wire request to the engine's `EngineRequest` on the way; tell the engine when input has ended for now
(the consumer caught up), so a static batch may start partial.

The head of a queue goes to the lifecycle (lifecycle.py), which answers it instead when its cancel is known
or its deadline can no longer be met (handing it over would only spend compute on an answer nobody can use),
and otherwise moves it into the engine. A less urgent request is held back while admitting it
would slow a more urgent running one past its inter-token latency target (admission.py); the ones behind it
wait too, so priorities hold.
"""

from __future__ import annotations

import time

import msgspec

from schemas.request import (GenerationRequest, GrammarFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat,
                             ResponseFormat)
from schemas.tools import NamedToolChoice
from worker.engine.api import EngineRequest, EngineStats, SamplingParams, StructuredOutput
from worker.transport.load.admission import Admission
from worker.transport.requests.engine_client import EngineClient
from worker.transport.requests.lifecycle import Lifecycle
from worker.transport.requests.local_queue import QueuedRequest
from worker.transport.requests.streamer import Streamer
from worker.transport.load.tenant_book import cache_salt_of
from worker.tools.grammar import tool_call_grammar


SEED_STRIDE = 0x9E3779B97F4A7C15
"""Completion i of a seeded request samples with (seed + i * SEED_STRIDE) mod 2**63: completion 0 keeps the
request's seed (n = 1 samples as before), the others get seeds far from it and from each other."""


COMPILING_CAPS = 8
"""Requests waiting in the engine for their grammars to compile do not count against max_in_engine, up to this
many times it (1,024 at the default cap of 128): each costs its spec's memory and a place in the compile queue,
not a seat; hostile formats at volume (most end there, refused) then cannot crowd out requests that could run."""


def completion_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index * SEED_STRIDE) % 2**63


def structured_output(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """The engine's grammar for a wire response_format; None for free text. A schema becomes compact JSON text
    with its keys in their order (the order properties are generated in), the key of the engine's cache."""
    if isinstance(response_format, JsonSchemaFormat):
        return StructuredOutput("json_schema", msgspec.json.encode(response_format.json_schema.schema).decode())
    if isinstance(response_format, JsonObjectFormat):
        return StructuredOutput("json_schema", '{"type":"object"}')
    if isinstance(response_format, RegexFormat):
        return StructuredOutput("regex", response_format.regex)
    if isinstance(response_format, GrammarFormat):
        return StructuredOutput("grammar", response_format.grammar)
    return None


def tool_call_output(req: GenerationRequest) -> StructuredOutput | None:
    """The grammar of a forced tool call (tool_choice required or a named function); None otherwise."""
    if not req.forces_tool_call:
        return None
    tools = req.tools or []
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    functions = [(t.function.name, t.function.arguments_schema) for t in tools]
    # A named function is called once (OpenAI's meaning); `required` may call several when parallel.
    return StructuredOutput("grammar", tool_call_grammar(functions, parallel=req.parallel_tool_calls
                                                         and not isinstance(choice, NamedToolChoice)), "tools")


def engine_messages(req: GenerationRequest) -> list[dict] | None:
    """The chat messages as the engine renders them: role and content, with tool_calls or tool_call_id where
    set."""
    if req.messages is None:
        return None
    out = []
    for m in req.messages:
        message: dict = {"role": m.role, "content": m.content}
        if m.tool_calls is not None:
            message["tool_calls"] = msgspec.to_builtins(m.tool_calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def engine_tools(req: GenerationRequest) -> list[dict]:
    """The tools as the prompt shows them: name, description where given, and the arguments' schema (a
    function without parameters shows the empty object it is called with)."""
    out = []
    for tool in req.tools or ():
        function: dict = {"name": tool.function.name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        function["parameters"] = tool.function.arguments_schema
        out.append({"type": "function", "function": function})
    return out


def to_engine_requests(queued: QueuedRequest, fair_tag: float = 0.0) -> list[EngineRequest]:
    """The engine's view of a wire request, one engine request per completion (n or best_of of them): sampling,
    priority, and times on the engine's monotonic clock. Completions after the first wait in the engine for
    the first one's prompt (prefix_leader), so they take its blocks from the prefix cache: they share its
    cache namespace (the tenant's and cache_salt's)."""
    req = queued.request
    s = req.sampling
    num = req.num_completions
    # best_of > n ranks completions by cumulative logprob, so the engine must compute it.
    logprobs = s.logprobs or num > req.n
    now_mono, now_ms = time.monotonic(), time.time() * 1000.0
    deadline = None if queued.deadline_ms is None else now_mono + (queued.deadline_ms - now_ms) / 1000.0
    # When the client asked (the record's timestamp, bounded by the fetch time minus the allowed clock skew),
    # not when we fetched: a request that waited unread in Kafka keeps its place.
    arrival = now_mono - max(0.0, now_ms - queued.arrival_ms) / 1000.0
    messages = engine_messages(req)
    # tool_choice none: the model is not shown the tools (docs/wire-format.md, "Tool calling").
    tools = engine_tools(req) if req.effective_tool_choice != "none" else None
    structured = tool_call_output(req) or structured_output(req.response_format)
    cache_salt = cache_salt_of(queued.tenant, req.cache_salt)
    if queued.resume is not None:
        deadline = None  # it started on another worker: a deadline bounds the wait before the first step
    requests = []
    for index in range(num):
        resumed = queued.resumed(index)
        sampling = SamplingParams(
            max_new_tokens=req.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=completion_seed(s.seed, index),
            stop_token_ids=tuple(s.stop_token_ids) if s.stop_token_ids else (), stop=tuple(s.stop) if s.stop else (),
            ignore_eos=s.ignore_eos, min_tokens=s.min_tokens, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty, logprobs=logprobs,
            top_logprobs=s.top_logprobs, structured=structured,
        )
        requests.append(EngineRequest(
            request_id=queued.completion_engine_id(index),
            prompt=req.prompt,
            messages=messages,
            tools=tools,
            prompt_token_ids=list(req.prompt_token_ids) if req.prompt_token_ids is not None else None,
            sampling=sampling,
            priority=queued.priority,
            deadline=deadline,
            arrival_time=arrival,
            prefix_leader=queued.completion_engine_id(0) if index else None,
            cache_salt=cache_salt,
            fair_tag=fair_tag,
            tenant=queued.tenant,
            model=req.model,
            resume_token_ids=list(resumed.token_ids) if resumed is not None and resumed.token_ids else None,
        ))
    return requests


class Dispatcher:
    def __init__(self, lifecycle: Lifecycle, admission: Admission, max_in_engine: int) -> None:
        self.lifecycle = lifecycle
        self.queue = lifecycle.queue
        self.streamer: Streamer = lifecycle.streamer
        tenants = lifecycle.tenants
        self._may_start = None if tenants.quotas.action != "defer" else (
            lambda queued: tenants.may_dispatch(queued.tenant, queued.expected_tokens, time.monotonic()))
        self.engine: EngineClient = lifecycle.engine
        self.admission = admission
        self.max_in_engine = max_in_engine
        self.draining = False
        """Set at shutdown: nothing more enters the engine."""
        self._input_ended: bool | None = None

    def admit(self) -> None:
        if self.draining:
            return
        stats: EngineStats = self.engine.stats
        for priority in range(len(self.streamer.num_open_by_priority)):
            while (queued := self.queue.head(priority, self._may_start)) is not None and self._has_room(queued):
                if self.lifecycle.ended_before_engine(queued):
                    continue
                if not self.admission.may_enter_batch(priority, queued.num_prompt_tokens,
                                                      self.streamer.num_open_by_priority, stats):
                    return  # less urgent requests would slow the same urgent ones even more: hold them all
                self.lifecycle.enter(queued, lambda queued: to_engine_requests(queued, queued.fair_tag))

    def _has_room(self, queued: QueuedRequest) -> bool:
        """Below the cap, or past it while less urgent requests hold places in the engine, or requests of its
        own priority and another tenant running far more and owed less (api.fair_preempts): the engine's scheduler
        preempts them for this one, so a cap filled with less urgent work, or with a flood's, cannot make the
        request wait (the cap bounds what can still be shed or reordered here, not who may run)."""
        priority = queued.priority
        # Requests whose grammar still compiles hold no seat (up to COMPILING_CAPS caps' worth of them): a crowd
        # of formats that are slow to refuse must not keep requests that could run out of the engine.
        num_compiling = min(self.engine.stats.num_compiling, COMPILING_CAPS * self.max_in_engine)
        num_in_engine = len(self.streamer) - num_compiling
        if num_in_engine < self.max_in_engine:
            return True
        num_open = self.streamer.num_open_by_priority
        if sum(num_open[priority + 1:]) > 0 and sum(num_open[:priority + 1]) < self.max_in_engine:
            return True
        return num_in_engine < 2 * self.max_in_engine and self.lifecycle.fair_room(queued)

    def set_input_ended(self, ended: bool) -> None:
        """The consumer caught up (True) or has records to read again (False); passed on when it changes."""
        if ended != self._input_ended:
            self._input_ended = ended
            self.engine.set_input_ended(ended)
