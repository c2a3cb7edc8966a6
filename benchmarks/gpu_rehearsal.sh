#!/usr/bin/env bash
# Rehearse benchmarks/gpu_check.sh here, on the CPU, in the lent GPU machine's software, before spending its
# device time: Python 3.12 with torch 2.11, triton 3.6 and transformers 5.17 (../shared/DESIGN.md lists what that
# machine has), plus only the wheels benchmarks/gpu_wheels.sh carries there. It runs gpu_check.sh itself with
# GPU_CHECK_SMOKE=1, so the script's interpreter search, its wheel install into /tmp and the engine check's Python
# side (tiny shapes, every part and token check) meet those versions; then every Triton kernel is compiled to an
# sm_90 cubin by that Triton (no GPU needed). What needs CUDA to run (capture, replay, the kernels' results, real
# step times) still needs the GPU.
#
#   bash benchmarks/gpu_rehearsal.sh            # venv in .venv-rehearsal (git ignores it; ~6 GB: torch's CUDA build)
#
# Environment: PY312 (a Python 3.12 interpreter; default python3.12 on PATH, else pyenv's), REHEARSAL_VENV,
# OUT (default benchmarks/results/gpu_rehearsal/), PARTS (passed on; "engine,kernel-tests" adds the kernel tests
# under Triton 3.6's interpreter, which cannot run our kernels' loops over loaded bounds: compiled on CUDA they
# are fine, so that part's failures here say nothing about the GPU).
# psutil is installed too: transformers' continuous batching sizes its cache from it on a CPU (on CUDA it asks
# torch), and without it completes no request here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY312="${PY312:-}"
if [ -z "$PY312" ]; then
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 1 >/dev/null 2>&1; then
            PY312="$candidate"
            break
        fi
    done
fi
[ -n "$PY312" ] || { echo "no Python 3.12 here: set PY312" >&2; exit 2; }
VENV="${REHEARSAL_VENV:-.venv-rehearsal}"
STAMP="$VENV/.rehearsal-stamp"
PINS=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy pytest hypothesis psutil)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "${PINS[*]}" ]; then
    "$PY312" -m venv "$VENV"
    "$VENV/bin/pip" install -q "${PINS[@]}"
    echo "${PINS[*]}" > "$STAMP"
fi
bash benchmarks/gpu_wheels.sh .whl >/dev/null
export OUT="${OUT:-benchmarks/results/gpu_rehearsal}"
rm -rf /tmp/gpu-check-site  # installed afresh from .whl, as on the GPU machine
GPU_CHECK_SMOKE=1 PYTHON="$VENV/bin/python" bash benchmarks/gpu_check.sh
# Compiled mode without a GPU: every kernel, with its wrapper's arguments, through this Triton to an sm_90 cubin
# (what the kernel tests will compile there; tests/kernels/compile_check.py).
TRITON_INTERPRET=0 PYTHONPATH="$PWD" "$VENV/bin/python" -m tests.kernels.compile_check 90 2>&1 \
    | tee "$OUT/compile_check.log"
exit "${PIPESTATUS[0]}"
