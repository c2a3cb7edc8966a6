#!/usr/bin/env bash
# One script for a lent GPU machine: the kernel tests compiled on CUDA, then the kernel benchmark.
#
#   bash benchmarks/gpu_check.sh            # writes to $OUT if set, else benchmarks/results/gpu_check/
#
# Environment:
#   PYTHON               interpreter to use (default: the first of .venv/bin/python, python3 that imports
#                        torch, triton and pytest and sees CUDA)
#   KERNEL_TEST_MARKERS  pytest -m expression (default "gpu or not slow": the gpu set plus the fast set, about
#                        16 kernel variants to compile; "gpu or not gpu" adds the slow sweep, about 75 more
#                        compiles, several minutes on top: use it when the device budget allows)
#   TEST_TIMEOUT_S, BENCH_TIMEOUT_S   wall-clock caps (default 360 and 200) so one run fits a 10-minute call
#
# The GPU machine may have no package index. A .venv carried from another machine will not do (its torch
# was built there), so the script looks for a working interpreter first and only then tries
# `pip install -e '.[test]'` into .venv-gpu (with --system-site-packages, to reuse a preinstalled torch);
# without an index that step fails and the script says so. The kernels and tests need only torch, triton,
# pytest and transformers (for one probe test); PYTHONPATH=. stands in for installing the project.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$OUT_DIR"
MARKERS="${KERNEL_TEST_MARKERS:-gpu or not slow}"

works() { "$1" -c "import torch, triton, pytest; assert torch.cuda.is_available()" >/dev/null 2>&1; }

PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && works "$candidate"; then
        PY="$candidate"
        break
    fi
done
if [ -z "$PY" ] && ! nvidia-smi >/dev/null 2>&1; then
    echo "FAILED: no GPU here (nvidia-smi fails); this script is for a CUDA machine" | tee "$OUT_DIR/FAILED"
    exit 3
fi
if [ -z "$PY" ]; then
    echo "no interpreter with torch + triton + pytest seeing CUDA; trying pip install -e '.[test]' into .venv-gpu"
    if python3 -m venv --system-site-packages .venv-gpu && .venv-gpu/bin/pip install -q -e '.[test]' \
        && works .venv-gpu/bin/python; then
        PY=.venv-gpu/bin/python
    else
        echo "FAILED: could not set up an interpreter (no package index reachable?)" | tee "$OUT_DIR/FAILED"
        exit 3
    fi
fi

{
    echo "python: $PY"
    "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', \
triton.__version__, 'cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0))"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null
} 2>&1 | tee "$OUT_DIR/env.txt"

unset TRITON_INTERPRET  # compiled kernels on CUDA (tests/kernels/conftest.py picks CUDA when it sees a GPU)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# --confcutdir: the root conftest loads Kafka and model fixtures the kernel tests do not need.
timeout "${TEST_TIMEOUT_S:-360}" "$PY" -m pytest tests/kernels -m "$MARKERS" -q -rfEs --durations=15 \
    -p no:cacheprovider --confcutdir=tests/kernels --junitxml="$OUT_DIR/kernel_tests.xml" 2>&1 \
    | tee "$OUT_DIR/kernel_tests.log"
tests_rc=${PIPESTATUS[0]}

timeout "${BENCH_TIMEOUT_S:-200}" "$PY" benchmarks/bench_kernels.py --json "$OUT_DIR/bench_kernels.json" 2>&1 \
    | tee "$OUT_DIR/bench_kernels.log"
bench_rc=${PIPESTATUS[0]}

echo "kernel tests exit $tests_rc, benchmark exit $bench_rc (124 = timed out)" | tee "$OUT_DIR/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
