"""Before a worker starts its clients: can it connect, authenticate, and do what it needs? One line says why not.

aiokafka's clients retry every connection failure alike and log each retry, so a wrong password, an unknown CA
or a missing ACL would look like an unreachable broker that never comes back. `check_access` makes one
connection with the worker's own settings and turns each configuration error into `AccessDenied`, whose text
names the cause (authentication failed for user X; TLS verification failed for host Y; not authorized to WRITE
topic Z); `serve` prints it and exits. A broker that cannot be reached at all is not a configuration error:
the check returns and the worker's usual retries take over.

The permissions come from the broker's own answer, not from guessing: a Metadata request (version 8, which
aiokafka does not define, hence the structs below) returns, per topic, the operations this principal may do,
and DescribeGroups (version 3, which aiokafka defines but does not pick) returns them for the consumer group.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import ssl
from dataclasses import dataclass, field

from aiokafka.errors import KafkaConnectionError, KafkaError, SaslAuthenticationFailed, UnsupportedSaslMechanismError
from aiokafka.protocol.admin import DescribeGroupsRequest_v3, DescribeGroupsResponse_v3
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String

from worker.kafka_settings import KafkaSettings
from worker.security import SecuritySettingsError

log = logging.getLogger(__name__)

OPERATION_BITS = {"READ": 3, "WRITE": 4, "DESCRIBE": 8}
"""Kafka's AclOperation codes: bit n of an authorized-operations field allows operation n."""
TOPIC_AUTHORIZATION_FAILED, GROUP_AUTHORIZATION_FAILED = 29, 30
UNKNOWN_TOPIC = 3


class AccessDenied(Exception):
    """A configuration or permission error that retrying cannot fix; str() is the one line to show."""


@dataclass(slots=True)
class Needs:
    """What a client must be allowed to do."""

    read_topics: list[str] = field(default_factory=list)
    write_topics: list[str] = field(default_factory=list)
    group: str | None = None
    """A consumer group it must READ (join and commit in)."""

    @classmethod
    def of_worker(cls, kafka: KafkaSettings) -> "Needs":
        progress = [kafka.progress_topic] if kafka.progress_topic and kafka.exactly_once else []
        return cls([kafka.request_topic, kafka.control_topic, *progress],
                   [kafka.result_topic, kafka.dead_letter_topic, kafka.status_topic,
                    *([kafka.usage_topic] if kafka.usage_topic else []), *progress], kafka.group_id)


def principal_of(kafka: KafkaSettings) -> str:
    if kafka.sasl_mechanism == "OAUTHBEARER":
        return "the token's subject"
    if kafka.sasl_mechanism:
        return f"user {kafka.sasl_username}"
    if kafka.ssl_certfile:
        return f"the certificate {kafka.ssl_certfile}"
    return "ANONYMOUS"


async def check_access(kafka: KafkaSettings, needs: Needs, timeout_s: float = 15.0) -> None:
    """Raises AccessDenied for a configuration or permission error; returns when all is well, or when no broker
    answered at all (that is for the client's own retries)."""
    try:
        async with asyncio.timeout(timeout_s):
            conn = await _connect(kafka)
            if conn is None:
                return
            try:
                await _check_permissions(kafka, conn, needs)
            finally:
                conn.close()
    except TimeoutError:
        log.info("access check: no answer from %s within %.0f s; connecting anyway", kafka.bootstrap_servers,
                 timeout_s)


async def _connect(kafka: KafkaSettings):
    from aiokafka.conn import create_conn

    try:
        kwargs = kafka.client_kwargs()
    except SecuritySettingsError as exc:
        raise AccessDenied(str(exc)) from None
    kwargs.pop("bootstrap_servers")
    for server in kafka.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            return await create_conn(host, int(port), client_id="llm-worker-access-check", **kwargs)
        except SaslAuthenticationFailed as exc:
            raise AccessDenied(f"authentication failed for {principal_of(kafka)} ({kafka.sasl_mechanism}) at "
                               f"{server}: {exc.args[0] if exc.args else exc}") from None
        except UnsupportedSaslMechanismError:
            raise AccessDenied(f"the broker at {server} does not offer SASL mechanism {kafka.sasl_mechanism} "
                               f"(KAFKA_SASL_MECHANISM)") from None
        except ssl.SSLCertVerificationError as exc:
            raise AccessDenied(f"TLS verification failed for host {host}: {exc.verify_message} (KAFKA_SSL_CAFILE="
                               f"{kafka.ssl_cafile or 'the system CAs'}, KAFKA_SSL_CHECK_HOSTNAME="
                               f"{kafka.ssl_check_hostname})") from None
        except ssl.SSLError as exc:
            raise AccessDenied(_tls_error(kafka, server, exc)) from None
        except KafkaConnectionError as exc:
            cause = exc.__cause__
            if isinstance(cause, ssl.SSLError):
                raise AccessDenied(_tls_error(kafka, server, cause)) from None
            if kafka.security_protocol in ("PLAINTEXT", "SASL_PLAINTEXT") and await _speaks_tls(host, int(port)):
                raise AccessDenied(f"the listener at {server} speaks TLS, but KAFKA_SECURITY_PROTOCOL="
                                   f"{kafka.security_protocol}: use SSL or SASL_SSL") from None
            log.info("access check: %s did not answer (%r)", server, exc)
        except (OSError, KafkaError) as exc:
            log.info("access check: %s did not answer (%r)", server, exc)
    return None


def _tls_error(kafka: KafkaSettings, server: str, exc: ssl.SSLError) -> str:
    reason = exc.reason or str(exc)
    if reason == "WRONG_VERSION_NUMBER":
        return (f"the listener at {server} does not speak TLS, but KAFKA_SECURITY_PROTOCOL="
                f"{kafka.security_protocol}: use PLAINTEXT or SASL_PLAINTEXT")
    if "ALERT" in reason:  # the broker ended the handshake: it refused what we presented
        if not kafka.ssl_certfile:
            return (f"TLS handshake refused by {server} ({reason}): the broker requires a client certificate "
                    f"(KAFKA_SSL_CERTFILE)")
        return (f"TLS handshake refused by {server}: the broker rejected the client certificate "
                f"{kafka.ssl_certfile}{_certificate_problem(kafka.ssl_certfile)} ({reason})")
    return f"TLS failed with {server}: {reason}"


def _certificate_problem(path: str) -> str:
    """Why a broker may refuse our own certificate, as far as the certificate itself tells."""
    try:
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(open(path, "rb").read())
    except Exception:  # noqa: BLE001 - the hint is optional; the broker's reason is still shown
        return ""
    now = datetime.datetime.now(datetime.timezone.utc)
    if cert.not_valid_after_utc < now:
        return f": it expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if cert.not_valid_before_utc > now:
        return f": it is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
    return f": issued by {cert.issuer.rfc4514_string()}, which the broker does not trust"


async def _speaks_tls(host: str, port: int) -> bool:
    """True when a TLS handshake (without verification) completes: the port is a TLS listener."""
    def handshake() -> bool:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            with socket.create_connection((host, port), timeout=3.0) as sock:
                with context.wrap_socket(sock, server_hostname=host):
                    return True
        except ssl.SSLError as exc:  # a refused client certificate still means TLS was spoken
            return "ALERT" in (exc.reason or "")
        except OSError:
            return False

    return await asyncio.to_thread(handshake)


async def _check_permissions(kafka: KafkaSettings, conn, needs: Needs) -> None:
    topics = sorted({*needs.read_topics, *needs.write_topics})
    response = await conn.send(MetadataV8Request(topics))
    allowed = {}
    for error_code, name, _internal, _partitions, operations in response.topics:
        if error_code == TOPIC_AUTHORIZATION_FAILED:
            allowed[name] = 0
        elif error_code == UNKNOWN_TOPIC:
            continue  # missing topics: the worker waits for them, as without security
        else:
            allowed[name] = operations
    for operation, names in (("READ", needs.read_topics), ("WRITE", needs.write_topics)):
        for name in names:
            if name in allowed and not allowed[name] >> OPERATION_BITS[operation] & 1:
                raise AccessDenied(f"not authorized to {operation} topic {name} ({principal_of(kafka)}; the broker's "
                                   f"ACLs must allow it)")
    if needs.group:
        await _check_group(kafka, conn, needs.group)


async def _check_group(kafka: KafkaSettings, conn, group: str) -> None:
    from aiokafka.conn import create_conn
    from aiokafka.protocol.coordination import FindCoordinatorRequest

    denied = AccessDenied(f"not authorized to READ group {group} ({principal_of(kafka)}; the broker's ACLs must "
                          f"allow it)")
    found = await conn.send(FindCoordinatorRequest(group, 0))
    if found.error_code == GROUP_AUTHORIZATION_FAILED:
        raise denied
    if found.error_code != 0:
        return  # no coordinator yet (a new cluster): the consumer's join finds out later
    coordinator = conn
    if (found.host, found.port) != (conn.host, conn.port):
        kwargs = kafka.client_kwargs()
        kwargs.pop("bootstrap_servers")
        coordinator = await create_conn(found.host, found.port, client_id="llm-worker-access-check", **kwargs)
    try:
        described = await coordinator.send(DescribeGroupsV3Request(group))
    finally:
        if coordinator is not conn:
            coordinator.close()
    for entry in described.groups:
        error_code, operations = entry[0], entry[-1]
        # INT32_MIN: the broker did not compute them (an old broker); the join finds out.
        if error_code == GROUP_AUTHORIZATION_FAILED or (error_code == 0 and operations != -(2**31)
                                                        and not operations >> OPERATION_BITS["READ"] & 1):
            raise denied


# -- Metadata v8: topics with this principal's authorized operations (Kafka's MetadataRequest.json) ----------
class _MetadataResponseV8(Response):
    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("brokers", Array(("node_id", Int32), ("host", String("utf-8")), ("port", Int32), ("rack", String("utf-8")))),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        ("topics", Array(
            ("error_code", Int16), ("name", String("utf-8")), ("is_internal", Boolean),
            ("partitions", Array(("error_code", Int16), ("partition_index", Int32), ("leader_id", Int32),
                                 ("leader_epoch", Int32), ("replica_nodes", Array(Int32)),
                                 ("isr_nodes", Array(Int32)), ("offline_replicas", Array(Int32)))),
            ("topic_authorized_operations", Int32),
        )),
        ("cluster_authorized_operations", Int32),
    )  # fmt: skip


class _MetadataRequestV8Struct(RequestStruct):
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = _MetadataResponseV8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))),  # an array of one-field structs: on the wire, of names
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


class MetadataV8Request(Request[_MetadataRequestV8Struct]):
    API_KEY = 3

    def __init__(self, topics: list[str]) -> None:
        self._topics = topics

    def build(self, request_struct_class: type[_MetadataRequestV8Struct]) -> _MetadataRequestV8Struct:
        return request_struct_class(list(self._topics), False, False, True)


class _DescribeGroupsV3Struct(DescribeGroupsRequest_v3):
    RESPONSE_TYPE = DescribeGroupsResponse_v3  # aiokafka 0.14 parses v3 answers as v2, dropping the operations


class DescribeGroupsV3Request(Request[_DescribeGroupsV3Struct]):
    API_KEY = 15

    def __init__(self, group: str) -> None:
        self._group = group

    def build(self, request_struct_class):
        return request_struct_class([self._group], True)
