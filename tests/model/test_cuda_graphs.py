"""The bucketed decode path of ENGINE_CUDA_GRAPHS (worker/model/cuda_graphs.py), on the CPU: the same padded
static-buffer path that CUDA captures and replays, run eagerly. Greedy tokens equal the normal path's across
batch sizes that hit every bucket with padding rows, through preemption and mixed prefill/decode steps; the
padding rows touch no request's KV blocks. (Capture and replay themselves need a GPU:
benchmarks/gpu_engine_check.py checks them there.)"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.model.batch import BLOCK, assert_logits_close, random_tokens, tiny_settings
from worker.model.settings import EngineSettings
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.cuda_graphs import BucketedInput, batch_sizes, default_batch_sizes, graph_mode, pick_bucket
from worker.model.runner import ModelRunner
from worker.model.step_batch import StepRequests

# ---- bucket choice ------------------------------------------------------------------------------------------


def test_default_batch_sizes_follow_vllm_capped_at_max_num_seqs():
    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(8) == [1, 2, 4, 8]
    assert default_batch_sizes(3) == [1, 2, 3]
    assert default_batch_sizes(1) == [1]


def test_configured_batch_sizes_are_sorted_and_checked():
    assert batch_sizes([], 16) == [1, 2, 4, 8, 16]
    assert batch_sizes([8, 2, 8, 5], 16) == [2, 5, 8]
    with pytest.raises(ValueError):
        batch_sizes([0, 4], 16)
    with pytest.raises(ValueError):
        batch_sizes([32], 16)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        EngineSettings(max_num_seqs=16, cuda_graph_batch_sizes=[4, 32])


def test_pick_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16, 24]
    expected = {0: None, 1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 24: 24, 25: None, 100: None}
    assert {n: pick_bucket(sizes, n) for n in expected} == expected
    for n in range(1, 25):  # the property, exhaustively
        bucket = pick_bucket(sizes, n)
        assert bucket >= n and all(s < n for s in sizes if s < bucket)
    assert pick_bucket([3], 1) == 3 and pick_bucket([3], 4) is None


@pytest.mark.parametrize(("setting", "device", "backend", "interpreted", "expected"), [
    ("auto", "cuda", "triton", False, "capture"),
    ("auto", "cuda", "torch", False, None),
    ("auto", "cuda", "triton", True, None),
    ("auto", "cpu", "torch", False, None),
    ("auto", "cpu", "triton", True, None),
    ("on", "cuda", "triton", False, "capture"),
    ("on", "cpu", "torch", False, "eager"),
    ("on", "cpu", "triton", True, "eager"),
    ("on", "cuda", "triton", True, "eager"),
    ("off", "cuda", "triton", False, None),
    ("off", "cpu", "torch", False, None),
])
def test_graph_mode(setting, device, backend, interpreted, expected):
    assert graph_mode(setting, device, backend, interpreted) == expected


def test_on_refuses_cuda_with_the_torch_backend():
    with pytest.raises(ValueError, match="triton"):
        graph_mode("on", "cuda", "torch", False)


# ---- the runner: one hand-built step at a time ---------------------------------------------------------------


@pytest.fixture(scope="module")
def runners(tiny_model_path: Path) -> tuple[ModelRunner, ModelRunner]:
    """(off, on): the same weights, the normal path and the bucketed one (buckets 1, 2, 4, 8)."""
    off = ModelRunner(tiny_model_path, tiny_settings(cuda_graphs="off", max_num_seqs=8))
    on = ModelRunner(tiny_model_path, tiny_settings(cuda_graphs="on", max_num_seqs=8))
    return off, on


def test_on_runs_bucketed_eagerly_on_the_cpu_with_one_reserved_block(runners):
    off, on = runners
    assert off.graphs is None and off.kv_cache.shape[2] == off.num_blocks == 64
    assert on.graph_mode == "eager" and on.graphs.sizes == [1, 2, 4, 8] and not on.graphs.replay
    assert on.num_blocks == 64 and on.kv_cache.shape[2] == 65  # the engine never sees block 64
    assert on.graphs.pad_block == 64


@pytest.mark.parametrize("setting", ["auto", "on"])
def test_a_failed_capture_falls_back_to_eager_under_auto_and_fails_under_on(tiny_model_path: Path, monkeypatch,
                                                                              setting: str):
    import worker.model.runner as runner_module
    from worker.model.cuda_graphs import DecodeGraphs

    def fail(self):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(runner_module, "graph_mode", lambda *args: "capture")  # as on CUDA
    monkeypatch.setattr(DecodeGraphs, "capture", fail)
    settings = tiny_settings(cuda_graphs=setting, max_num_seqs=4)
    if setting == "on":
        with pytest.raises(RuntimeError, match="capture failed"):
            ModelRunner(tiny_model_path, settings)
        return
    runner = ModelRunner(tiny_model_path, settings)
    assert runner.graphs is None and runner.graph_mode is None
    step = _step(["a"], [[1]], [0], [[5]])
    assert not isinstance(runner.prepare_input(step), BucketedInput)


def test_capture_graphs_false_keeps_the_bucketed_path_eager(tiny_model_path: Path, monkeypatch):
    import worker.model.runner as runner_module

    monkeypatch.setattr(runner_module, "graph_mode", lambda *args: "capture")
    runner = ModelRunner(tiny_model_path, tiny_settings(cuda_graphs="on", max_num_seqs=4), capture_graphs=False)
    assert runner.graph_mode == "eager" and not runner.graphs.replay


def _step(ids: list[str], tables: list[list[int]], computed: list[int], new_tokens: list[list[int]],
          samples: list[bool] | None = None) -> StepRequests:
    return StepRequests(request_ids=ids, block_ids=tables, num_computed=computed, num_new=[len(t) for t in new_tokens],
                        samples=samples or [True] * len(ids), input_ids=[t for ts in new_tokens for t in ts])


def test_bucketed_decode_steps_match_the_normal_path_and_touch_only_their_own_blocks(runners):
    off, on = runners
    for runner in runners:
        runner.reset()
        runner.kv_cache.zero_()
    ids = ["a", "b", "c"]
    prompts = {rid: random_tokens(n, seed=40 + n) for rid, n in zip(ids, (5, 9, 2))}
    tables = {"a": [3, 4, 5, 6], "b": [10, 11, 12, 13, 14], "c": [20, 21, 22]}
    prefill = _step(ids, [tables[r] for r in ids], [0, 0, 0], [prompts[r] for r in ids])
    assert not isinstance(on.prepare_input(prefill), BucketedInput)  # prefill tokens: the normal path
    logits = off.execute(off.prepare_input(prefill))
    torch.testing.assert_close(on.execute(on.prepare_input(prefill)), logits, rtol=0, atol=0)
    lengths = {r: len(p) for r, p in prompts.items()}
    next_ids = dict(zip(ids, logits.argmax(-1).tolist()))
    # 3 rows padded to bucket 4; 2 rows (c sits out) in bucket 2; 3 rows of which b does not sample.
    plan = [(ids, None), (ids, None), (["a", "b"], None), (ids, [True, False, True]), (ids, None)]
    for active, samples in plan:
        decode = _step(active, [tables[r] for r in active], [lengths[r] for r in active],
                       [[next_ids[r]] for r in active], samples)
        bucketed = on.prepare_input(decode)
        assert isinstance(bucketed, BucketedInput) and bucketed.num_rows == len(active)
        assert bucketed.bucket == (2 if len(active) == 2 else 4)
        expected = off.execute(off.prepare_input(decode))
        got = on.execute(bucketed)
        assert got.shape == expected.shape == (sum(decode.samples), 49152)
        assert_logits_close(got, expected)
        sampled = [r for r, s in zip(active, decode.samples) if s]
        next_ids.update(zip(sampled, expected.argmax(-1).tolist()))
        for r in active:
            lengths[r] += 1
    # Every block a request owns holds the same K/V on both paths; only the reserved block differs.
    torch.testing.assert_close(on.kv_cache[:, :, :64], off.kv_cache, atol=1e-5, rtol=1e-5)
    assert on.kv_cache[:, :, 64].abs().sum() > 0  # the padding rows wrote there
    assert on.graphs.steps_by_bucket == {4: 4, 2: 1} and on.graphs.num_padding_rows == 4


def test_decode_batches_past_the_largest_bucket_run_unpadded(tiny_model_path: Path):
    runner = ModelRunner(tiny_model_path, tiny_settings(cuda_graphs="on", max_num_seqs=8, cuda_graph_batch_sizes=[2]))
    step = _step(["a", "b", "c"], [[1], [2], [3]], [0, 0, 0], [[5], [6], [7]])
    assert not isinstance(runner.prepare_input(step), BucketedInput)
    step = _step(["a", "b"], [[1], [2]], [1, 1], [[5], [6]])
    assert runner.prepare_input(step).bucket == 2


# ---- the engine: token for token, through preemption and mixed steps -----------------------------------------


def make_trace(seed: int = 1) -> list[tuple[int, EngineRequest]]:
    """(arrival step, request): staggered arrivals and lengths so the running batch takes every size from 1 to
    8; two long requests arrive last and finish alone (bucket 1)."""
    rng = random.Random(seed)
    trace = []
    for i in range(14):
        prompt = [rng.randrange(200, 20000) for _ in range(rng.randint(3, 70))]
        trace.append((rng.randint(0, 14), prompt, rng.randint(1, 24)))
    trace += [(16, [rng.randrange(200, 20000) for _ in range(12)], 40), (17, [4242, 77], 34)]
    return sorted(((step, EngineRequest(f"r{i}", prompt_token_ids=prompt,
                                        sampling=SamplingParams(max_new_tokens=n, ignore_eos=i % 3 == 0)))
                   for i, (step, prompt, n) in enumerate(trace)), key=lambda item: item[0])


def run_trace(engine: LLMEngine, trace) -> tuple[dict[str, list[int]], int]:
    tokens: dict[str, list[int]] = {}
    pending, step = list(trace), 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            request = pending.pop(0)[1]
            tokens[request.request_id] = []
            assert engine.add_request(request) == []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
        assert step < 2000
    return tokens, engine.num_steps


def engine_settings(model_path: Path, cuda_graphs: str, **overrides) -> EngineSettings:
    values = dict(model=str(model_path), device="cpu", dtype="float32", attention_backend="torch", block_size=BLOCK,
                  num_kv_blocks=40, max_num_batched_tokens=48, max_num_seqs=8, cuda_graphs=cuda_graphs)
    return EngineSettings(**{**values, **overrides})


@pytest.fixture(scope="module")
def normal_tokens(tiny_model_path: Path) -> dict[str, list[int]]:
    engine = LLMEngine(engine_settings(tiny_model_path, "off"))
    tokens, _ = run_trace(engine, make_trace())
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemptions"
    return tokens


@pytest.mark.slow  # ~3 s: in the full suite, not the fast subset
def test_bucketed_engine_matches_the_normal_path_token_for_token(tiny_model_path: Path, normal_tokens):
    engine = LLMEngine(engine_settings(tiny_model_path, "on"))
    tokens, num_steps = run_trace(engine, make_trace())
    assert tokens == normal_tokens
    graphs = engine.runner.graphs
    assert engine.scheduler.num_preemptions > 0
    assert set(graphs.steps_by_bucket) == {1, 2, 4, 8}, graphs.steps_by_bucket
    assert graphs.num_padding_rows > 0
    assert num_steps > sum(graphs.steps_by_bucket.values()), "prefill and mixed steps were meant to run unpadded"
    engine.scheduler.check_invariants()


@pytest.mark.slow  # ~1 s: in the full suite, not the fast subset
def test_configured_sizes_leave_larger_batches_unpadded_and_still_match(tiny_model_path: Path, normal_tokens):
    engine = LLMEngine(engine_settings(tiny_model_path, "on", cuda_graph_batch_sizes=[3, 5]))
    tokens, _ = run_trace(engine, make_trace())
    assert tokens == normal_tokens
    assert set(engine.runner.graphs.steps_by_bucket) == {3, 5}


@pytest.mark.slow  # in the full suite, not the fast subset
def test_calibration_runs_through_the_bucketed_path(tiny_model_path: Path):
    from worker.engine.calibrate import calibrate

    engine = LLMEngine(engine_settings(tiny_model_path, "on", max_num_batched_tokens=32, num_kv_blocks=64))
    points = calibrate(engine, repeats=1)
    assert 8 in [tokens for tokens, _ in points] and all(seconds > 0 for _, seconds in points)
    assert engine.runner.graphs.steps_by_bucket.get(8)  # the decode batch ran bucketed
    stats = engine.stats()
    assert stats.step_time_base_s + stats.step_time_per_token_s * 32 > 0
    assert not engine.has_unfinished() and stats.num_steps == 0 and stats.kv_usage == 0.0
    assert np.isfinite(stats.step_time_per_token_s)
