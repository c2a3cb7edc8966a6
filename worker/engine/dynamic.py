"""A model-free engine with the real one's dynamics, for the fault, overload and fairness tests.

The instant engine (instant.py) finishes the requests of a partition in the order it read them when they have
the same length, charges nothing for a prompt or a preemption, and takes as long for one request as for a full
batch. A transport bug that lives where requests finish out of order, where a long prompt holds a step, or where
a batch slows as it fills is invisible to it: the exactly-once defect lived exactly there. This engine keeps the
instant engine's outputs (token t of a request is (crc32(prompt) + t) % vocab, its text "<token>") and adds:

- lengths that vary: unless the request sets ignore_eos, it stops ("stop") at a seeded point in
  [1, max_new_tokens] with probability `eos_probability` (from crc32 of its prompt and its seed: the same
  request stops at the same token on any worker, so a redelivered request streams the same text);
- prompt cost: a step that seats requests takes `prefill_s_per_token` for each of their prompt tokens (bytes
  of the prompt, as in the instant engine);
- step time that grows with the batch: `step_time_s + per_seq_s` x running requests;
- preemption that costs a recompute: a request preempted for a more urgent one keeps the tokens it streamed,
  and the step that seats it again pays for its prompt and those tokens again.

What it does not model: a KV-cache budget (only a seat count), chunked prefill (a prompt is paid whole in one
step), token-level text (one "<id>" per token), and sampling (outputs are fixed by the prompt).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from worker.engine.api import EngineRequest
from worker.engine.instant import InstantEngine, _prompt_bytes, _Running


def eos_point(request: EngineRequest, eos_probability: float) -> int | None:
    """The output token count at which the request stops on EOS, or None (it runs to max_new_tokens)."""
    sampling = request.sampling
    if sampling.ignore_eos or eos_probability <= 0 or sampling.max_new_tokens <= 1:
        return None
    draw = zlib.crc32(_prompt_bytes(request) + str(sampling.seed).encode())
    if (draw % 10_000) / 10_000 >= eos_probability:
        return None
    return 1 + (draw // 10_000) % sampling.max_new_tokens


def expected_output(request: EngineRequest, eos_probability: float, vocab_size: int = 49152) -> tuple[str, str]:
    """(text, finish reason) of a request that runs to its end (tests compare against it)."""
    seed = zlib.crc32(_prompt_bytes(request))
    stop = eos_point(request, eos_probability)
    n = stop if stop is not None else request.sampling.max_new_tokens
    return "".join(f"<{(seed + t) % vocab_size}>" for t in range(n)), "stop" if stop is not None else "length"


@dataclass(slots=True)
class DynamicEngine(InstantEngine):
    step_time_s: float = 0.02
    """A step's time with nothing in it; each running request adds per_seq_s."""
    per_seq_s: float = 0.001
    prefill_s_per_token: float = 0.00005
    """Per prompt token (and per recomputed output token) of each request seated in a step."""
    eos_probability: float = 0.3

    def _step_time(self, seated: list[_Running]) -> float:
        recompute = sum(state.num_prompt_tokens + state.num_output_tokens for state in seated)
        return self.step_time_s + self.per_seq_s * len(self._running) + self.prefill_s_per_token * recompute

    def _stop_at(self, request: EngineRequest) -> int | None:
        return eos_point(request, self.eos_probability)
