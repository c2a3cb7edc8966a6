"""Row buckets (ENGINE_ROW_BUCKETS): every matmul's row count padded to a fixed set of sizes whose kernels are
built at start-up, so a CPU worker's memory stops depending on which token counts its steps happen to meet.
(That padding changes no real row's logits is checked by every test of test_llama.py, run both ways.)"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from tests.model.batch import BLOCK, Chunk, make_input, random_tokens, tiny_settings
from worker import memory
from worker.model.runner import ModelRunner, cpu_has_native_bf16, row_bucket_sizes, use_row_buckets


def test_sizes_cover_every_row_count_with_bounded_padding():
    sizes = row_bucket_sizes(512)
    assert len(sizes) == 31 and sizes[0] == 1 and sizes[-1] == 512
    assert list(sizes) == sorted(set(sizes))
    for rows in range(1, 513):
        padded = min(s for s in sizes if s >= rows)
        assert padded - rows <= (7 if rows <= 64 else 15 if rows <= 256 else 31)
    assert row_bucket_sizes(100)[-1] == 100 and row_bucket_sizes(1) == (1,)


def test_auto_pads_where_onednn_runs_the_matmuls():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_row_buckets("auto", cpu, torch.bfloat16) and use_row_buckets("auto", cpu, torch.float16)
    assert not use_row_buckets("auto", cpu, torch.float32)
    assert not use_row_buckets("auto", cuda, torch.bfloat16)
    assert use_row_buckets("on", cpu, torch.float32) and not use_row_buckets("off", cpu, torch.bfloat16)


def _in_use_mb() -> float:
    gc.collect()
    memory.trim()
    heap = memory.native_heap()
    if heap is None:
        pytest.skip("no glibc mallinfo2 here")
    return heap.in_use_bytes / 2**20


def _sweep(runner: ModelRunner, row_counts: range) -> None:
    """A step of k one-token prompts for each k: k rows in every matmul, each prompt's attention the same
    shape (the attention kernels' own caches are keyed by prompt and context lengths, not by rows)."""
    for k in row_counts:
        chunks = [Chunk(random_tokens(1, seed=k * 1000 + i), 0, [1 + i]) for i in range(k)]
        runner.execute(make_input(chunks, BLOCK))


@pytest.mark.slow  # ~10 s: three bf16 runners, 64 forwards each
@pytest.mark.skipif(not cpu_has_native_bf16(), reason="oneDNN runs bf16 matmuls only on CPUs with bf16 units")
def test_new_row_counts_grow_memory_only_without_buckets(tiny_model_path):
    """Steps of odd row counts first, then of even ones (shapes never met before). Unpadded, each new count
    builds new oneDNN kernels that stay cached (about a MB each even for this tiny model); padded, the even
    counts fall in buckets built at start-up, with torch's plain F.linear and with the weights packed at
    start-up (ENGINE_CPU_PACKED_WEIGHTS) alike."""
    growth = {}
    for buckets, packed in (("on", True), ("on", False), ("off", False)):
        runner = ModelRunner(tiny_model_path, tiny_settings(row_buckets=buckets, cpu_packed_weights=packed,
                                                            dtype="bfloat16", num_kv_blocks=128, max_num_seqs=64))
        _sweep(runner, range(1, 65, 2))
        before = _in_use_mb()
        _sweep(runner, range(2, 65, 2))
        growth[buckets, packed] = _in_use_mb() - before
        del runner
    assert growth["on", True] < 2.0 and growth["on", False] < 2.0, growth
    assert growth["off", False] > 10 * max(growth["on", False], 1.0), growth


def _sweep_on_a_new_thread(runner: ModelRunner, prepare: bool) -> float:
    """MB of glibc's heap that a sweep over every row count leaves on a thread that starts after the runner's
    start-up (as the engine thread does), with and without `prepare_thread` first."""
    grown = []

    def sweep() -> None:
        if prepare:
            runner.prepare_thread()
        before = _in_use_mb()
        _sweep(runner, range(1, 65))
        grown.append(_in_use_mb() - before)

    thread = threading.Thread(target=sweep)
    thread.start()
    thread.join()
    return grown[0]


@pytest.mark.slow  # ~10 s: a bf16 runner, 256 forwards
@pytest.mark.skipif(not cpu_has_native_bf16(), reason="oneDNN runs bf16 matmuls only on CPUs with bf16 units")
def test_a_thread_that_steps_after_start_up_grows_memory_at_new_buckets_only_unprepared(tiny_model_path):
    """ideep caches its kernel descriptors per thread: the buckets built at start-up serve the thread that built
    them, and another thread that steps builds each bucket's again as it meets it, kept for the thread's life.
    prepare_thread builds them all for the calling thread before its first step."""
    runner = ModelRunner(tiny_model_path, tiny_settings(row_buckets="on", dtype="bfloat16", num_kv_blocks=128,
                                                        max_num_seqs=64))
    _sweep_on_a_new_thread(runner, prepare=True)  # what any first sweep pages in, once per process
    prepared = _sweep_on_a_new_thread(runner, prepare=True)
    unprepared = _sweep_on_a_new_thread(runner, prepare=False)
    assert prepared < 0.15, (prepared, unprepared)
    assert unprepared > 2.5 * max(prepared, 0.05), (prepared, unprepared)


def _prompts(runner: ModelRunner, lengths: range) -> None:
    """A step of one fresh prompt of each length, and one of a chunk of that length after a cached context."""
    for n in lengths:
        runner.execute(make_input([Chunk(random_tokens(n, seed=n), 0, list(range(1, 1 + -(-n // BLOCK))))], BLOCK))
        context = n + 5
        blocks = list(range(1, 1 + -(-(context + n) // BLOCK)))
        runner.execute(make_input([Chunk(random_tokens(n, seed=n), context, blocks)], BLOCK))


def _has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


@pytest.mark.slow  # ~10 s: two bf16 runners, 200 forwards each
@pytest.mark.skipif(not _has_amx(), reason="torch's bf16 flash attention keeps per-shape kernels only with AMX; "
                                           "on AVX512-BF16 alone the sweep grows nothing either way")
def test_new_prompt_lengths_grow_memory_only_without_fixed_attention_kernels(tiny_model_path):
    """Prompts of even lengths first, then of odd ones, each alone and as a chunk after a cached context.
    As they come, each new length builds bf16 attention kernels that stay (about 100 KB each); with
    `fixed_kernels`, prompts fall in the padded lengths built at start-up and chunks after a context attend in
    float32. Matmul rows are bucketed in both runs, so the difference is attention's."""
    growth = {}
    for pad in (True, False):
        runner = ModelRunner(tiny_model_path, tiny_settings(row_buckets="on", dtype="bfloat16", num_kv_blocks=128))
        assert runner.backend.fixed_kernels
        runner.backend.fixed_kernels = pad
        _prompts(runner, range(2, 200, 2))
        before = _in_use_mb()
        _prompts(runner, range(3, 200, 2))
        growth[pad] = _in_use_mb() - before
        del runner
    assert growth[True] < 1.0, growth
    assert growth[False] > 5 * max(growth[True], 0.5), growth
