"""How KafkaSettings' security fields become aiokafka client arguments: TLS contexts (CA, client certificate,
hostname verification), SASL credentials, and OAUTHBEARER tokens from a file or a command.

`KafkaSettings.client_kwargs()` is the only caller of `security_kwargs`, and every Kafka client the project makes
(worker, control reader, publisher, admin, CLI commands, example client) is built from `client_kwargs()`, so a
setting added here reaches all of them. Secrets leave this module only as aiokafka arguments: they are never
logged, and errors name the file or the command, never the secret.
"""

from __future__ import annotations

import asyncio
import shlex
import ssl
from pathlib import Path
from typing import Protocol

from pydantic import SecretStr


class KafkaSecurity(Protocol):
    """The security fields this module reads (KafkaSettings has them): named here so that the settings
    module may call this one without this one importing it back."""

    security_protocol: str
    sasl_mechanism: str | None
    sasl_username: str | None
    sasl_password: SecretStr | None
    sasl_oauth_token_file: str | None
    sasl_oauth_token_command: str | None
    ssl_cafile: str | None
    ssl_certfile: str | None
    ssl_keyfile: str | None
    ssl_key_password: SecretStr | None
    ssl_check_hostname: bool

TLS_PROTOCOLS = ("SSL", "SASL_SSL")
SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
TOKEN_COMMAND_TIMEOUT_S = 20.0


class SecuritySettingsError(ValueError):
    """Security settings that cannot work together (raised while the settings are validated)."""


def check_security(kafka: KafkaSecurity) -> None:
    """Refuse combinations that would only fail later, at the broker, with a vaguer message."""
    protocol, mechanism = kafka.security_protocol, kafka.sasl_mechanism
    if protocol in SASL_PROTOCOLS and not mechanism:
        raise SecuritySettingsError(f"KAFKA_SECURITY_PROTOCOL={protocol} needs KAFKA_SASL_MECHANISM")
    if mechanism and protocol not in SASL_PROTOCOLS:
        raise SecuritySettingsError(f"KAFKA_SASL_MECHANISM={mechanism} needs KAFKA_SECURITY_PROTOCOL=SASL_SSL "
                                    f"or SASL_PLAINTEXT (it is {protocol})")
    if mechanism == "OAUTHBEARER":
        if bool(kafka.sasl_oauth_token_file) == bool(kafka.sasl_oauth_token_command):
            raise SecuritySettingsError("KAFKA_SASL_MECHANISM=OAUTHBEARER needs exactly one of "
                                        "KAFKA_SASL_OAUTH_TOKEN_FILE and KAFKA_SASL_OAUTH_TOKEN_COMMAND")
    elif mechanism and not (kafka.sasl_username and kafka.sasl_password):
        raise SecuritySettingsError(f"KAFKA_SASL_MECHANISM={mechanism} needs KAFKA_SASL_USERNAME and "
                                    f"KAFKA_SASL_PASSWORD")
    tls_fields = [name for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(kafka, name)]
    if tls_fields and protocol not in TLS_PROTOCOLS:
        raise SecuritySettingsError(f"KAFKA_{tls_fields[0].upper()} is set but KAFKA_SECURITY_PROTOCOL={protocol} "
                                    f"does not use TLS (SSL or SASL_SSL)")
    if kafka.ssl_keyfile and not kafka.ssl_certfile:
        raise SecuritySettingsError("KAFKA_SSL_KEYFILE needs KAFKA_SSL_CERTFILE")


def security_kwargs(kafka: KafkaSecurity) -> dict:
    kwargs: dict = {"security_protocol": kafka.security_protocol}
    if kafka.security_protocol in SASL_PROTOCOLS:
        kwargs["sasl_mechanism"] = kafka.sasl_mechanism
        if kafka.sasl_mechanism == "OAUTHBEARER":
            kwargs["sasl_oauth_token_provider"] = token_provider(kafka)
        else:
            kwargs["sasl_plain_username"] = kafka.sasl_username
            kwargs["sasl_plain_password"] = kafka.sasl_password.get_secret_value()
            if kafka.sasl_mechanism.startswith("SCRAM-"):
                from worker.transport.kafka.aiokafka_compat import cache_scram_salted_passwords

                cache_scram_salted_passwords()
    if kafka.security_protocol in TLS_PROTOCOLS:
        kwargs["ssl_context"] = ssl_context(kafka)
    return kwargs


def ssl_context(kafka: KafkaSecurity) -> ssl.SSLContext:
    """Verifies the broker against ssl_cafile (or the system's CAs), its name unless ssl_check_hostname is off,
    and presents ssl_certfile when set. Unreadable files fail here, naming the setting."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if kafka.ssl_cafile:
        try:
            context.load_verify_locations(cafile=kafka.ssl_cafile)
        except (OSError, ssl.SSLError) as exc:
            raise SecuritySettingsError(f"KAFKA_SSL_CAFILE {kafka.ssl_cafile}: cannot load a CA from it "
                                        f"({_reason(exc)})") from None
    if kafka.ssl_certfile:
        password = kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password else None
        try:
            context.load_cert_chain(kafka.ssl_certfile, kafka.ssl_keyfile or None, password)
        except (OSError, ssl.SSLError) as exc:
            hint = (" (wrong KAFKA_SSL_KEY_PASSWORD, or a key that does not match)"
                    if isinstance(exc, ssl.SSLError) else "")
            raise SecuritySettingsError(f"KAFKA_SSL_CERTFILE {kafka.ssl_certfile} / KAFKA_SSL_KEYFILE "
                                        f"{kafka.ssl_keyfile or '(in the certfile)'}: cannot load the client "
                                        f"certificate{hint}") from None
    # Off only on request: the chain is still verified (CERT_REQUIRED stays), the name is not.
    context.check_hostname = kafka.ssl_check_hostname
    return context


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or type(exc).__name__


def token_provider(kafka: KafkaSecurity):
    from aiokafka.abc import AbstractTokenProvider

    class TokenProvider(AbstractTokenProvider):
        """Reads the token at each authentication: a refreshed file or a command's new token is picked up at the
        next connection, as managed services' short-lived IAM tokens need."""

        async def token(self) -> str:
            if kafka.sasl_oauth_token_file:
                return read_token_file(Path(kafka.sasl_oauth_token_file))
            return await run_token_command(kafka.sasl_oauth_token_command)

    return TokenProvider()


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise SecuritySettingsError(f"KAFKA_SASL_OAUTH_TOKEN_FILE {path}: {_reason(exc)}") from None
    if not token:
        raise SecuritySettingsError(f"KAFKA_SASL_OAUTH_TOKEN_FILE {path} is empty")
    return token


async def run_token_command(command: str) -> str:
    argv = shlex.split(command)
    name = argv[0] if argv else "(empty)"
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), TOKEN_COMMAND_TIMEOUT_S)
    except (OSError, IndexError) as exc:
        raise SecuritySettingsError(f"KAFKA_SASL_OAUTH_TOKEN_COMMAND {name}: cannot run it "
                                    f"({_reason(exc)})") from None
    except asyncio.TimeoutError:
        proc.kill()
        raise SecuritySettingsError(f"KAFKA_SASL_OAUTH_TOKEN_COMMAND {name}: no token within "
                                    f"{TOKEN_COMMAND_TIMEOUT_S:g} s") from None
    token = stdout.decode(errors="replace").strip()
    if proc.returncode != 0 or not token:
        # stderr's last line says why; stdout (a partial token, maybe) is never shown.
        last = (stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1][:200]
        raise SecuritySettingsError(f"KAFKA_SASL_OAUTH_TOKEN_COMMAND {name}: exit {proc.returncode}, "
                                    f"no token ({last})")
    return token
