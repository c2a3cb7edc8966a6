"""deploy/alerts.yaml under `promtool test rules` (Debian's prometheus package; `make setup` installs it where
apt is there), and every metric the alerts and deploy/grafana-dashboard.json query is one the worker exports.
A real Prometheus scraping a running worker with these rules is in tests/transport/test_fleet_kafka.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from worker.transport.metrics import WorkerMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install "
                                    "prometheus; `make setup` does it where apt is available)")
METRIC = re.compile(r"\b(llm_worker:[a-zA-Z0-9_:]+|up)\b")
SCRAPE_SERIES = {"up"}
"""Series Prometheus makes itself for every target."""


def exported_names() -> set[str]:
    """Every series name the worker's registry exposes (counters with _total, histograms with their parts)."""
    names = set()
    for family in WorkerMetrics.create().registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def _alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "alerts.yaml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


@needs_promtool
def test_the_alert_rules_pass_their_promtool_tests() -> None:
    check = subprocess.run([PROMTOOL, "check", "rules", "alerts.yaml"], cwd=DEPLOY, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    result = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yaml"], cwd=DEPLOY, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_six_alerts_exist() -> None:
    rules = yaml.safe_load((DEPLOY / "alerts.yaml").read_text())
    names = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    assert names == {"LLMWorkerBacklogOverBudget", "LLMWorkerShedding", "LLMWorkerCommitsStalled",
                     "LLMWorkerKVCacheNearlyFull", "LLMWorkerErrorFinalsRising", "LLMWorkerNoStatus"}


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_query_names_an_exported_metric(source: str) -> None:
    exprs = _dashboard_exprs() if source == "dashboard" else _alert_exprs()
    assert exprs
    exported = exported_names() | SCRAPE_SERIES
    for expr in exprs:
        names = set(METRIC.findall(expr))
        assert names, expr
        assert names <= exported, (expr, names - exported)


def test_a_renamed_metric_would_fail() -> None:
    assert "llm_worker:requests_shed_total" in exported_names()
    assert "llm_worker:requests_shed" not in exported_names()  # counters are only exposed with _total
