"""int8 weights (ENGINE_QUANTIZATION=int8, with the LM head in int8 for few-row steps and without:
ENGINE_QUANTIZE_LM_HEAD; and with one-row steps compiled: ENGINE_CPU_COMPILE) against the model dtype on the
default model, in one process and one run: time per output token at one request, output tokens/s at saturation,
and accuracy; FP8 weights and activations (ENGINE_QUANTIZATION=fp8) for accuracy only, unless `--no-fp8` (on the
CPU their product is torch's reference, with no FP8 hardware: its speed says nothing of a GPU's).

  latency     one request at a time, four open-ended chat prompts of `--max-new-tokens` tokens each (EOS
              ignored): seconds per output token over the trace, prefills included;
  saturation  `--batch` requests at once, the same prompts repeated: output tokens/s;
  accuracy    sixteen chat prompts, greedy, with log-probabilities, four at a time (`--accuracy-at-once`: a
              step of a few rows takes the int8 head): the prompts whose whole output is the same token for
              token, the tokens agreeing before the first difference, and the difference of the chosen tokens'
              log-probabilities over those agreeing tokens (mean and max); and the same for the model dtype
              against float32, for scale.

The four runners are built once and alternate `--repeats` times; the median of each measurement counts.

    python -m benchmarks.bench_quantization --out benchmarks/results/<date>-int8
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.lib.chat import OPEN_PROMPTS, chat_request, default_model
from benchmarks.lib.results_store import write_results
from worker.engine.api import EngineRequest
from worker.engine.engine import LLMEngine
from worker.model.runner import ModelRunner
from worker.model.settings import EngineSettings

OPEN = OPEN_PROMPTS
ACCURACY = OPEN + [
    "What is the capital of France, and what is it known for?",
    "List five prime numbers and explain what makes a number prime.",
    "How does a consumer group divide the partitions of a Kafka topic?",
    "Write a Python function that reverses a string.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Explain the difference between a list and a tuple in Python.",
    "Describe how a rainbow forms.",
    "Give me a recipe for a simple tomato soup.",
    "Why do cats purr?",
    "What should I pack for a week of hiking in the mountains?",
]


def timed(runner: ModelRunner, settings: EngineSettings, batches: list[list[EngineRequest]]) -> tuple[float, int]:
    """Seconds and output tokens for the batches run one after another."""
    engine = LLMEngine(settings, runner)
    start = time.perf_counter()
    num_tokens = sum(len(c.token_ids) for batch in batches for c in engine.generate(batch).values())
    return time.perf_counter() - start, num_tokens


def greedy_with_logprobs(runner: ModelRunner, settings: EngineSettings, max_new_tokens: int,
                         prompts: list[str] = ACCURACY, at_once: int | None = None) -> dict[str, list]:
    """Each prompt's greedy [(token id, log-probability)]: the prompts in waves of `at_once` (all in one batch
    when None)."""
    engine = LLMEngine(settings, runner)
    out: dict[str, list] = {}
    at_once = at_once or len(prompts)
    for first in range(0, len(prompts), at_once):
        pending = []
        for i, prompt in enumerate(prompts[first:first + at_once], start=first):
            pending += engine.add_request(chat_request(prompt, f"acc-{i}", max_new_tokens, logprobs=True))
            out[f"acc-{i}"] = []
        while True:
            for update in pending:
                out[update.request_id] += [(lp.token_id, lp.logprob) for lp in update.new_logprobs or ()]
            if not engine.has_unfinished():
                break
            pending = engine.step()
    return out


def compare(reference: dict[str, list], quantized: dict[str, list]) -> dict:
    same, agreeing, total, diffs = 0, 0, 0, []
    for request_id, ref in reference.items():
        got = quantized[request_id]
        total += len(ref)
        same += [t for t, _ in ref] == [t for t, _ in got]
        for (token, logprob), (other, other_logprob) in zip(ref, got):
            if token != other:
                break
            agreeing += 1
            diffs.append(abs(logprob - other_logprob))
    return {"identical_outputs": f"{same}/{len(reference)}", "agreeing_tokens": f"{agreeing}/{total}",
            "logprob_diff_mean": round(statistics.fmean(diffs), 4) if diffs else None,
            "logprob_diff_max": round(max(diffs), 4) if diffs else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--accuracy-at-once", type=int, default=4,
                        help="prompts run together for accuracy (4: the int8 head's steps; 0: all sixteen)")
    parser.add_argument("--no-fp8", action="store_true", help="skip FP8's accuracy (about a minute on 2 cores)")
    args = parser.parse_args()

    import torch

    path = default_model(args.threads)
    loadavg = [round(x, 2) for x in os.getloadavg()]
    arms = {"none": {}, "int8": {"quantization": "int8"},
            "int8_float_head": {"quantization": "int8", "quantize_lm_head": False},
            "int8_compiled": {"quantization": "int8", "cpu_compile": True}}
    settings = {kind: EngineSettings(model=str(path), device="cpu", dtype=args.dtype, max_num_seqs=max(64, args.batch),
                                     enable_prefix_caching=False, **arm)
                for kind, arm in arms.items()}
    load_s, runners = {}, {}
    for kind, s in settings.items():
        start = time.perf_counter()
        runners[kind] = ModelRunner(str(path), s)
        load_s[kind] = round(time.perf_counter() - start, 2)
    latency = [[chat_request(p, f"lat-{i}", args.max_new_tokens, ignore_eos=True)] for i, p in enumerate(OPEN)]
    saturation = [[chat_request(OPEN[i % len(OPEN)], f"sat-{i}", args.max_new_tokens, ignore_eos=True)
                   for i in range(args.batch)]]
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for kind in settings:
            seconds, tokens = timed(runners[kind], settings[kind], latency)
            samples.setdefault((kind, "ms_per_token"), []).append(1000 * seconds / tokens)
            seconds, tokens = timed(runners[kind], settings[kind], saturation)
            samples.setdefault((kind, "tokens_per_s"), []).append(tokens / seconds)
            print(kind, {k[1]: round(v[-1], 2) for k, v in samples.items() if k[0] == kind}, flush=True)
    medians = {f"{kind}_{what}": round(statistics.median(v), 2) for (kind, what), v in samples.items()}
    def greedy(runner: ModelRunner, settings: EngineSettings) -> dict[str, list]:
        return greedy_with_logprobs(runner, settings, 48, at_once=args.accuracy_at_once)

    reference = greedy(runners["none"], settings["none"])
    accuracy = compare(reference, greedy(runners["int8"], settings["int8"]))
    float_head_accuracy = compare(reference, greedy(runners["int8_float_head"], settings["int8_float_head"]))
    float32 = settings["none"].model_copy(update={"dtype": "float32"})
    dtype_vs_float32 = compare(greedy(ModelRunner(str(path), float32), float32), reference)
    fp8_accuracy = None
    if not args.no_fp8:
        fp8 = settings["none"].model_copy(update={"quantization": "fp8"})
        fp8_accuracy = compare(reference, greedy(ModelRunner(str(path), fp8), fp8))
    summary = {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "loadavg_before": loadavg,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()], "dtype": str(runners["none"].dtype).removeprefix(
            "torch."), "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
        "batch": args.batch, "repeats": args.repeats,
        "accuracy_at_once": args.accuracy_at_once or len(ACCURACY), "load_s": load_s, "medians": medians,
        "ms_per_token_ratio": round(medians["int8_ms_per_token"] / medians["none_ms_per_token"], 3),
        "saturation_ratio": round(medians["int8_tokens_per_s"] / medians["none_tokens_per_s"], 3),
        "ms_per_token_ratio_float_head": round(medians["int8_float_head_ms_per_token"]
                                               / medians["none_ms_per_token"], 3),
        "saturation_ratio_float_head": round(medians["int8_float_head_tokens_per_s"]
                                             / medians["none_tokens_per_s"], 3),
        "ms_per_token_ratio_compiled": round(medians["int8_compiled_ms_per_token"] / medians["none_ms_per_token"], 3),
        "accuracy_48_tokens": accuracy, "float_head_accuracy_48_tokens": float_head_accuracy,
        "compiled_accuracy_48_tokens": compare(reference, greedy(runners["int8_compiled"],
                                                                 settings["int8_compiled"])),
        "dtype_vs_float32_48_tokens": dtype_vs_float32,
        "fp8_accuracy_48_tokens": fp8_accuracy,
        "samples": {f"{kind}_{what}": [round(x, 2) for x in v] for (kind, what), v in samples.items()},
    }
    print(summary)
    if args.out is not None:
        print(write_results(args.out, {"summary": summary}, summary, indent=1))


if __name__ == "__main__":
    main()
