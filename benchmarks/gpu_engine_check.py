"""The engine end to end on a GPU (benchmarks/gpu_check.sh runs it), in parts, each under its own time limit.

Per model shape (SmolLM2-135M and Llama-3.2-1B, random weights built on the machine: benchmarks/lib/random_model.py):
  load     the bf16 runner, its CUDA graphs captured (time and memory of the capture)
  graphs   greedy tokens of one workload (staggered arrivals, every bucket, padding rows, mixed steps, a KV budget
           that forces preemption) three ways on the same weights: CUDA-graph replay, the same bucketed path run
           eagerly (must be equal: the same kernels on the same shapes), and ENGINE_CUDA_GRAPHS=off; in bf16 the
           padded batch's other GEMM shapes may round differently, so replay vs off is reported there and must be
           equal in float32 (a second runner)
  steps    decode step times at several batch sizes, replay vs off, and the prefill steps on the way, against the
           simulated H200's prediction for the same step (worker/model/sim.py step_cost)
  systems  one offline trace (benchmarks/lib/trace.py) through continuous batching (graphs and eager), the static
           policy, the simulated H200 and transformers' continuous batching (benchmarks/lib/hf_systems.py)
  fp8      where the GPU has FP8 tensor cores (compute capability 8.9+; in --smoke, the CPU's reference product):
           a runner with ENGINE_QUANTIZATION=fp8 on the same weights, its graphs captured, and the steps part
           again, to set its step times beside bf16's

Results: results.json in --out, rewritten after every part, so a part that fails or runs out of time leaves the
others' results; the exit status is 0 only if every part ran and every token check held. --smoke runs it all on
the CPU in seconds (two tiny shapes, float32, the bucketed path eagerly: nothing is captured there), so a test
catches Python errors before the script meets a GPU.

    python benchmarks/gpu_engine_check.py --out DIR [--budget-s 280] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the GPU machine has the tree, not an install

from benchmarks.bench_engine import run_engine
from benchmarks.lib.check_parts import PartTimeout, Report
from benchmarks.lib.random_model import build_random_model
from benchmarks.lib.run_result import compute_metrics
from benchmarks.lib.settings import engine_settings, set_threads
from benchmarks.lib.trace import TraceConfig, generate_trace, max_request_len
from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.runner import ModelRunner
from worker.model.sim import DEVICES, ModelShape, step_cost
from worker.model.tiny import TINY_CONFIG

log = logging.getLogger("gpu_engine_check")
BLOCK_SIZE = 16


def tiny_shape(num_layers: int) -> dict:
    return {**TINY_CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048,
            "num_hidden_layers": num_layers, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str
    models: tuple[tuple[str, str | dict], ...]
    max_model_len: int
    max_num_seqs: int
    """The runners' (and so the largest CUDA graph's) batch size."""
    max_num_batched_tokens: int
    num_kv_blocks: int
    graph_requests: int
    graph_prompt: tuple[int, int]
    graph_output: int
    graph_kv_blocks: int
    """The engine's block pool in the graphs part: small enough to preempt."""
    step_batches: tuple[int, ...]
    step_prompt: int
    step_decode_steps: int
    trace_requests: int
    trace_profile: str
    limits: dict[str, float] = field(default_factory=dict)
    """Seconds per part (per model for all but build)."""


FULL = Plan(
    device="cuda", dtype="bfloat16", models=(("smollm2-135m", "smollm2-135m"), ("llama-3.2-1b", "llama-3.2-1b")),
    max_model_len=2048, max_num_seqs=128, max_num_batched_tokens=2048, num_kv_blocks=8192,
    graph_requests=40, graph_prompt=(8, 300), graph_output=32, graph_kv_blocks=200,
    step_batches=(1, 8, 32, 64, 128), step_prompt=512, step_decode_steps=20,
    trace_requests=64, trace_profile="full",
    limits={"build": 90, "load": 75, "graphs": 75, "steps": 45, "systems": 90},
)
SMOKE = Plan(
    device="cpu", dtype="float32", models=(("tiny-2-layers", tiny_shape(2)), ("tiny-3-layers", tiny_shape(3))),
    max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256,
    graph_requests=8, graph_prompt=(3, 40), graph_output=4, graph_kv_blocks=16,
    step_batches=(1, 3, 8), step_prompt=20, step_decode_steps=2,
    trace_requests=4, trace_profile="tiny",
    limits={"build": 60, "load": 30, "graphs": 60, "steps": 30, "systems": 90},
)


def environment() -> dict:
    import transformers
    import triton

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    return env


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- runners and decode paths ----------------------------------------------------------------------------------


def load_runner(folder: Path, plan: Plan, dtype: str, max_num_seqs: int | None = None,
                quantization: str = "none") -> ModelRunner:
    settings = EngineSettings(
        model=str(folder), device=plan.device, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=plan.num_kv_blocks,
        max_model_len=plan.max_model_len, max_num_seqs=max_num_seqs or plan.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens, cuda_graphs="on", quantization=quantization,
    )
    return ModelRunner(folder, settings)


def has_fp8_product(plan: Plan) -> bool:
    """FP8 tensor cores on the plan's GPU, or the smoke plan's CPU (torch's reference product, for the code path)."""
    return plan.device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)


def paths_of(runner: ModelRunner) -> tuple[str, ...]:
    """The decode paths a runner can take: replay (captured graphs), bucketed (the same, eagerly), off."""
    return ("replay", "bucketed", "off") if runner.graphs is not None and runner.graphs.replay else ("bucketed", "off")


@contextmanager
def decode_path(runner: ModelRunner, path: str) -> Iterator[None]:
    graphs = runner.graphs
    replay = graphs.replay if graphs is not None else False
    try:
        if path == "off":
            runner.graphs = None
        elif path == "bucketed":
            graphs.replay = False
        elif path != "replay" or not replay:
            raise ValueError(f"no {path} path on this runner")
        yield
    finally:
        runner.graphs = graphs
        if graphs is not None:
            graphs.replay = replay


@contextmanager
def kv_blocks(runner: ModelRunner, num_blocks: int) -> Iterator[None]:
    """An engine built inside sees only the first `num_blocks` blocks (the runner's cache is larger)."""
    full = runner.num_blocks
    runner.num_blocks = min(num_blocks, full)
    try:
        yield
    finally:
        runner.num_blocks = full


# ---- part: graphs (token checks) -------------------------------------------------------------------------------


def greedy_trace(plan: Plan, vocab_size: int, seed: int = 0) -> list[tuple[int, EngineRequest]]:
    """(arrival step, request): staggered arrivals, so the decode batch takes many sizes; a late long one ends
    alone (batch 1)."""
    rng = random.Random(seed)
    low, high = min(1000, vocab_size // 4), min(vocab_size, 128000)
    trace = []
    for i in range(plan.graph_requests):
        prompt = [rng.randrange(low, high) for _ in range(rng.randint(*plan.graph_prompt))]
        trace.append((rng.randint(0, plan.graph_requests), prompt, plan.graph_output))
    trace.append((plan.graph_requests + 4, [rng.randrange(low, high) for _ in range(5)], 3 * plan.graph_output))
    return sorted(((step, EngineRequest(f"g{i}", prompt_token_ids=prompt,
                                        sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)))
                   for i, (step, prompt, n) in enumerate(trace)), key=lambda item: item[0])


GREEDY_MAX_NUM_SEQS = 64


def run_greedy(runner: ModelRunner, plan: Plan, trace) -> dict:
    settings = EngineSettings(model=str(runner.model_path), block_size=BLOCK_SIZE, max_model_len=plan.max_model_len,
                              max_num_seqs=min(GREEDY_MAX_NUM_SEQS, plan.max_num_seqs), max_num_batched_tokens=256)
    with kv_blocks(runner, plan.graph_kv_blocks):
        engine = LLMEngine(settings, runner=runner)
    before = dict(runner.graphs.steps_by_bucket) if runner.graphs is not None else {}
    tokens: dict[str, list[int]] = {}
    pending, step = list(trace), 0
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            request = pending.pop(0)[1]
            tokens[request.request_id] = []
            engine.add_request(request)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
        if step > 20_000:
            raise RuntimeError("the greedy workload did not finish")
    after = runner.graphs.steps_by_bucket if runner.graphs is not None else {}
    return {"tokens": tokens, "num_steps": engine.num_steps, "preemptions": engine.scheduler.num_preemptions,
            "seconds": round(time.perf_counter() - started, 3),
            "steps_by_bucket": {b: n - before.get(b, 0) for b, n in sorted(after.items()) if n > before.get(b, 0)}}


def compare(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    total = sum(len(t) for t in a.values())
    agree = 0
    diverged = {}
    for rid, tokens in a.items():
        other = b.get(rid, [])
        n = next((i for i, (x, y) in enumerate(zip(tokens, other)) if x != y), min(len(tokens), len(other)))
        agree += n
        if tokens != other:
            diverged[rid] = n
    return {"equal": a == b, "tokens": total, "tokens_before_first_divergence": agree,
            "requests_diverged": len(diverged), "first_divergence": dict(list(diverged.items())[:8])}


def part_graphs(report: Report, name: str, runner: ModelRunner, folder: Path, plan: Plan, result: dict) -> None:
    trace = greedy_trace(plan, runner.vocab_size)
    runs = {}
    for path in paths_of(runner):
        with decode_path(runner, path):
            runs[path] = run_greedy(runner, plan, trace)
        result[f"{plan.dtype}_{path}"] = {k: v for k, v in runs[path].items() if k != "tokens"}
    reference = runs.get("replay", runs["bucketed"])["tokens"]
    if "replay" in runs:
        same = compare(reference, runs["bucketed"]["tokens"])
        report.check(f"{name}: {plan.dtype} replay == bucketed eager", same["equal"], same)
        result[f"{plan.dtype}_replay_vs_off"] = compare(reference, runs["off"]["tokens"])  # reported, not checked
        print(f"  {name}: {plan.dtype} replay vs off: {result[f'{plan.dtype}_replay_vs_off']}", flush=True)
    else:
        same = compare(reference, runs["off"]["tokens"])
        report.check(f"{name}: {plan.dtype} bucketed eager == off", same["equal"], same)
    buckets = runs[paths_of(runner)[0]]["steps_by_bucket"]
    result["buckets_hit"] = sorted(buckets)
    # Then a float32 runner on the same weights, where rounding cannot flip a greedy token: its first path (replay
    # on CUDA) must give the tokens of `off`. (In --smoke the first runner is float32 already; the second one
    # runs anyway, so this code meets the CPU too.) Graphs only up to the workload's largest batch: fewer
    # captures, and fewer float32 kernels to compile.
    fp32 = load_runner(folder, plan, "float32", max_num_seqs=min(GREEDY_MAX_NUM_SEQS, plan.max_num_seqs))
    try:
        first = paths_of(fp32)[0]
        fp32_runs = {}
        for path in (first, "off"):
            with decode_path(fp32, path):
                fp32_runs[path] = run_greedy(fp32, plan, trace)
            result[f"float32_runner_{path}"] = {k: v for k, v in fp32_runs[path].items() if k != "tokens"}
        same = compare(fp32_runs[first]["tokens"], fp32_runs["off"]["tokens"])
        report.check(f"{name}: float32 runner {first} == off", same["equal"], same)
    finally:
        del fp32
        if plan.device == "cuda":
            torch.cuda.empty_cache()


# ---- part: steps (real step times vs the simulator) ------------------------------------------------------------


@contextmanager
def instrumented(runner: ModelRunner, device: str, current: dict) -> Iterator[None]:
    """Per step: its shape (from input_from, which every step's input passes through just before its launch)
    and the forward's time to completion (execute, synchronized)."""
    input_from, execute = runner.input_from, runner.execute

    def timed_input_from(step, arrays):
        num_new = np.array(step.num_new)
        current.update(num_new=num_new, seq_lens=np.array(step.num_computed) + num_new,
                       num_sampled=int(sum(step.samples)))
        return input_from(step, arrays)

    def timed_execute(model_input, **kwargs):
        start = time.perf_counter()
        out = execute(model_input, **kwargs)
        sync(device)
        current.update(forward_s=time.perf_counter() - start, bucket=getattr(model_input, "bucket", None))
        return out

    runner.input_from, runner.execute = timed_input_from, timed_execute
    try:
        yield
    finally:
        del runner.input_from, runner.execute  # back to the class's methods


def part_steps(runner: ModelRunner, plan: Plan, result: dict) -> None:
    shape, profile = ModelShape.of(runner.config), DEVICES["h200"]
    current: dict = {}
    records: list[dict] = []
    result["records"] = records
    paths = ["replay", "off"] if "replay" in paths_of(runner) else ["bucketed", "off"]
    rng = random.Random(1)
    low, high = min(1000, runner.vocab_size // 4), min(runner.vocab_size, 128000)

    def step(engine: LLMEngine, kind: str, batch: int) -> None:
        started = time.perf_counter()
        engine.step()
        step_s = time.perf_counter() - started
        cost = step_cost(shape, profile, current["num_new"], current["seq_lens"], current["num_sampled"])
        records.append({"kind": kind, "batch": batch, "tokens": int(current["num_new"].sum()),
                        "bucket": current.get("bucket"), "step_s": step_s, "forward_s": current["forward_s"],
                        "predicted_s": cost.seconds, "predicted_memory_s": cost.memory_s,
                        "predicted_compute_s": cost.compute_s})

    with instrumented(runner, plan.device, current):
        for batch in plan.step_batches:
            if batch > plan.max_num_seqs:
                continue
            settings = EngineSettings(model=str(runner.model_path), block_size=BLOCK_SIZE,
                                      max_model_len=plan.max_model_len, max_num_seqs=batch,
                                      max_num_batched_tokens=plan.max_num_batched_tokens, enable_prefix_caching=False,
                                      async_scheduling="off")  # each step() is then one forward, timed whole
            engine = LLMEngine(settings, runner=runner)
            # Requests prefilled first decode while the others prefill: room for those steps too.
            num_prefill_steps = -(-batch * plan.step_prompt // plan.max_num_batched_tokens) + 1
            sampling = SamplingParams(max_new_tokens=len(paths) * plan.step_decode_steps + num_prefill_steps + 8,
                                      ignore_eos=True)
            for i in range(batch):
                prompt = [rng.randrange(low, high) for _ in range(plan.step_prompt)]
                engine.add_request(EngineRequest(f"s{batch}-{i}", prompt_token_ids=prompt, sampling=sampling))
            for _ in range(10_000):  # prefill every request (chunked), up to its first token
                if engine.scheduler.num_running == batch and all(r.num_output_tokens >= 1
                                                                 for r in engine.scheduler.running):
                    break
                step(engine, "prefill", batch)
            for path in paths:
                with decode_path(runner, path):
                    for _ in range(plan.step_decode_steps):
                        step(engine, f"decode-{path}", batch)
            engine.abort([r.request_id for r in list(engine.scheduler.running)])
    result["summary"] = summarize_steps(records)
    for row in result["summary"]:
        print("  " + json.dumps(row), flush=True)


def summarize_steps(records: list[dict]) -> list[dict]:
    rows = []
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        if r["kind"].startswith("decode"):
            groups.setdefault((r["kind"], r["batch"]), []).append(r)
        else:
            groups.setdefault(("prefill", r["tokens"]), []).append(r)
    for (kind, size), group in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1])):
        med = {key: statistics.median(r[key] for r in group) for key in ("step_s", "forward_s", "predicted_s")}
        rows.append({"kind": kind, "batch" if kind != "prefill" else "tokens": size, "n": len(group),
                     "step_ms": round(med["step_s"] * 1e3, 3), "forward_ms": round(med["forward_s"] * 1e3, 3),
                     "predicted_ms": round(med["predicted_s"] * 1e3, 3),
                     "forward_over_predicted": round(med["forward_s"] / med["predicted_s"], 2)})
    return rows


# ---- part: systems ---------------------------------------------------------------------------------------------


def part_systems(runner: ModelRunner, folder: Path, plan: Plan, result: dict) -> None:
    from benchmarks.lib.hf_systems import HFBaselines

    vocab = runner.vocab_size
    trace = generate_trace(TraceConfig(rate=math.inf, num_requests=plan.trace_requests, profile=plan.trace_profile,
                                       seed=0, min_token_id=min(1000, vocab // 4), vocab_size=min(vocab, 128000)))
    assert max_request_len(plan.trace_profile) <= plan.max_model_len
    limits = dict(device=plan.device, dtype=plan.dtype, max_num_seqs=min(64, plan.max_num_seqs),
                  max_batch_size=min(16, plan.max_num_seqs))
    result["trace"] = {"requests": len(trace.requests), "profile": plan.trace_profile,
                       "output_tokens": trace.num_output_tokens}
    runs: dict = {}
    result["runs"] = runs
    first_path = paths_of(runner)[0]

    def engine_run(system: str, policy: str, path: str) -> dict:
        with decode_path(runner, path):
            engine = LLMEngine(engine_settings(policy, plan.max_model_len, **limits), runner=runner)
            metrics = compute_metrics(run_engine(engine, trace, system))
        if path != "off":
            metrics["decode_path"] = path
        return metrics

    def sim_run() -> dict:
        settings = engine_settings("continuous", plan.max_model_len, **{**limits, "device": "sim:h200"},
                                   model=str(folder), num_kv_blocks=runner.num_blocks)
        metrics = compute_metrics(run_engine(LLMEngine(settings), trace, "sim-h200"))
        return metrics

    def hf_cb_run() -> dict:
        hf = HFBaselines(folder, kv_budget_tokens=runner.num_blocks * BLOCK_SIZE, device=plan.device,
                         dtype=getattr(torch, plan.dtype))
        return compute_metrics(hf.run("hf-cb", trace))

    systems = [("continuous", lambda: engine_run("continuous", "continuous", first_path)),
               ("static", lambda: engine_run("static", "static", first_path)),
               ("continuous-eager", lambda: engine_run("continuous-eager", "continuous", "off")),
               ("sim-h200", sim_run), ("hf-cb", hf_cb_run)]
    for system, run in systems:
        try:
            runs[system] = run()
            m = runs[system]
            print(f"  {system:<17} {m['output_tokens_per_s']:9.1f} tok/s  wall {m['wall_s']:.2f} s  "
                  f"done {m['num_completed']}/{m['num_requests']}", flush=True)
        except PartTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 (one system's failure leaves the others' results)
            runs[system] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(f"  {system}: {runs[system]['error']}", flush=True)
        finally:
            if plan.device == "cuda":
                torch.cuda.empty_cache()
    failed = failed_systems(runs)
    if failed:
        raise RuntimeError(f"systems failed: {failed}")


def failed_systems(runs: dict[str, dict]) -> dict[str, str]:
    """The systems that raised, or that ran but left requests unanswered (transformers' continuous batching logs
    an error in its own thread and returns what it has: on a CPU without psutil it completed 0 of 4)."""
    failed = {}
    for system, m in runs.items():
        if "error" in m:
            failed[system] = m["error"]
        elif m["num_completed"] < m["num_requests"]:
            failed[system] = f"completed {m['num_completed']} of {m['num_requests']} requests"
    return failed


# ---- main ------------------------------------------------------------------------------------------------------


def run_fp8(report: Report, name: str, folder: Path, plan: Plan) -> None:
    """The load and steps parts again with FP8 weights and activations (ENGINE_QUANTIZATION=fp8)."""
    holder: dict = {}

    def load(result: dict) -> None:
        runner = holder["runner"] = load_runner(folder, plan, plan.dtype, quantization="fp8")
        graphs = runner.graphs
        result.update(quantization=runner.quantization, graph_mode=runner.graph_mode,
                      capture_s=graphs.capture_s if graphs else None, num_kv_blocks=runner.num_blocks)

    report.run(f"{name}/fp8-load", plan.limits["load"], load)
    if "runner" in holder:
        report.run(f"{name}/fp8-steps", plan.limits["steps"], lambda result: part_steps(holder["runner"], plan, result))
    holder.clear()
    if plan.device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--json-name", default="results.json", help="the results file's name in --out")
    parser.add_argument("--models-dir", type=Path, help="where the random models are built (default: OUT/models)")
    parser.add_argument("--budget-s", type=float, default=280.0, help="all parts together; a part gets what is left")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in seconds")
    parser.add_argument("--models", help="comma-separated subset of the plan's model names")
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    set_threads(1 if args.smoke else None)  # tiny CPU forwards: more threads only spin against each other
    try:
        return run(args, plan)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, plan: Plan) -> int:
    models = [(n, s) for n, s in plan.models if not args.models or n in args.models.split(",")]
    report = Report(args.out, args.budget_s, args.json_name, environment())
    report.data["plan"] = {"smoke": args.smoke, "device": plan.device, "dtype": plan.dtype,
                           "models": [n for n, _ in models], "max_model_len": plan.max_model_len}
    models_dir = args.models_dir or args.out / "models"
    folders: dict[str, Path] = {}

    def build(result: dict) -> None:
        for name, shape in models:
            started = time.perf_counter()
            folders[name] = build_random_model(models_dir / name, shape, device=plan.device,
                                               dtype=getattr(torch, plan.dtype))
            result[name] = {"seconds": round(time.perf_counter() - started, 2)}

    report.run("build", plan.limits["build"], build)
    for name, _ in models:
        folder = folders.get(name)
        if folder is None:
            continue
        holder: dict = {}

        def load(result: dict, folder=folder, holder=holder) -> None:
            runner = holder["runner"] = load_runner(folder, plan, plan.dtype)
            graphs = runner.graphs
            result.update(graph_mode=runner.graph_mode, buckets=graphs.sizes if graphs else None,
                          capture_s=graphs.capture_s if graphs else None,
                          capture_mib=graphs.capture_bytes / 2**20 if graphs else None,
                          num_kv_blocks=runner.num_blocks)

        report.run(f"{name}/load", plan.limits["load"], load)
        runner = holder.get("runner")
        if runner is None:
            continue
        report.run(f"{name}/graphs", plan.limits["graphs"],
                   lambda result: part_graphs(report, name, runner, folder, plan, result))
        report.run(f"{name}/steps", plan.limits["steps"], lambda result: part_steps(runner, plan, result))
        report.run(f"{name}/systems", plan.limits["systems"],
                   lambda result: part_systems(runner, folder, plan, result))
        holder.clear()  # the runner's weights and KV cache go before the next model's
        runner = None
        if plan.device == "cuda":
            torch.cuda.empty_cache()
        if has_fp8_product(plan):
            run_fp8(report, name, folder, plan)
    report.write()
    print(f"results: {report.path}; all parts ran and every check held: {report.ok}", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("worker.model").setLevel(logging.INFO)  # device, dtype, KV cache, the graphs' capture
    raise SystemExit(main())
