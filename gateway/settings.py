"""The gateway settings (GATEWAY_*): the OpenAI-compatible HTTP gateway and batch jobs. Every field carries a
docstring: docs/configuration.md is generated from them (`llm-worker config --markdown`); `llm-worker config`
finds this class through the `llm_worker.settings` entry point."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.paths import PathSettings


class GatewaySettings(BaseSettings):
    """The OpenAI-compatible HTTP gateway (`llm-worker gateway`) and batch jobs (`llm-worker batch run`)."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Address the HTTP server listens on."""
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port."""
    instance_id: str = ""
    """This gateway's name in its reply topic (`reply_topic_prefix` + id); empty: a random one per start."""
    reply_topic_prefix: str = "llm.replies."
    """Each instance creates and reads its own reply topic under this prefix; the workers must allow the prefix
    (KAFKA_ALLOWED_REPLY_TOPIC_PREFIXES)."""
    reply_topic_partitions: int = Field(2, ge=1, le=256)
    """Partitions of an instance's reply topic."""
    reply_sweep_s: float = Field(300.0, ge=0)
    """How often an instance deletes the reply topics of random-id instances gone (their heartbeat, sent every
    quarter of this, expired); 0: never. Stable ids (`instance_id`) are reused, never swept."""
    models: list[str] = ["smollm2-135m-instruct"]
    """Model names the workers behind the request topic serve (`GET /v1/models`); a request naming another is
    refused with 404. All workers of one request topic serve one model."""
    tokenizer: str = ""
    """A tokenizer.json (or a folder with one) that turns logprobs' token ids into token text; empty: the
    provisioned model's, when there is one, else tokens are written `token_id:<id>`."""
    default_priority: int = Field(1, ge=0)
    """Priority of a request without `service_tier` or `X-Priority`."""
    batch_priority: int = Field(-1, ge=-1)
    """Priority of batch jobs; -1: the least urgent one."""
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1)
    """Largest request body; above it 413."""
    max_upload_bytes: int = Field(200 * 1024 * 1024, ge=1)
    """Largest batch input file (`POST /v1/files`), counted as it streams, chunked or not: past it (plus 64 KiB
    of multipart framing) 413 at once, the rest unread, the connection closed."""
    max_files_per_owner: int = Field(100, ge=1)
    """Most files one owner keeps (uploads and batch output files, until deleted or expired); an upload past it
    gets 429. A batch's output files are always kept."""
    max_active_batches_per_owner: int = Field(10, ge=1)
    """Most batches of one owner not yet ended (validating, in progress, finalizing, cancelling); another gets
    429."""
    file_sweep_interval_s: float = Field(60.0, gt=0)
    """How often expired files are deleted from disk (an expired file answers 404 at once)."""
    max_batch_lines: int = Field(50_000, ge=1)
    """Most requests in one batch file."""
    batch_concurrency: int = Field(256, ge=1)
    """Requests of one batch in flight at once (the rest wait on disk, not in Kafka)."""
    data_dir: Path = Field(default_factory=lambda: PathSettings().home / "gateway")
    """Where batch files, batch progress and API keys live (they survive a restart); default: `gateway` under
    LLM_WORKER_HOME, so one volume keeps a container's whole state."""
    request_wait_s: float = Field(600.0, gt=0)
    """Longest the gateway waits for an answer to a request without a timeout."""
    keys_file: Path | None = None
    """API keys (`llm-worker gateway keys add`; a mounted Secret works too), read again when it changes. None:
    `data_dir`/keys.json. While no such file exists the gateway is open (every caller trusted) and binds only
    loopback unless `behind_auth_proxy`."""
    behind_auth_proxy: bool = False
    """Without keys, allow a non-loopback address: a proxy in front authenticates callers and sets X-Tenant."""
    submit_timeout_s: float = Field(10.0, gt=0)
    """Longest a request waits for Kafka to take it; then 503 with Retry-After (a broker outage)."""
    responses_topic: str = "llm.responses"
    """Compacted topic of background responses' states, keyed by response id: every gateway instance reads it
    whole, so any instance answers a poll for any response. Created at start when missing."""
    responses_topic_partitions: int = Field(4, ge=1, le=256)
    """Partitions of `responses_topic` when the gateway creates it."""
    response_retention_s: float = Field(30 * 24 * 3600.0, gt=0)
    """How long a background response stays retrievable after it was created; then it is deleted (a tombstone on
    `responses_topic`)."""
    background_concurrency: int = Field(1024, ge=1)
    """Background responses of one instance in flight at once; the rest stay `queued` (in Kafka's compacted
    topic, not in memory only)."""
    webhook_urls: list[str] = []
    """Endpoints that receive signed webhook events (response.* and batch.*); empty: none are sent. Each URL's
    host must be in `webhook_allowed_hosts`."""
    webhook_secret: str = ""
    """The signing secret, `whsec_` + base64 of the key (Standard Webhooks, as OpenAI issues them); required
    when `webhook_urls` is set."""
    webhook_allowed_hosts: list[str] = []
    """Host names (or addresses) webhook URLs may point at; a URL with another host stops the start."""
    webhook_retry_s: float = Field(3 * 24 * 3600.0, gt=0)
    """How long an event is retried (exponential backoff) before it is dropped and counted; the queue is on disk,
    so a restart or an endpoint down for less than this loses nothing."""
    webhook_backoff_initial_s: float = Field(1.0, gt=0)
    """First wait after a failed delivery; it doubles per failure, up to `webhook_backoff_max_s`."""
    webhook_backoff_max_s: float = Field(300.0, gt=0)
    """Longest wait between two attempts of one event (an endpoint that comes back gets every event at once:
    a delivery that succeeds brings the others of its URL forward)."""
    webhook_timeout_s: float = Field(10.0, gt=0)
    """Longest one delivery may take (connect, send, answer)."""
    webhook_concurrency: int = Field(16, ge=1)
    """Deliveries in flight at once."""

    @property
    def keys_path(self) -> Path:
        return self.keys_file if self.keys_file is not None else self.data_dir / "keys.json"
