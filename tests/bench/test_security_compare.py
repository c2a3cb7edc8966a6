"""The secured-vs-plaintext comparisons of the Kafka benchmarks (--security): which runs are paired, the ratios,
and the secured worker's connection settings."""

import pytest

from benchmarks.bench_kafka_path import SECURED_FLOOR, compare_secured, worker_env
from benchmarks.bench_plumbing import security_ratios
from benchmarks.lib.broker_target import Target, start_broker
from worker.kafka_settings import KafkaSettings


def test_secured_over_plaintext_is_a_ratio_of_medians_with_pairs_per_repetition():
    kafka = [{"output_tokens_per_s": 10.0}, {"output_tokens_per_s": 20.0}, {"output_tokens_per_s": 30.0}]
    secured = [{"output_tokens_per_s": 9.0}, {"output_tokens_per_s": 19.0}, {"output_tokens_per_s": 27.0}]
    out = compare_secured(kafka, secured)
    assert out["ratio_of_medians"] == pytest.approx(19.0 / 20.0)
    assert out["ratio_per_rep"] == pytest.approx([0.9, 0.95, 0.9])
    assert out["floor"] == SECURED_FLOOR and out["meets_floor"]
    assert not compare_secured(kafka, [{"output_tokens_per_s": 1.0}] * 3)["meets_floor"]


def test_plumbing_ratios_pair_the_same_case_across_modes():
    def row(security, tokens, rate, eos=True):
        return {"security": security, "exactly_once": eos, "max_new_tokens": tokens, "stream": tokens > 1,
                "sustained_req_per_s": rate, "req_per_wall_s": rate / 2, "req_per_worker_cpu_s_total": None}

    rows = [row("plaintext", 1, 1000.0), row("sasl_ssl", 1, 900.0), row("plaintext", 1, 1200.0),
            row("sasl_ssl", 1, 1000.0), row("plaintext", 4, 500.0), row("sasl_ssl", 4, 500.0),
            row("plaintext", 1, 700.0, eos=False)]  # no secured partner: no ratio
    ratios = security_ratios(rows)
    assert [(r["max_new_tokens"], r["sustained_req_per_s_ratio"]) for r in ratios] == [(1, 0.864), (4, 1.0)]
    assert all(r["security"] == "sasl_ssl" and "req_per_worker_cpu_s_total_ratio" not in r for r in ratios)


def test_the_secured_worker_connects_as_the_worker_principal():
    class FakeSecurity:
        def client_env(self, principal, bootstrap):
            return {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_USERNAME": principal,
                    "KAFKA_BOOTSTRAP_SERVERS": bootstrap}

    target = Target("sasl_ssl", "127.0.0.1:1", security=FakeSecurity())
    env = worker_env(KafkaSettings(bootstrap_servers="127.0.0.1:1"), "m", 128, 1, target)
    assert env["KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and env["KAFKA_SASL_USERNAME"] == "worker"
    assert Target("plaintext", "127.0.0.1:1").env("worker") == {}


def test_an_unknown_mode_is_refused_before_any_broker_starts(tmp_path):
    with pytest.raises(ValueError, match="unknown security mode"):
        start_broker(tmp_path, "kerberos")
