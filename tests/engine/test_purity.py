"""The scheduler and block pool stay pure Python: importing them pulls in no torch, aiokafka or transformers."""

import json
import subprocess
import sys

PURE_MODULES = [
    "worker.engine.request",
    "worker.engine.block_pool",
    "worker.engine.outputs",
    "worker.engine.policies",
    "worker.engine.scheduler",
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
