"""`llm-worker config --check`: a wrong override (an unknown name, a refused value, more workers than partitions
per priority) is refused with the setting's name; the shipped compose file passes."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys
from pathlib import Path

from worker.config_cli import check_settings

REPO = Path(__file__).resolve().parents[1]


def test_unknown_names_and_bad_values_are_named():
    problems = check_settings({"KAFKA_BOOTSTRAP_SERVER": "x:9092", "ENGINE_MAX_NUM_SEQS": "0",
                               "WORKER_MAX_QUEUE_TIME_S": "[10, 30", "KAFKA_HEAP_OPTS": "-Xmx1g"})
    text = "\n".join(problems)
    assert "KAFKA_BOOTSTRAP_SERVER: no such setting (did you mean KAFKA_BOOTSTRAP_SERVERS?)" in text
    assert "ENGINE_MAX_NUM_SEQS:" in text and "WORKER_MAX_QUEUE_TIME_S: not valid JSON" in text
    assert "KAFKA_HEAP_OPTS" not in text  # Kafka's own script variable, not ours
    assert len(problems) == 3


def test_more_workers_than_partitions_per_priority_is_refused():
    assert check_settings({"KAFKA_PARTITIONS_PER_PRIORITY": "2"}, workers=2) == []
    (problem,) = check_settings({"KAFKA_PARTITIONS_PER_PRIORITY": "2"}, workers=3)
    assert problem.startswith("KAFKA_PARTITIONS_PER_PRIORITY: 3 workers over 2")


def _check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "WORKER_", "ENGINE_", "GATEWAY_"))}
    return subprocess.run([sys.executable, "-m", "worker.cli", "config", "--check", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_the_shipped_compose_file_passes_and_a_bad_override_fails(tmp_path):
    shipped = _check("--compose", str(REPO / "compose.yaml"))
    assert shipped.returncode == 0, shipped.stderr
    override = tmp_path / "compose.override.yaml"
    override.write_text("services:\n  worker:\n    command: [llm-worker, serve]\n    deploy: {replicas: 4}\n"
                        "    environment:\n      KAFKA_PARTITIONS_PER_PRIORITY: '2'\n"
                        "      ENGINE_MAX_NUM_SEQ: '8'\n")
    bad = _check("--compose", str(override))
    assert bad.returncode == 1
    assert "worker: ENGINE_MAX_NUM_SEQ: no such setting (did you mean ENGINE_MAX_NUM_SEQS?)" in bad.stderr
    assert "worker: KAFKA_PARTITIONS_PER_PRIORITY: 4 workers over 2" in bad.stderr
    env_file = tmp_path / "worker.env"
    env_file.write_text("# a Helm-like values file flattened\nWORKER_DRAIN_TIMEOUT_S=abc\n")
    assert "WORKER_DRAIN_TIMEOUT_S:" in _check("--env-file", str(env_file)).stderr
