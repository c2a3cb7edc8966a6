"""KafkaSettings' security fields, the clients they build, and the local broker's generated security files
(fast: no broker, no Java)."""

from __future__ import annotations

import json
import ssl
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from worker.broker.secure import Security, settings_for
from worker.kafka_settings import KafkaSettings
from worker.config_cli import masked_dump
from worker.security import SecuritySettingsError, run_token_command, ssl_context, token_provider


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Security:
    return Security.load_or_create(tmp_path_factory.mktemp("broker"), "ssl")


def test_sasl_ssl_builds_scram_credentials_and_a_verifying_tls_context(pki: Security) -> None:
    kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="worker",
                          sasl_password="s3cret-pw", ssl_cafile=str(pki.ca_path))
    kwargs = kafka.client_kwargs()
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == ("worker", "s3cret-pw")
    context = kwargs["ssl_context"]
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert KafkaSettings(**{**kafka.model_dump(), "ssl_check_hostname": False}).client_kwargs()[
        "ssl_context"].check_hostname is False


def test_mutual_tls_loads_an_encrypted_client_key_and_names_a_wrong_password(pki: Security) -> None:
    env = {k.removeprefix("KAFKA_").lower(): v for k, v in pki.client_env("worker", "127.0.0.1:1").items()}
    assert env["security_protocol"] == "SSL" and env["ssl_key_password"]
    assert isinstance(KafkaSettings(**env).client_kwargs()["ssl_context"], ssl.SSLContext)
    with pytest.raises(SecuritySettingsError, match="KAFKA_SSL_KEY_PASSWORD") as caught:
        ssl_context(KafkaSettings(**{**env, "ssl_key_password": "not-it"}))
    assert "not-it" not in str(caught.value)


@pytest.mark.parametrize(("fields", "message"), [
    ({"security_protocol": "SASL_SSL"}, "needs KAFKA_SASL_MECHANISM"),
    ({"sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"}, "needs KAFKA_SECURITY_PROTOCOL"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256", "sasl_username": "u"}, "SASL_PASSWORD"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"}, "exactly one of"),
    ({"ssl_cafile": "/ca.pem"}, "does not use TLS"),
    ({"security_protocol": "SSL", "ssl_keyfile": "/k.pem"}, "KAFKA_SSL_KEYFILE needs KAFKA_SSL_CERTFILE"),
])  # fmt: skip
def test_settings_that_cannot_work_are_refused_at_once(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KafkaSettings(**fields)


def test_secrets_are_masked_in_config_output_and_repr() -> None:
    kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="u",
                          sasl_password="hunter2-pw", ssl_certfile="/c.pem", ssl_key_password="key-pw-9")
    dumped = json.dumps(masked_dump(kafka))
    assert "hunter2-pw" not in dumped and "key-pw-9" not in dumped and '"sasl_password": "***"' in dumped
    assert "hunter2-pw" not in repr(kafka) and "key-pw-9" not in str(kafka)


async def test_oauth_token_comes_fresh_from_the_file_at_each_authentication(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER",
                          sasl_oauth_token_file=str(token_file))
    provider = kafka.client_kwargs()["sasl_oauth_token_provider"]
    token_file.write_text("first.jwt.token\n")
    assert await provider.token() == "first.jwt.token"
    token_file.write_text("second.jwt.token")
    assert await provider.token() == "second.jwt.token"


async def test_oauth_token_command_output_is_the_token_and_its_failure_hides_stdout(tmp_path: Path) -> None:
    kafka = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER",
                          sasl_oauth_token_command=f"{sys.executable} -c \"print('cmd.jwt.token')\"")
    assert await token_provider(kafka).token() == "cmd.jwt.token"
    failing = f"{sys.executable} -c \"import sys; print('leaked.partial'); sys.exit('no credentials found')\""
    with pytest.raises(SecuritySettingsError, match="exit 1, no token \\(no credentials found\\)") as caught:
        await run_token_command(failing)
    assert "leaked.partial" not in str(caught.value)


def test_client_files_hold_each_principal_settings_for_us_librdkafka_and_java(tmp_path: Path) -> None:
    security = Security.load_or_create(tmp_path, "sasl_ssl")
    env_files = security.write_client_files(tmp_path, "127.0.0.1:19092")
    assert set(env_files) == {"admin", "worker", "client"}
    worker_env = dict(line.split("=", 1) for line in env_files["worker"].read_text().splitlines())
    assert worker_env["KAFKA_SASL_USERNAME"] == "worker"
    assert worker_env["KAFKA_SASL_PASSWORD"] == security.passwords["worker"]
    assert env_files["worker"].stat().st_mode & 0o077 == 0
    librdkafka = (tmp_path / "clients" / "client.properties").read_text()
    assert "sasl.username=client" in librdkafka and f"ssl.ca.location={security.ca_path}" in librdkafka
    assert "ScramLoginModule" in (tmp_path / "clients" / "client.java.properties").read_text()
    props = security.server_properties("127.0.0.1", 19092, 19093)
    assert props["listeners"] == "SASL_SSL://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert "User:admin" in props["super.users"] and "User:worker" not in props["super.users"]
    assert len(security.format_args()) == 2 * 2 * 3  # two SCRAM mechanisms x three users, flag + value
    admin = settings_for(security, "admin", "127.0.0.1:19092", KafkaSettings(result_topic="r"))
    assert admin.sasl_username == "admin" and admin.result_topic == "r"
    # The same folder keeps its mode and passwords; another mode is refused rather than half-applied.
    assert Security.load_or_create(tmp_path, None).passwords == security.passwords
    with pytest.raises(Exception, match="start --fresh"):
        Security.load_or_create(tmp_path, "ssl")
