"""Run the kernel tests compiled on CUDA when there is a GPU, else under Triton's CPU interpreter.

Triton reads TRITON_INTERPRET when a function is decorated with triton.jit, and triton.language decorates
its own helpers (tl.cdiv, tl.max, ...) when triton is first imported. So the variable must be set before
anything imports triton; importing torch first is fine (torch does not import triton). The root conftest's
plugins import neither today. If triton was already imported in the other mode, the kernels cannot run
and the session stops with a UsageError saying how to fix it. An explicit TRITON_INTERPRET wins.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

INTERPRET = os.environ["TRITON_INTERPRET"].strip().lower() in ("1", "true", "yes", "on")


def _check_triton_mode() -> None:
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return  # not imported yet: it will be decorated in the mode set above
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(standard.cdiv, InterpretedFunction) != INTERPRET:
        mode = os.environ["TRITON_INTERPRET"]
        raise pytest.UsageError(
            f"triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET={mode} (a root conftest"
            " plugin?), so its kernels were built for the other mode. Set TRITON_INTERPRET in the environment"
            " (1 on CPU, 0 on CUDA) or before that import."
        )


_check_triton_mode()


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernels run: CPU tensors under the interpreter, CUDA when compiled."""
    if INTERPRET:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 but no CUDA device: compiled Triton kernels need a GPU")
    return "cuda"
