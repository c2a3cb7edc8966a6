"""Structured output (issue #17): which grammar library, and what masking costs a CPU engine step.

`libs`: xgrammar against llguidance on SmolLM2's tokenizer (vocabulary 49152) and the five schemas of
benchmarks/lib/structured_schemas.py. Per library: the tokenizer set-up, each schema's compile time (cold: a fresh
compiler, so no library cache helps), the per-step cost for 16 constrained rows (fill the 16 bitmasks, apply
them to [16, 49152] float32 logits, advance each matcher by its token), and correctness: rows decode on random
logits (the best allowed token of a fresh random row) until the grammar ends, and each finished text must parse
and validate against its schema with jsonschema. Rows that finish start over, so 16 stay busy. Install size is
measured from the installed packages' files.

`engine`: the real LLMEngine on SmolLM2 (the real forward on the CPU, fp32) at 32 running requests, decode
steps only, greedy: none constrained against half of them constrained (the five schemas in turn), in alternating
rounds (ABBA) so that a drift in the machine's speed hits both alike. Reported: the median step time of each, and
the time a step spends on grammars (mask fill, apply, matcher advance) measured inside it, which a busy shared
machine disturbs far less than the difference of two step times.

    .venv/bin/python -m benchmarks.bench_structured libs --steps 200
    .venv/bin/python -m benchmarks.bench_structured engine --rounds 4 --steps 16
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from pathlib import Path

import jsonschema
import numpy as np

from benchmarks.lib.structured_schemas import PROMPTS, SCHEMAS

VOCAB = 49152
NUM_ROWS = 16
MAX_ROW_TOKENS = 200
"""A row on random logits that has not finished by then (a number may grow digits forever) starts over."""


def install_size_mb(*distributions: str) -> float:
    total = 0
    for name in distributions:
        for f in importlib.metadata.distribution(name).files or []:
            path = f.locate()
            if Path(path).is_file():
                total += Path(path).stat().st_size
    return total / 1e6


# ---- the two libraries behind one small interface ---------------------------------------------------------


class Llguidance:
    name = "llguidance"
    distributions = ("llguidance",)

    def __init__(self, tokenizer, eos_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.lib, self.np = llguidance, llguidance.numpy
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB, eos_token=eos_token_ids)
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, schema: dict):
        # As the engine does (worker/model/structured/grammar.py): a pristine matcher, copied for each request.
        from worker.model.structured.compile import JSON_OPTIONS

        grammar = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"
    distributions = ("xgrammar", "apache-tvm-ffi")

    def __init__(self, tokenizer, eos_token_ids: list[int]) -> None:
        import torch
        import xgrammar

        self.lib, self.torch = xgrammar, torch
        start = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=eos_token_ids)
        self.setup_s = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema: dict):
        # A fresh compiler each time: its own cache would make a repeat free, which is not what is measured.
        compiler = self.lib.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, self.torch.from_numpy(bitmask))

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """The engine's own masking (worker/model/token_mask.py), the same for both libraries: their bitmasks share
    one layout."""
    import torch

    from worker.model.token_mask import TokenMask, apply

    apply(torch.from_numpy(logits), TokenMask(list(range(len(logits))), bitmask), on_numpy=True)


def bench_library(lib, tokenizer, eos_token_ids: list[int], steps: int, seed: int) -> dict:
    compile_ms = {}
    compiled = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(3):
            start = time.perf_counter()
            compiled[name] = lib.compile(schema)
            times.append(time.perf_counter() - start)
        compile_ms[name] = round(min(times) * 1000, 2)
    names = list(SCHEMAS)
    rows = [names[i % len(names)] for i in range(NUM_ROWS)]
    matchers = [lib.matcher(compiled[name]) for name in rows]
    tokens: list[list[int]] = [[] for _ in rows]
    bitmask = np.full((NUM_ROWS, VOCAB // 32), -1, dtype=np.int32)
    rng = np.random.default_rng(seed)
    eos = set(eos_token_ids)
    fill_s, apply_s, accept_s = [], [], []
    finished = valid = restarted = 0
    invalid_examples = []
    for _ in range(steps):
        logits = rng.standard_normal((NUM_ROWS, VOCAB), dtype=np.float32)
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        picked = logits.argmax(axis=1).tolist()
        t3 = time.perf_counter()
        ok = [lib.accept(m, t) for m, t in zip(matchers, picked)]
        t4 = time.perf_counter()
        fill_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        accept_s.append(t4 - t3)
        for i, token_id in enumerate(picked):
            assert ok[i], (lib.name, rows[i], tokens[i], token_id)
            if token_id not in eos:
                tokens[i].append(token_id)
            if lib.done(matchers[i]) or token_id in eos or len(tokens[i]) >= MAX_ROW_TOKENS:
                if lib.done(matchers[i]) or token_id in eos:
                    finished += 1
                    text = tokenizer.decode(tokens[i])
                    try:
                        jsonschema.validate(json.loads(text), SCHEMAS[rows[i]])
                        valid += 1
                    except (ValueError, jsonschema.ValidationError) as exc:
                        invalid_examples.append((rows[i], text, str(exc).splitlines()[0][:160]))
                else:
                    restarted += 1
                matchers[i] = lib.matcher(compiled[rows[i]])
                tokens[i] = []
    ms = lambda xs: round(statistics.median(xs) * 1000, 3)  # noqa: E731
    return {
        "library": lib.name,
        "version": importlib.metadata.version(lib.name),
        "install_mb": round(install_size_mb(*lib.distributions), 1),
        "tokenizer_setup_ms": round(lib.setup_s * 1000, 1),
        "compile_ms": compile_ms,
        "step_ms_16_rows": {"fill": ms(fill_s), "apply": ms(apply_s), "accept": ms(accept_s),
                            "total": ms([a + b + c for a, b, c in zip(fill_s, apply_s, accept_s)])},
        "fill_ms_p90": round(float(np.percentile(fill_s, 90)) * 1000, 3),
        "finished": finished, "valid": valid, "cut_at_max_tokens": restarted,
        "invalid_examples": invalid_examples[:3],
    }


def cmd_libs(args) -> None:
    from transformers import AutoTokenizer

    from worker.model.pull import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    eos = [tokenizer.eos_token_id]
    results = []
    for cls in (Xgrammar, Llguidance):
        if args.library and cls.name != args.library:
            continue
        start = time.perf_counter()
        try:
            lib = cls(tokenizer, eos)
        except ImportError:
            print(f"{cls.name} is not installed (.venv/bin/pip install {' '.join(cls.distributions)}): skipped")
            continue
        import_and_setup = time.perf_counter() - start
        result = bench_library(lib, tokenizer, eos, args.steps, args.seed)
        result["import_and_setup_s"] = round(import_and_setup, 2)
        results.append(result)
        print(json.dumps(result, indent=1))


# ---- the engine at 32 running, half constrained -----------------------------------------------------------


class GrammarTimer:
    """Sums the time a step spends on grammars: filling the bitmasks (engine._grammar_mask), applying them to the
    logits (token_mask.apply) and advancing the matchers (Matcher.advance)."""

    def __init__(self, engine) -> None:
        from worker.model import grammar, token_mask

        self.seconds = 0.0
        engine._grammar_mask = self._timed(engine._grammar_mask)
        token_mask.apply = self._timed(token_mask.apply)
        grammar.Matcher.advance = self._timed(grammar.Matcher.advance)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def cmd_engine(args) -> None:
    import torch

    from benchmarks.lib.settings import set_threads
    from worker.model.settings import EngineSettings
    from worker.engine.api import EngineRequest, SamplingParams, StructuredOutput
    from worker.engine.engine import LLMEngine
    from worker.model.pull import ensure_default_model

    set_threads(args.threads)
    settings = EngineSettings(model=str(ensure_default_model()), device="cpu", dtype="float32",
                              max_num_seqs=args.running, max_num_batched_tokens=2048, max_model_len=1024,
                              enable_prefix_caching=False)
    engine = LLMEngine(settings)
    timer = GrammarTimer(engine)
    names = list(SCHEMAS)
    runs: dict[str, list[float]] = {"none": [], "half": []}
    grammar_ms: list[float] = []
    for round_index in range(args.rounds):
        for label in ("none", "half") if round_index % 2 == 0 else ("half", "none"):  # ABBA against drift
            requests = []
            for i in range(args.running):
                name = names[(i // 2) % len(names)]
                constrained = label == "half" and i % 2 == 1
                structured = StructuredOutput("json_schema", json.dumps(SCHEMAS[name])) if constrained else None
                # Free rows ignore EOS and constrained ones have room: all of them run through the timed steps
                # (a step in which one finished is not timed).
                requests.append(EngineRequest(
                    f"{label}-{round_index}-{i}", messages=[{"role": "user", "content": PROMPTS[name]}],
                    sampling=SamplingParams(max_new_tokens=200, ignore_eos=not constrained, structured=structured)))
            for request in requests:
                assert not engine.add_request(request)
            while engine._compiling:  # the first round compiles the five schemas: not a decode step
                engine.step()
            for step in range(args.warmup + args.steps):
                timer.seconds = 0.0
                start = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - start
                if step >= args.warmup and engine.stats().num_running == args.running and \
                        not any(o.finished for o in outputs):
                    runs[label].append(elapsed)
                    if label == "half":
                        grammar_ms.append(timer.seconds * 1000)
            engine.abort([r.request_id for r in requests])
            print(label, round_index, f"{len(runs[label])} steps so far", flush=True)
    none_ms = statistics.median(runs["none"]) * 1000
    half_ms = statistics.median(runs["half"]) * 1000
    grammar = statistics.median(grammar_ms)
    print(json.dumps({
        "running": args.running, "constrained": args.running // 2, "threads": torch.get_num_threads(),
        "steps_timed": {k: len(v) for k, v in runs.items()},
        "step_ms_median": {"none": round(none_ms, 2), "half": round(half_ms, 2)},
        "step_ms_p25_p75": {k: [round(float(np.percentile(v, q)) * 1000, 2) for q in (25, 75)]
                            for k, v in runs.items()},
        "overhead_half_vs_none": round(half_ms / none_ms - 1, 4),
        "grammar_ms_per_step_median": round(grammar, 3),
        "grammar_share_of_none_step": round(grammar / none_ms, 4),
    }, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    libs = sub.add_parser("libs")
    libs.add_argument("--steps", type=int, default=200)
    libs.add_argument("--seed", type=int, default=0)
    libs.add_argument("--library", choices=("xgrammar", "llguidance"))
    engine = sub.add_parser("engine")
    engine.add_argument("--running", type=int, default=32)
    engine.add_argument("--steps", type=int, default=16)
    engine.add_argument("--warmup", type=int, default=3)
    engine.add_argument("--rounds", type=int, default=4)
    engine.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    {"libs": cmd_libs, "engine": cmd_engine}[args.command](args)


if __name__ == "__main__":
    main()
