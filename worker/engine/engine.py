"""`LLMEngine`: the scheduler, the model runner, the sampler and the detokenizer in one synchronous loop.

`step()` is schedule → run → sample → update → postprocess. It runs in its own thread
(worker/transport/requests/engine_thread.py) and speaks only the plain objects of worker/engine/api.py to the outside.
With async scheduling (ENGINE_ASYNC_SCHEDULING, on for GPUs and simulated devices) one step stays in flight
between calls: each call schedules and prepares the next step while the previous one's forward runs, samples
the previous step, launches the next, and applies and detokenizes the previous one's tokens while the next
runs.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, EngineStats, RequestOutput, SamplingParams, TokenLogprobs
from worker.engine.batch_builder import build_step_requests
from worker.engine.block_pool import salt_key
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.ngram import NgramDrafts, size_drafts
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import Scheduler
from worker.engine.scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput
from worker.engine.step_time import StepTimeModel
from worker.model.structured.compile import GrammarLimits
from worker.model.input import Launched, StepArrays
from worker.model.lora import AdapterError
from worker.model.step_batch import StepRequests
from worker.model.structured.manager import StructuredOutputManager
from worker.tools.render import render_chat, template_renders_tools
from worker.model.runner import ModelRunner, make_runner
from worker.model.sampler import RowSampling, Sampler
from worker.model.token_mask import TokenMask

log = logging.getLogger(__name__)


def grammar_limits(settings: EngineSettings) -> GrammarLimits:
    return GrammarLimits(
        max_size=settings.grammar_max_size, lexer_fuel=settings.grammar_lexer_fuel,
        step_lexer_fuel=settings.grammar_step_lexer_fuel, step_max_items=settings.grammar_step_max_items,
        max_lexer_states=settings.grammar_max_lexer_states, compile_timeout_s=settings.grammar_compile_timeout_s)


def async_scheduling(setting: str, runner) -> bool:
    """ENGINE_ASYNC_SCHEDULING: auto is on where the forward runs off the host (CUDA, a simulated device)."""
    if setting != "auto":
        return setting == "on"
    device = getattr(runner, "device", None)
    return getattr(runner, "simulated", False) or (device is not None and getattr(device, "type", "") == "cuda")


class InvalidRequest(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Live:
    """Per-request state the scheduler does not keep: how its rows are sampled (seed included) and its text."""

    detokenizer: IncrementalDetokenizer
    sampling: RowSampling
    constrained: bool = False
    """Structured output: its tokens follow a grammar (StructuredOutputManager keeps where it is in it)."""
    drafts: NgramDrafts | None = None
    """Its n-gram drafts, when it speculates (LLMEngine._speculates)."""


@dataclass(slots=True)
class _InFlight:
    """A launched step: what sampling and update() need once its logits are ready."""

    sched: SchedulerOutput
    launched: Launched
    sampling: list[ScheduledRequest]
    """The entries that sample, in the row order of the logits."""
    params: list[RowSampling]
    started: float
    """perf_counter() at its launch: the step's time runs from here to its tokens."""
    logprobs: dict | None = None
    drafting: bool = False
    """Some entry verifies drafts: its rows of the logits are its last 1 + drafts tokens'."""


@dataclass(slots=True)
class Completion:
    """A whole request's result, for `generate()` callers (tests, benchmarks)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    last: RequestOutput | None = None


class LLMEngine:
    def __init__(self, settings: EngineSettings | None = None, runner: ModelRunner | None = None) -> None:
        self.settings = settings or EngineSettings()
        self.runner = runner or make_runner(self.settings)
        self.runner.reset()  # a shared runner may still hold rows of another engine's unfinished requests
        self.tokenizer = self.runner.tokenizer
        model_path = getattr(self.runner, "model_path", None)
        self.base_model_names = tuple(dict.fromkeys(
            [self.settings.model, Path(self.settings.model).name] + ([model_path.name] if model_path else [])))
        """What a request's `model` may say for the base model: ENGINE_MODEL as set, and its folder's name."""
        self.native_tools = template_renders_tools(getattr(self.tokenizer, "chat_template", None))
        """The model's template shows tools in the convention the worker parses; else the generic format."""
        # Runners stood in by tests may not say; their models then keep every block.
        self.scheduler = Scheduler(self.settings, self.runner.num_blocks, self.runner.max_model_len,
                                   getattr(self.runner, "kv_window", None))
        loras = getattr(self.runner, "loras", None)
        if loras is not None:
            self.scheduler.loaded_adapters = loras.loaded  # a live view: the registry changes it in place
        self.sampler = Sampler()
        if str(getattr(self.runner, "device", "")) == "cpu":  # the draw runs in numpy there
            self.sampler.reserve(self.settings.max_num_seqs, self.runner.vocab_size)
        self.step_time = StepTimeModel()
        self.num_steps = 0
        self.num_batched_tokens = 0
        self.busy_s = 0.0
        self._last_step = (0, 0, 0.0)
        self._live: dict[str, _Live] = {}
        self.structured = StructuredOutputManager(
            self.tokenizer, self.runner.vocab_size, tuple(self.runner.eos_token_ids),
            grammar_limits(self.settings), self.settings.grammar_compile_threads,
            # The list's own method: the judges' threads must not keep the engine alive.
            busy=self.scheduler.running.__len__, max_rows=self.settings.max_num_seqs,
            cache_size=self.settings.grammar_cache_size)
        self.async_scheduling = async_scheduling(self.settings.async_scheduling, self.runner)
        # Drafts are proposed from the tokens of the step just applied, which async scheduling has not applied yet
        # when it schedules the next step.
        self.num_draft_tokens = 0 if self.async_scheduling else self.settings.speculative_ngram_tokens
        """Speculative tokens proposed per step and request (0: no speculation)."""
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self._inflight: _InFlight | None = None
        """With async scheduling: the step launched by the last step() call, whose tokens the next one applies."""
        log.info("engine: policy=%s max_num_batched_tokens=%d max_num_seqs=%d block_size=%d prefix_caching=%s "
                 "async_scheduling=%s", self.settings.policy, self.settings.max_num_batched_tokens,
                 self.settings.max_num_seqs, self.settings.block_size, self.settings.enable_prefix_caching,
                 self.async_scheduling)

    # ---- requests in and out ------------------------------------------------------------------------

    def tokenize(self, request: EngineRequest) -> list[int]:
        given = [x is not None for x in (request.prompt, request.messages, request.prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequest("invalid_request", "exactly one of prompt, messages, prompt_token_ids is required")
        if request.prompt_token_ids is not None:
            token_ids = list(request.prompt_token_ids)
            if any(not 0 <= t < self.runner.vocab_size for t in token_ids):
                raise InvalidRequest("invalid_request", f"token ids must lie in [0, {self.runner.vocab_size})")
        elif request.messages is not None:
            messages, tools = render_chat(request.messages, request.tools, self.native_tools)
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
            token_ids = self.tokenizer(text, add_special_tokens=False).input_ids
        else:
            token_ids = self.tokenizer(request.prompt).input_ids
        if not token_ids:
            raise InvalidRequest("invalid_request", "the prompt is empty")
        limit = self.scheduler.max_model_len
        if len(token_ids) + request.sampling.max_new_tokens > limit:
            raise InvalidRequest(
                "prompt_too_long",
                f"prompt of {len(token_ids)} tokens + max_new_tokens {request.sampling.max_new_tokens} "
                f"exceeds the {limit} tokens this worker allows",
            )
        return token_ids

    def add_request(self, request: EngineRequest) -> list[RequestOutput]:
        now = time.monotonic()
        arrival = request.arrival_time if request.arrival_time is not None else now
        try:
            adapter = self._adapter_of(request.model)
            token_ids = self.tokenize(request)
        except InvalidRequest as exc:
            return [RequestOutput(request.request_id, [], "", True, "error", exc.code, str(exc), arrival_time=arrival,
                                  finish_time=now)]
        sampling = request.sampling
        req = Request(
            request_id=request.request_id,
            prompt_token_ids=token_ids,
            sampling=sampling,
            priority=request.priority,
            arrival_time=arrival,
            deadline=request.deadline,
            eos_token_ids=() if sampling.ignore_eos else tuple(self.runner.eos_token_ids),
            prefix_leader=request.prefix_leader,
            cache_salt=salt_key(request.cache_salt, None if adapter is None else self.runner.loras.key(adapter)),
            fair_tag=request.fair_tag,
            tenant=request.tenant,
            adapter=adapter,
        )
        live = _Live(
            IncrementalDetokenizer(self.tokenizer, token_ids, stop=sampling.stop),
            self._row_sampling(req.request_id, sampling, req.eos_token_ids),
        )
        if request.resume_token_ids:
            req.output_token_ids = list(request.resume_token_ids)
            # The text of these tokens went out already: the detokenizer takes them in silently, so that what it
            # emits next continues that text (and a stop string may span the two).
            shown = req.output_token_ids
            if self._ends_on_stop_token(req):
                shown = shown[:-1]  # never part of the text
            if shown:
                live.detokenizer.push(shown)
        if self._speculates(req, live):
            live.drafts = NgramDrafts(token_ids + req.output_token_ids)
        if sampling.structured is None:
            if req.output_token_ids and (done := self._resumed_finished(req, live)) is not None:
                return [done]
            self.scheduler.add_request(req)
            self._live[req.request_id] = live
            return []
        # Compiled on the grammar thread; step() adds the request to the scheduler once its grammar is ready.
        ready = self.structured.add(req.request_id, sampling.structured.kind, sampling.structured.spec, (req, live),
                                    now)
        return [] if ready is None else self._start_constrained(*ready.payload, ready.error)

    def _speculates(self, req: Request, live: _Live) -> bool:
        """Whether a request gets n-gram drafts: no penalties, min_tokens or logprobs (they read each token's
        distribution as the tokens before it left it). Greedy or sampled, its drafts are kept while they are the
        tokens drawn at their places (_sample_drafting); under a grammar, only those it admits are proposed,
        and each row is drawn under the grammar's mask where its drafts lead (_grammar_mask)."""
        return bool(self.num_draft_tokens) and live.sampling.plain

    def _adapter_of(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model). An adapter is loaded here on first use
        where a slot is free, so that one which cannot be served is refused before it queues; with every slot
        taken it loads when the request is scheduled (evicting then, not now: an eviction at arrival would throw
        out an adapter that requests queued ahead of this one still need)."""
        if model is None or model in self.base_model_names:
            return None
        loras = getattr(self.runner, "loras", None)
        if loras is None:
            raise InvalidRequest("invalid_request", f"unknown model {model!r}: this worker serves "
                                 f"{self.base_model_names[0]!r} and no LoRA adapters (ENGINE_ADAPTERS_DIR)")
        try:
            loras.get(model, self._adapters_running(), evict=False)
        except AdapterError as exc:
            raise InvalidRequest("invalid_request", str(exc)) from None
        return model

    def _adapters_running(self) -> set[str]:
        return {r.adapter for r in self.scheduler.running if r.adapter is not None}

    def _load_adapters(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        """Every adapter of the step loaded (evicting ones no running request uses: the scheduler keeps the
        running requests' adapters within max_loras). One whose files changed into something that cannot be
        served ends its requests with invalid_request, and they leave the step."""
        names = {entry.request.adapter for entry in sched.scheduled if entry.request.adapter is not None}
        if not names:
            return
        # Each adapter's rows side by side: the runner's LoRA products then run over slices of the step's rows,
        # with no gather and scatter per adapter (the logits follow this order, and nothing else reads it).
        sched.scheduled.sort(key=lambda entry: entry.request.adapter or "")
        running = self._adapters_running()
        wanted: set[str] | None = None
        for name in names:
            if wanted is None and name not in self.runner.loras.loaded:
                wanted = {r.adapter for r in self.scheduler.waiting if r.adapter is not None}
            try:
                self.runner.loras.get(name, running, wanted or ())
            except (AdapterError, RuntimeError) as exc:
                gone = [e for e in sched.scheduled if e.request.adapter == name]
                sched.scheduled = [e for e in sched.scheduled if e.request.adapter != name]
                sched.num_batched_tokens -= sum(e.num_new_tokens for e in gone)
                for request in self.scheduler.finish_requests([e.request_id for e in gone],
                                                              RequestStatus.FINISHED_ABORTED):
                    out = self._final(request)
                    out.finish_reason, out.error_code, out.error_message = "error", "invalid_request", str(exc)
                    outputs.append(out)

    def _start_constrained(self, req: Request, live: _Live, error: str | None) -> list[RequestOutput]:
        if error is not None:  # the format cannot be kept: the request ends before it runs
            return [RequestOutput(req.request_id, [], "", True, "error", "invalid_request",
                                  f"{req.sampling.structured.field}: {error}", arrival_time=req.arrival_time,
                                  finish_time=time.monotonic())]
        live.constrained = True
        self._live[req.request_id] = live
        if req.output_token_ids:  # resumed: the grammar goes where the tokens already delivered took it
            ended = False
            tokens = req.output_token_ids
            if self._ends_on_stop_token(req) and tokens[-1] in req.sampling.stop_token_ids:
                tokens = tokens[:-1]  # a stop token is outside the format; an EOS is the grammar's own end
            for token_id in tokens:
                ended, error = self.structured.advance(req.request_id, token_id)
                if error is not None:
                    return [self._format_error(req, error)]
            done = self._resumed_finished(req, live, grammar_complete=ended)
            if done is not None:
                return [done]
        self.scheduler.add_request(req)
        return []

    def _ends_on_stop_token(self, req: Request) -> bool:
        last = req.output_token_ids[-1] if req.output_token_ids else None
        return last is not None and len(req.output_token_ids) >= req.sampling.min_tokens and (
            last in req.sampling.stop_token_ids or last in req.eos_token_ids)

    def _resumed_finished(self, req: Request, live: _Live, grammar_complete: bool = False) -> RequestOutput | None:
        """The final of a resumed request whose delivered tokens already end it (its earlier run ended it but
        its final never became visible), as that run's last step would have ended it; None when it goes on."""
        num = len(req.output_token_ids)
        if self._ends_on_stop_token(req):
            req.stop_reason = req.output_token_ids[-1]
            status = RequestStatus.FINISHED_STOPPED
        elif live.detokenizer.stopped or grammar_complete:
            req.stop_reason = live.detokenizer.stop_string
            status = RequestStatus.FINISHED_STOPPED
        elif num >= req.sampling.max_new_tokens or req.num_prompt_tokens + num >= self.scheduler.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        else:
            return None
        req.status, req.finish_time = status, time.monotonic()
        self._live[req.request_id] = live
        return self._final(req)

    def _start_compiled(self) -> list[RequestOutput]:
        outputs = []
        for ready in self.structured.take_ready(time.monotonic()):
            outputs += self._start_constrained(*ready.payload, ready.error)
        return outputs

    def _row_sampling(self, request_id: str, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> RowSampling:
        """Every sampled row gets a seed (the request's own, else ENGINE_SEED XOR crc32(request id)), so a
        request's tokens are reproducible, also on a replay."""
        seed = None
        if not (params.temperature <= 0.0 or params.top_k == 1):  # RowSampling.greedy
            seed = params.seed if params.seed is not None else self.settings.seed ^ zlib.crc32(request_id.encode())
        return RowSampling(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, min_tokens=params.min_tokens,
            min_tokens_stop_ids=(eos_token_ids + params.stop_token_ids) if params.min_tokens else (),
            logprobs=params.logprobs, top_logprobs=params.top_logprobs if params.logprobs else 0,
        )

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = [self._final(request) for request in self.scheduler.abort(request_ids)]
        for request, _ in self.structured.abort(request_ids):
            request.status, request.finish_time = RequestStatus.FINISHED_ABORTED, time.monotonic()
            outputs.append(self._final(request))
        return outputs

    def set_input_ended(self, ended: bool = True) -> None:
        self.scheduler.set_input_ended(ended)

    def close(self) -> None:
        """Stops what the engine runs beside its own thread: the grammar compiler's judge processes (about 100 MB
        each), which would otherwise live until the process exits. A later constrained request starts them again."""
        self.structured.close()

    def prepare_thread(self) -> None:
        """What the thread that will step this engine builds for itself before its first step (the runner's
        per-thread kernel caches)."""
        prepare = getattr(self.runner, "prepare_thread", None)
        if prepare is not None:
            seconds = prepare()
            if seconds:
                log.info("matmul kernels built again for the stepping thread in %.2f s", seconds)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.structured.num_held > 0 or self._inflight is not None

    def wake_time(self) -> float | None:
        now = time.monotonic()
        if self._inflight is not None:
            return now  # a launched step's tokens wait to be applied
        wake = self.scheduler.wake_time(now)
        grammar_wake = self.structured.wake_time(now)
        if grammar_wake is not None:
            return grammar_wake if wake is None else min(wake, grammar_wake)
        return wake

    # ---- one step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule, run the forward, sample, update, turn the new tokens into outputs. With async
        scheduling the outputs returned are those of the step launched by the previous call (see _step_async)."""
        if self.async_scheduling:
            return self._step_async()
        outputs = self._start_compiled() if self.structured.num_held else []
        sched = self._schedule(outputs)
        if sched.is_empty:
            return outputs
        step = build_step_requests(sched)
        flight = self._launch(sched, step, self.runner.prepare_arrays(step))
        updates = self.scheduler.update(sched, self._sample(flight, outputs), time.monotonic())
        outputs += self._postprocess_step(flight, updates)
        if self.num_draft_tokens:
            self._propose()
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """While step N's forward is in flight: schedule step N+1 and prepare its input arrays, its decode rows
        waiting for the tokens step N samples. Then wait for step N and sample it (the only host work the device
        waits for), write those tokens into step N+1's input and launch it; while it runs, apply step N's tokens
        to the scheduler and turn them into outputs. A request that step N finished computes one more token in
        step N+1, which update() then skips (as in vLLM). Tokens, seeds and stop decisions are those of the
        synchronous loop; outputs come one step later."""
        outputs = self._start_compiled() if self.structured.num_held else []
        sched = self._schedule(outputs)
        step = build_step_requests(sched) if sched.scheduled else None
        arrays = self.runner.prepare_arrays(step) if step is not None else None
        previous, self._inflight = self._inflight, None
        sampled = self._sample(previous, outputs) if previous is not None else {}
        if step is not None:
            for index, request_id in step.pending:
                arrays.input_ids[index] = sampled[request_id]
            self._inflight = self._launch(sched, step, arrays)
        if previous is not None:
            updates = self.scheduler.update(previous.sched, sampled, time.monotonic())
            outputs += self._postprocess_step(previous, updates)
        return outputs

    def _schedule(self, outputs: list[RequestOutput]) -> SchedulerOutput:
        sched = self.scheduler.schedule(time.monotonic(), self.step_time.coefficients())
        outputs += [self._final(request) for request in sched.deadline_dropped]
        if sched.preempted_request_ids:
            self.runner.release(sched.preempted_request_ids)  # they come back with new block tables
        if getattr(self.runner, "loras", None) is not None:
            self._load_adapters(sched, outputs)
        return sched

    def _launch(self, sched: SchedulerOutput, step: StepRequests, arrays: StepArrays) -> _InFlight:
        start = time.perf_counter()
        launched = self.runner.launch(self.runner.input_from(step, arrays))
        sampling = [entry for entry in sched.scheduled if entry.samples]  # row order of the logits
        return _InFlight(sched, launched, sampling, [self._live[entry.request_id].sampling for entry in sampling],
                         start, drafting=bool(step.num_logits))

    def _sample(self, flight: _InFlight, outputs: list[RequestOutput]) -> dict[str, int]:
        """Wait for the step's logits and draw its rows: request id -> token id (for a request that verified
        drafts, the list of the drafts kept and the token after them)."""
        if flight.drafting:
            return self._sample_drafting(flight, outputs)
        return self._sample_rows(flight, flight.sampling, flight.params, flight.launched.logits, outputs)

    def _sample_drafting(self, flight: _InFlight, outputs: list[RequestOutput]) -> dict:
        """A step with drafts: every row is drawn as one step at a time would draw it, a drafting request's rows
        at the counters of the tokens they stand for (greedy rows take the argmax, sampled ones the same seeded
        draw). A drafting request keeps its drafts while each equals the token drawn at its place, and takes the
        drawn token at the first that does not (or after the last). A draft is then kept with the probability
        the request's distribution gives it, and a refused place gets a token from that distribution without the
        draft: speculative sampling with a one-hot proposal, coupled to the plain draw, so the tokens are those of
        decoding without drafts, greedy or seeded."""
        rows: list[ScheduledRequest] = []
        params: list[RowSampling] = []
        counters: list[int] = []
        constrained = self.structured.has_constrained()
        after: list[list[int]] | None = [] if constrained else None
        """Per row, the drafts its token is drawn after: a grammar's mask there is the state they lead to."""
        for entry, row_sampling in zip(flight.sampling, flight.params):
            num = entry.num_logits
            rows += [entry] * num
            params += [row_sampling] * num
            first = len(entry.request.output_token_ids)
            counters += range(first, first + num)
            if after is not None:
                drafts = entry.draft_token_ids or []
                after += [drafts[:j] for j in range(num)]
        capped: dict[str, int] = {}
        drawn = self._sample_rows(flight, rows, params, flight.launched.logits, outputs, counters, dict_of=False,
                                  drafts=after, capped=capped)
        sampled: dict = {}
        row = 0
        for entry in flight.sampling:
            drafts = entry.draft_token_ids
            if not drafts:
                sampled[entry.request_id] = drawn[row]
                row += 1
                continue
            tokens = drawn[row:row + entry.num_logits]
            row += entry.num_logits
            kept, most = 0, capped.get(entry.request_id, len(drafts))
            while kept < most and drafts[kept] == tokens[kept]:
                kept += 1
            sampled[entry.request_id] = drafts[:kept] + [tokens[kept]]
            self.num_proposed_tokens += len(drafts)
            self.num_accepted_tokens += kept
            self._live[entry.request_id].drafts.verified(kept, len(drafts))
        return sampled

    def _sample_rows(self, flight: _InFlight, sampling: list[ScheduledRequest], params: list[RowSampling],
                     logits, outputs: list[RequestOutput], counters: list[int] | None = None,
                     dict_of: bool = True, drafts: list[list[int]] | None = None,
                     capped: dict[str, int] | None = None) -> dict[str, int] | list[int]:
        """The tokens drawn from each row of the logits (`sampling` and `params` row by row): request id -> token,
        or the list of tokens in row order (dict_of False); `drafts` and `capped` as _grammar_mask's."""
        sampling_ids = [entry.request_id for entry in sampling]
        # Everything that does not need the logits comes before waiting for them: on a GPU (and with async
        # scheduling) the forward is still running meanwhile.
        mask = self._grammar_mask(sampling_ids, outputs, drafts, capped) if self.structured.has_constrained() \
            else None
        # The draw's counter is the index of the token being generated: stable across preemption and replay.
        if counters is None:
            counters = [len(entry.request.output_token_ids) for entry in sampling]
        # The draw goes in behind the forward, as a GPU queues it on its stream (worker/model/input.py, Launched).
        sampled = self.sampler.sample_step(
            logits, params, counters,  # [S, V]
            # Asked only for the rows with penalties.
            lambda row: (sampling[row].request.prompt_token_ids, sampling[row].request.output_token_ids),
            mask,
        )
        flight.launched.wait()
        if sampled.logprobs:
            flight.logprobs = {sampling_ids[row]: lp for row, lp in sampled.logprobs.items()}
        sched = flight.sched
        seconds = time.perf_counter() - flight.started
        self.step_time.observe(sched.num_batched_tokens, seconds)
        self.num_steps += 1
        self.num_batched_tokens += sched.num_batched_tokens
        self.busy_s += seconds
        self._last_step = (sched.num_batched_tokens, len(sched.scheduled), seconds)
        return dict(zip(sampling_ids, sampled.token_ids)) if dict_of else sampled.token_ids

    def _postprocess_step(self, flight: _InFlight, updates: list[RequestUpdate]) -> list[RequestOutput]:
        outputs = []
        live_of, output = self._live, self._output
        for update in updates:
            # The common case inlined (a running request's next token, no grammar): it runs for every running
            # request at every step. _postprocess has the rest.
            live = live_of[update.request.request_id] if update.finish_status is None else None
            if len(update.new_token_ids) > 1:
                outputs.append(self._postprocess_verified(update))
                continue
            if live is None or live.constrained:
                outputs.append(self._postprocess(update))
                continue
            detokenizer = live.detokenizer
            text = detokenizer.push(update.new_token_ids)
            if detokenizer.stopped:
                outputs.append(self._postprocess_stopped(update.request, update.new_token_ids, text))
            else:
                outputs.append(output(update.request, update.new_token_ids, text))
        if flight.logprobs:
            for out in outputs:
                lp = flight.logprobs.get(out.request_id)
                if lp is not None and out.new_token_ids:
                    out.new_logprobs = [TokenLogprobs(out.new_token_ids[-1], *lp)]
        return outputs

    def _postprocess_verified(self, update: RequestUpdate) -> RequestOutput:
        """The tokens of a step that kept drafts, one at a time as steps of their own would have given them, so
        that a stop string ends the request at the token that completes it (the tokens after it are dropped, as
        they would never have been generated); one output for them all."""
        request = update.request
        token_ids = update.new_token_ids
        output_ids = request.output_token_ids
        num_before = len(output_ids) - len(token_ids)
        del output_ids[num_before:]
        merged: RequestOutput | None = None
        for i, token_id in enumerate(token_ids):
            output_ids.append(token_id)
            last = i == len(token_ids) - 1
            out = self._postprocess(RequestUpdate(request, [token_id], update.finish_status if last else None))
            if merged is not None:
                out.new_token_ids = merged.new_token_ids + out.new_token_ids
                out.text_delta = merged.text_delta + out.text_delta
            merged = out
            if out.finished:
                break
        return merged

    def _propose(self) -> None:
        """Drafts for the next step of each running request that speculates, while the batch is small enough
        for a step's extra rows to cost little (ENGINE_SPECULATIVE_MAX_BATCH), as many of them as pay for their
        rows under the step-time model (ENGINE_SPECULATIVE_ADAPTIVE, ngram.size_drafts)."""
        running = self.scheduler.running
        if len(running) > self.settings.speculative_max_batch:
            return
        settings = self.settings
        drafting: list[Request] = []
        proposed: list[list[int]] = []
        continuations: list[float] = []
        num_rows = 0
        for request in running:
            num_rows += max(1, request.num_tokens - request.num_computed_tokens)
            live = self._live.get(request.request_id)
            drafts = live.drafts if live is not None else None
            if drafts is None or request.num_computed_tokens != request.num_tokens - 1:
                continue  # no speculation, or still prefilling
            known = len(drafts.tokens)
            if known < request.num_tokens:
                drafts.extend(request.output_token_ids[known - request.num_tokens:])
            elif known > request.num_tokens:
                drafts.truncate(request.num_tokens)
            room = request.sampling.max_new_tokens - len(request.output_token_ids) - 1
            tokens = drafts.propose(min(self.num_draft_tokens, room), settings.speculative_ngram_min,
                                    settings.speculative_ngram_max)
            if tokens and live.constrained:
                tokens = self.structured.admitted_drafts(request.request_id, tokens)
            request.draft_token_ids = tokens
            if tokens:
                drafting.append(request)
                proposed.append(tokens)
                continuations.append(drafts.continuation())
        if not drafting or not settings.speculative_adaptive:
            return
        base, per_row = self.step_time.coefficients()
        num_rows = min(num_rows, self.scheduler.max_num_batched_tokens)
        for request, tokens, count in zip(drafting, proposed, size_drafts(
                proposed, continuations, num_rows, float(len(running)), base, per_row)):
            request.draft_token_ids = tokens[:count]

    def _grammar_mask(self, sampling_ids: list[str], outputs: list[RequestOutput],
                      drafts: list[list[int]] | None = None, capped: dict[str, int] | None = None
                      ) -> TokenMask | None:
        """The bitmasks of this step's constrained rows (`drafts`: what each row's token is drawn after, in a
        step that verifies drafts). A request whose grammar cannot go on (an error state, no token allowed) ends
        here with invalid_request; its row is left unmasked and the token drawn for it dropped (update() skips
        finished requests). Where that happens only after some of its drafts, it keeps fewer drafts than that
        (`capped`: request id -> most drafts kept), so the token it takes is drawn where its grammar goes on; its
        next step meets the same state, and ends it then if the drafts were its tokens."""
        rows, bitmask, failed = self.structured.grammar_bitmask(sampling_ids, drafts)
        ended: set[str] = set()
        for row, why in failed:
            request_id = sampling_ids[row]
            if drafts and drafts[row]:
                capped[request_id] = min(capped.get(request_id, len(drafts[row])), len(drafts[row]) - 1)
            elif request_id not in ended:
                ended.add(request_id)
                outputs.append(self._format_error(self.scheduler.requests[request_id], why))
        return TokenMask(rows, bitmask) if rows else None

    def _format_error(self, request: Request, why: str) -> RequestOutput:
        """The final of a constrained request whose output cannot keep its format; what was streamed stays."""
        if not request.status.finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
        out = self._final(request)
        out.finish_reason, out.error_code = "error", "invalid_request"
        out.error_message = f"{request.sampling.structured.field}: {why}"
        return out

    def _postprocess(self, update: RequestUpdate) -> RequestOutput:
        request = update.request
        live = self._live[request.request_id]
        detokenizer = live.detokenizer
        token_ids = update.new_token_ids
        status = update.finish_status
        if status is None:  # the common case, kept short: it runs for every running request at every step
            ended = False
            if live.constrained:
                # A grammar that is complete ends the request (stop), its last token shown.
                ended, error = self.structured.advance(request.request_id, token_ids[-1])
                if error is not None:
                    return self._format_error(request, error)
            text = detokenizer.push(token_ids)
            if not (detokenizer.stopped or ended):
                return self._output(request, token_ids, text)
            if live.constrained and detokenizer.stopped:
                error = self.structured.check_stop_string(request.request_id, detokenizer.text)
                if error is not None:
                    return self._format_error(request, error)
            return self._postprocess_stopped(request, token_ids, text)
        if live.constrained:
            stop_token_ids = request.sampling.stop_token_ids if status is RequestStatus.FINISHED_STOPPED else ()
            error = self.structured.check_end(request.request_id, token_ids, stop_token_ids)
            if error is not None:
                return self._format_error(request, error)
        # The EOS or stop token that ended it is counted, never shown.
        text_ids = token_ids[:-1] if status is RequestStatus.FINISHED_STOPPED else token_ids
        return self._final(request, token_ids, detokenizer.push(text_ids) if text_ids else "")

    def _postprocess_stopped(self, request: Request, token_ids: list[int], text: str) -> RequestOutput:
        """A stop string (or a complete grammar) ended the request at this token."""
        request.stop_reason = self._live[request.request_id].detokenizer.stop_string
        if request.status.finished:  # drafts kept past the stop: the scheduler ended it on a later token
            request.status = RequestStatus.FINISHED_STOPPED
        self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        return self._final(request, token_ids, text)

    def _output(self, request: Request, token_ids: list[int], text: str) -> RequestOutput:
        # Positional (in RequestOutput's field order): it runs for every running request at every step.
        return RequestOutput(
            request.request_id, token_ids, text, False, None, None, None,  # finished .. error_message
            len(request.prompt_token_ids), len(request.output_token_ids), request.num_cached_tokens,
            request.arrival_time, request.first_scheduled_time, request.first_token_time,
        )

    def _final(self, request: Request, token_ids: list[int] | None = None, text: str = "") -> RequestOutput:
        # Every way a request ends passes here (stop, length, abort, deadline), so its runner row is freed here.
        self.runner.release([request.request_id])
        live = self._live.pop(request.request_id, None)
        if live is not None and live.constrained:
            self.structured.finish(request.request_id)
        if live is not None and request.status is not RequestStatus.FINISHED_ABORTED:
            text += live.detokenizer.flush()
        out = self._output(request, token_ids or [], text)
        out.finished = True
        out.finish_reason = request.status.value
        out.finish_time = request.finish_time if request.finish_time is not None else time.monotonic()
        return out

    # ---- what the transport and the benchmarks read -------------------------------------------------

    def stats(self) -> EngineStats:
        base, per_token = self.step_time.coefficients()
        pool = self.scheduler.pool
        return EngineStats(
            num_waiting=self.scheduler.num_waiting + self.structured.num_held,
            num_running=self.scheduler.num_running,
            kv_usage=self.scheduler.kv_usage,
            prefix_cache_hit_rate=pool.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_batched_tokens=self.num_batched_tokens,
            busy_s=self.busy_s,
            last_step_num_tokens=self._last_step[0],
            last_step_num_seqs=self._last_step[1],
            last_step_s=self._last_step[2],
            step_time_base_s=base,
            step_time_per_token_s=per_token,
            max_model_len=self.scheduler.max_model_len,
            protected_priorities=self.scheduler.protected_priorities,
            num_waiting_by_priority=self.scheduler.num_waiting_by_priority(),
            num_compiling=self.structured.num_held,
            num_draft_tokens=self.num_proposed_tokens,
            num_accepted_draft_tokens=self.num_accepted_tokens,
            **self._adapter_stats(),
        )

    def _adapter_stats(self) -> dict:
        loras = getattr(self.runner, "loras", None)
        if loras is None:
            return {}
        return {"adapters": tuple(loras.available()), "loaded_adapters": tuple(loras.loaded),
                "num_adapter_loads": loras.num_loads}

    def generate(self, requests: list[EngineRequest]) -> dict[str, Completion]:
        """Run requests to completion (all known up front) and gather each one's tokens and text."""
        completions = {r.request_id: Completion(r.request_id) for r in requests}
        pending = []
        for request in requests:
            pending += self.add_request(request)
        self.set_input_ended()
        while True:
            for out in pending:
                done = completions[out.request_id]
                done.token_ids += out.new_token_ids
                done.text += out.text_delta
                if out.finished:
                    done.finish_reason, done.last = out.finish_reason, out
            if not self.has_unfinished():
                return completions
            pending = self.step()
