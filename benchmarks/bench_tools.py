"""Tool calling's cost: a forced call against the same number of tokens without tools, time to the last token.

Each round runs two requests alone through the real LLMEngine (the CPU forward, fp32), in alternating order
(ABBA) so that a drift in the machine's speed hits both alike:

- `tools`: a chat request with two functions and tool_choice naming one, built by the worker's own dispatcher
  (`to_engine_requests`: the tools rendered into the prompt, the call's grammar); its text deltas go through the
  streamer's tool-call parser as they come. Its grammar is compiled anew every round (the schema differs by a
  `description`), the cost a new tool set pays; `--warm` keeps one schema, so later rounds find it compiled.
- `plain`: the same prompt token ids, no grammar, no parse, held to exactly as many output tokens (min_tokens and
  ignore_eos), so the two differ only by what tool calling adds.

Time to the last token: from add_request to the output that finishes the request. Reported: the median of each,
their ratio less one (the overhead; the floor is 0.10), the median of the per-round ratios, and the ratio of the
minima (on a shared machine the least disturbed run of each is the steadiest estimate of its cost).

    .venv/bin/python -m benchmarks.bench_tools --rounds 6            # SmolLM2-135M-Instruct
    .venv/bin/python -m benchmarks.bench_tools --model PATH --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec

FLOOR = 0.10
"""The overhead a forced call may add to the time to the last token."""

ASK = [{"role": "user", "content": "What is the weather in Paris, in Celsius, for the next three days?"}]


def tools(round_index: int, warm: bool) -> list[dict]:
    weather = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}
    if not warm:
        weather["description"] = f"arguments, round {round_index}"  # a new spec: compiled, not cached
    clock = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"]}
    return [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                              "parameters": weather}},
            {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone",
                                              "parameters": clock}}]


def tools_request(round_index: int, warm: bool):
    from aiokafka import TopicPartition

    from schemas.request import GenerationRequest
    from worker.transport.requests.dispatcher import to_engine_requests
    from worker.transport.requests.local_queue import QueuedRequest

    request = msgspec.convert({"id": f"tools-{round_index}", "messages": ASK, "tools": tools(round_index, warm),
                               "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                               "max_new_tokens": 128}, GenerationRequest)
    queued = QueuedRequest(request=request, partition=TopicPartition("bench", 0), offset=round_index, priority=0,
                           attempt=0, timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="bench",
                           num_prompt_tokens=1)
    [engine_request] = to_engine_requests(queued)
    return request, engine_request


def run_alone(engine, request, parser=None) -> tuple[float, list[int], str]:
    """(seconds to the last token, output token ids, text) of one request run alone."""
    start = time.perf_counter()
    outputs = engine.add_request(request)
    tokens: list[int] = []
    text = []
    while True:
        for out in outputs:
            assert out.request_id == request.request_id and out.finish_reason != "error", out
            tokens += out.new_token_ids
            text.append(out.text_delta)
            if parser is not None and out.text_delta:
                parser.feed(out.text_delta)
            if out.finished:
                if parser is not None:
                    parser.finish()
                return time.perf_counter() - start, tokens, "".join(text)
        outputs = engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warm", action="store_true", help="one tool set: its grammar compiled once")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    import torch

    from benchmarks.lib.settings import set_threads
    from worker.model.settings import EngineSettings
    from worker.engine.api import EngineRequest, SamplingParams
    from worker.engine.engine import LLMEngine
    from worker.model.pull import ensure_default_model
    from worker.tools.parse import ToolCallParser

    set_threads(args.threads)
    model = args.model or str(ensure_default_model())
    # No prefix cache: both requests compute the same prompt every time.
    engine = LLMEngine(EngineSettings(model=model, device="cpu", dtype="float32", max_num_seqs=4,
                                      max_num_batched_tokens=2048, max_model_len=2048, enable_prefix_caching=False))
    # One untimed pair: the first forward and the first grammar of a process pay for their set-up.
    wire, first = tools_request(-1, False)
    run_alone(engine, first)
    times: dict[str, list[float]] = {"tools": [], "plain": []}
    ratios = []
    shape = None
    for round_index in range(args.rounds):
        wire, request = tools_request(round_index, args.warm)
        prompt = engine.tokenize(request)
        pair: dict[str, float] = {}
        num_tokens = None
        for label in ("tools", "plain") if round_index % 2 == 0 else ("plain", "tools"):
            if label == "tools":
                calls = ToolCallParser(frozenset(t.function.name for t in wire.tools), wire.parallel_tool_calls)
                seconds, tokens, text = run_alone(engine, request, calls)
                assert [c.name for c in calls.calls] == ["get_weather"], text
                json.loads(calls.calls[0].arguments)
                num_tokens = len(tokens)
            else:
                # The tools request runs first in even rounds; in odd ones its length is the previous round's.
                n = num_tokens or shape[1]
                plain = EngineRequest(f"plain-{round_index}", prompt_token_ids=prompt, sampling=SamplingParams(
                    max_new_tokens=n, min_tokens=n, ignore_eos=True))
                seconds, tokens, _ = run_alone(engine, plain)
                assert len(tokens) == n
            pair[label] = seconds
            times[label].append(seconds)
        if num_tokens != (shape[1] if shape else num_tokens):
            # Greedy on the same prompt gives the same call; a changed schema may not, and then the pair differs.
            print(f"round {round_index}: the call has {num_tokens} tokens, the plain run had {shape[1]}")
        shape = (len(prompt), num_tokens)
        ratios.append(pair["tools"] / pair["plain"])
        print(f"round {round_index}: tools {pair['tools'] * 1000:.1f} ms, plain {pair['plain'] * 1000:.1f} ms",
              flush=True)
    tools_s, plain_s = statistics.median(times["tools"]), statistics.median(times["plain"])
    overhead = tools_s / plain_s - 1
    print(json.dumps({
        "model": model, "threads": torch.get_num_threads(), "rounds": args.rounds, "warm_grammar": args.warm,
        "prompt_tokens": shape[0], "output_tokens": shape[1],
        "time_to_last_token_ms_median": {"tools": round(tools_s * 1000, 1), "plain": round(plain_s * 1000, 1)},
        "time_to_last_token_ms_min": {k: round(min(v) * 1000, 1) for k, v in times.items()},
        "overhead": round(overhead, 4), "overhead_per_round_median": round(statistics.median(ratios) - 1, 4),
        "overhead_of_minima": round(min(times["tools"]) / min(times["plain"]) - 1, 4),
        "floor": FLOOR, "within_floor": overhead <= FLOOR,
    }, indent=1))


if __name__ == "__main__":
    main()
