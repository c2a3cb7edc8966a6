"""deploy/: the Kubernetes manifests against the Kubernetes schemas (kubernetes-validate, strict) and KEDA's
ScaledObject schema (vendored in deploy/schemas/, made strict here), every setting they name against the code,
and the numbers that must agree between them (docs/fleet.md says why each is what it is)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.test_compose import _settings_by_prefix
from worker.transport.metrics import WorkerMetrics
from worker.transport.requests.tracing import OTEL_ENV

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.37.0"
ACK_WAIT_S = 30
"""How long a stopping worker waits for its records' acknowledgements after the drain (Worker._shutdown)."""
# The parameters KEDA documents for the two scalers used (keda.sh/docs, scalers apache-kafka and prometheus).
KAFKA_SCALER_PARAMETERS = {
    "bootstrapServers", "consumerGroup", "topic", "lagThreshold", "activationLagThreshold", "offsetResetPolicy",
    "allowIdleConsumers", "excludePersistentLag", "scaleToZeroOnInvalidOffset", "limitToPartitionsWithLag",
    "version", "partitionLimitation", "sasl", "tls", "unsafeSsl", "ensureEvenDistributionOfPartitions",
}
PROMETHEUS_SCALER_PARAMETERS = {
    "serverAddress", "query", "threshold", "activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
    "unsafeSsl", "queryParameters",
}


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _kind(kind: str) -> dict:
    found = [d for name in ("worker.yaml", "pdb.yaml", "keda-scaledobject.yaml") for d in _docs(name)
             if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def _worker_container() -> dict:
    (container,) = [c for c in _kind("Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"]
    return container


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _strict(schema: dict) -> dict:
    """Kubernetes prunes fields a structural CRD schema does not declare (a typo would vanish silently): refuse
    them here instead."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.mark.parametrize("name", ["worker.yaml", "pdb.yaml"])
def test_kubernetes_manifests_match_the_kubernetes_schemas(name: str) -> None:
    for doc in _docs(name):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_typo_fails_the_kubernetes_schema() -> None:
    doc = copy.deepcopy(_kind("Deployment"))
    doc["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_scaled_object_matches_kedas_schema_and_scaler_parameters() -> None:
    schema = _strict(json.loads((DEPLOY / "schemas" / "keda-scaledobject-v1alpha1.json").read_text()))
    scaled = _kind("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    jsonschema.validate(scaled, schema)
    bad = copy.deepcopy(scaled)
    bad["spec"]["cooldownPeriods"] = 600
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    known = {"kafka": KAFKA_SCALER_PARAMETERS, "prometheus": PROMETHEUS_SCALER_PARAMETERS}
    for trigger in scaled["spec"]["triggers"]:
        assert set(trigger["metadata"]) <= known[trigger["type"]], trigger


def test_every_env_name_is_a_worker_setting() -> None:
    by_prefix = _settings_by_prefix()
    spec = _kind("Deployment")["spec"]["template"]["spec"]
    for container in spec["containers"] + spec.get("initContainers", []):
        for name in _env(container):
            if name.startswith("OTEL_"):  # the OpenTelemetry SDK's own, read by worker/transport/requests/tracing.py
                assert name in OTEL_ENV, name
                continue
            prefix = max((p for p in by_prefix if name.startswith(p)), key=len, default=None)
            assert prefix is not None, f"{container['name']}: {name} matches no settings class"
            field = name[len(prefix):].lower()
            assert field in by_prefix[prefix].model_fields, f"{name} is not a {by_prefix[prefix].__name__} field"


def test_the_numbers_agree() -> None:
    deployment, scaled = _kind("Deployment"), _kind("ScaledObject")
    pod, container = deployment["spec"]["template"]["spec"], _worker_container()
    env = _env(container)
    # The grace period covers the drain, the acknowledgements and a margin for the commit and LeaveGroup.
    assert pod["terminationGracePeriodSeconds"] >= float(env["WORKER_DRAIN_TIMEOUT_S"]) + ACK_WAIT_S + 10
    assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    # Probes on the worker's metrics port; readiness on its /ready.
    port = int(env["WORKER_METRICS_PORT"])
    assert {"name": "metrics", "containerPort": port} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    # The model cache is where the worker looks for models.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["model-cache"] == env["LLM_WORKER_HOME"]
    # A worker that is still loading its model is never scaled away: cooldown past the start-up budget.
    startup = container["startupProbe"]
    assert scaled["spec"]["cooldownPeriod"] > startup["periodSeconds"] * startup["failureThreshold"]
    # No more workers than partitions per priority (each worker must hold every priority).
    assert scaled["spec"]["maxReplicaCount"] == int(env["KAFKA_PARTITIONS_PER_PRIORITY"])
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    triggers = {t["type"]: t for t in scaled["spec"]["triggers"]}
    kafka = triggers["kafka"]["metadata"]
    assert (kafka["topic"], kafka["consumerGroup"]) == (env["KAFKA_REQUEST_TOPIC"], env["KAFKA_GROUP_ID"])
    assert kafka["bootstrapServers"] == env["KAFKA_BOOTSTRAP_SERVERS"]
    assert kafka["allowIdleConsumers"] == "false"
    # The prometheus query names a metric the worker exports.
    assert "llm_worker:desired_workers" in triggers["prometheus"]["metadata"]["query"]
    assert "llm_worker:desired_workers" in {m.name for m in WorkerMetrics.create().registry.collect()}
    pdb = _kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_the_readiness_endpoint_follows_the_worker() -> None:
    import urllib.error
    import urllib.request

    from worker.broker.net import free_port

    state = {"ready": False}
    port = free_port()
    server = WorkerMetrics.create().serve(port, addr="127.0.0.1", ready=lambda: state["ready"])
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5)
        assert refused.value.code == 503
        state["ready"] = True
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert "llm_worker:desired_workers" in response.read().decode()
    finally:
        server.shutdown()
        server.server_close()


def _gateway(kind: str) -> dict:
    (doc,) = [d for d in _docs("gateway.yaml") if d["kind"] == kind]
    return doc


def test_gateway_manifests_match_the_kubernetes_schemas() -> None:
    docs = _docs("gateway.yaml")
    assert {d["kind"] for d in docs} == {"PersistentVolumeClaim", "Deployment", "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_gateway_settings_agree_with_the_workers_and_its_pod() -> None:
    from gateway.settings import GatewaySettings
    from worker.kafka_settings import KafkaSettings

    by_prefix = _settings_by_prefix()
    deployment = _gateway("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = _env(container)
    assert container["command"] == ["llm-worker", "gateway"]
    for name in env:
        prefix = max((p for p in by_prefix if name.startswith(p)), key=len, default=None)
        assert prefix in ("KAFKA_", "GATEWAY_"), name
        assert name[len(prefix):].lower() in by_prefix[prefix].model_fields, name
    gateway = GatewaySettings(**{k.removeprefix("GATEWAY_").lower(): v for k, v in env.items()
                                 if k.startswith("GATEWAY_")})
    # A client of the workers' topics: the same names and the same partition layout (worker.yaml).
    worker_env = _env(_worker_container())
    for name, value in env.items():
        if name.startswith("KAFKA_"):
            assert worker_env[name] == value, name
    # The workers answer on the gateway's reply topics only if their allowed prefixes cover it.
    assert "KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES" not in worker_env
    assert any(gateway.reply_topic_prefix.startswith(p) for p in KafkaSettings().allowed_reply_topic_prefixes)
    # It listens beyond loopback, so keys are required; they come from the Secret, mounted where it reads them.
    assert gateway.host == "0.0.0.0" and not gateway.behind_auth_proxy
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert gateway.keys_path.parent == Path(mounts["keys"]) and "secret" in volumes["keys"]
    assert gateway.data_dir == Path(mounts["data"])
    claim = _gateway("PersistentVolumeClaim")["metadata"]["name"]
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == claim
    # One pod at a time on a ReadWriteOnce volume.
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    # Probes and the Service reach the port it listens on; the Service selects its pods.
    assert {"name": "http", "containerPort": gateway.port} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user (Dockerfile)
    service = _gateway("Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
