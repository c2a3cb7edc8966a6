"""Compile every kernel for a CUDA architecture without a GPU: `python -m tests.kernels.compile_check 90`.

The interpreter runs kernels as Python and so accepts code the compiler rejects (type changes of loop-carried
values, dot shapes under the minimum, a non-constexpr where one is needed). Triton can compile to a cubin on
any machine (ptxas ships in its wheel), so this catches those errors on the CPU. Each wrapper is called with
tensors on the `meta` device and a recorder in place of its kernel, so what gets compiled is exactly the
arguments and constexprs the wrapper would launch with. Needs TRITON_INTERPRET unset or 0.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import torch.nn.functional as F

from kernels import fused, kv_write, lora, moe, paged_decode, ragged_prefill

TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
              torch.int64: "i64"}


class Recorder:
    """Stands in for a @triton.jit kernel: `rec[grid](*args, **kwargs)` records instead of launching."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    sig, constexprs, options = {}, {}, {}
    for key in ("num_warps", "num_stages"):
        if key in kwargs:
            options[key] = kwargs.pop(key)
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPE_NAMES[value.dtype]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    for name, value in kwargs.items():
        sig[name] = "constexpr"
        constexprs[name] = value
    return sig, constexprs, options


def launches(module, kernel_names: tuple[str, ...], call) -> list[tuple]:
    """(kernel, args, kwargs) of every launch `call` makes of the named kernels of `module`."""
    kernels = {name: getattr(module, name) for name in kernel_names}
    recorders = {name: Recorder(kernel) for name, kernel in kernels.items()}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        call()
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    return [(rec.kernel, args, kwargs) for rec in recorders.values() for args, kwargs in rec.launches]


def meta(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def cases() -> list[tuple[str, object, tuple, dict]]:
    found = []
    # bf16 (the serving dtype) in three shapes; fp16 and fp32 in one each, to keep the check near a minute.
    shapes = {  # dtype -> (Hq, Hkv, D, block_size, num_splits)
        torch.bfloat16: [(32, 8, 128, 16, 1), (9, 3, 64, 32, 5), (8, 8, 64, 16, 1)],
        torch.float16: [(9, 3, 64, 32, 5)],
        torch.float32: [(8, 8, 64, 16, 1)],
    }
    for dtype, dtype_shapes in shapes.items():
        for num_q_heads, num_kv_heads, head_dim, block_size, splits in dtype_shapes:
            cache = meta(64, block_size, num_kv_heads, head_dim, dtype=dtype)
            i32 = torch.int32

            def decode():
                paged_decode.paged_decode_attention(
                    meta(4, num_q_heads, head_dim, dtype=dtype), cache, cache, meta(4, 16, dtype=i32),
                    meta(4, dtype=i32), 0.1, num_splits=splits)

            found += [(f"decode {dtype} Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} splits={splits}", *launch)
                      for launch in launches(paged_decode, ("_decode_kernel", "_merge_splits_kernel"), decode)]
            for max_query_len in (1, 300):
                def prefill():
                    ragged_prefill.ragged_prefill_attention(
                        meta(300, num_q_heads, head_dim, dtype=dtype), cache, cache, meta(3, dtype=i32),
                        meta(2, dtype=i32), meta(2, 16, dtype=i32), 0.1, max_query_len)

                found += [(f"prefill {dtype} Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} "
                           f"max_query_len={max_query_len}", *launch)
                          for launch in launches(ragged_prefill, ("_prefill_kernel",), prefill)]

        def write():
            kv_write.write_kv(meta(5, 8, 128, dtype=dtype), meta(5, 8, 128, dtype=dtype),
                              meta(64, 16, 8, 128, dtype=dtype), meta(64, 16, 8, 128, dtype=dtype),
                              meta(5, dtype=torch.int64))

        found += [(f"write_kv {dtype}", *launch) for launch in launches(kv_write, ("_write_kv_kernel",), write)]
    # Sliding windows and soft caps (their own kernels: HAS_WINDOW and HAS_SOFTCAP are constexprs), bf16.
    cache = meta(64, 16, 4, 128, dtype=torch.bfloat16)
    for window, softcap in ((4096, None), (4096, 50.0)):
        label = f"window={window} softcap={softcap}"
        found += [(f"decode {label}", *launch) for launch in launches(paged_decode, (
            "_decode_kernel", "_merge_splits_kernel"), lambda: paged_decode.paged_decode_attention(
                meta(4, 16, 128, dtype=torch.bfloat16), cache, cache, meta(4, 16, dtype=torch.int32),
                meta(4, dtype=torch.int32), 0.1, num_splits=3, window=window, softcap=softcap))]
        found += [(f"prefill {label}", *launch) for launch in launches(ragged_prefill, ("_prefill_kernel",),
            lambda: ragged_prefill.ragged_prefill_attention(
                meta(300, 16, 128, dtype=torch.bfloat16), cache, cache, meta(3, dtype=torch.int32),
                meta(2, dtype=torch.int32), meta(2, 16, dtype=torch.int32), 0.1, 300, window=window,
                softcap=softcap))]
    # LoRA and MoE in the serving dtype, on CPU tensors: their wrappers' index work runs for real, and what is
    # compiled depends only on the recorded arguments' dtypes and values.
    found += [(f"lora {launch[0].fn.__name__}", *launch) for launch in launches(lora, (
        "_shrink_kernel", "_expand_kernel"), lambda: lora.add_lora(
            torch.zeros(5, 576, dtype=torch.bfloat16), torch.tensor([0, -1, 1, 0, 1]),
            torch.zeros(2, 576, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 960, dtype=torch.bfloat16),
            torch.zeros(5, 960, dtype=torch.bfloat16)))]
    bf16 = torch.bfloat16
    found += [(f"moe {launch[0].fn.__name__}", *launch) for launch in launches(moe, ("_grouped_matmul_kernel",),
        lambda: moe.fused_moe(torch.zeros(7, 256, dtype=bf16), torch.zeros(8, 1024, 256, dtype=bf16),
                              torch.zeros(8, 256, 512, dtype=bf16), torch.full((7, 2), 0.5),
                              torch.tensor([[i % 8, (i + 3) % 8] for i in range(7)]), F.silu))]
    # The fused per-layer chains: bf16 (the serving dtype, rounded by hand) and float32, each activation.
    for dtype in (torch.bfloat16, torch.float32):
        found += [(f"add_rms_norm {dtype}", *launch) for launch in launches(fused, ("_add_rms_norm_kernel",),
            lambda: fused.add_rms_norm(meta(5, 576, dtype=dtype), meta(5, 576, dtype=dtype), meta(576, dtype=dtype),
                                       1e-5))]
        for act in fused.ACTS:
            found += [(f"act_mul {act} {dtype}", *launch) for launch in launches(fused, ("_act_mul_kernel",),
                lambda: fused.act_mul(meta(5, 3072, dtype=dtype), act))]
        found += [(f"rope_kv_write {dtype}", *launch) for launch in launches(fused, ("_rope_kv_write_kernel",),
            lambda: fused.rope_kv_write(meta(5, 12, 64, dtype=dtype), meta(5, 3, 64, dtype=dtype),
                                        meta(5, 64, dtype=dtype), meta(5, 64, dtype=dtype),
                                        meta(64, 16, 3, 64, dtype=dtype), meta(64, 16, 3, 64, dtype=dtype),
                                        meta(5, dtype=torch.int64), 9))]
    return found


_CASES: list = []
"""Filled before the pool forks, so each child compiles from the same recorded launches by index."""


def compile_one(arch: int, index: int) -> str:
    label, kernel, args, kwargs = _CASES[index]
    start = time.perf_counter()
    sig, constexprs, options = signature(kernel, args, dict(kwargs))
    compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    assert compiled.asm["cubin"], label
    seconds = time.perf_counter() - start
    return f"sm_{arch} {kernel.fn.__name__} {label}: {len(compiled.asm['cubin'])} B cubin in {seconds:.1f}s"


def main(arch: int) -> int:
    _CASES[:] = cases()
    assert _CASES, "no launches recorded"
    # Each compile is single-threaded: one process a core.
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        for line in pool.map(compile_one, [arch] * len(_CASES), range(len(_CASES))):
            print(line)
    print(f"compiled {len(_CASES)} kernels for sm_{arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
