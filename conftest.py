# Root conftest: shared fixtures live in tests/fixtures/ as plugins so that each concern keeps its own file.
import os
import sys

# pytest keeps each test module's assertion-rewritten bytecode only where bytecode may be written; an environment
# with PYTHONDONTWRITEBYTECODE set would rewrite every test module on every run (two thirds of collection time).
# The caches go to __pycache__ folders, which git ignores.
sys.dont_write_bytecode = False

# The tests compare the engine with transformers token for token, which holds in float32. The default dtype
# (bfloat16 on CPUs with bf16 matrix units) has tests of its own that clear this (tests/model/test_dtype.py).
os.environ.setdefault("ENGINE_DTYPE", "float32")

pytest_plugins = ["tests.fixtures.kafka", "tests.fixtures.models", "tests.fixtures.worker_logs"]
