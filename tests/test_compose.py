"""compose.yaml and the Dockerfile agree with the code: setting names, topic layout, scalability."""

from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path

import pytest
import yaml
from pydantic_settings import BaseSettings

import worker.config
from worker.cli import SUBCOMMANDS
from worker.config import KafkaSettings

ROOT = Path(__file__).resolve().parent.parent
CLIENT_SERVICES = ("topics", "worker", "worker-gpu", "producer")
# Subcommands compose runs that the CLI does not register yet; once registered, their flags are parsed below.
PENDING_SUBCOMMANDS = {"serve", "generate"}


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def _settings_by_prefix() -> dict[str, type[BaseSettings]]:
    classes = [
        cls
        for _, cls in inspect.getmembers(worker.config, inspect.isclass)
        if issubclass(cls, BaseSettings) and cls is not BaseSettings and cls.__module__ == worker.config.__name__
    ]
    return {cls.model_config["env_prefix"]: cls for cls in classes}


def _field_default(name: str):
    return KafkaSettings.model_fields[name].default


def test_all_services_exist(services: dict[str, dict]) -> None:
    assert {"kafka", *CLIENT_SERVICES} <= set(services)


@pytest.mark.parametrize("service", CLIENT_SERVICES)
def test_env_names_are_real_settings_fields(services: dict[str, dict], service: str) -> None:
    by_prefix = _settings_by_prefix()
    assert {"KAFKA_", "ENGINE_", "WORKER_", "LLM_WORKER_"} <= set(by_prefix)
    for name in services[service]["environment"]:
        # Longest prefix first: LLM_WORKER_ must not be read as a WORKER_ setting.
        prefix = max((p for p in by_prefix if name.startswith(p)), key=len, default=None)
        assert prefix is not None, f"{service}: {name} matches no settings class"
        field = name[len(prefix) :].lower()
        assert field in by_prefix[prefix].model_fields, f"{service}: {name} is not a {by_prefix[prefix].__name__} field"


@pytest.mark.parametrize("service", CLIENT_SERVICES)
def test_env_values_load_and_topics_are_the_defaults(
    services: dict[str, dict], service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = services[service]["environment"]
    for name in KafkaSettings.model_fields:
        monkeypatch.delenv(f"KAFKA_{name.upper()}", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    settings = KafkaSettings()  # validates every value compose passes
    for field in ("request_topic", "result_topic", "dead_letter_topic", "status_topic", "group_id"):
        assert getattr(settings, field) == _field_default(field), f"{service}: {field}"
    assert settings.bootstrap_servers == "kafka:9092"
    default_partitions = _field_default("num_priorities") * _field_default("partitions_per_priority")
    assert settings.num_request_partitions == default_partitions


def test_workers_and_topic_job_share_the_partition_layout(services: dict[str, dict]) -> None:
    layout_names = ("KAFKA_NUM_PRIORITIES", "KAFKA_PARTITIONS_PER_PRIORITY", "KAFKA_REQUEST_TOPIC")
    layouts = {s: tuple(str(services[s]["environment"][n]) for n in layout_names) for s in CLIENT_SERVICES}
    assert len(set(layouts.values())) == 1, layouts


@pytest.mark.parametrize("service", ["worker", "worker-gpu"])
def test_worker_scales(services: dict[str, dict], service: str) -> None:
    spec = services[service]
    assert "container_name" not in spec and "ports" not in spec and "hostname" not in spec
    assert spec["depends_on"]["topics"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("service", ["worker", "worker-gpu"])
def test_workers_may_drain_before_compose_kills_them(services: dict[str, dict], service: str) -> None:
    spec = services[service]
    grace_s = float(spec["stop_grace_period"].removesuffix("s"))
    assert float(spec["environment"]["WORKER_DRAIN_TIMEOUT_S"]) + 10 <= grace_s


def test_gpu_variant_is_a_profile_that_reserves_an_nvidia_device(services: dict[str, dict]) -> None:
    assert "profiles" not in services["worker"]
    assert services["worker"]["environment"]["ENGINE_DEVICE"] == "cpu"
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["environment"]["ENGINE_DEVICE"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_broker_advertises_what_clients_bootstrap_from(services: dict[str, dict]) -> None:
    env = services["kafka"]["environment"]
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"].startswith(f"{env['KAFKA_NODE_ID']}@kafka:")
    # Like the local broker: single-replica internal topics, no auto-created topics.
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"


@pytest.mark.parametrize("service", CLIENT_SERVICES)
def test_commands_are_cli_subcommands_with_valid_flags(services: dict[str, dict], service: str) -> None:
    program, subcommand, *rest = services[service]["command"]
    assert program == "llm-worker"
    if subcommand not in SUBCOMMANDS:
        assert subcommand in PENDING_SUBCOMMANDS, f"{service}: unknown subcommand {subcommand}"
        return
    module = importlib.import_module(SUBCOMMANDS[subcommand][0])
    parser = argparse.ArgumentParser(prog=f"llm-worker {subcommand}")
    module.configure_parser(parser)
    parser.parse_args(rest)  # exits (SystemExit) on an unknown flag


def test_dockerfile_builds_the_worker_with_its_model() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert any(line.startswith("RUN llm-worker model pull") for line in lines)
    assert any("pip install" in line and "." in line for line in lines)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored
