# Root conftest: shared fixtures live in tests/fixtures/ as plugins so that each concern keeps its own file.
import os

# The tests compare the engine with transformers token for token, which holds in float32. The default dtype
# (bfloat16 on CPUs with bf16 matrix units) has tests of its own that clear this (tests/model/test_dtype.py).
os.environ.setdefault("ENGINE_DTYPE", "float32")

pytest_plugins = ["tests.fixtures.kafka", "tests.fixtures.models", "tests.fixtures.worker_logs"]
