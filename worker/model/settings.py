"""The engine settings (ENGINE_*): the model, the device, batching, the KV cache and the kernels. They live in the
model layer, the lowest that reads them (the runner), so the engine above it imports them and the model never
imports the engine. Every field carries a docstring: docs/configuration.md is generated from them
(`llm-worker config --markdown`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineSettings(BaseSettings):
    """The model, the KV cache and the batching policy."""

    model_config = SettingsConfigDict(env_prefix="ENGINE_", extra="ignore", use_attribute_docstrings=True)

    model: str = "smollm2-135m-instruct"
    """A Hugging Face Llama-family folder, or the name of a model provisioned by `llm-worker model pull`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV-cache dtype. auto: bfloat16 on CUDA and on CPUs with bf16 matrix units (AMX or
    AVX512-BF16: 2-3x the float32 throughput there), float32 on other CPUs. Token-for-token comparisons with
    transformers (the tests) run in float32."""
    quantization: Literal["none", "int8", "fp8"] = "none"
    """The layers' projection weights in 8 bits, one scale per output channel; activations, the KV cache, the embedding
    and the LM head stay in `dtype` (but see quantize_lm_head). int8 (CPU, dtype bfloat16 or float16): weight-only,
    cuts the time per token of a few requests, whose steps read every weight for a few rows, and is slower in large
    batches, where the matmuls are bound by arithmetic. fp8 (GPUs with FP8 tensor cores: Ada, Hopper, dtype
    bfloat16): e4m3 weights and each step's activations quantized per token, as vLLM's FP8 dynamic; on the CPU it
    runs a slow reference product, for checking accuracy. Made from the checkpoint's weights at start-up, or taken
    as they are from a checkpoint quantized so already (compressed-tensors, as llm-compressor writes); none: such a
    checkpoint still runs its own kind where the device has its kernel, and is widened to `dtype` elsewhere
    (docs/quantization.md: figures and accuracy)."""
    quantize_lm_head: bool = True
    """With quantization int8: an int8 copy of the LM head too (per-row scales), which steps sampling up to four
    rows multiply by; the head in `dtype` stays for larger steps and the embedding. At one request the head is
    a tenth of a step's time in bf16, and int8 reads half its bytes (docs/quantization.md: speed and accuracy
    with it and without). false: the head in `dtype` only."""
    cpu_compile: bool = False
    """On the CPU, a lone decode row's step runs through torch.compile (inductor): the work between two layers'
    attentions fused into one compiled call (worker/model/compiled_cpu.py), compiled at start-up (seconds
    logged). Llama-graph families with gated MLPs, and weights inductor takes as inputs: int8 (quantization), or
    bf16 with cpu_packed_weights false; otherwise refused at start naming the reason. For the time per token of a
    lone request (docs/quantization.md); false: every step eager."""
    cpu_packed_weights: bool = True
    """On the CPU in bfloat16, every layer's projection weights are packed once at start-up into oneDNN's
    blocked layout, instead of being reordered by every matmul of more than one row, which costs more than the
    product itself for a few rows. The packed copies replace the layers' weights; the LM head keeps its plain
    copy beside the packed one, for steps that sample one row (SmolLM2: 57 MB more). false: torch's plain
    F.linear."""
    device: Literal["auto", "cpu", "cuda", "sim:h100", "sim:h200"] = "auto"
    """Where the model runs; auto picks CUDA when available. sim:h100, sim:h200: a simulated GPU (no weights, no
    KV memory; each step waits for its roofline time on that GPU and returns deterministic logits)."""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """auto: Triton on CUDA, torch on the CPU."""
    fused_kernels: Literal["auto", "on", "off"] = "auto"
    """Triton kernels for two per-layer chains of elementwise operations (kernels/fused.py): the residual add
    with the RMSNorm after attention, and the MLP's gated activation (act(gate) * up), each one kernel instead
    of several launches. auto: where the attention runs in Triton on CUDA, in the layers of the Llama graph
    (Llama, Mistral, Qwen, Phi-3, their MoE variants: the activation where the MLP is dense). on: wherever
    Triton runs, the CPU interpreter included (tests); off: torch's operations."""
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
    speculative_ngram_tokens: int = Field(0, ge=0, le=16)
    """Speculative decoding without a second model: up to this many draft tokens per step, copied from where the
    request's last tokens occurred earlier in its prompt or output (n-gram prompt lookup), verified in the same
    forward as its next token; requests without penalties, min_tokens, logprobs or a grammar, and not with async
    scheduling. The output is the same token for token, greedy or seeded (a draft is kept when it is the token
    the sampler draws at its place); a step costs a few rows more, and a request whose drafts keep failing
    proposes ever more rarely. 0: off."""
    speculative_ngram_min: int = Field(2, ge=1)
    speculative_ngram_max: int = Field(4, ge=1)
    """The n-grams looked up: the longest suffix of the request's tokens, from max down to min tokens, that
    occurred before."""
    speculative_adaptive: bool = True
    """Size each step's drafts by their cost: a request's drafts go in while the chance that they are kept
    (from its recent verify steps) raises the step's expected tokens per second under the engine's step-time
    model, so a request copying a long run verifies all its drafts and one whose drafts stop early verifies
    few. false: every request verifies all it proposes."""
    speculative_max_batch: int = Field(8, ge=1)
    """Drafts are proposed only while at most this many requests run: in a larger batch a step's extra rows
    cost about what they save."""
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
    fair_step_ms: float = Field(0.0, ge=0)
    """Tenants' latency under another's flood: while a tenant holding no more than its equal share of the seats
    runs beside one holding more, at the same priority, a step is cut to about this long (by the step-time model):
    the larger tenant's rows beyond it wait for a later step, keeping their KV (no recompute), though it always
    gets as many tokens as the largest smaller tenant. Where a step's time grows with its batch (a CPU) this keeps
    the smaller tenants' time per token near this target, at the cost of throughput while they run; where it
    hardly grows (a GPU's decode) it seldom binds. 0: off (docs/tenants.md)."""
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
    lora_resident_first_steps: int = Field(32, ge=0)
    """With every adapter slot taken: a waiting request whose adapter is not loaded lets requests of its priority
    behind it whose adapters are (or the base model's) go first, for at most this many steps, so that a backlog
    is served by the adapters already loaded rather than by evicting and loading one for each request in
    arrival order. Never across priorities, nor for a request with a deadline. 0: arrival order (each such
    request loads its adapter as soon as a seat is free)."""
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
