"""transformers baselines, replaying a trace in real time like benchmarks/bench_engine.py.

hf-static  `model.generate` on static batches: max_batch_size requests in arrival order, left padding; a batch
           starts once it is full (or the trace is over) and the previous one has returned, and runs to the
           longest output in it (min_new_tokens = max_new_tokens = that length, i.e. EOS ignored). A request's
           first token and finish times are taken from a streamer at the step that produced its first and its
           last wanted token (the most favourable reading: plain generate returns only at the batch's end).
hf-cb      transformers' continuous batching (`ContinuousBatchingManager`, what `generate_batch` drives),
           fed request by request at arrival time through `add_request` with each request's own
           max_new_tokens (generate_batch takes one max_new_tokens for all, so it could not replay the trace's
           lengths); EOS disabled (eos_token_id=-1). Offline (rate 0) it sees every request at t=0, as
           generate_batch would. Same token budget, request limit, KV budget and page size as LLMEngine.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from benchmarks.lib.run_result import RequestRecord, RunResult
from benchmarks.lib.settings import BLOCK_SIZE, KV_CACHE_BYTES, MAX_BATCH_SIZE, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from benchmarks.lib.trace import Trace, TraceRequest

log = logging.getLogger(__name__)


class _TokenClock(BaseStreamer):
    """A generate() streamer that only notes when each step's tokens come out: times[0] is the prompt push,
    times[k] the k-th generated token of every row."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _records(trace: Trace) -> dict[str, RequestRecord]:
    return {r.request_id: RequestRecord(r.request_id, r.kind, r.priority, r.arrival_s, r.num_prompt_tokens)
            for r in trace.requests}


class HFBaselines:
    """Each system's model is loaded on first use (in float32 on the CPU unless told otherwise: the GPU check
    runs bf16 on CUDA)."""

    def __init__(self, model_path: Path, kv_budget_tokens: int | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoTokenizer
        self.model_path = model_path
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.kv_budget_tokens = kv_budget_tokens
        self.device, self.dtype = device, dtype
        self._models: dict[str, torch.nn.Module] = {}

    def _model(self, system: str):
        # One instance per system: the continuous-batching manager switches the model's attention implementation.
        if system not in self._models:
            from transformers import AutoModelForCausalLM

            try:
                model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype,
                                                             attn_implementation="sdpa")
            except ValueError:  # an architecture transformers runs only eagerly (Gemma2: soft-capped scores)
                model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype,
                                                             attn_implementation="eager")
            self._models[system] = model.to(self.device).eval()
        return self._models[system]

    @property
    def static_model(self):
        return self._model("hf-static")

    @property
    def cb_model(self):
        return self._model("hf-cb")

    def run(self, system: str, trace: Trace) -> RunResult:
        self._model(system)  # loaded before the replay's clock starts
        if system == "hf-static":
            return self.run_static(trace)
        if system == "hf-cb":
            return self.run_cb(trace)
        raise ValueError(system)

    # ---- static batches with padding ------------------------------------------------------------------

    def run_static(self, trace: Trace, batch_size: int = MAX_BATCH_SIZE) -> RunResult:
        requests, records = trace.requests, _records(trace)
        queue: deque[TraceRequest] = deque()
        kv_util: list[float] = []
        start = time.perf_counter()
        num_added = max_batch = 0
        while num_added < len(requests) or queue:
            now = time.perf_counter()
            while num_added < len(requests) and start + requests[num_added].arrival_s <= now:
                queue.append(requests[num_added])
                num_added += 1
            if len(queue) >= batch_size or (queue and num_added == len(requests)):
                batch = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
                max_batch = max(max_batch, len(batch))
                self._run_batch(batch, records, start, kv_util)
            else:
                time.sleep(max(0.0, min(1.0, start + requests[num_added].arrival_s - time.perf_counter())))
        wall = time.perf_counter() - start
        return RunResult("hf-static", trace.config.rate, list(records.values()), wall, kv_util, [], max_batch)

    @torch.inference_mode()
    def _run_batch(self, batch: list[TraceRequest], records: dict[str, RequestRecord], start: float,
                   kv_util: list[float]) -> None:
        prompt_len = max(r.num_prompt_tokens for r in batch)
        input_ids = torch.full((len(batch), prompt_len), self.pad_id, dtype=torch.long)  # [B, P], left padded
        attention_mask = torch.zeros_like(input_ids)
        for row, r in enumerate(batch):
            input_ids[row, prompt_len - r.num_prompt_tokens:] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, prompt_len - r.num_prompt_tokens:] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        num_steps = max(r.max_new_tokens for r in batch)
        clock = _TokenClock()
        self.static_model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_steps,
            min_new_tokens=num_steps, do_sample=False, pad_token_id=self.pad_id, streamer=clock,
        )
        assert len(clock.times) == num_steps + 1, (len(clock.times), num_steps)
        for r in batch:
            record = records[r.request_id]
            record.num_output_tokens = r.max_new_tokens
            record.first_token_s = clock.times[1] - start
            record.finish_s = clock.times[r.max_new_tokens] - start
        # The padded cache holds B x (P + t - 1) positions when token t is produced; real ones are fewer.
        prompt_tokens = sum(r.num_prompt_tokens for r in batch)
        for t in range(1, num_steps + 1):
            held = prompt_tokens + sum(min(t - 1, r.max_new_tokens) for r in batch)
            kv_util.append(held / (len(batch) * (prompt_len + t - 1)))

    # ---- transformers' continuous batching --------------------------------------------------------------

    def _cb_manager(self):
        import inspect

        import transformers
        from transformers import GenerationConfig

        budget = self.kv_budget_tokens or KV_CACHE_BYTES // self._bytes_per_token()
        options = dict(
            page_size=BLOCK_SIZE, num_blocks=budget // BLOCK_SIZE,
            max_batch_tokens=MAX_NUM_BATCHED_TOKENS, max_requests_per_batch=MAX_NUM_SEQS,
            allow_block_sharing=False, use_cuda_graph=False, use_async_batching=False, auto_switch_to_flash=False,
        )
        gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=self.pad_id, max_new_tokens=16)
        config_cls = getattr(transformers, "ContinuousBatchingConfig", None)
        if config_cls is None:  # older transformers (the GPU machine's may be): the options ride on GenerationConfig
            for key, value in options.items():
                setattr(gen_config, "block_size" if key == "page_size" else key, value)
            return self.cb_model.init_continuous_batching(generation_config=gen_config)
        known = inspect.signature(config_cls).parameters
        cb_config = config_cls(**{k: v for k, v in options.items() if k in known})
        return self.cb_model.init_continuous_batching(generation_config=gen_config,
                                                      continuous_batching_config=cb_config)

    def _bytes_per_token(self) -> int:
        c = self.cb_model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * self.dtype.itemsize  # K and V

    def run_cb(self, trace: Trace) -> RunResult:
        requests, records = trace.requests, _records(trace)
        manager = self._cb_manager()
        manager.start()
        num_added = num_done = 0
        start = time.perf_counter()
        try:
            while num_done < len(requests):
                now = time.perf_counter()
                while num_added < len(requests) and start + requests[num_added].arrival_s <= now:
                    r = requests[num_added]
                    manager.add_request(r.prompt_token_ids, request_id=r.request_id, max_new_tokens=r.max_new_tokens,
                                        record_timestamps=True, eos_token_id=-1)
                    num_added += 1
                wait = 0.05
                if num_added < len(requests):
                    wait = max(0.0, min(wait, start + requests[num_added].arrival_s - time.perf_counter()))
                result = manager.get_result(timeout=wait) if wait > 0 else None
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread died")
                    continue
                if not result.is_finished():
                    continue
                num_done += 1
                record = records[result.request_id]
                record.num_output_tokens = len(result.generated_tokens)
                if result.error is not None:
                    record.error = str(result.error)[:200]
                    continue
                record.first_token_s = result.timestamps[0] - start if result.timestamps else None
                finished = result.timestamps[-1] if result.timestamps else result.lifespan[1]
                record.finish_s = finished - start
        finally:
            manager.stop(block=True, timeout=30)
        wall = time.perf_counter() - start
        attn = self.cb_model.config._attn_implementation
        return RunResult("hf-cb", trace.config.rate, list(records.values()), wall, extra={"hf_cb_attention": attn})
