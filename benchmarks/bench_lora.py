"""LoRA adapters on the CPU: what a batch that mixes adapters costs against the base model, and how long an
adapter takes to load.

  throughput  tokens/s of one batch of requests (prompt and output lengths fixed, EOS ignored) all on the base
              model, then the same batch spread round-robin over N adapters of rank r targeting every projection;
              the two alternate `--repeats` times and the best of each counts (other work on the machine only
              slows a run down). Reports both rates and their ratio.
  step        milliseconds of one decode forward of the batch (each request 64 tokens into its context), base
              against the adapters' rows side by side as the engine orders them: the minimum of `--step-repeats`
              alternating runs, which contention on a shared machine cannot lower.
  load        milliseconds to read and check one rank-r adapter of the model (every projection of every layer)
              from a warm page cache into a fresh registry: the median of `--load-repeats` loads.

Adapters are written in PEFT's file layout with random weights; the numbers depend on shapes, not values.

    python -m benchmarks.bench_lora --num-adapters 8 --rank 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.lora import GROUPS, AdapterRegistry, projection_shapes
from worker.model.pull import ensure_default_model
from worker.model.runner import ModelRunner


def write_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """An adapter in PEFT's layout (adapter_config.json, adapter_model.safetensors) on every projection."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for projection in (p for group in GROUPS.values() for p in group):
            out_size, in_size = shapes[projection]
            module = "self_attn" if projection in GROUPS["qkv"] + GROUPS["o"] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_size, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_size, rank, generator=generator) * 0.01
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [p for group in GROUPS.values() for p in group]}))


def run_batch(runner: ModelRunner, settings: EngineSettings, models: list[str | None], prompt_len: int,
              output_len: int) -> float:
    """Tokens (prompt and output) per second of the whole batch, from its first add to its last token."""
    engine = LLMEngine(settings, runner)
    requests = [EngineRequest(f"r{i}", prompt_token_ids=[100 + (7 * i + j) % 20000 for j in range(prompt_len)],
                              model=model, sampling=SamplingParams(max_new_tokens=output_len, ignore_eos=True))
                for i, model in enumerate(models)]
    start = time.perf_counter()
    done = engine.generate(requests)
    seconds = time.perf_counter() - start
    assert all(len(c.token_ids) == output_len for c in done.values())
    return len(models) * (prompt_len + output_len) / seconds


def step_ms(runner: ModelRunner, adapters: list[str | None], repeats: int) -> list[float]:
    """Minimum milliseconds of one decode forward with these adapters per request; the base's when all None."""
    from worker.model.step_batch import StepRequests

    context, block = 64, runner.block_size
    per_request = -(-(context + 1) // block)
    step = StepRequests(request_ids=[f"s{i}" for i in range(len(adapters))],
                        block_ids=[list(range(i * per_request, (i + 1) * per_request)) for i in range(len(adapters))],
                        num_computed=[context] * len(adapters), num_new=[1] * len(adapters),
                        samples=[True] * len(adapters), input_ids=[100] * len(adapters),
                        adapters=adapters if any(a is not None for a in adapters) else [])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(runner.prepare_input(step))
        times.append((time.perf_counter() - start) * 1000)
    runner.release(step.request_ids)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a model folder; default: the provisioned SmolLM2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--load-repeats", type=int, default=10)
    parser.add_argument("--step-repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(ensure_default_model())
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        settings = EngineSettings(model=model, device="cpu", dtype=args.dtype, adapters_dir=str(folder),
                                  max_loras=args.num_adapters, max_lora_rank=args.rank,
                                  max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.batch))
        runner = ModelRunner(model, settings)
        names = [f"adapter{i}" for i in range(args.num_adapters)]
        for i, name in enumerate(names):
            write_adapter(folder / name, runner.config, args.rank, seed=i)

        load_ms = []
        for _ in range(args.load_repeats):
            registry = AdapterRegistry(folder, runner.config, 1, args.rank, runner.device, runner.dtype)
            start = time.perf_counter()
            registry.get(names[0])
            load_ms.append((time.perf_counter() - start) * 1000)

        for name in names:
            runner.loras.get(name)
        sorted_models = sorted((names[i % len(names)] for i in range(args.batch)))
        base_step, mixed_step = [], []
        for _ in range(args.step_repeats // 5):
            base_step += step_ms(runner, [None] * args.batch, 5)
            mixed_step += step_ms(runner, sorted_models, 5)

        base_models = [None] * args.batch
        mixed_models = [names[i % len(names)] for i in range(args.batch)]
        run_batch(runner, settings, mixed_models[:4], 8, 2)  # warm-up: kernels, adapters loaded
        base, mixed = [], []
        for _ in range(args.repeats):
            base.append(run_batch(runner, settings, base_models, args.prompt_len, args.output_len))
            mixed.append(run_batch(runner, settings, mixed_models, args.prompt_len, args.output_len))
    result = {
        "model": Path(model).name, "dtype": str(runner.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "batch": args.batch, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "num_adapters": args.num_adapters, "rank": args.rank,
        "base_tokens_per_s": round(max(base), 1), "mixed_tokens_per_s": round(max(mixed), 1),
        "mixed_over_base": round(max(mixed) / max(base), 3),
        "all_base_runs": [round(x, 1) for x in base], "all_mixed_runs": [round(x, 1) for x in mixed],
        "step_ms_base_min": round(min(base_step), 2), "step_ms_mixed_min": round(min(mixed_step), 2),
        "step_mixed_over_base": round(min(mixed_step) / min(base_step), 3),
        "load_ms_median": round(statistics.median(load_ms), 1), "load_ms_max": round(max(load_ms), 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
