"""The model families' floors on the CPU, each family as its tiny random model (worker/model/tiny.py, FAMILIES).

    .venv/bin/python -m benchmarks.bench_families --num-requests 32 --threads 1

(a) throughput: one offline trace (every request at t=0, EOS ignored) through our engine (continuous policy) and
    through transformers' continuous batching (`hf-cb`, benchmarks/lib/hf_systems.py: paged sdpa, same token budget,
    request limit, KV budget and page size); output tokens per second of each and their ratio. Where transformers'
    continuous batching fails on a family, its padded batched `generate` (`hf-static`) stands in, and the row
    says so. Floor: ours >= 2x.
(b) mixture of experts: decode step time of a Mixtral layout with E experts and top-k routing against a dense
    Mistral of the same shape whose MLP is k experts wide (the same active parameters), the same requests
    decoding in both; median over alternating repetitions. Floor: MoE <= 1.5x dense.
(c) sliding window: one request of a Mistral windowed on every layer generating 8x its window, beside a few
    shorter ones; the most blocks any decoding request held, read from the engine's block pool, against
    window / block_size + 1 (one layer group: every layer has the window); and the same with the freeing off.

A table is printed and the figures written as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_engine import run_engine
from benchmarks.lib.hf_systems import HFBaselines
from benchmarks.lib.run_result import compute_metrics
from benchmarks.lib.settings import DEFAULT_MODEL, engine_settings, set_threads
from benchmarks.lib.trace import TraceConfig, generate_trace
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.pull import resolve_model
from worker.model.runner import ModelRunner
from worker.model.tiny import FAMILIES, build_tiny_family, build_tiny_model

MAX_MODEL_LEN = 1024


def throughput(tokenizer_dir: Path, work: Path, name: str, num_requests: int, seed: int) -> dict:
    path = build_tiny_family(work / name, tokenizer_dir, name)
    runner = ModelRunner(path, engine_settings("continuous", MAX_MODEL_LEN))
    trace = generate_trace(TraceConfig(rate=0, num_requests=num_requests, profile="cpu", seed=seed,
                                       vocab_size=runner.vocab_size))
    ours = compute_metrics(run_engine(LLMEngine(engine_settings("continuous", MAX_MODEL_LEN), runner=runner),
                                      trace, "continuous"))
    baselines = HFBaselines(path)
    peer, why = "hf-cb", ""
    try:
        theirs = compute_metrics(baselines.run("hf-cb", trace))
        if theirs.get("num_errors") or not theirs["output_tokens_per_s"] > 0:
            raise RuntimeError(f"hf-cb finished with errors: {theirs.get('num_errors')}")
    except Exception as exc:  # noqa: BLE001 - a family transformers' continuous batching cannot run
        peer, why = "hf-static", f"{type(exc).__name__}: {str(exc)[:160]}"
        theirs = compute_metrics(baselines.run("hf-static", trace))
    ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    return {"family": name, "architecture": FAMILIES[name][0], "ours_tok_s": ours["output_tokens_per_s"],
            "peer": peer, "peer_tok_s": theirs["output_tokens_per_s"], "ratio": ratio, "peer_fallback_reason": why,
            "floor_ok": ratio >= 2.0}


def _decoding_engine(path: Path, num_seqs: int, prompt_len: int, num_steps: int) -> LLMEngine:
    engine = LLMEngine(engine_settings("continuous", MAX_MODEL_LEN, max_num_seqs=num_seqs), runner=ModelRunner(
        path, engine_settings("continuous", MAX_MODEL_LEN, max_num_seqs=num_seqs)))
    for i in range(num_seqs):
        prompt = [1000 + (i * 37 + j * 11) % 20000 for j in range(prompt_len)]
        engine.add_request(EngineRequest(f"d{i}", prompt_token_ids=prompt, sampling=SamplingParams(
            max_new_tokens=num_steps + 64, ignore_eos=True)))
    while not (engine.scheduler.num_running == num_seqs
               and all(r.num_output_tokens >= 2 for r in engine.scheduler.running)):
        engine.step()
    return engine


def moe_vs_dense(tokenizer_dir: Path, work: Path, num_experts: int, top_k: int, expert_size: int, hidden: int,
                 num_seqs: int, num_steps: int, reps: int) -> dict:
    shape = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                 num_hidden_layers=4)
    moe_path = build_tiny_model(work / "moe", tokenizer_dir, "MixtralForCausalLM", seed=1,
                                intermediate_size=expert_size,
                                num_local_experts=num_experts, num_experts_per_tok=top_k, **shape)
    dense_path = build_tiny_model(work / "dense", tokenizer_dir, "MistralForCausalLM", seed=1,
                                  intermediate_size=top_k * expert_size, **shape)
    engines = {"moe": _decoding_engine(moe_path, num_seqs, 32, num_steps * reps),
               "dense": _decoding_engine(dense_path, num_seqs, 32, num_steps * reps)}
    times: dict[str, list[float]] = {"moe": [], "dense": []}
    for _ in range(reps):  # alternating, so the machine's drift hits both
        for name, engine in engines.items():
            start = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / num_steps)
    moe, dense = statistics.median(times["moe"]), statistics.median(times["dense"])
    return {"num_experts": num_experts, "top_k": top_k, "expert_intermediate": expert_size, "hidden": hidden,
            "dense_intermediate": top_k * expert_size, "num_seqs": num_seqs, "moe_step_ms": 1e3 * moe,
            "dense_step_ms": 1e3 * dense, "ratio": moe / dense, "floor_ok": moe / dense <= 1.5,
            "moe_step_ms_all": [1e3 * t for t in times["moe"]], "dense_step_ms_all": [1e3 * t for t in times["dense"]]}


def window_blocks(tokenizer_dir: Path, work: Path, window: int, block_size: int, freeing: bool) -> dict:
    path = work / "mistral-window"
    if not path.exists():
        build_tiny_model(path, tokenizer_dir, "MistralForCausalLM", seed=2, num_hidden_layers=2, sliding_window=window)
    settings = engine_settings("continuous", MAX_MODEL_LEN, block_size=block_size, num_kv_blocks=256)
    runner = ModelRunner(path, settings)
    if not freeing:
        runner.kv_window = None
    engine = LLMEngine(settings, runner=runner)
    lengths = {"long": 8 * window, "b": 2 * window, "c": 3 * window, "d": window}
    for i, (request_id, num_new) in enumerate(lengths.items()):
        prompt = [2000 + (i * 53 + j * 7) % 20000 for j in range(window // 2 + 3 * i)]
        engine.add_request(EngineRequest(request_id, prompt_token_ids=prompt, sampling=SamplingParams(
            max_new_tokens=num_new, ignore_eos=True)))
    most_held = dict.fromkeys(lengths, 0)
    most_used = 0
    while engine.has_unfinished():
        engine.step()
        pool = engine.scheduler.pool
        most_used = max(most_used, pool.num_used_blocks)
        for request in engine.scheduler.running:
            if request.num_computed_tokens >= request.num_tokens - 1:  # decoding
                held = len(request.block_ids) - request.num_freed_blocks
                most_held[request.request_id] = max(most_held[request.request_id], held)
    bound = window // block_size + 1
    return {"window": window, "block_size": block_size, "freeing": freeing, "long_new_tokens": lengths["long"],
            "most_held_per_request": most_held, "most_blocks_in_use": most_used, "bound": bound,
            "window_freed": engine.scheduler.pool.num_window_freed,
            "floor_ok": max(most_held.values()) <= bound}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe-reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    results: dict = {"threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = [throughput(tokenizer_dir, work, name, args.num_requests, args.seed)
                for name in args.families.split(",")]
        results["throughput"] = rows
        print(f"(a) output tok/s, {args.num_requests} requests offline, torch threads {threads}")
        print("| family | ours | peer | peer tok/s | ours / peer | >= 2x |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['family']} | {r['ours_tok_s']:.0f} | {r['peer']} | {r['peer_tok_s']:.0f} | {r['ratio']:.2f} "
                  f"| {'yes' if r['floor_ok'] else 'NO'} |")
            if r["peer_fallback_reason"]:
                print(f"  ({r['family']}: hf-cb failed, {r['peer_fallback_reason']})")
        moe = moe_vs_dense(tokenizer_dir, work, num_experts=8, top_k=2, expert_size=512, hidden=256, num_seqs=32,
                           num_steps=10, reps=args.moe_reps)
        results["moe"] = moe
        print(f"\n(b) decode step, {moe['num_seqs']} requests: MoE E={moe['num_experts']} k={moe['top_k']} "
              f"(expert {moe['expert_intermediate']}) {moe['moe_step_ms']:.2f} ms vs dense (MLP "
              f"{moe['dense_intermediate']}) {moe['dense_step_ms']:.2f} ms: {moe['ratio']:.2f}x "
              f"({'<=' if moe['floor_ok'] else 'NOT <='} 1.5x)")
        results["window"] = [window_blocks(tokenizer_dir, work, 64, 16, freeing) for freeing in (True, False)]
        print("\n(c) most KV blocks a decoding request held, window 64, blocks of 16, longest request 8x the window")
        print("| freeing | per request | most in use | bound (window/bs + 1) | within |")
        print("|---|---|---|---|---|")
        for w in results["window"]:
            print(f"| {'on' if w['freeing'] else 'off'} | {w['most_held_per_request']} | {w['most_blocks_in_use']} "
                  f"| {w['bound']} | {'yes' if w['floor_ok'] else 'no'} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    ok = all(r["floor_ok"] for r in rows) and moe["floor_ok"] and results["window"][0]["floor_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
