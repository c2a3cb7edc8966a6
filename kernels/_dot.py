"""How the attention kernels call tl.dot, and the one interpreter workaround it needs.

Precision: fp16/bf16 inputs use tensor cores with fp32 accumulation. fp32 inputs use "tf32x3" (three TF32
products, about fp32 accuracy) rather than plain TF32 (10-bit mantissa, ~1e-3 relative error) or "ieee"
(exact FMA loops: a 1.2 MB cubin and 80 s of compiling for the D=128 prefill kernel on sm_90, 7x tf32x3).

Triton 3.9's interpreter stores bfloat16 as uint16 and hands those integers to np.matmul, so a bf16 tl.dot
returns garbage on the CPU. Under the interpreter the wrappers pass UPCAST=True: the kernels widen q, k and v
to fp32 after loading, and round the softmax probabilities to the cache dtype before widening them again.
That keeps the compiled kernel's rounding: every bf16 value is an fp32 value, and the GPU's bf16 tensor-core
dot also accumulates in fp32. (The branch is a constexpr, so compiled kernels carry no trace of it. It is
inlined rather than a shared @triton.jit helper because the interpreter re-patches triton.language on every
nested jit call, which made the tests much slower.)
"""

from __future__ import annotations

import torch


def dot_options(dtype: torch.dtype, kernel: object) -> dict[str, object]:
    """Constexpr kwargs DOT_PRECISION and UPCAST for an attention kernel on `dtype` inputs; UPCAST only
    when `kernel` runs under the interpreter (decided when it was decorated). The interpreter's numpy dot
    ignores DOT_PRECISION."""
    from triton.runtime.interpreter import InterpretedFunction

    upcast = isinstance(kernel, InterpretedFunction) and dtype == torch.bfloat16
    return {"DOT_PRECISION": "tf32x3" if dtype == torch.float32 else "tf32", "UPCAST": upcast}
