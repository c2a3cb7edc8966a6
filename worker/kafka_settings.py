"""The Kafka settings (KAFKA_*): the broker, the topics, the consumer group, security and delivery
semantics. Shared by everything that talks to Kafka (the worker's transport, the client, the gateway, the
commands), so beside worker/security.py, which turns them into client options, not inside the transport, which
clients never import. Every field carries a docstring: docs/configuration.md is generated from them
(`llm-worker config --markdown`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class KafkaSettings(BaseSettings):
    """Where the broker is and how the topics are laid out."""

    model_config = SettingsConfigDict(env_prefix="KAFKA_", extra="ignore", use_attribute_docstrings=True)

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list of the Kafka cluster."""
    request_topic: str = "llm.requests"
    """Topic the workers consume generation requests from."""
    result_topic: str = "llm.results"
    """Default topic for stream chunks and final records."""
    dead_letter_topic: str = "llm.dead-letter"
    """Topic for records that cannot be decoded or that poison the worker."""
    status_topic: str = "llm.status"
    """Topic on which each worker publishes its load status every second."""
    control_topic: str = "llm.control"
    """Topic of control records (cancels), key = request id; every worker reads all of its partitions."""
    usage_topic: str = "llm.usage"
    """One usage record per request (schemas/usage.py), in the same transaction as its final with exactly-once
    finals; `llm-worker usage report` sums it. Empty: none are written."""
    progress_topic: str = "llm.progress"
    """How far each running request's output was delivered (schemas/progress.py), written with exactly-once
    finals, so that a partition's next owner resumes its streams there instead of starting them over. One
    partition per request partition. Empty: none is written, and a moved request starts over."""
    num_priorities: int = Field(3, ge=1, le=16)
    """Number of priority levels; priority 0 is the most urgent."""
    partitions_per_priority: int = Field(2, ge=1, le=256)
    """Request-topic partitions per priority; bounds the number of useful workers."""
    replication_factor: int = Field(1, ge=1)
    """Replication factor used when the topics command creates topics."""
    result_retention_ms: int = 24 * 3600 * 1000
    """retention.ms of the result topic."""
    group_id: str = "llm-workers"
    """Consumer group shared by all workers."""
    exactly_once: bool = True
    """Each request's finals and its offset commit go in one Kafka transaction per request partition, so a
    consumer reading with isolation.level=read_committed sees exactly one final per request, across crashes
    and rebalances, and a fenced zombie's writes never (docs/delivery.md). Workers and clients must agree:
    the Python client reads read_committed when it is on. Off: finals are sent at once and offsets committed
    after, one final per attempt (consumers deduplicate by attempt)."""
    offset_metadata_max_bytes: int = Field(4096, ge=64)
    """The brokers' offset.metadata.max.bytes. With exactly_once each commit records, in its metadata, which
    offsets above the committed one are already answered (requests finish out of order), so the partition's
    next owner skips them; when that record would pass this size, reading the partition waits until its
    watermark moves (the status topic lists it in commit_waiting_partitions)."""
    allowed_reply_topics: list[str] = []
    """Topics, besides the result topic, that a request may name as its reply topic."""
    allowed_reply_topic_prefixes: list[str] = ["llm.replies."]
    """A request may also name any reply topic that starts with one of these. The default is the gateways'
    (GATEWAY_REPLY_TOPIC_PREFIX), under which each gateway instance reads its own reply topic, so a worker and a
    gateway started with default settings answer each other; `[]` allows none."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """PLAINTEXT, SSL (TLS; with ssl_certfile: mutual TLS), SASL_PLAINTEXT or SASL_SSL (SASL over TLS)."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    """SASL mechanism; required with the SASL protocols. PLAIN and SCRAM take sasl_username and sasl_password;
    OAUTHBEARER takes a token from sasl_oauth_token_file or sasl_oauth_token_command."""
    sasl_username: str | None = None
    """SASL user name (PLAIN, SCRAM)."""
    sasl_password: SecretStr | None = None
    """SASL password (PLAIN, SCRAM); masked in `llm-worker config`, logs and errors."""
    sasl_oauth_token_file: str | None = None
    """OAUTHBEARER: a file holding the bearer token (a JWT), read again at every authentication, so a sidecar
    that refreshes the file refreshes the worker's token."""
    sasl_oauth_token_command: str | None = None
    """OAUTHBEARER: a command (run without a shell, split like a shell line) whose standard output is the
    token, run at every authentication; e.g. a cloud CLI that prints an IAM token for the cluster."""
    ssl_cafile: str | None = None
    """CA bundle (PEM) that verifies the broker's certificate; empty: the system's CAs."""
    ssl_certfile: str | None = None
    """Client certificate (PEM, may hold its chain) for mutual TLS."""
    ssl_keyfile: str | None = None
    """Private key (PEM) of ssl_certfile; empty when ssl_certfile holds the key too."""
    ssl_key_password: SecretStr | None = None
    """Password of an encrypted ssl_keyfile; masked like sasl_password."""
    ssl_check_hostname: bool = True
    """Check that the broker's certificate names the host connected to. Turn off only for a broker whose
    certificate cannot name its address; the chain is verified against ssl_cafile either way."""

    @model_validator(mode="after")
    def _check_security(self) -> "KafkaSettings":
        from worker.security import check_security

        check_security(self)
        return self

    @property
    def num_request_partitions(self) -> int:
        return self.num_priorities * self.partitions_per_priority

    def client_kwargs(self) -> dict:
        """Connection keyword arguments shared by every aiokafka producer, consumer and admin client we make:
        the one place where security settings become client settings (worker/security.py), and where aiokafka's
        metadata retries learn to back off (aiokafka_compat.back_off_failed_metadata_updates)."""
        from worker.security import security_kwargs
        from worker.transport.kafka.aiokafka_compat import back_off_failed_metadata_updates

        back_off_failed_metadata_updates()
        return {"bootstrap_servers": self.bootstrap_servers, **security_kwargs(self)}
