"""Compiled-mode check without a GPU: every kernel, with the arguments its wrapper passes, compiles to an
sm_90 and an sm_80 cubin (tests/kernels/compile_check.py). Run in a subprocess because the kernels in this
process may be interpreter-decorated. Skipped where CUDA exists: the GPU tests compile and run them there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu-marked tests compile the real launches")
@pytest.mark.parametrize("arch", [90])  # sm_80 compiles the same code paths; one arch keeps CI short
def test_kernels_compile_for_cuda(arch: int) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.compile_check", str(arch)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"kernels for sm_{arch}" in result.stdout
