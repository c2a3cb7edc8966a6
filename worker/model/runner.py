"""`ModelRunner`: owns the model weights, the paged KV cache and the attention backend; runs one step.

Each step the engine hands over a `StepRequests` of plain ints; `prepare_input` turns it into tensors on this
runner's device (from buffers kept between steps, `PersistentInput`) and `execute` runs the forward, returning
float32 logits for the rows that sample (two calls, so model tests can hand `execute` tensors they built by
hand). `release` forgets a finished or preempted request's buffers. Device, dtype and backend are chosen here
once and logged, so a deployment's log says what actually runs. Decode-only steps of up to the largest CUDA-graph
batch size go through `DecodeGraphs` (worker/model/cuda_graphs.py, ENGINE_CUDA_GRAPHS): padded to a bucket in
static buffers and replayed as a CUDA graph captured here at start-up (or, where nothing can be captured and the
setting is `on`, run eagerly the same way).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from worker.model.settings import EngineSettings
from worker.model.attention import AttentionBackend
from worker.model.config import ModelConfig, load_config, load_eos_token_ids, load_tokenizer
from worker.model.cuda_graphs import BucketedInput, DecodeGraphs, batch_sizes, graph_mode, triton_interpreted
from worker.model.input import Launched, ModelInput, PersistentInput, PersistentInputRunner, StepArrays
from worker.model.loader import load_model
from worker.model.models.base import INT8_HEAD_MAX_ROWS
from worker.model.lora import AdapterRegistry, LoraStep
from worker.model.pull import resolve_model
from worker.model.checkpoint_quant import CheckpointQuantization, read_checkpoint_quantization
from worker.model.quantize import linear
from worker.model.step_batch import StepRequests

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_runner(settings: EngineSettings):
    """The runner the settings name: `ModelRunner`, or `SimRunner` (worker/model/sim.py) for a sim: device."""
    if settings.device.startswith("sim:"):
        from worker.model.sim import SimRunner

        return SimRunner(settings)
    return ModelRunner(settings.model, settings)


def pick_device(setting: str) -> torch.device:
    if setting.startswith("sim:"):
        raise ValueError(f"ENGINE_DEVICE={setting}: a simulated device has no tensors; use make_runner")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("ENGINE_DEVICE=cuda but torch sees no CUDA device")
    return torch.device(setting)


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, and on a CPU with bf16 matrix units (AMX or AVX512-BF16), where oneDNN runs bf16
    matmuls natively; float32 on other CPUs, which would emulate bf16 and run slower than float32. With AMX,
    SmolLM2-135M steps of ~380 tokens take about a third of their float32 time in bf16, and decode-only steps of
    50 requests about half (one thread; docs/benchmarks.md)."""
    if setting == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else torch.float32
    return _DTYPES[setting]


def pick_quantization(setting: str, checkpoint: CheckpointQuantization | None, device: torch.device,
                      dtype: torch.dtype) -> str:
    """The projections' kernel: ENGINE_QUANTIZATION's, made at start-up from float weights or taken from a
    checkpoint quantized alike; with `none`, a quantized checkpoint's own kind where this device and dtype have
    its kernel, else "none" (its weights widened as they load). A setting the device cannot run, or one that
    differs from the checkpoint's kind, is refused with a line naming it."""
    if setting != "none" and checkpoint is not None and checkpoint.kind != setting:
        raise ValueError(f"ENGINE_QUANTIZATION={setting}, but the checkpoint holds {checkpoint.kind} weights: "
                         f"unset it (or set {checkpoint.kind}) to load them")
    if setting == "int8":
        if device.type != "cpu":
            raise ValueError("ENGINE_QUANTIZATION=int8 is the CPU path (torch's int8 weight-pack matmul); "
                             f"this engine runs on {device.type}")
        if dtype == torch.float32:
            raise ValueError("ENGINE_QUANTIZATION=int8 needs ENGINE_DTYPE bfloat16 or float16: torch's int8 "
                             "matmul with float32 activations is several times slower than float32 weights")
    if setting == "fp8" and device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(f"ENGINE_QUANTIZATION=fp8 needs FP8 tensor cores (compute capability 8.9 or later: "
                             f"Ada, Hopper); this GPU is {major}.{minor}")
        if dtype != torch.bfloat16:
            raise ValueError("ENGINE_QUANTIZATION=fp8 on CUDA needs ENGINE_DTYPE bfloat16 (the product with "
                             "per-row scales writes bf16)")
    if setting != "none" or checkpoint is None:
        return setting
    if checkpoint.kind == "int8":
        return "int8" if device.type == "cpu" and dtype != torch.float32 else "none"
    fp8_cores = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    return "fp8" if fp8_cores and dtype == torch.bfloat16 else "none"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AMX tiles or AVX512-BF16)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    try:
        if all(probe is not None for probe in probes):
            return any(probe() for probe in probes)
    except RuntimeError:
        pass
    try:  # torch without those probes: the kernel's CPU flags (Linux)
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def use_row_buckets(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """What ENGINE_ROW_BUCKETS means here: auto pads where oneDNN runs the matmuls (bf16, fp16 on the CPU)."""
    if setting != "auto":
        return setting == "on"
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def row_bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond, up to `max_rows` (the last size,
    whatever its step): 31 sizes cover 512 rows. A step pads at most 7 rows below 64 (where a matmul's time is
    mostly reading its weights, whatever the rows), 15 below 256 and 31 beyond (at most 12 % of its rows)."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size = size * 2 if size < 8 else size + (8 if size < 64 else 16 if size < 256 else 32)
    return tuple(sizes + [max_rows])


def use_fused_kernels(setting: str, device: torch.device, backend_name: str) -> bool:
    """ENGINE_FUSED_KERNELS: auto fuses where the attention runs in Triton on CUDA."""
    if setting == "auto":
        return device.type == "cuda" and backend_name == "triton"
    if setting == "on" and device.type != "cuda" and not triton_interpreted():
        raise ValueError("ENGINE_FUSED_KERNELS=on runs Triton kernels: it needs a CUDA device (or Triton's "
                         f"interpreter, TRITON_INTERPRET=1); this engine runs on {device.type}")
    return setting == "on"


def make_backend(setting: str, device: torch.device, needs_windows: bool = False) -> AttentionBackend:
    """`needs_windows`: the model has sliding-window layers or soft-capped attention. The Triton kernels take
    both, but have been checked only under Triton's interpreter and compiled, not run on a GPU: until a GPU run
    holds them to the torch backend on real models, auto picks torch for such a model on CUDA too, and
    ENGINE_ATTENTION_BACKEND=triton chooses them (docs/model-families.md)."""
    name = setting if setting != "auto" else ("triton" if device.type == "cuda" and not needs_windows else "torch")
    if name == "triton":
        # Imported only here: importing Triton is slow and pointless on a CPU-only worker.
        try:
            from worker.model.triton_attention import TritonAttention
        except ModuleNotFoundError as exc:
            if exc.name != "triton":
                raise
            raise RuntimeError("ENGINE_ATTENTION_BACKEND=triton needs the triton package, installed on Linux only; "
                               "set ENGINE_ATTENTION_BACKEND=torch") from None

        return TritonAttention()
    from worker.model.torch_attention import TorchAttention

    return TorchAttention()


class ModelRunner(PersistentInputRunner):
    def __init__(self, model_path: str | Path, settings: EngineSettings, capture_graphs: bool = True) -> None:
        """`capture_graphs=False` runs the bucketed decode path (ENGINE_CUDA_GRAPHS) without capturing it even
        where it could be: the eager reference that benchmarks/gpu_engine_check.py compares replays with."""
        self.settings = settings
        self.model_path = resolve_model(model_path)
        self.config: ModelConfig = load_config(self.model_path)
        self.device = pick_device(settings.device)
        self.dtype = pick_dtype(settings.dtype, self.device)
        self.max_model_len = settings.max_model_len or self.config.max_position_embeddings
        self.config.check_max_model_len(self.max_model_len)
        self.block_size = settings.block_size
        needs_windows = self.config.sliding_window is not None or self.config.attn_logit_softcap is not None
        self.kv_window = self.config.kv_window
        self.backend = make_backend(settings.attention_backend, self.device, needs_windows)
        self.graph_mode = graph_mode(settings.cuda_graphs, self.device.type, self.backend.name, triton_interpreted())
        if self.graph_mode == "capture" and not capture_graphs:
            self.graph_mode = "eager"

        checkpoint = read_checkpoint_quantization(self.model_path)
        self.quantization = pick_quantization(settings.quantization, checkpoint, self.device, self.dtype)
        """"none", "int8" or "fp8": the kernel the layers' projections run (worker/model/quantize.py)."""
        from_checkpoint = checkpoint is not None and checkpoint.kind == self.quantization
        self.model = load_model(
            self.config, self.model_path, self.backend, self.max_model_len, self.device, self.dtype,
            checkpoint_kind=self.quantization if from_checkpoint else None,
        )
        if checkpoint is not None:
            log.info("checkpoint holds %s: %s", checkpoint.description,
                     "loaded as they are" if from_checkpoint else f"widened to {self.dtype} (no {checkpoint.kind} "
                     f"kernel for {self.dtype} on {self.device.type}; docs/quantization.md)")
        if self.quantization != "none":
            skipped = self.model.quantize(self.quantization) if not from_checkpoint else []
            log.info("layers' projections in %s with per-channel scales%s", self.quantization,
                     f" ({', '.join(skipped)} left in {self.dtype})" if skipped else "")
            if self.quantization == "int8" and settings.quantize_lm_head:
                self.model.quantize_head()
                log.info("LM head in int8 too, for steps sampling up to %d rows", INT8_HEAD_MAX_ROWS)
            if self.quantization == "fp8" and self.device.type == "cpu":
                log.warning("FP8 on the CPU runs torch's reference FP8 product, several times slower than %s: "
                            "for checking accuracy, not for serving", self.dtype)
            if settings.cpu_packed_weights and self.device.type == "cpu" and self.dtype == torch.bfloat16:
                self.model.pack_weights(layers=False)  # the head stays bf16: packed for steps of several rows
        elif settings.cpu_packed_weights and self.device.type == "cpu" and self.dtype == torch.bfloat16:
            start = time.perf_counter()
            packed = self.model.pack_weights()
            log.info("%d weight matrices packed for oneDNN in %.2f s", packed, time.perf_counter() - start)
        if settings.cpu_compile and self.device.type == "cpu":
            log.info("one-row steps compiled in %.1f s", self.model.compile_one_row_steps())
        if use_fused_kernels(settings.fused_kernels, self.device, self.backend.name):
            fused = self.model.use_fused_kernels()
            if fused:
                log.info("fused Triton kernels in %d layers", fused)
            else:
                log.info("no fused Triton kernels for %s (the Llama graph's layers only)", self.config.architecture)
        self.loras: AdapterRegistry | None = None
        """The LoRA adapters of ENGINE_ADAPTERS_DIR (worker/model/lora.py); None when it is not set."""
        if settings.adapters_dir:
            self.loras = AdapterRegistry(settings.adapters_dir, self.config, settings.max_loras,
                                         settings.max_lora_rank, self.device, self.dtype)
        self.eos_token_ids = load_eos_token_ids(self.model_path, self.config)
        self.vocab_size = self.config.vocab_size
        if not any((self.model_path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
            raise FileNotFoundError(f"{self.model_path} has no tokenizer.json or tokenizer.model")
        self._tokenizer = None

        c = self.config
        # K and V of every layer in one allocation: [layers, 2, blocks, block_size, Hkv, D].
        self.bytes_per_block = 2 * c.num_layers * self.block_size * c.kv_size * self.dtype.itemsize
        self.num_blocks = self._num_blocks()
        # The bucketed decode path pads its batches with rows whose K/V go to one extra block, past the engine's.
        num_pad_blocks = 1 if self.graph_mode else 0
        self.kv_cache = torch.zeros(
            c.num_layers, 2, self.num_blocks + num_pad_blocks, self.block_size, c.num_kv_heads, c.head_dim,
            device=self.device, dtype=self.dtype,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(c.num_layers)]
        self.inputs = PersistentInput(-(-self.max_model_len // self.block_size), self.block_size, self.device,
                                      num_rows=settings.max_num_seqs)

        log.info(
            "model %s (%s, %d layers, %d/%d heads): device=%s dtype=%s attention=%s; KV cache %d blocks x %d "
            "tokens = %d tokens (%.0f MiB); max_model_len %d",
            self.model_path.name, c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, self.device,
            str(self.dtype).removeprefix("torch."), self.backend.name, self.num_blocks, self.block_size,
            self.num_blocks * self.block_size, self.num_blocks * self.bytes_per_block / 2**20, self.max_model_len,
        )
        if use_row_buckets(settings.row_buckets, self.device, self.dtype):
            self.model.row_buckets = row_bucket_sizes(max(settings.max_num_batched_tokens, settings.max_num_seqs))
        self._kept_logits, self._kept_logits_f32 = self._reserve_logits(self.model.padded_rows(settings.max_num_seqs))
        if self.model.row_buckets:
            seconds = self.prepare_thread()  # the constructing thread's; the engine thread builds its own
            log.info("matmul rows padded to %d sizes up to %d; their kernels built in %.2f s",
                     len(self.model.row_buckets), self.model.row_buckets[-1], seconds)
            start = time.perf_counter()
            calls = self.backend.fix_kernels(c.num_heads, c.num_kv_heads, c.head_dim, settings.max_num_batched_tokens,
                                             self.block_size, self.dtype, self.device)
            if calls:
                log.info("prompts' attention padded to whole blocks; its kernels built in %.2f s (%d lengths)",
                         time.perf_counter() - start, calls)
        self.graphs: DecodeGraphs | None = None
        if self.graph_mode:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.inputs,
                                       batch_sizes(settings.cuda_graph_batch_sizes, settings.max_num_seqs),
                                       self.max_model_len, pad_block=self.num_blocks, device=self.device)
            if self.graph_mode == "capture":
                self._capture(settings.cuda_graphs)
            else:
                why = ("on the CPU" if self.device.type == "cpu" else "under Triton's interpreter"
                       if triton_interpreted() else "as the caller asked")
                log.info("decode steps of up to %d requests run padded to batch sizes %s from static buffers, "
                         "eagerly (no CUDA graph capture %s)", self.graphs.sizes[-1], self.graphs.sizes, why)
        if self.device.type == "cpu":
            log.info("burst-sized steps run once in %.2f s", self._run_burst_steps())
        if self.device.type == "cuda" and not triton_interpreted():
            lengths = self.backend.prompt_lengths_to_compile(
                c.num_heads, c.num_kv_heads, c.head_dim,
                min(settings.max_num_batched_tokens, self.max_model_len, self.num_blocks * self.block_size))
            if lengths:
                seconds = self._run_prompts(lengths)
                log.info("prompts' attention kernels compiled in %.2f s (lengths %s)", seconds, lengths)
        if self.num_blocks * self.block_size < self.max_model_len:
            log.warning(
                "the KV cache holds %d tokens, fewer than max_model_len %d: one long request can exhaust it",
                self.num_blocks * self.block_size, self.max_model_len,
            )

    @torch.inference_mode()
    def _build_matmul_kernels(self, max_sampled_rows: int) -> float:
        """Run every weight's matmul at every row bucket once, so the library builds all the kernels a worker
        will ever need now, and its memory is at its high-water mark before the first request. Every layer's
        weights have the first layer's shapes, and a kernel is cached by shape. Seconds taken."""
        start = time.perf_counter()
        c = self.config
        for rows in self.model.row_buckets:
            for width, weight, bias, scale in self.model.matmuls():
                linear(torch.zeros(rows, width, device=self.device, dtype=self.dtype), weight, bias, scale)
            if rows <= max_sampled_rows:
                hidden = torch.zeros(rows, c.hidden_size, device=self.device, dtype=self.dtype)
                self.model.lm_head_logits(hidden, self._kept_logits)
        return time.perf_counter() - start

    def prepare_thread(self) -> float:
        """Build this thread's own matmul kernel caches; call it on the thread that will step the engine, before
        its first step. ideep, through which torch runs its CPU matmuls, keeps the kernel descriptors it has
        made in a per-thread cache, so the kernels built at start-up serve only the thread that built them: a
        thread that steps next met each row bucket anew, and a rebalance's burst, bringing the largest buckets
        first, left their descriptors in the engine thread's heap for good (docs/memory.md). Seconds taken
        (0.0 where rows are not padded to buckets)."""
        if not self.model.row_buckets:
            return 0.0
        return self._build_matmul_kernels(self.model.padded_rows(self.settings.max_num_seqs))

    def burst_steps(self) -> list[list[tuple[int, int]]]:
        """Steps of the shapes a burst brings (a rebalance handing back a backlog, a flood): each a list of
        (new tokens, cached tokens) per request, within the engine's limits."""
        s = self.settings
        rows, budget = min(64, s.max_num_seqs), s.max_num_batched_tokens
        room = min(self.max_model_len, self.num_blocks * self.block_size)

        def fit(new: int, cached: int) -> tuple[int, int]:  # scaled down to the context the cache holds
            new = 1 if new == 1 else max(1, min(new, budget, room // 2))
            return new, max(0, min(cached, room - new))

        steps = [
            [fit(1, 8 + 6 * i) for i in range(rows)],  # decodes over many contexts: several groups
            [fit(1, 40)] * rows,
            [fit(1, 300)] * rows,
            [fit(64, 0)] * max(1, min(rows, budget // 64)),  # fresh prompts
            [fit(200, 300)],  # a chunk after a cached context
            [fit(budget // 4, 50), fit(budget // 8, 20)] + [fit(1, 100)] * (rows // 2),
            [fit(budget // 2, 0), fit(budget // 4, 0)] + [fit(1, 60)] * (rows // 4),
        ]
        return [step for step in steps if sum(new for new, _ in step) <= budget]

    def _run_burst_steps(self) -> float:
        """Run `burst_steps` once through the whole forward, so that the libraries' code a burst runs (torch
        picks its kernels, and whether to run them on its thread pool, by size) is paged in now: first run
        by a rebalance's burst, it added 0.7 MB of libtorch's pages to the resident size for good
        (docs/memory.md). Seconds taken."""
        start = time.perf_counter()
        self._run_steps(self.burst_steps())
        if self.graphs is not None:  # its step counts are the engine's, from the first request on
            self.graphs.steps_by_bucket.clear()
            self.graphs.num_padding_rows = 0
        return time.perf_counter() - start

    @torch.inference_mode()
    def _run_steps(self, steps: list[list[tuple[int, int]]]) -> None:
        """Steps of (new tokens, cached tokens) per request through the whole forward before any request
        comes. They write K/V into the first blocks, zeroed again after (no request holds a block yet)."""
        used = 0
        for n, step in enumerate(steps):
            ids = [f"start-up-{n}-{i}" for i in range(len(step))]
            tables = [list(range(-(-(new + cached) // self.block_size))) for new, cached in step]
            used = max(used, *(len(t) for t in tables))
            batch = StepRequests(request_ids=ids, block_ids=tables, num_computed=[c for _, c in step],
                                 num_new=[new for new, _ in step], samples=[True] * len(step),
                                 input_ids=[0] * sum(new for new, _ in step))
            self.execute(self.prepare_input(batch), keep=True)
            self.release(ids)
        self.kv_cache[:, :, :used].zero_()

    def _run_prompts(self, lengths: tuple[int, ...]) -> float:
        """One prompt step of each length through the whole forward, so that every kernel compiled on first use
        (the backend's `prompt_lengths_to_compile`) is built before the first request; on an H200 each compile
        took 0.4 to 1.1 s, which the first request of its kind waited. Seconds taken."""
        start = time.perf_counter()
        self._run_steps([[(length, 0)] for length in lengths])
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _reserve_logits(self, rows: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """On the CPU, where a step's logits go to the engine's step: [rows, V] in the model dtype and its
        float32 copy, made and touched now at the largest step. A step's logits are the largest arrays it
        allocates (SmolLM2: 96 KB a row in bf16, 192 KB in float32); fresh each step, a burst's larger ones
        were carved from the allocator's arenas and left the heap a few MB larger for good (docs/memory.md),
        and past glibc's mmap threshold each costs page faults. (None, None) on other devices, where they never
        touch host memory; the float32 copy is None when the model dtype is float32."""
        if self.device.type != "cpu":
            return None, None
        model_dtype = torch.zeros(rows, self.vocab_size, dtype=self.dtype)
        return model_dtype, None if self.dtype == torch.float32 else torch.zeros(rows, self.vocab_size)

    def _capture(self, setting: str) -> None:
        try:
            self.graphs.capture()
        except Exception:
            if setting == "on":
                raise
            # auto: a worker that cannot capture still serves, every step eager.
            log.exception("CUDA graph capture failed; ENGINE_CUDA_GRAPHS=auto runs every step eagerly instead")
            self.graphs, self.graph_mode = None, None

    def _num_blocks(self) -> int:
        if self.settings.num_kv_blocks is not None:
            return self.settings.num_kv_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.settings.kv_cache_gpu_fraction)
        else:
            budget = self.settings.kv_cache_bytes
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"KV-cache budget of {budget} bytes is smaller than one block "
                             f"({self.bytes_per_block} bytes)")
        return num_blocks

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer, loaded on first use (about a second; tests of the forward skip it)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def input_from(self, step: StepRequests, arrays: StepArrays) -> ModelInput:
        if step.adapters:  # the captured graphs hold the base model's matmuls only: an adapter's step runs eagerly
            model_input = self.inputs.tensors(arrays)
            loaded = self.loras.loaded if self.loras is not None else {}
            # An adapter that is not loaded (its load failed at this step: the engine ended its requests) runs
            # as the base; nothing reads those rows.
            adapters = [None if name is None else loaded.get(name) for name in step.adapters]
            model_input.lora = LoraStep.build(adapters, np.asarray(step.num_new), self.device,
                                              self.loras.stack() if self.loras is not None else None,
                                              use_kernel=self.backend.name == "triton")
            return model_input
        graphs = self.graphs
        if graphs is not None:
            bucket = graphs.bucket_for(step)
            if bucket is not None:
                return graphs.prepare(arrays, bucket)
        return self.inputs.tensors(arrays)

    def launch(self, model_input: ModelInput) -> Launched:
        """The engine's step: on the CPU its logits go into the buffers kept for them (`execute`, keep)."""
        return Launched(self.execute(model_input, keep=True))

    @torch.inference_mode()
    def execute(self, model_input: ModelInput, keep: bool = False) -> torch.Tensor:  # [S, V] float32
        """The step's logits. `keep`: on the CPU, written into the buffers kept for the engine's steps, valid
        until the next such call (the engine samples a step before it launches the next); otherwise a tensor
        of their own, as tests and benchmarks that compare forwards need."""
        if isinstance(model_input, BucketedInput):
            return self.graphs.execute(model_input)
        attn = model_input.attn
        if attn.max_seq_len > self.max_model_len:
            raise ValueError(f"a sequence of {attn.max_seq_len} tokens exceeds max_model_len {self.max_model_len}")
        logits = self.model(
            model_input.input_ids,
            model_input.positions,
            self.kv_caches,
            attn,
            model_input.logits_indices,
            self._kept_logits if keep else None,
            model_input.lora,
        )
        kept = keep and self._kept_logits is not None and logits.data_ptr() == self._kept_logits.data_ptr()
        if not kept or self._kept_logits_f32 is None:  # not in the buffer (a step larger than it), or float32
            return logits.float()  # no copy when it already is float32
        return self._kept_logits_f32[:logits.shape[0]].copy_(logits)
