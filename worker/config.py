"""Settings for every layer, from environment variables and CLI flags (pydantic-settings).

Each class has its own environment prefix so a deployment can set `KAFKA_BOOTSTRAP_SERVERS`,
`ENGINE_POLICY`, `WORKER_MAX_WAITING` and so on. Every field carries a docstring: the settings
table in docs/configuration.md is generated from them (`llm-worker config --markdown`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_HOME = Path.home() / ".cache" / "kafka-llm-worker"


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
        the one place where security settings become client settings (worker/security.py)."""
        from worker.security import security_kwargs

        return {"bootstrap_servers": self.bootstrap_servers, **security_kwargs(self)}


class EngineSettings(BaseSettings):
    """The model, the KV cache and the batching policy."""

    model_config = SettingsConfigDict(env_prefix="ENGINE_", extra="ignore", use_attribute_docstrings=True)

    model: str = "smollm2-135m-instruct"
    """A Hugging Face Llama-family folder, or the name of a model provisioned by `llm-worker model pull`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV-cache dtype. auto: bfloat16 on CUDA and on CPUs with bf16 matrix units (AMX or
    AVX512-BF16: 2-3x the float32 throughput there), float32 on other CPUs. Token-for-token comparisons with
    transformers (the tests) run in float32."""
    device: Literal["auto", "cpu", "cuda", "sim:h100", "sim:h200"] = "auto"
    """Where the model runs; auto picks CUDA when available. sim:h100, sim:h200: a simulated GPU (no weights, no
    KV memory; each step waits for its roofline time on that GPU and returns deterministic logits)."""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """auto: Triton on CUDA, torch on the CPU."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """Decode-only steps of up to the largest of cuda_graph_batch_sizes requests run padded to the next of those
    sizes from static input buffers, each size's forward captured once at start-up as a CUDA graph and replayed.
    auto: on with CUDA and the Triton backend (not under TRITON_INTERPRET), off otherwise. on: the same, but
    where nothing can be captured (the CPU, the interpreter) the padded static-buffer path runs eagerly (tests
    check it token for token against off); CUDA with the torch backend is refused. Simulated devices ignore it."""
    row_buckets: Literal["auto", "on", "off"] = "auto"
    """Pad every matmul's row count (tokens in a step, rows sampled) up to one of a fixed set of sizes, and
    build each size's kernels at start-up. oneDNN, which runs bf16 and fp16 matmuls on the CPU, builds and
    caches a kernel per distinct shape (about 0.6 MB each, up to 1,024 per cache), so without padding a worker
    grows by hundreds of MB over hours as its steps meet new token counts. Padding adds at most 7 rows below
    64, 15 below 256 and 31 beyond. It also keeps the torch attention backend's prefill kernels to a fixed set
    (its flash attention keeps one per prompt length in these dtypes): prompts are padded to whole blocks,
    chunks after a cached context attend in float32. auto: on for bf16 and fp16 on the CPU, off elsewhere
    (float32 on the CPU goes to MKL, which caches nothing per shape; GPUs pad decode steps to CUDA-graph sizes
    instead)."""
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    """Schedule and prepare step N+1 while step N's forward runs, and apply and detokenize step N's tokens
    while step N+1's runs (vLLM's async scheduling): on a GPU the scheduler, input building and detokenizing
    then overlap the device instead of adding to every step; only sampling stays between two forwards. Outputs
    reach the transport one step later, and a request that step N finishes computes one more token in step
    N+1, which is dropped. auto: on for CUDA and simulated devices, off on the CPU (where the forward is host
    work, so there is nothing to hide)."""
    cuda_graph_batch_sizes: list[int] = []
    """Batch sizes with a CUDA graph, each in [1, max_num_seqs]; empty: 1, 2, 4, the multiples of 8 below
    max_num_seqs, and max_num_seqs. Larger decode batches and steps with prefill tokens run eagerly."""
    block_size: int = Field(16, ge=1, le=256)
    """Tokens per KV-cache block."""
    kv_cache_bytes: int = Field(256 * 1024**2, ge=1)
    """KV-cache size on the CPU, in bytes."""
    kv_cache_gpu_fraction: float = Field(0.8, gt=0, le=1)
    """Fraction of free GPU memory (after loading weights) given to the KV cache on CUDA."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides the byte and fraction budgets (tests use it)."""
    max_num_batched_tokens: int = Field(512, ge=1)
    """Token budget of one engine step (prefill chunks plus decode tokens)."""
    max_num_seqs: int = Field(64, ge=1)
    """Maximum number of requests running at once."""
    protected_priorities: int = Field(2, ge=0)
    """Requests of the most urgent this many priorities (0 and 1: all but the bulk priority of the default
    three) are protected by deadline-aware step sizes: the scheduler shrinks a step's token budget when a running
    protected request's deadline needs it (down to a quarter of the budget), and admission counts on those
    smaller steps. Unprotected requests are admitted on full steps and stopped by their deadline. 0: none."""
    max_model_len: int | None = None
    """Longest prompt plus output; defaults to the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks across requests that share a prompt prefix."""
    policy: Literal["continuous", "dynamic", "static"] = "continuous"
    """continuous: iteration-level batching; dynamic: windowed batches run to completion; static: fixed batches."""
    max_batch_size: int = Field(16, ge=1)
    """Batch size of the dynamic and static policies."""
    batch_window_ms: float = Field(50.0, ge=0)
    """dynamic policy: the longest the oldest waiting request waits before a partial batch starts."""
    seed: int = 0
    """Seed for requests that sample without a seed of their own."""
    adapters_dir: str = ""
    """A folder of LoRA adapters in PEFT's format, one subfolder each (adapter_config.json and
    adapter_model.safetensors); a request names one by its folder name in `model`. Loaded on first use, no restart
    needed (docs/lora.md). Empty: the worker serves the base model only."""
    max_loras: int = Field(4, ge=1)
    """LoRA adapters loaded at once, and distinct adapters among the running requests (so every step's adapters
    are loaded): a request for another adapter waits until one is free. The least recently used adapter that no
    running request uses is evicted to load another."""
    max_lora_rank: int = Field(64, ge=1)
    """Highest LoRA rank served; an adapter above it is refused at load."""
    sim_model: str = ""
    """Simulated devices: the model shape, smollm2-135m or llama-3.1-8b (shipped config.json copies), a folder or a
    config.json path; empty: ENGINE_MODEL's own config.json. ENGINE_MODEL's tokenizer serves the text."""
    sim_logits_width: int = Field(2048, ge=0)
    """Simulated devices: columns of the logits the sampler sees (0: the model's vocabulary)."""
    grammar_compile_timeout_s: float = Field(2.0, gt=0)
    """Structured output: the compile budget of a response_format's grammar. The first pass, on a niced thread
    under cut limits (never inside a step), settles nearly every grammar in milliseconds and may take this long,
    wall-clock, the first-mask probe included. A grammar refused there on a cut limit goes to a judge process
    at idle priority (worker/model/structured/judge.py), which may spend this many CPU seconds under the full
    limits, or 10 times it in wall time since it was sent. Past either the request ends with invalid_request
    naming this limit, and the same format is refused at once from then on."""
    grammar_compile_threads: int = Field(2, ge=1, le=16)
    """Structured output: first-pass compiles at once, each on a thread of its own. A compile past the time budget
    gives its slot to the next one in the queue; its thread runs on, unused, until the cut limits end it (at
    most 8 such threads at a time)."""
    grammar_cache_size: int = Field(64, ge=1)
    """Structured output: distinct response formats kept compiled (refusals included), least recently used
    dropped first. A hit saves a compile (0.4-1 ms for an ordinary schema) and starts from a warm lexer. Each
    entry holds about 150 KB of llguidance's lexer and parser, built on a compile thread among the others, and
    a cache that turns over (a distinct format per request) leaves holes in those threads' heaps that take a few
    turnovers to settle: 256 entries (39 MB) grew the soak's resident size 1.3 MB over minutes 5-9 of traffic
    (docs/memory.md). Raise it for a service that cycles through more formats than this."""
    grammar_max_size: int = Field(500_000, ge=1)
    """Structured output: the most symbols a compiled grammar may have (llguidance's max_grammar_size)."""
    grammar_lexer_fuel: int = Field(1_000_000, ge=1)
    """Structured output: work allowed to build a grammar's lexer (llguidance's initial_lexer_fuel, about 50 per
    microsecond); `a{1000000}` reaches it. A 50,000-value enum of short strings needs 500,000 to 700,000."""
    grammar_step_lexer_fuel: int = Field(200_000, ge=1)
    """Structured output: lexer work allowed per request per step when computing its mask (llguidance's
    step_lexer_fuel, about 14 per microsecond: the default bounds a row at about 15 ms)."""
    grammar_step_max_items: int = Field(50_000, ge=1)
    """Structured output: parser items allowed per request per step (llguidance's step_max_items, about 20 per
    microsecond); a required recursive $ref reaches it."""
    grammar_max_lexer_states: int = Field(250_000, ge=1)
    """Structured output: lexer states one grammar may build (llguidance's max_lexer_states, 1-2 kB each)."""

    @model_validator(mode="after")
    def _check(self) -> "EngineSettings":
        if self.policy != "continuous" and self.max_batch_size > self.max_num_seqs:
            raise ValueError("max_batch_size must not exceed max_num_seqs")
        if any(not 1 <= n <= self.max_num_seqs for n in self.cuda_graph_batch_sizes):
            raise ValueError("cuda_graph_batch_sizes must lie in [1, max_num_seqs]")
        return self


class PathSettings(BaseSettings):
    """Where the project keeps downloaded jars, models and broker data."""

    model_config = SettingsConfigDict(env_prefix="LLM_WORKER_", extra="ignore", use_attribute_docstrings=True)

    home: Path = DEFAULT_HOME
    """Cache folder for Kafka jars, provisioned models and the local broker's data."""

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def kafka_dir(self) -> Path:
        return self.home / "kafka"


def _default_worker_id() -> str:
    import os
    import socket

    return f"{socket.gethostname()}-{os.getpid()}"


class TenantQuota(BaseModel):
    """One tenant's token bucket: sustained rate and burst size, in tokens (prompt and output)."""

    rate_tokens_per_s: float = Field(ge=0)
    burst_tokens: float = Field(gt=0)


class WorkerSettings(BaseSettings):
    """Admission, shedding, backpressure, streaming and shutdown of `llm-worker serve`."""

    model_config = SettingsConfigDict(env_prefix="WORKER_", extra="ignore", use_attribute_docstrings=True)

    worker_id: str = Field(default_factory=_default_worker_id)
    """Name in status records, final records and logs; hostname-pid by default."""
    max_waiting: int = Field(256, ge=1)
    """Local waiting-queue high watermark, per priority counting it and the more urgent ones: above it, that
    priority is no longer fetched and its partitions pause (a queue of less urgent work never pauses an
    urgent priority)."""
    resume_waiting: int = Field(128, ge=0)
    """Local waiting-queue low watermark (counted the same way): below it, paused partitions resume."""
    kv_pause_threshold: float = Field(0.95, gt=0, le=1)
    """KV-cache usage above which partitions pause."""
    kv_resume_threshold: float = Field(0.85, ge=0, le=1)
    """KV-cache usage below which paused partitions may resume."""
    max_queue_time_s: list[float] = [10.0, 30.0, 0.0]
    """Per priority: the longest estimated wait (tokens ahead / tokens per second served) before that priority's
    backlog is shed; 0: no bound, the priority is never shed for lag alone (its work waits in Kafka, paused
    partitions being the backpressure, and a request with a deadline is still refused when the estimate says it
    cannot finish in time). The most urgent priority is never shed for lag alone. The last value covers
    priorities past the list. The default leaves the bulk priority (batch jobs) unbounded: see
    docs/overload.md."""
    itl_target_ms: list[float] = [0.0, 0.0, 0.0]
    """Per priority: inter-token latency target; 0 disables latency-target admission for that priority."""
    status_interval_s: float = Field(1.0, gt=0)
    """How often the worker publishes a status record."""
    chunk_interval_ms: float = Field(100.0, ge=0)
    """Coalesce stream chunks for this long; 0 sends one chunk per engine step. The first token of a request
    goes out at once. On a simulated H200 running Llama-3.1-8B with 256 requests, the Kafka path reached
    0.83-0.88 of the engine alone at 20 ms (8,200 records/s), 0.84-0.91 at 50 ms (3,800-4,200/s) and
    0.85-0.93 at 100 ms (2,150-2,350/s) (benchmarks/bench_sim_kafka.py; docs/benchmarks.md); a CPU step is longer
    than 100 ms anyway. Lower it for smoother streams where the publisher has cores to spare."""
    transaction_interval_ms: float = Field(100.0, gt=0)
    """With KAFKA_EXACTLY_ONCE: how long a request partition's finals gather before they are written and
    committed in one transaction with the partition's offset. It bounds the extra time to a final for a
    read_committed reader, and how late such a reader sees chunks (it cannot read past an open transaction)."""
    progress_interval_ms: float = Field(2000.0, gt=0)
    """With exactly-once finals and a progress topic: how often each partition's transactions carry a full
    round of progress records (schemas/progress.py); a request's first one goes in the next transaction that
    answers something. Shorter rounds keep the tail a new owner reads back short, at the broker's cost."""
    destination_wait_s: float = Field(5.0, gt=0)
    """How long a topic that records are addressed to (a reply topic above all) may be absent from the broker's
    metadata, or hold a batch without an answer, before its records are answered elsewhere: a final as an
    `error`/`reply_topic_unavailable` final on the result topic, a chunk dropped. Records for other topics never
    wait on it. Allowed reply topics are checked at start-up and every `destination_check_interval_s`."""
    destination_check_interval_s: float = Field(30.0, gt=0)
    """How often the allowed reply topics are looked up again (a missing one: a WARNING line when it goes
    missing, the `reply_topic_available` gauge, and requests naming it answered at once while it stays so)."""
    io_gather_max_ms: float = Field(50.0, ge=0)
    """While the engine runs requests, the intake waits 5 % of the engine's last step (at most this long)
    between reads, and the publisher lets records gather as long before a send: fewer wake-ups of the worker's
    loop, each of which takes the core from the forward on a CPU worker. 0 reads and sends at once."""
    engine_process: bool = False
    """Run the engine core in a process of its own (worker/transport/requests/engine_process.py), as vLLM v1 and SGLang
    do, so the transport's Python never holds the engine's GIL; the worker joins its group once the engine in
    the child is built. Off: the engine runs in a thread of the worker's process."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM/SIGINT: how long in-flight requests may run before the worker stops without them."""
    commit_interval_s: float = Field(0.5, gt=0)
    """How often safe offsets are committed."""
    max_poll_records: int = Field(500, ge=1)
    """Records fetched per poll."""
    fetch_min_bytes: int = Field(1, ge=1)
    """Request consumer: the broker answers a fetch once this many bytes are there, or after fetch_max_wait_ms.
    1 answers at once; a few KiB batch the records of a busy topic into fewer fetches (less broker work)."""
    fetch_max_wait_ms: int = Field(500, ge=0)
    """Request consumer: the longest the broker holds a fetch waiting for fetch_min_bytes."""
    metrics_port: int = Field(9400, ge=0, le=65535)
    """Prometheus metrics HTTP port; 0 disables the endpoint."""
    pause_dwell_s: float = Field(0.5, ge=0)
    """Least time a priority's partitions stay paused or resumed before the next change (avoids churn)."""
    priority_backlog_threshold: int = Field(64, ge=0)
    """While a more urgent priority's backlog (lag + local waiting) exceeds this, less urgent ones pause."""
    session_timeout_s: float = Field(10.0, ge=1)
    """Consumer-group session timeout: how long a dead worker's partitions wait before another takes them."""
    max_clock_skew_ms: float = Field(1000.0, ge=0)
    """Queue order: a request counts as arrived at its record's timestamp, but never earlier than this long
    before the worker fetched it, so a producer whose clock runs behind cannot jump its priority's queue or
    dodge preemption. Timings in final records still start at the record's timestamp."""
    max_engine_inflight: int = Field(0, ge=0)
    """Requests handed to the engine and not finished; the rest wait in the local queue where they can still be
    shed or reordered. 0: twice the engine's max_num_seqs."""
    cancel_ttl_s: float = Field(900.0, gt=0)
    """How long a cancel counts, from its record's timestamp: a request read within it is answered `cancelled`
    at once (a cancel may come before its request, or before a rebalance moves the request here). At start a
    worker reads the control topic back this far; keep it below that topic's retention (1 hour)."""
    cancel_max_ids: int = Field(100_000, ge=1)
    """Most cancelled ids a worker remembers; past it the oldest are forgotten first."""
    cancel_sync_timeout_s: float = Field(3.0, ge=0)
    """At start, how long request intake waits for the control topic to be read up to date (so that a
    redelivered request that was cancelled is not run first); past it intake starts anyway."""
    malloc_arena_max: int = Field(128, ge=0)
    """glibc malloc arenas the worker process may use, set at start (0: glibc's default, 8 per core). More than
    the threads a worker runs (about 15: the event loop, the engine, torch's and llguidance's pools, the
    grammar compile threads, the metrics server), so that no thread shares another's arena: glibc binds a
    thread to an arena at its first malloc and, past the cap, hands out the arenas in use in turn. With 8, a
    grammar compile thread shared the engine thread's arena, and the grammars it built, kept for minutes in the
    cache, pinned pages between the engine's per-step temporaries (docs/memory.md). An arena only holds what
    its threads allocate, and the free pages of each go back to the kernel every WORKER_MALLOC_TRIM_INTERVAL_S.
    """
    malloc_mmap_threshold_bytes: int = Field(4 * 1024**2, ge=0)
    """Blocks of this size and more get pages of their own, handed back to the kernel when freed (glibc's
    M_MMAP_THRESHOLD, set at start); 0: glibc's default, which rises to the size of every large block freed,
    so that a burst's multi-megabyte temporaries stay in the arenas as free heap. 4 MiB reaches the float32
    logits of steps with 22 rows and more (SmolLM2's vocabulary). It keeps a burst's largest temporaries out of
    the arenas. The cost is page faults on those steps: 10 % of throughput with
    120 requests at once on the CPU (17 % at 128 KiB); 0 and WORKER_MALLOC_ARENA_MAX=2 give it back
    (docs/memory.md)."""
    numpy_huge_pages: bool = False
    """Let numpy ask for transparent huge pages for its arrays of 4 MiB and more (its own default). Off: the
    advice stays on the address range after the array is freed, and where that range lies in a malloc arena
    the kernel keeps a whole 2 MiB page resident around any live block in it, a step in the resident size
    that `malloc_trim` cannot undo (docs/memory.md). Arrays that large are a step's temporaries on the CPU,
    faulted in 4 KiB pages without it."""
    malloc_tcache_count: int = Field(0, ge=-1)
    """Freed small blocks glibc keeps per size in each thread's cache (tcache; the tunable
    glibc.malloc.tcache_count), set when `serve` starts by running itself again with it in GLIBC_TUNABLES, unless
    that names it already; -1: glibc's default, 7. Off (0): the blocks a rebalance's burst freed in the part of
    the engine thread's arena it widened stay in that cache, each pinning a page `malloc_trim` cannot return:
    the soak's rebalance step was +840 KB with it, +4 KB without, at the same finals a second (docs/memory.md)."""
    numpy_buffer_cache: bool = False
    """Let numpy keep freed data buffers of under 1 KiB for reuse on the engine's thread (its own default). Off:
    numpy keeps seven of each size for good, and a burst's batch-sized arrays bring sizes the steady load never
    makes, carved from the arena while the burst has it widened: a step in the resident size that `malloc_trim`
    cannot undo (docs/memory.md). glibc's per-thread cache reuses small blocks as fast."""
    malloc_trim_interval_s: float = Field(60.0, ge=0)
    """How often free heap pages are handed back to the kernel (glibc malloc_trim, on a thread of its own: a
    trim walks every free hole, tens of milliseconds on a fragmented heap); 0 never."""

    tenant_weights: dict[str, float] = {}
    """Fair share among the tenants of a priority, by tokens served: a tenant's weight (default 1), e.g.
    {"search": 2}: backlogged, it gets twice the tokens of a tenant of weight 1 (docs/tenants.md)."""
    tenant_max_credit_tokens: float = Field(2048.0, ge=0)
    """The most service (tokens) an idle tenant banks: back with requests, it starts at most this far below the
    counters of the tenants that kept the worker busy, so it cannot take the engine over for long."""
    tenant_contention_window_s: float = Field(30.0, gt=0)
    """Two or more tenants read at a priority within this window make a full local queue keep reading and shed
    the newest request of the tenant holding most of it (over its share), instead of pausing the priority."""
    tenant_quotas: dict[str, TenantQuota] = {}
    """Token rates per tenant: {"team-a": {"rate_tokens_per_s": 500, "burst_tokens": 4000}}; "*" is the
    default for tenants not named (requests without a tenant included). A request takes its expected tokens
    (prompt and max_new_tokens) and is corrected to those served when it ends. Empty: no quotas."""
    tenant_quota_action: Literal["reject", "defer"] = "reject"
    """Over quota: reject (rejected/quota_exceeded at once, with when the bucket refills) or defer (the request
    waits in the local queue until its bucket holds its tokens; its deadline still applies)."""
    tenant_max_labels: int = Field(10, ge=0, le=1000)
    """Tenants with a label of their own in metrics and on the status topic: the top ones by tokens read; the
    rest share "other", requests without a tenant "none"."""

    @model_validator(mode="after")
    def _check(self) -> "WorkerSettings":
        if any(not (w > 0 and math.isfinite(w)) for w in self.tenant_weights.values()):
            raise ValueError("tenant_weights must be positive and finite")
        if self.resume_waiting > self.max_waiting:
            raise ValueError("resume_waiting must not exceed max_waiting")
        if self.kv_resume_threshold > self.kv_pause_threshold:
            raise ValueError("kv_resume_threshold must not exceed kv_pause_threshold")
        return self

    def max_queue_time_for(self, priority: int) -> float:
        return self.max_queue_time_s[min(priority, len(self.max_queue_time_s) - 1)]

    def itl_target_for(self, priority: int) -> float:
        return self.itl_target_ms[min(priority, len(self.itl_target_ms) - 1)]


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


class LogLimitSettings(BaseSettings):
    """Limits on repeated log records, for every `llm-worker` command."""

    model_config = SettingsConfigDict(env_prefix="LLM_WORKER_LOG_", extra="ignore", use_attribute_docstrings=True)

    max_repeats: int = 5
    """Records let through per key (logger, level, message template) per interval; 0 turns limiting off."""
    repeat_interval_s: float = 60.0
    """Length of one counting interval in seconds; the dropped count is reported when it ends. A broker
    outage keeps about six keys flooding (aiokafka's reconnect, metadata, fetch and coordinator errors),
    so a key costs up to max_repeats + 1 lines per interval: with 10 s a one-minute outage still logged
    206 ERROR lines, with 60 s it logs about 50."""
    min_level: str = "WARNING"
    """Records below this level pass untouched (INFO and DEBUG carry progress, not reconnect floods)."""
