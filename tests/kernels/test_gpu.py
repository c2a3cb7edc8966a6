"""Compiled kernels on CUDA at serving shapes (the unmarked and slow tests also run compiled on CUDA when a GPU
is present; these add the shapes too large for the interpreter). Tolerances: paged_case.TOLERANCES."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import choose_num_splits, paged_decode_attention
from kernels.ragged_prefill import ragged_prefill_attention
from kernels.reference import ref_paged_decode, ref_ragged_attention
from tests.kernels.paged_case import assert_close, make_case, make_q, needs_compiled_cuda
from worker.model.input import AttentionMetadata
from worker.model.triton_attention import TritonAttention

pytestmark = [pytest.mark.gpu, needs_compiled_cuda]


def decode_case(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    case = make_case([0] * len(seq_lens), seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
    q = make_q(len(seq_lens), num_q_heads, num_kv_heads, head_dim, dtype, "cuda",
               torch.Generator(device="cuda").manual_seed(3))
    return case, q


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64)])
def test_decode_batch_64_at_2k(num_q_heads, num_kv_heads, head_dim) -> None:
    seq_lens = torch.randint(1, 2049, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    seq_lens[:3] = [2048, 1, 0]
    case, q = decode_case(seq_lens, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16)
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    assert_close(out, ref_paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale))


def test_long_context_splits_automatically_and_matches() -> None:
    seq_lens = [32768, 30001, 5, 16384]
    case, q = decode_case(seq_lens, 32, 8, 128, 16, torch.bfloat16)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert choose_num_splits(len(seq_lens) * 8, max(seq_lens), num_sms) > 1
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    auto = paged_decode_attention(*args)
    single = paged_decode_attention(*args, num_splits=1)
    ref = ref_paged_decode(*args)
    assert_close(auto, ref)
    assert_close(single, ref)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "dtype"),
    [(32, 8, 128, torch.bfloat16), (9, 3, 64, torch.float16), (8, 8, 64, torch.float32)],
)
def test_prefill_mixed_serving_batch(num_q_heads, num_kv_heads, head_dim, dtype) -> None:
    # a 512-token chunk after 1,500 cached, a fresh 1,024-token prompt, 16 decode rows, an empty request
    requests = [(512, 2012), (1024, 1024), *[(1, 100 + 97 * i) for i in range(16)], (0, 40)]
    q_lens, seq_lens = [q for q, _ in requests], [s for _, s in requests]
    case = make_case(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, 16, dtype, "cuda", strided_q=True)
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale)
    assert_close(ragged_prefill_attention(*args, max(q_lens)), ref_ragged_attention(*args))


@pytest.mark.parametrize("requests", [[(1, 700), (1, 3), (1, 2048)], [(300, 300), (1, 900), (64, 1000)]],
                         ids=["decode", "mixed"])
def test_triton_backend_matches_torch_backend(requests) -> None:
    from worker.model.torch_attention import TorchAttention

    q_lens, seq_lens = [q for q, _ in requests], [s for _, s in requests]
    case = make_case(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    # TorchAttention pads gathered contexts with slot 0 and masks scores, and 0 * NaN in its P @ V is NaN:
    # clear the poison (the other tests keep it to catch our kernels reading outside the context).
    case.k_cache.nan_to_num_(0.0)
    case.v_cache.nan_to_num_(0.0)
    new_slots = [slot for (q_len, _), slots in zip(requests, case.slots) for slot in slots[len(slots) - q_len :]]
    k_new = torch.randn(len(new_slots), 8, 128, device="cuda").bfloat16()
    v_new = torch.randn(len(new_slots), 8, 128, device="cuda").bfloat16()
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device="cuda"),
        query_start_loc=case.query_start_loc, seq_lens=case.seq_lens, block_tables=case.block_tables,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )
    caches_torch = (case.k_cache.clone(), case.v_cache.clone())
    out_torch = TorchAttention().forward(case.q, k_new, v_new, *caches_torch, meta, case.scale)
    out_triton = TritonAttention().forward(case.q, k_new, v_new, case.k_cache, case.v_cache, meta, case.scale)
    assert torch.equal(case.k_cache, caches_torch[0]) and torch.equal(case.v_cache, caches_torch[1])
    assert_close(out_triton, out_torch)


def _compiled_variants(kernel) -> int:
    """How many specializations of a Triton kernel this process has compiled (its per-device caches)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_a_started_runner_compiles_no_attention_kernel_for_any_prompt_step(tmp_path) -> None:
    # Before the runner built them at start-up, a worker's first prompt of each tile height, and the first step
    # of each class (1, a multiple of 16, other) of request count or of longest context in blocks, waited 0.4 to
    # 1.1 s for a compile.
    from benchmarks.lib.random_model import build_random_model
    from kernels.ragged_prefill import _prefill_kernel
    from worker.model.settings import EngineSettings
    from worker.model.runner import ModelRunner
    from worker.model.step_batch import StepRequests

    folder = build_random_model(tmp_path, "smollm2-135m", num_hidden_layers=2)
    settings = EngineSettings(model=str(folder), device="cuda", dtype="bfloat16", block_size=16, max_model_len=2048,
                              max_num_seqs=16, max_num_batched_tokens=2048, num_kv_blocks=1024)
    runner = ModelRunner(folder, settings)
    built = _compiled_variants(_prefill_kernel)
    assert built >= 3  # SmolLM2's three query heads a KV head: tiles of 16, 32, 64 and 128 rows
    next_block = 0
    # (new tokens, cached tokens) per request: lone prompts of each height, chunks after a cached context,
    # mixed steps with decode rows, 16 requests at once.
    for step_requests in ([(2, 0)], [(5, 0)], [(11, 0)], [(137, 0)], [(2000, 0)], [(512, 1024)],
                          [(3, 0), (1, 40), (1, 100)], [(20, 0)] * 16, [(700, 0)] + [(1, 30)] * 15):
        ids, tables = [], []
        for i, (new, cached) in enumerate(step_requests):
            blocks = -(-(new + cached) // 16)
            ids.append(f"r{next_block}-{i}")
            tables.append(list(range(next_block, next_block + blocks)))
            next_block = (next_block + blocks) % 512
        step = StepRequests(request_ids=ids, block_ids=tables, num_computed=[c for _, c in step_requests],
                            num_new=[n for n, _ in step_requests], samples=[True] * len(ids),
                            input_ids=[7] * sum(n for n, _ in step_requests))
        assert torch.isfinite(runner.execute(runner.prepare_input(step))).all()
        runner.release(ids)
    torch.cuda.synchronize()
    assert _compiled_variants(_prefill_kernel) == built


def test_capture_reports_at_least_the_memory_its_graphs_outputs_hold(tmp_path) -> None:
    # torch.cuda.graph empties the allocator's cache as it starts; measured without emptying it first, the
    # blocks that return hid the pool's growth, and the first runner of a process reported 0 MiB.
    from benchmarks.lib.random_model import build_random_model
    from worker.model.settings import EngineSettings
    from worker.model.runner import ModelRunner

    folder = build_random_model(tmp_path, "smollm2-135m", num_hidden_layers=2)
    settings = EngineSettings(model=str(folder), device="cuda", dtype="bfloat16", block_size=16, max_model_len=2048,
                              max_num_seqs=16, max_num_batched_tokens=2048, num_kv_blocks=1024)
    # Memory left cached before the capture, as a process's earlier work leaves it: segments of their own, so the
    # runner's allocations leave most of them wholly free for the capture's emptying to hand back.
    cached = [torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del cached
    runner = ModelRunner(folder, settings)
    outputs = sum(t.numel() * t.element_size() for t in runner.graphs.outputs.values())
    assert runner.graphs.capture_bytes >= outputs > 0


needs_fp8_cores = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs FP8 tensor cores (compute capability 8.9 or later)")


@needs_fp8_cores
@pytest.mark.parametrize("rows", [1, 7, 64, 512])
def test_fp8_product_on_tensor_cores_matches_the_quantized_operands_product(rows) -> None:
    """The 1B shape's gate|up weight: _scaled_mm on the FP8 cores against float32 arithmetic on the same e4m3
    operands and scales (what the CPU tests check the reference product against)."""
    from worker.model.quantize import FP8, FP8_MAX, linear, quantize_fp8

    generator = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(2 * 8192, 2048, device="cuda", generator=generator).to(torch.bfloat16) * 0.02
    x = torch.randn(rows, 2048, device="cuda", generator=generator).to(torch.bfloat16)
    q, scale = quantize_fp8(w)
    got = linear(x, q, None, scale)
    x_scale = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    expected = ((x.float() / x_scale).to(FP8).float() * x_scale) @ (q.float() * scale[:, None]).t()
    assert got.dtype == torch.bfloat16
    assert ((got.float() - expected).abs().max() / expected.abs().max()).item() < 1e-2


@needs_fp8_cores
def test_an_fp8_model_on_cuda_generates_close_to_bf16_with_graphs_and_without(tmp_path) -> None:
    """Random weights in SmolLM2's shapes, ENGINE_QUANTIZATION=fp8 on the GPU: every request completes, and CUDA
    graphs replay the FP8 steps token for token as eager runs them. (Random weights give near-flat logits, so
    greedy agreement with bf16 says little: accuracy is measured on the real model, docs/quantization.md.)"""
    from benchmarks.lib.random_model import build_random_model
    from tests.engine.test_engine_correctness import make_trace, run_trace
    from worker.engine.engine import LLMEngine
    from worker.model.settings import EngineSettings

    folder = build_random_model(tmp_path, "smollm2-135m", num_hidden_layers=4)
    trace = make_trace(8)
    runs = {}
    for name, overrides in {"fp8": {"quantization": "fp8"},
                            "fp8-eager": {"quantization": "fp8", "cuda_graphs": "off"}}.items():
        settings = EngineSettings(model=str(folder), device="cuda", dtype="bfloat16", block_size=16,
                                  max_model_len=2048, max_num_seqs=8, num_kv_blocks=512, **overrides)
        engine = LLMEngine(settings)
        assert engine.runner.quantization == "fp8"
        runs[name] = run_trace(engine, trace)
    assert runs["fp8"] == runs["fp8-eager"]
