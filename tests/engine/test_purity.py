"""The engine's planning modules (scheduler, block pool, batch builder, ...) stay pure Python: importing them pulls
in no torch, aiokafka or transformers (tests/test_layers.py checks the same of their import statements)."""

import json
import subprocess
import sys

PURE_MODULES = [
    "worker.engine.api",
    "worker.engine.request",
    "worker.engine.block_pool",
    "worker.engine.scheduler_output",
    "worker.engine.policies",
    "worker.engine.scheduler",
    "worker.engine.batch_builder",
    "worker.model.step_batch",
]
HEAVY_MODULES = ["torch", "aiokafka", "transformers", "triton", "numpy"]


def test_scheduler_modules_import_no_heavy_dependencies():
    code = (
        "import json, sys\n"
        f"for name in {PURE_MODULES!r}:\n"
        "    __import__(name)\n"
        "print(json.dumps({\n"
        f"    'imported': [m for m in {PURE_MODULES!r} if m in sys.modules],\n"
        f"    'heavy': [m for m in {HEAVY_MODULES!r} if m in sys.modules],\n"
        "}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(result.stdout)
    assert report["imported"] == PURE_MODULES  # the subprocess really imported them
    assert report["heavy"] == []
