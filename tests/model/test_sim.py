"""The simulated accelerator: roofline arithmetic against hand-computed numbers, KV capacity, the runner's
deterministic logits and its wait (which must leave the GIL to other threads)."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest

from worker.model.settings import EngineSettings
from worker.model.sim import DEVICES, ModelShape, SimRunner, sim_config, step_cost
from worker.model.step_batch import StepRequests


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory) -> ModelShape:
    return ModelShape.of(sim_config("smollm2-135m", tmp_path_factory.mktemp("unused")))


@pytest.fixture(scope="module")
def llama8b_shape(tmp_path_factory) -> ModelShape:
    return ModelShape.of(sim_config("llama-3.1-8b", tmp_path_factory.mktemp("unused")))


def test_shapes_from_config_json_alone(smollm2_shape, llama8b_shape):
    # Layer matrices: q/k/v/o, gate/up/down and two norms. SmolLM2: 576 x (576 + 2 x 192) + 576 x 576
    # + 3 x 576 x 1536 + 2 x 576 = 3,540,096; Llama-3.1-8B: 4096 x 6144 + 4096^2 + 3 x 4096 x 14336 + 8192.
    assert smollm2_shape.layer_params == 3_540_096
    assert llama8b_shape.layer_params == 218_112_000
    # 134.5 M parameters (tied embeddings) and 8.03 B (untied), as the model cards say.
    assert smollm2_shape.weight_bytes_in_memory(tied=True) == 2 * 134_515_008
    assert llama8b_shape.weight_bytes_in_memory(tied=False) == 2 * 8_030_261_248
    assert smollm2_shape.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, bf16
    assert llama8b_shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_one_decode_step_by_hand(smollm2_shape):
    # Two requests decoding one token each, contexts of 10 and 20 after the step, both sampled, on an H200.
    cost = step_cost(smollm2_shape, DEVICES["h200"], np.array([1, 1]), np.array([10, 20]), num_sampled=2)
    weights = 2 * (30 * 3_540_096 + 576 + 49152 * 576)  # layers, final norm, LM head (the tied embedding)
    embedding_rows = 2 * 576 * 2
    kv = 23_040 * (30 + 2)  # the contexts read, the two new tokens written
    logits = 12 * 49152 * 2
    assert cost.bytes == weights + embedding_rows + kv + logits == 270_949_248
    # Matmuls over 2 tokens, the LM head over 2 rows, attention 4 x layers x heads x head_dim x (10 + 20).
    assert cost.flops == 2 * 30 * 3_540_096 * 2 + 2 * 49152 * 576 * 2 + 4 * 30 * 9 * 64 * 30 == 540_131_328
    assert cost.memory_s == pytest.approx(270_949_248 / 4.8e12)
    assert cost.compute_s == pytest.approx(540_131_328 / 989.4e12)
    assert cost.launch_s == pytest.approx(20e-6 + 30 * 8e-6)
    assert cost.seconds == pytest.approx(270_949_248 / 4.8e12 + 260e-6)  # memory-bound: about 0.32 ms


def test_a_prefill_chunk_counts_the_causal_context_of_each_new_token(smollm2_shape):
    # 4 new tokens after 6 cached ones attend to 7, 8, 9 and 10 positions.
    decode = step_cost(smollm2_shape, DEVICES["h100"], np.array([4]), np.array([10]), num_sampled=1)
    attention = 4 * 30 * 9 * 64 * (7 + 8 + 9 + 10)
    assert decode.flops == 2 * 30 * 3_540_096 * 4 + 2 * 49152 * 576 + attention


def test_llama_8b_decode_of_256_requests_takes_about_10_ms_on_an_h200(llama8b_shape):
    cost = step_cost(llama8b_shape, DEVICES["h200"], np.ones(256), np.full(256, 1024), num_sampled=256)
    assert 8e-3 < cost.seconds < 12e-3 and cost.memory_s > cost.compute_s  # decode is memory-bound
    prefill = step_cost(llama8b_shape, DEVICES["h200"], np.array([8192]), np.array([8192]), num_sampled=1)
    assert prefill.compute_s > prefill.memory_s  # a long prefill is compute-bound


def sim_settings(model_path, **overrides) -> EngineSettings:
    values = dict(model=str(model_path), device="sim:h200", sim_model="smollm2-135m", block_size=16,
                  max_num_seqs=8, max_model_len=1024)
    return EngineSettings(**{**values, **overrides})


def test_kv_capacity_is_the_gpu_memory_left_by_the_weights_and_nothing_is_allocated(tiny_model_path):
    runner = SimRunner(sim_settings(tiny_model_path, sim_model="llama-3.1-8b"), sleep=lambda s: None)
    assert runner.num_blocks == int((141e9 - 2 * 8_030_261_248) * 0.8) // (131_072 * 16)
    assert not hasattr(runner, "kv_cache") and not hasattr(runner, "model")
    assert runner.vocab_size == 128256 and runner.logits_width == 2048
    assert SimRunner(sim_settings(tiny_model_path, num_kv_blocks=77), sleep=lambda s: None).num_blocks == 77
    with pytest.raises(ValueError, match="sim:h100"):
        SimRunner(sim_settings(tiny_model_path, device="cuda"))


def test_special_tokens_past_the_logits_width_leave_every_id_below_it_ordinary(tmp_path, tiny_model_path):
    # Llama 3's specials start at 128000, far past the 2048 columns the simulator narrows logits to; a special
    # below the width (7 here) is still never produced.
    from benchmarks.lib.random_model import write_synthetic_tokenizer

    shutil.copy(tiny_model_path / "config.json", tmp_path)  # the folder is a model's; sim_model sets the shape
    write_synthetic_tokenizer(tmp_path, vocab_size=4096, bos_id=4000, eos_ids=(4001, 7), max_length=1024)
    runner = SimRunner(sim_settings(tmp_path, sim_model="llama-3.2-1b"), sleep=lambda s: None)
    runner.tokenizer
    step = StepRequests(request_ids=["a"], block_ids=[[3]], num_computed=[0], num_new=[3], samples=[True],
                        input_ids=[101, 102, 103])
    logits = runner.execute(runner.prepare_input(step)).numpy()
    assert logits.shape == (1, 2048)
    assert np.isinf(logits[0, 7]) and np.isfinite(np.delete(logits[0], 7)).all()
    produced = runner.next_token_ids(np.arange(5000), np.arange(5000))
    assert 7 not in produced and produced.max() < 2048 and len(set(produced.tolist())) > 1500


def test_logits_spike_on_a_deterministic_ordinary_token_and_the_step_waits_its_cost(tiny_model_path):
    waits = []
    runner = SimRunner(sim_settings(tiny_model_path), sleep=waits.append)
    runner.tokenizer  # loaded by the engine at start; a first step would otherwise spend its wait loading it
    step = StepRequests(request_ids=["a", "b"], block_ids=[[3], [4, 5]], num_computed=[0, 17], num_new=[5, 1],
                        samples=[True, True], input_ids=[101, 102, 103, 104, 105, 999])
    runner.execute(runner.prepare_input(step))  # a first call pays numpy's and torch's first-use costs
    waits.clear()
    logits = runner.execute(runner.prepare_input(step))
    assert logits.shape == (2, 2048)
    expected = runner.next_token_ids(np.array([105, 999]), np.array([4, 17]))
    assert logits.argmax(-1).tolist() == expected.tolist()
    assert all(17 <= t < 2048 for t in expected)  # never a special token (SmolLM2's are 0-16)
    assert np.isinf(logits[:, :17].numpy()).all() and len(set(logits[0, 17:].tolist())) == 2048 - 17
    # SmolLM2's simulated step costs tens of microseconds, which building the logits can outlast on a loaded
    # machine (then nothing is left to wait); the 8B shape's costs milliseconds: the step waits once, for the
    # part of its cost that the host work did not use.
    waits_8b = []
    runner_8b = SimRunner(sim_settings(tiny_model_path, sim_model="llama-3.1-8b"), sleep=waits_8b.append)
    runner_8b.tokenizer
    runner_8b.execute(runner_8b.prepare_input(step))
    assert runner_8b.last_cost.seconds > 1e-3
    assert len(waits_8b) == 1 and 0 < waits_8b[0] <= runner_8b.last_cost.seconds
    # The next step's spikes replace this one's.
    step = StepRequests(request_ids=["b"], block_ids=[[4, 5]], num_computed=[18], num_new=[1], samples=[True],
                        input_ids=[int(expected[1])])
    again = runner.execute(runner.prepare_input(step))
    assert again.shape == (1, 2048) and (again[0] == 8.0).sum() == 1


def test_the_wait_leaves_the_gil_to_other_threads(tiny_model_path):
    runner = SimRunner(sim_settings(tiny_model_path, sim_model="llama-3.1-8b", max_num_seqs=64))
    step = StepRequests(request_ids=[f"r{i}" for i in range(64)], block_ids=[[i] for i in range(64)],
                        num_computed=[0] * 64, num_new=[16] * 64, samples=[True] * 64, input_ids=[7] * 1024)
    model_input = runner.prepare_input(step)
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        time.sleep(0.002)
        before = count[0]
        start = time.perf_counter()
        runner.execute(model_input)
        waited = time.perf_counter() - start
        during = count[0] - before
    finally:
        stop.set()
        thread.join()
    assert waited >= runner.last_cost.seconds * 0.95 and runner.last_cost.seconds > 5e-3
    assert during > 1000  # the other thread kept running while the "device" worked
