"""Speculative decoding with n-gram drafts (ENGINE_SPECULATIVE_NGRAM_TOKENS) against plain decoding, on the
default model, greedy, in one process and one run.

Two traces of chat requests:
  copy     the output repeats the prompt: a text repeated verbatim, a code edit (a rename), a JSON record edited,
           a list reformatted;
  nothing  open-ended answers (stories, explanations): little to copy;
  json     records rewritten as JSON under a JSON Schema (response_format), the values copied from the prompt:
           drafts verified under the grammar (`--traces copy,nothing,json`).
Each trace runs at 1 request at a time and at 4 at once, with drafts off and on, in alternation `--repeats`
times on one shared model runner; the best output tokens/s of each counts (other work on the machine only slows
a run down). Greedy outputs are compared request by request between the two.

Four at once, two ways: `waves`, the four prompts started together and the next wave when all four are done (a
request that finishes early leaves its seat empty until its wave ends, so drafts pay only when every request of
the wave gains); and `kept`, `--kept-requests` requests (the prompts repeated) with four always running, the next
one started as soon as one finishes, as a server under a steady load of four does.

    python -m benchmarks.bench_speculative --dtype float32 --out benchmarks/results/<date>-speculative
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.lib.chat import OPEN_PROMPTS, chat_request, default_model
from benchmarks.lib.results_store import write_results
from worker.engine.api import EngineRequest, StructuredOutput
from worker.engine.engine import LLMEngine
from worker.model.runner import ModelRunner
from worker.model.settings import EngineSettings

TEXT = ("Apache Kafka stores records in partitions. Each partition is an ordered log, and a consumer group "
        "divides the partitions of a topic among its members. When a member fails, the group rebalances and the "
        "partitions move to the members that remain, which resume from the committed offsets.")
CODE = '''def total(items):
    x = 0
    for item in items:
        if item.price > 0:
            x = x + item.price * item.quantity
    return x


def average(items):
    x = total(items)
    return x / len(items) if items else 0
'''
RECORD = '{"id": 42, "name": "Bob", "city": "Rome", "email": "bob@example.com", "tags": ["kafka", "llm"]}'
LIST = "apples 3, pears 5, plums 7, cherries 11, grapes 13, lemons 17, limes 19"

COPY = [
    "Repeat this text exactly, word for word:\n\n" + TEXT,
    "Rename the variable x to count in this Python code and show the whole code:\n\n" + CODE,
    "Change the city to Madrid in this JSON and print the whole JSON:\n\n" + RECORD,
    "Write this list with one item per line, as 'fruit: number':\n\n" + LIST,
]
NOTHING = OPEN_PROMPTS
PEOPLE = [
    "name: Alice Fernandez-Lindqvist, city: Saint Petersburg, team: streaming platform reliability, topics: consumer "
    "group rebalancing, exactly-once delivery, partition reassignment",
    "name: Bob Okonkwo-Martinez, city: Rio de Janeiro, team: inference serving, topics: continuous batching, paged "
    "attention, speculative decoding",
    "name: Chen Wei-Lindgren, city: Buenos Aires, team: data pipelines, topics: schema registry, compacted topics, "
    "consumer lag",
    "name: Dana Abernathy-Kowalski, city: San Francisco, team: developer tools, topics: client libraries, "
    "configuration, observability",
]
JSON_PROMPTS = ["Rewrite this record as JSON, copying every value exactly:\n" + person for person in PEOPLE]
_TEXT = {"type": "string", "maxLength": 60}
PERSON_SCHEMA = {"type": "object", "properties": {"name": _TEXT, "city": _TEXT, "team": _TEXT,
                                                  "topics": {"type": "array", "items": _TEXT, "maxItems": 5}},
                 "required": ["name", "city", "team", "topics"], "additionalProperties": False}


def requests(prompts: list[str], max_new_tokens: int, tag: str) -> list[EngineRequest]:
    extra = {"structured": StructuredOutput("json_schema", json.dumps(PERSON_SCHEMA))} if tag == "json" else {}
    return [chat_request(prompt, f"{tag}-{i}", max_new_tokens, **extra) for i, prompt in enumerate(prompts)]


def run(runner: ModelRunner, settings: EngineSettings, batch: list[EngineRequest], concurrency: int,
        kept: bool = False) -> dict:
    """Output tokens/s over the whole trace, `concurrency` requests at a time (in waves, or `kept` at that many
    running); each request's tokens."""
    engine = LLMEngine(settings, runner)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    if kept:
        waiting, running, pending = list(batch), 0, []
        while waiting or running:
            while waiting and running < concurrency:
                tokens[waiting[0].request_id] = []
                pending += engine.add_request(waiting.pop(0))
                running += 1
            for out in pending:
                tokens[out.request_id] += out.new_token_ids
                running -= out.finished
            pending = engine.step() if engine.has_unfinished() else []
    else:
        for first in range(0, len(batch), concurrency):
            for request_id, completion in engine.generate(batch[first:first + concurrency]).items():
                tokens[request_id] = completion.token_ids
    seconds = time.perf_counter() - start
    num_tokens = sum(len(t) for t in tokens.values())
    return {"tokens_per_s": num_tokens / seconds, "seconds": seconds, "num_tokens": num_tokens,
            "steps": engine.num_steps, "proposed": engine.num_proposed_tokens,
            "accepted": engine.num_accepted_tokens, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kept-requests", type=int, default=16,
                        help="kept: requests per trace (the prompts repeated), four always running")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--traces", default="copy,nothing", help="of copy, nothing, json")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    path = default_model(args.threads)
    base = EngineSettings(model=str(path), device="cpu", dtype=args.dtype, max_num_seqs=8,
                          max_num_batched_tokens=512, enable_prefix_caching=False)
    runner = ModelRunner(str(path), base)
    loadavg = [f"{x:.2f}" for x in os.getloadavg()]
    prompts_of = {name: prompts for name, prompts in (("copy", COPY), ("nothing", NOTHING), ("json", JSON_PROMPTS))
                  if name in args.traces.split(",")}
    traces = {name: requests(prompts, args.max_new_tokens, name) for name, prompts in prompts_of.items()}
    kept_traces = {name: requests((prompts * args.kept_requests)[:args.kept_requests], args.max_new_tokens, name)
                   for name, prompts in prompts_of.items()}
    modes = ((1, "waves"), (4, "waves"), (4, "kept"))
    best: dict[tuple, dict] = {}
    for _ in range(args.repeats):
        for name, batch in traces.items():
            for concurrency, mode in modes:
                for num_draft in (0, args.num_draft):
                    settings = base.model_copy(update={"speculative_ngram_tokens": num_draft})
                    result = run(runner, settings, kept_traces[name] if mode == "kept" else batch, concurrency,
                                 kept=mode == "kept")
                    key = (name, concurrency, mode, num_draft)
                    if key not in best or result["tokens_per_s"] > best[key]["tokens_per_s"]:
                        best[key] = result
    rows = []
    for name in traces:
        for concurrency, mode in modes:
            plain, drafted = best[name, concurrency, mode, 0], best[name, concurrency, mode, args.num_draft]
            same = [rid for rid in plain["tokens"] if plain["tokens"][rid] == drafted["tokens"][rid]]
            rows.append({
                "trace": name, "concurrency": concurrency, "mode": mode,
                "plain_tokens_per_s": round(plain["tokens_per_s"], 1),
                "drafted_tokens_per_s": round(drafted["tokens_per_s"], 1),
                "ratio": round(drafted["tokens_per_s"] / plain["tokens_per_s"], 3),
                "steps": [plain["steps"], drafted["steps"]],
                "accepted_of_proposed": [drafted["accepted"], drafted["proposed"]],
                "identical_outputs": f"{len(same)}/{len(plain['tokens'])}",
                "output_tokens": [plain["num_tokens"], drafted["num_tokens"]],
            })
            print(f"{name:8s} x{concurrency} {mode:5s}: {rows[-1]['plain_tokens_per_s']:7.1f} -> "
                  f"{rows[-1]['drafted_tokens_per_s']:7.1f} tok/s  ratio {rows[-1]['ratio']:.2f}  "
                  f"steps {plain['steps']} -> {drafted['steps']}  kept {drafted['accepted']}/{drafted['proposed']}"
                  f"  identical {rows[-1]['identical_outputs']}")
    # Plain decoding's own consistency, for reading the identical-output column: greedy tokens of requests run
    # alone against the same requests four at once (in bf16 a matmul's rounding depends on the step's shape).
    consistent = {name: sum(best[name, 1, "waves", 0]["tokens"][rid] == best[name, 4, "waves", 0]["tokens"][rid]
                            for rid in best[name, 1, "waves", 0]["tokens"]) for name in traces}
    print("plain decoding, alone vs four at once, identical:", consistent)
    summary = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "loadavg_before": loadavg, "dtype": str(runner.dtype).replace("torch.", ""),
               "threads": torch.get_num_threads(), "num_draft": args.num_draft,
               "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "kept_requests": args.kept_requests,
               "rows": rows,
               "plain_alone_vs_batched_identical": {name: f"{n}/{len(traces[name])}" for name, n in consistent.items()}}
    if args.out is not None:
        raw = {"summary": summary, "tokens": {"-".join(map(str, k)): v["tokens"] for k, v in best.items()}}
        print(write_results(args.out, raw, summary, indent=1))


if __name__ == "__main__":
    main()
