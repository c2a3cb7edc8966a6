# Root conftest: shared fixtures live in tests/fixtures/ as plugins so that each concern keeps its own file.
pytest_plugins = ["tests.fixtures.kafka", "tests.fixtures.models", "tests.fixtures.worker_logs"]
