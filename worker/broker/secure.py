"""The local broker's security modes: TLS, SASL users, the authorizer, and ready-made client settings.

`llm-worker broker start --security MODE`, MODE one of:

- plaintext: no security (the default; the development broker as before).
- sasl_plaintext: SASL (SCRAM-SHA-512, SCRAM-SHA-256, PLAIN, OAUTHBEARER with unsecured test tokens), no TLS.
- sasl_ssl: the same SASL over TLS (what most managed services offer).
- ssl: mutual TLS; a client is the principal its certificate's CN names.

Every secured mode turns on Kafka's StandardAuthorizer with three principals: `admin` (a super user, also the
broker's own inter-broker identity, and the one `llm-worker topics` runs as), `worker` and `client`, whose ACLs
acls.py grants. The controller listener stays PLAINTEXT on loopback; its connections carry the principal
ANONYMOUS, which must therefore be a super user (only controller requests are served on that port).

What a mode needs is generated once into `<data_dir>/security/` (the CA, certificates, random passwords) and
kept: a restarted broker keeps its users and its clients keep their settings. `<data_dir>/clients/` holds, per
principal, `NAME.env` (our KAFKA_* settings) and `NAME.properties` (librdkafka keys, for kcat and
confluent-kafka) and `NAME.java.properties` (Java clients).
"""

from __future__ import annotations

import json
import secrets
import shlex
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from worker.broker.jars import BrokerError

if TYPE_CHECKING:
    from worker.kafka_settings import KafkaSettings

MODES = ("plaintext", "sasl_plaintext", "sasl_ssl", "ssl")
PRINCIPALS = ("admin", "worker", "client")
SCRAM_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256")
CLIENT_MECHANISM = "SCRAM-SHA-512"
BROKER_CN = "broker"
SECURITY_DIR = "security"
CLIENTS_DIR = "clients"
# User:<CN> for a certificate whose subject starts with CN=<name>; Kafka's default would be the whole DN.
PRINCIPAL_MAPPING = "RULE:^CN=([^,]+).*$/$1/,DEFAULT"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


@dataclass(slots=True)
class Security:
    """One broker's security setup, as kept in `<data_dir>/security/state.json`."""

    mode: str
    folder: Path
    passwords: dict[str, str] = field(default_factory=dict)
    """SASL password of each principal."""
    key_password: str = ""
    """Password of the worker's and the client's private keys (the admin key and the broker's stay plain)."""

    @property
    def protocol(self) -> str:
        return self.mode.upper()

    @property
    def uses_tls(self) -> bool:
        return self.mode in ("ssl", "sasl_ssl")

    @property
    def uses_sasl(self) -> bool:
        return self.mode.startswith("sasl_")

    @property
    def secured(self) -> bool:
        return self.mode != "plaintext"

    @property
    def ca_path(self) -> Path:
        return self.folder / "ca.pem"

    @classmethod
    def load_or_create(cls, data_dir: Path, mode: str | None) -> "Security":
        """The data folder's setup; `mode` None keeps whatever it has (plaintext for a new one). A folder
        set up for one mode refuses another: its users and ACLs were made for it (start --fresh)."""
        folder = data_dir / SECURITY_DIR
        state_path = folder / "state.json"
        if state_path.exists():
            state = json.loads(state_path.read_text())
            if mode is not None and mode != state["mode"]:
                raise BrokerError(f"the broker in {data_dir} was set up with --security {state['mode']}; "
                                  f"use that, or start --fresh to set it up as {mode}")
            return cls(state["mode"], folder, state.get("passwords", {}), state.get("key_password", ""))
        has_data = (data_dir / "kraft" / "meta.properties").exists()
        if mode in (None, "plaintext") or (has_data and mode is not None):
            if has_data and mode not in (None, "plaintext"):
                raise BrokerError(f"the broker in {data_dir} was set up without security; start --fresh to set "
                                  f"it up as {mode}")
            return cls("plaintext", folder)
        if mode not in MODES:
            raise BrokerError(f"unknown security mode {mode!r}; one of {', '.join(MODES)}")
        security = cls(mode, folder, {name: secrets.token_urlsafe(18) for name in PRINCIPALS},
                       secrets.token_urlsafe(18))
        security._create_files()
        state_path.write_text(json.dumps({"mode": mode, "passwords": security.passwords,
                                          "key_password": security.key_password}) + "\n")
        state_path.chmod(0o600)
        return security

    def _create_files(self) -> None:
        from worker.broker.pki import CertificateAuthority

        ca = CertificateAuthority.create(self.folder)
        ca.issue(self.folder, BROKER_CN, server=True)
        ca.issue(self.folder, "admin")
        for name in ("worker", "client"):
            ca.issue(self.folder, name, password=self.key_password)

    # -- the broker side -----------------------------------------------------------------------------------
    def server_properties(self, host: str, port: int, controller_port: int) -> dict[str, str]:
        """server.properties entries over LocalBroker's plaintext ones (later keys win in Java's Properties)."""
        if not self.secured:
            return {}
        listener = self.protocol
        props = {
            "listeners": f"{listener}://{host}:{port},CONTROLLER://{host}:{controller_port}",
            "advertised.listeners": f"{listener}://{host}:{port}",
            "listener.security.protocol.map": f"{listener}:{self.protocol},CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": listener,
            "authorizer.class.name": AUTHORIZER,
            "super.users": f"User:admin;User:{BROKER_CN};User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
        }
        prefix = f"listener.name.{listener.lower()}."
        if self.uses_tls:
            props.update({
                "ssl.keystore.type": "PEM", "ssl.keystore.location": str(self.folder / f"{BROKER_CN}-bundle.pem"),
                "ssl.truststore.type": "PEM", "ssl.truststore.location": str(self.ca_path),
                "ssl.principal.mapping.rules": PRINCIPAL_MAPPING,
                "ssl.client.auth": "required" if self.mode == "ssl" else "none",
            })  # fmt: skip
        if self.uses_sasl:
            admin = self.passwords["admin"]
            users = " ".join(f'user_{name}="{password}"' for name, password in self.passwords.items())
            props.update({
                "sasl.enabled.mechanisms": ",".join([*SCRAM_MECHANISMS, "PLAIN", "OAUTHBEARER"]),
                "sasl.mechanism.inter.broker.protocol": CLIENT_MECHANISM,
                f"{prefix}plain.sasl.jaas.config": "org.apache.kafka.common.security.plain.PlainLoginModule "
                                                   f'required username="admin" password="{admin}" {users};',
                # Kafka's unsecured validator: it accepts unsigned JWTs, enough to exercise a client's OAUTHBEARER
                # path; a real cluster validates signed tokens against its identity provider's keys.
                f"{prefix}oauthbearer.sasl.jaas.config": "org.apache.kafka.common.security.oauthbearer."
                                                         "OAuthBearerLoginModule required "
                                                         'unsecuredLoginStringClaim_sub="admin";',
            })  # fmt: skip
            for mechanism in SCRAM_MECHANISMS:
                props[f"{prefix}{mechanism.lower()}.sasl.jaas.config"] = (
                    f'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" '
                    f'password="{admin}";')
        return props

    def format_args(self) -> list[str]:
        """StorageTool format arguments that create the SCRAM users with the cluster's first metadata."""
        if not self.uses_sasl:
            return []
        return [arg for mechanism in SCRAM_MECHANISMS for name, password in self.passwords.items()
                for arg in ("--add-scram", f"{mechanism}=[name={name},password={password}]")]

    def probe_context(self) -> ssl.SSLContext | None:
        """What the readiness probe speaks to the listener: TLS (as admin, which mutual TLS requires)."""
        if not self.uses_tls:
            return None
        context = ssl.create_default_context(cafile=str(self.ca_path))
        context.load_cert_chain(self.folder / "admin.pem", self.folder / "admin.key")
        return context

    # -- the client side -----------------------------------------------------------------------------------
    def client_env(self, principal: str, bootstrap_servers: str) -> dict[str, str]:
        """KAFKA_* settings with which `principal` connects."""
        env = {"KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers, "KAFKA_SECURITY_PROTOCOL": self.protocol}
        if self.uses_sasl:
            env.update({"KAFKA_SASL_MECHANISM": CLIENT_MECHANISM, "KAFKA_SASL_USERNAME": principal,
                        "KAFKA_SASL_PASSWORD": self.passwords[principal]})
        if self.uses_tls:
            env["KAFKA_SSL_CAFILE"] = str(self.ca_path)
        if self.mode == "ssl":
            env.update({"KAFKA_SSL_CERTFILE": str(self.folder / f"{principal}.pem"),
                        "KAFKA_SSL_KEYFILE": str(self.folder / f"{principal}.key")})
            if principal != "admin":
                env["KAFKA_SSL_KEY_PASSWORD"] = self.key_password
        return env

    def librdkafka_properties(self, principal: str, bootstrap_servers: str) -> dict[str, str]:
        props = {"bootstrap.servers": bootstrap_servers, "security.protocol": self.protocol}
        if self.uses_sasl:
            props.update({"sasl.mechanism": CLIENT_MECHANISM, "sasl.username": principal,
                          "sasl.password": self.passwords[principal]})
        if self.uses_tls:
            props["ssl.ca.location"] = str(self.ca_path)
        if self.mode == "ssl":
            props.update({"ssl.certificate.location": str(self.folder / f"{principal}.pem"),
                          "ssl.key.location": str(self.folder / f"{principal}.key")})
            if principal != "admin":
                props["ssl.key.password"] = self.key_password
        return props

    def java_properties(self, principal: str, bootstrap_servers: str) -> dict[str, str]:
        props = {"bootstrap.servers": bootstrap_servers, "security.protocol": self.protocol}
        if self.uses_sasl:
            props.update({"sasl.mechanism": CLIENT_MECHANISM, "sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required "
                f'username="{principal}" password="{self.passwords[principal]}";')})
        if self.uses_tls:
            props.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": str(self.ca_path)})
        if self.mode == "ssl":
            props.update({"ssl.keystore.type": "PEM",
                          "ssl.keystore.location": str(self.folder / f"{principal}-bundle.pem")})
            if principal != "admin":
                props["ssl.key.password"] = self.key_password
        return props

    def write_client_files(self, data_dir: Path, bootstrap_servers: str) -> dict[str, Path]:
        """Writes the clients folder (readable by the owner only: it holds passwords); name -> env file."""
        if not self.secured:
            return {}
        folder = data_dir / CLIENTS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        env_files = {}
        for principal in PRINCIPALS:
            env_text = "".join(f"{key}={shlex.quote(value)}\n"
                               for key, value in self.client_env(principal, bootstrap_servers).items())
            env_files[principal] = _write_private(folder / f"{principal}.env", env_text)
            _write_private(folder / f"{principal}.properties",
                           _properties(self.librdkafka_properties(principal, bootstrap_servers)))
            _write_private(folder / f"{principal}.java.properties",
                           _properties(self.java_properties(principal, bootstrap_servers)))
        return env_files


def client_files(data_dir: Path) -> list[Path]:
    """The client settings files a secured broker wrote, for `broker status`."""
    folder = data_dir / CLIENTS_DIR
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _properties(values: dict[str, str]) -> str:
    # Java's Properties format: backslashes escape; paths and passwords here hold none (token_urlsafe).
    return "".join(f"{key}={value}\n" for key, value in values.items())


def _write_private(path: Path, text: str) -> Path:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)
    return path


def settings_for(security: Security, principal: str, bootstrap_servers: str, base: "KafkaSettings") -> "KafkaSettings":
    """`base` (topic names, group) with the security settings of `principal`."""
    from worker.kafka_settings import KafkaSettings

    fields = {key.removeprefix("KAFKA_").lower(): value
              for key, value in security.client_env(principal, bootstrap_servers).items()}
    return KafkaSettings(**{**base.model_dump(), **fields})
