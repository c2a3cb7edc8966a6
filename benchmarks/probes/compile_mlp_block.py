"""Does torch.compile (inductor) pay for the CPU path at one request? One MLP block of the default model's shape
(RMSNorm, gate|up, SiLU·up, down, residual) with int8 weights, one row, bf16: eager against compiled, and the
compile time. Measured here: 58.7 µs eager, 56.6 µs compiled, 16.8 s to compile: the block's small operations
are not where a step's time goes (docs/quantization.md).

    .venv/bin/python -m benchmarks.probes.compile_mlp_block
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from worker.model.layers import rms_norm
from worker.model.quantize import linear, quantize_int8

HIDDEN, INTERMEDIATE = 576, 1536


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    norm = torch.rand(HIDDEN, dtype=torch.bfloat16) + 0.5
    gate_up, gate_up_scale = quantize_int8(torch.randn(2 * INTERMEDIATE, HIDDEN, dtype=torch.bfloat16) * 0.05)
    down, down_scale = quantize_int8(torch.randn(HIDDEN, INTERMEDIATE, dtype=torch.bfloat16) * 0.05)

    def block(x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(rms_norm(x, norm, 1e-5), gate_up, None, gate_up_scale).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, down, None, down_scale)

    start = time.perf_counter()
    compiled = torch.compile(block, dynamic=False)
    compiled(x)
    print(f"compile: {time.perf_counter() - start:.1f} s; max difference "
          f"{(compiled(x).float() - block(x).float()).abs().max().item():.3g}")
    for name, fn in (("eager", block), ("compiled", compiled)):
        for _ in range(50):
            fn(x)
        start, calls = time.perf_counter(), 2000
        for _ in range(calls):
            fn(x)
        print(f"{name}: {(time.perf_counter() - start) / calls * 1e6:.1f} µs a call")


if __name__ == "__main__":
    main()
