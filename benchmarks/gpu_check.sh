#!/usr/bin/env bash
# One script for a lent GPU machine, about 8 minutes in all by default: the engine end to end on random weights
# in real shapes (benchmarks/gpu_engine_check.py: CUDA graphs vs eager token checks, step times vs the simulator,
# continuous vs static vs transformers' continuous batching), then the kernel tests compiled on CUDA, then the
# kernel benchmark. Each part runs under its own time limit, so one that fails or hangs leaves the others' results.
#
#   bash benchmarks/gpu_check.sh            # writes to $OUT if set, else benchmarks/results/gpu_check/
#
# Through the device tool: `bash benchmarks/gpu_wheels.sh` here first, then run `bash benchmarks/gpu_check.sh`
# there with carry [".whl"] and timeout_s 540; copy what comes back to benchmarks/results/<date>-gpu-check/.
#
# Environment:
#   PYTHON               interpreter to use (default: the first of .venv/bin/python, python3 that imports
#                        torch, triton and pytest and sees CUDA)
#   PARTS                the parts, in order (default "engine,kernel-tests,kernel-bench")
#   ENGINE_TIMEOUT_S, TEST_TIMEOUT_S, BENCH_TIMEOUT_S   wall-clock caps (default 290, 110 and 70 s: 470 s)
#   KERNEL_TEST_MARKERS  pytest -m expression (default "gpu or not slow": the gpu set plus the fast set, about
#                        16 kernel variants to compile; "gpu or not gpu" adds the slow sweep, about 75 more
#                        compiles, several minutes on top: raise TEST_TIMEOUT_S with it)
#   WHEELS_DIR           wheels installed first when the engine's pure-Python dependencies are missing
#                        (default .whl; benchmarks/gpu_wheels.sh fetches them on a machine with an index)
#   GPU_CHECK_SMOKE      1: a rehearsal on a CPU (benchmarks/gpu_rehearsal.sh): no CUDA required, the engine
#                        part in its --smoke mode (tiny shapes, float32), PARTS defaulting to "engine" (the
#                        kernel benchmark needs CUDA; kernel tests on a CPU run under Triton's interpreter)
#
# The GPU machine has no package index and lacks pydantic, pydantic-settings (the engine's settings) and
# llguidance (structured output). Fetch their wheels here with `bash benchmarks/gpu_wheels.sh` (into .whl/, which git ignores) and name `.whl` in the
# device call's carry; without them the engine part says what is missing and the kernel parts still run. A .venv
# carried from another machine will not do (its torch was built there), so the script looks for a working
# interpreter first and only then tries `pip install -e '.[test]'` into .venv-gpu (with --system-site-packages,
# to reuse a preinstalled torch); without an index that step fails and the script says so. PYTHONPATH=. stands
# in for installing the project.
#
# Files (at most 8 come back from a device call's $OUT): env.txt, engine_check.json (every part's results, written
# as each ends), engine_check.log, kernel_tests.log, bench_kernels.json, bench_kernels.log, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$OUT_DIR"
MARKERS="${KERNEL_TEST_MARKERS:-gpu or not slow}"
WHEELS_DIR="${WHEELS_DIR:-.whl}"
SMOKE="${GPU_CHECK_SMOKE:-0}"
if [ "$SMOKE" = 1 ]; then
    PARTS="${PARTS:-engine}"
    ENGINE_ARGS=(--smoke)
    NEEDS_CUDA=""
else
    PARTS="${PARTS:-engine,kernel-tests,kernel-bench}"
    ENGINE_ARGS=()
    NEEDS_CUDA="; assert torch.cuda.is_available()"
fi

works() { "$1" -c "import torch, triton, pytest$NEEDS_CUDA" >/dev/null 2>&1; }

PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && works "$candidate"; then
        PY="$candidate"
        break
    fi
done
if [ -z "$PY" ] && [ "$SMOKE" != 1 ] && ! nvidia-smi >/dev/null 2>&1; then
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

# Compiled kernels on CUDA (tests/kernels/conftest.py picks CUDA when it sees a GPU, else the interpreter).
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# The engine's pure-Python dependencies, from carried wheels when the interpreter lacks them.
ENGINE_IMPORTS="import pydantic, pydantic_settings, llguidance, safetensors, tokenizers, transformers"
if ! "$PY" -c "$ENGINE_IMPORTS" >/dev/null 2>&1 && ls "$WHEELS_DIR"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
        "$WHEELS_DIR"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gpu-check-site"
fi

{
    echo "python: $PY"
    "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', \
triton.__version__, 'cuda', torch.version.cuda, '|', \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU (rehearsal)')"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null
    "$PY" -c "$ENGINE_IMPORTS; print('engine imports: ok')" 2>&1 | tail -1
} 2>&1 | tee "$OUT_DIR/env.txt"

engine_rc=- tests_rc=- bench_rc=-
for part in ${PARTS//,/ }; do
    case "$part" in
    engine)
        # Random models go to /tmp (over a GiB each), never to $OUT; the Python side's own budget ends its parts
        # a little before the outer timeout would.
        limit="${ENGINE_TIMEOUT_S:-290}"
        timeout "$limit" "$PY" benchmarks/gpu_engine_check.py --out "$OUT_DIR" --json-name engine_check.json \
            --models-dir /tmp/gpu-check-models --budget-s "$((limit - 10))" ${ENGINE_ARGS[@]+"${ENGINE_ARGS[@]}"} 2>&1 \
            | tee "$OUT_DIR/engine_check.log"
        engine_rc=${PIPESTATUS[0]}
        ;;
    kernel-tests)
        # --confcutdir: the root conftest loads Kafka and model fixtures the kernel tests do not need.
        timeout "${TEST_TIMEOUT_S:-110}" "$PY" -m pytest tests/kernels -m "$MARKERS" -q -rfEs --durations=15 \
            -p no:cacheprovider --confcutdir=tests/kernels 2>&1 | tee "$OUT_DIR/kernel_tests.log"
        tests_rc=${PIPESTATUS[0]}
        ;;
    kernel-bench)
        timeout "${BENCH_TIMEOUT_S:-70}" "$PY" benchmarks/bench_kernels.py --json "$OUT_DIR/bench_kernels.json" 2>&1 \
            | tee "$OUT_DIR/bench_kernels.log"
        bench_rc=${PIPESTATUS[0]}
        ;;
    *)
        echo "unknown part $part (engine, kernel-tests, kernel-bench)" >&2
        ;;
    esac
done

echo "engine check exit $engine_rc, kernel tests exit $tests_rc, kernel benchmark exit $bench_rc" \
    "(124 = timed out, - = not run)" | tee "$OUT_DIR/summary.txt"
for rc in "$engine_rc" "$tests_rc" "$bench_rc"; do
    [ "$rc" = "-" ] || [ "$rc" -eq 0 ] || exit 1
done
