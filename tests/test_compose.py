"""compose.yaml and the Dockerfile agree with the code: setting names, topic layout, scalability."""

from __future__ import annotations

from types import SimpleNamespace

import argparse
import importlib
import re
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from worker.cli import SUBCOMMANDS
from gateway.settings import GatewaySettings
from worker.kafka_settings import KafkaSettings

ROOT = Path(__file__).resolve().parent.parent
CLIENT_SERVICES = ("topics", "worker", "worker-gpu", "gateway", "producer")


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def _settings_by_prefix() -> dict[str, SimpleNamespace]:
    """Per variable prefix, the fields of every settings class that reads it (WORKER_ is the worker's and the
    allocator's): `model_fields` and `__name__`, as one class would have them."""
    from worker.config_cli import SETTINGS_CLASSES

    merged: dict[str, SimpleNamespace] = {}
    for cls in SETTINGS_CLASSES:
        entry = merged.setdefault(cls.model_config["env_prefix"], SimpleNamespace(model_fields={}, __name__=""))
        entry.model_fields.update(cls.model_fields)
        entry.__name__ = f"{entry.__name__} or {cls.__name__}" if entry.__name__ else cls.__name__
    return merged


def _field_default(name: str):
    return KafkaSettings.model_fields[name].default


def test_all_services_exist(services: dict[str, dict]) -> None:
    assert {"kafka", *CLIENT_SERVICES} <= set(services)


@pytest.mark.parametrize("service", CLIENT_SERVICES)
def test_env_names_are_real_settings_fields(services: dict[str, dict], service: str) -> None:
    by_prefix = _settings_by_prefix()
    assert {"KAFKA_", "ENGINE_", "WORKER_", "LLM_WORKER_", "GATEWAY_"} <= set(by_prefix)
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


def _commands() -> dict[str, str]:
    """`llm-worker` subcommand -> module: the worker's own and those pyproject.toml registers (the clients')."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    registered = project["entry-points"]["llm_worker.commands"]
    return {**{name: module for name, (module, _) in SUBCOMMANDS.items()},
            **{name: target.split(":")[0] for name, target in registered.items()}}


@pytest.mark.parametrize("service", CLIENT_SERVICES)
def test_commands_are_cli_subcommands_with_valid_flags(services: dict[str, dict], service: str) -> None:
    program, subcommand, *rest = services[service]["command"]
    assert program == "llm-worker"
    commands = _commands()
    assert subcommand in commands, f"{service}: unknown subcommand {subcommand}"
    module = importlib.import_module(commands[subcommand])
    parser = argparse.ArgumentParser(prog=f"llm-worker {subcommand}")
    module.configure_parser(parser)
    parser.parse_args(rest)  # exits (SystemExit) on an unknown flag


def _dockerfile_lines(path: Path) -> list[str]:
    """Instructions with their continuation lines joined."""
    return [line.strip() for line in path.read_text().replace("\\\n", " ").splitlines()]


def test_dockerfile_builds_the_worker_with_its_model() -> None:
    lines = _dockerfile_lines(ROOT / "Dockerfile")
    # A slim Python image by default; any Debian-like base (the registry-free build) by argument.
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines and "FROM ${BASE_IMAGE}" in lines
    assert any(line.startswith("RUN") and "llm-worker model pull" in line for line in lines)
    assert any("pip install --no-deps ." in line for line in lines)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored and "deploy/containers/kafka/libs/" in ignored


def test_image_installs_every_extra_its_commands_need() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # `llm-worker model pull` (model), traces (otel) and `llm-worker gateway` (gateway).
    for extra in ("model", "otel", "gateway"):
        assert f"x['{extra}']" in text, extra


def test_gpu_image_gets_a_c_compiler(services: dict[str, dict]) -> None:
    assert services["worker-gpu"]["build"]["args"]["WITH_C_COMPILER"]
    assert "worker-gpu" not in services["worker"].get("build", {}).get("args", {})
    assert "WITH_C_COMPILER" not in services["worker"]["build"]["args"]
    lines = _dockerfile_lines(ROOT / "Dockerfile")
    (install,) = [line for line in lines if "WITH_C_COMPILER" in line and line.startswith("RUN")]
    assert "gcc" in install and "libc6-dev" in install


def test_scale_advice_matches_the_partitions(services: dict[str, dict]) -> None:
    per_priority = int(services["worker"]["environment"]["KAFKA_PARTITIONS_PER_PRIORITY"])
    text = (ROOT / "compose.yaml").read_text() + (ROOT / "docs" / "deployment.md").read_text()
    advised = [int(n) for n in re.findall(r"--scale worker=(\d+)", text)]
    assert advised and all(n <= per_priority for n in advised), advised


def test_gateway_service(services: dict[str, dict]) -> None:
    gateway = services["gateway"]
    assert gateway["command"][:2] == ["llm-worker", "gateway"]
    env = gateway["environment"]
    settings = GatewaySettings(**{k.removeprefix("GATEWAY_").lower(): v for k, v in env.items()
                                  if k.startswith("GATEWAY_")})
    # Its data (batches, keys) is on a named volume, at the path the gateway uses.
    mounts = dict(volume.split(":")[:2] for volume in gateway["volumes"])
    assert mounts[next(iter(mounts))] == str(settings.data_dir)
    assert next(iter(mounts)) in yaml.safe_load((ROOT / "compose.yaml").read_text())["volumes"]
    # Published on the port it listens on; it listens beyond loopback, so it needs keys, which compose does
    # not waive.
    assert any(port.endswith(f":{settings.port}") for port in gateway["ports"])
    assert settings.host == "0.0.0.0" and not settings.behind_auth_proxy
    assert gateway["depends_on"]["topics"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("service", ["worker", "worker-gpu"])
def test_workers_allow_the_gateways_reply_topics(
    services: dict[str, dict], service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in KafkaSettings.model_fields:
        monkeypatch.delenv(f"KAFKA_{name.upper()}", raising=False)
    for name, value in services[service]["environment"].items():
        monkeypatch.setenv(name, str(value))
    prefix = GatewaySettings().reply_topic_prefix
    gateway_env = services["gateway"]["environment"]
    prefix = gateway_env.get("GATEWAY_REPLY_TOPIC_PREFIX", prefix)
    assert any(prefix.startswith(p) for p in KafkaSettings().allowed_reply_topic_prefixes)


def test_local_override_only_swaps_images() -> None:
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    local = yaml.safe_load((ROOT / "compose.local.yaml").read_text())["services"]
    assert set(local) <= set(base)
    for name, spec in local.items():
        assert set(spec) <= {"image", "build"}, name
    # Every worker-image service builds the same way: one image for all of them.
    worker_builds = {str(spec["build"]) for name, spec in local.items() if name != "kafka"}
    assert len(worker_builds) == 1
    assert (ROOT / local["kafka"]["build"]["context"] / "Dockerfile").is_file()


def test_kafka_image_jars_match_the_local_broker() -> None:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}

    def properties(path: Path) -> dict[str, str]:
        root = ET.parse(path).getroot()
        return {child.tag.split("}")[1]: child.text for child in root.find("m:properties", ns)}

    image = properties(ROOT / "deploy" / "containers" / "kafka" / "pom.xml")
    broker = properties(ROOT / "worker" / "broker" / "pom.xml")
    assert image["kafka.version"] == broker["kafka.version"]
    assert image["log4j.version"] == broker["log4j.version"]
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    local = yaml.safe_load((ROOT / "compose.local.yaml").read_text())["services"]
    assert services["kafka"]["image"].endswith(":" + image["kafka.version"])
    assert local["kafka"]["image"].endswith(":" + image["kafka.version"])


def test_kafka_image_reads_the_official_images_variables(tmp_path: Path) -> None:
    import os
    import shutil
    import subprocess

    if shutil.which("sh") is None:
        pytest.skip("no POSIX shell")
    script = (ROOT / "deploy" / "containers" / "kafka" / "entrypoint.sh").read_text()
    # Only the property conversion: stop before Java runs.
    script = script.replace("/opt/kafka/config", str(tmp_path)).split('CLASSPATH="/opt/kafka/libs/*"')[0]
    env = {"PATH": os.environ["PATH"], "CLUSTER_ID": "x", "KAFKA_NODE_ID": "1",
           "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "A:PLAINTEXT,B:SSL", "KAFKA_HEAP_OPTS": "-Xmx1g",
           "KAFKA_SASL_MECHANISM_INTER__BROKER_PROTOCOL": "PLAIN", "KAFKA_A___B": "c=d"}
    subprocess.run(["sh", "-c", script], env=env, check=True)
    lines = (tmp_path / "server.properties").read_text().splitlines()
    assert "node.id=1" in lines
    assert "listener.security.protocol.map=A:PLAINTEXT,B:SSL" in lines
    assert "sasl.mechanism.inter_broker.protocol=PLAIN" in lines
    assert "a-b=c=d" in lines
    assert not any(line.startswith("heap") for line in lines)
