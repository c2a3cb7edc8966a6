"""Time per output token of the default model at one request, for comparing trees: it uses only what every tree
since the paged engine has (EngineSettings, ModelRunner, LLMEngine.generate), and settings a tree lacks come
from ENGINE_* variables, which an older tree ignores. Four open-ended chat prompts, 96 tokens each (EOS
ignored), one at a time after a warm-up; prints one JSON line.

An older tree (a git worktree) against this one, the same interpreter, alternating:

    PYTHONPATH=/tmp/base .venv/bin/python benchmarks/probes/one_request_latency.py --label base
    ENGINE_QUANTIZATION=int8 .venv/bin/python benchmarks/probes/one_request_latency.py --label int8
"""

from __future__ import annotations

import argparse
import json
import os
import time

import worker
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.pull import ensure_default_model
from worker.model.runner import ModelRunner
from worker.model.settings import EngineSettings

PROMPTS = [
    "Tell me a story about a dragon who learns to bake bread.",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short poem about autumn in a city.",
    "Give me three ideas for a weekend trip and why each is fun.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    path = ensure_default_model()
    settings = EngineSettings(model=str(path), device="cpu", enable_prefix_caching=False)
    runner = ModelRunner(str(path), settings)
    engine = LLMEngine(settings, runner)

    def request(i: int, prompt: str) -> EngineRequest:
        return EngineRequest(f"r{i}", messages=[{"role": "user", "content": prompt}],
                             sampling=SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True))

    engine.generate([request(-1, PROMPTS[0])])
    start, tokens = time.perf_counter(), 0
    for i, prompt in enumerate(PROMPTS):
        tokens += sum(len(c.token_ids) for c in engine.generate([request(i, prompt)]).values())
    seconds = time.perf_counter() - start
    print(json.dumps({"label": args.label, "tree": os.path.dirname(os.path.dirname(worker.__file__)),
                      "dtype": str(runner.dtype), "quantization": getattr(settings, "quantization", None),
                      "ms_per_token": round(1000 * seconds / tokens, 2), "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
