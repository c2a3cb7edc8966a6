"""The benchmark's torch baseline computes the same attention as the reference (so its timings compare like
with like), and without CUDA the benchmark refuses to run with a clear message and a non-zero exit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kernels.reference import ref_paged_decode, ref_ragged_attention

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["bench_kernels"]


def test_torch_baseline_matches_reference(bench) -> None:
    torch.manual_seed(0)
    p = bench.make_paged(3, 40, 2, 64, 16, torch.float32, device="cpu")
    q = torch.randn(3, 6, 64)
    ref = ref_paged_decode(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.125)
    torch.testing.assert_close(bench.torch_decode(q, p, 0.125), ref, atol=1e-5, rtol=1e-5)

    q = torch.randn(3 * 7, 6, 64)  # the 7 newest positions of each request
    qsl = torch.arange(0, 22, 7, dtype=torch.int32)
    ref = ref_ragged_attention(q, p.k_cache, p.v_cache, qsl, p.seq_lens, p.block_tables, 0.125)
    torch.testing.assert_close(bench.torch_prefill(q, p, 7, 0.125), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_benchmark_refuses_without_cuda(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py"])
    assert bench.main() != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
