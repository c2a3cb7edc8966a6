"""A simulated accelerator: `ENGINE_DEVICE=sim:h200` or `sim:h100`.

Everything around the forward is real (scheduler, block pool, input buffers, sampler, detokenizer); the forward
is replaced by a roofline estimate of its time on the named GPU for the configured model shape, waited out with
`time.sleep` (which releases the GIL, as a real device sync does), and logits whose argmax is a deterministic
function of the row's last token and its position, so outputs stay checkable. No weights are loaded and no KV
memory is allocated: the model is only its config.json (`worker/model/configs/` ships SmolLM2-135M-Instruct's
and Llama-3.1-8B-Instruct's; `ENGINE_SIM_MODEL` picks one, a folder or a config.json path, default ENGINE_MODEL's).

The roofline of one step, bf16 weights and KV cache:
    bytes  = weights streamed once (every layer's matrices, the final norm, the LM head; embedding rows of the
             step's tokens only) + K/V read (each request's whole context, once per layer) + K/V written (the
             new tokens) + logits (float32, written once and read twice by the sampler: S x V x 12 bytes)
    flops  = 2 x layer matrix parameters x T + 2 x hidden x V x S (the LM head, for sampled rows only)
             + attention: 4 x layers x q heads x head_dim x (sum over new tokens of the context each one sees)
    time   = max(bytes / HBM bandwidth, flops / peak dense bf16 FLOP/s) + step_launch_s + layers x layer_launch_s
T = tokens computed in the step, S = rows sampled, V = the model's vocabulary.

Device constants (NVIDIA datasheets; peak dense bf16 is half the "with sparsity" figure they print):
    H100 SXM5: 80 GB HBM3, 3.35 TB/s, 989.4 TFLOP/s   (NVIDIA H100 Tensor Core GPU datasheet)
    H200 SXM:  141 GB HBM3e, 4.8 TB/s, 989.4 TFLOP/s  (NVIDIA H200 Tensor Core GPU datasheet)
Peaks are upper bounds: measured dense bf16 GEMMs reach about 80% (about 790 TFLOP/s on an H200, DESIGN.md),
decode attention 70-85% of the bandwidth; the simulation is thus slightly optimistic. Launch costs are estimates,
not datasheet values: step_launch_s = 20 µs (one CUDA-graph launch, the sampled ids' copy to the host and its
sync), layer_launch_s = 8 µs (a Llama layer is about ten kernels, each with about 0.8 µs of launch gap and tail
that no bandwidth hides when its work is small). On an H200, with 1k-token contexts, a SmolLM2-135M decode step
(30 layers) comes out at 0.40 ms for 16 running requests, 0.64 ms for 64 and 1.6 ms for 256 (the K/V reads
dominate), and a Llama-3.1-8B step at 3.9, 5.2 and 10.7 ms: about 10 ms at 256, the step time the GPU
regime's targets were set for (benchmarks/probes/sim_profiles.py prints the table).

The wait is the step's time less what `launch` itself spent (the cost and the logits) and whatever the caller
did before waiting: with ENGINE_ASYNC_SCHEDULING (engine.py) the engine schedules the next step and detokenizes
the last one meanwhile, as it would while a GPU runs the forward. The sampler's draw also comes before the wait
(`Launched`, worker/model/input.py): on a GPU it runs on the device right behind the forward, and its bytes are
in the step's time above, so drawing on the host after the wait would count it twice (at 256 running the CPU
draw with top-k/top-p costs 1.5-2.5 ms against a 10.7 ms 8B step).

KV capacity: (HBM - all weights) x ENGINE_KV_CACHE_GPU_FRACTION, in blocks of the model's shape (or
ENGINE_NUM_KV_BLOCKS): only the block pool's count, nothing is allocated.

Logits: [S, W] float32 with W = ENGINE_SIM_LOGITS_WIDTH (default 2048; 0: the model's vocabulary). The draw
and the detokenizer need ids the tokenizer knows (the text side is ENGINE_MODEL's tokenizer, SmolLM2's by
default, 49152 ids, while Llama-3.1-8B has 128256), and the sampler's math on a CPU over a real vocabulary is
device work on a GPU (it is in the roofline's bytes above): so the logits are narrow, ids outside the
tokenizer's ordinary range (specials, ids past its vocabulary) get -inf, and the rest a fixed, tie-free
background in [-4, 0] under a spike of +8 on the deterministic next token (greedy picks it; temperature 0.8
about 98% of the time at W = 2048).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from worker.model.settings import EngineSettings
from worker.model.config import ModelConfig, load_eos_token_ids, load_tokenizer, parse_config
from worker.model.input import Launched, ModelInput, PersistentInput, PersistentInputRunner
from worker.model.pull import resolve_model

log = logging.getLogger(__name__)

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
BYTES_PER_PARAM = 2
"""bf16 weights and KV cache."""
SYNC_SPIN_S = 0.0003
"""The end of a simulated step's wait is spent yielding rather than sleeping (SimRunner._wait_until)."""
LOGITS_BYTES_PER_ENTRY = 12
"""float32 logits written once and read twice (sampling) per step."""


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    step_launch_s: float = 20e-6
    layer_launch_s: float = 8e-6


DEVICES = {
    "h100": DeviceProfile("NVIDIA H100 SXM5 80GB", hbm_bytes=80e9, hbm_bytes_per_s=3.35e12, peak_flops=989.4e12),
    "h200": DeviceProfile("NVIDIA H200 SXM 141GB", hbm_bytes=141e9, hbm_bytes_per_s=4.8e12, peak_flops=989.4e12),
}


def sim_config(name_or_path: str, model_path: Path) -> ModelConfig:
    """A shipped shape (configs/<name>.json), a folder holding config.json, a config.json, or (empty) the
    configured model's own config.json."""
    if not name_or_path:
        path = model_path / "config.json"
    elif (CONFIGS_DIR / f"{name_or_path}.json").is_file():
        path = CONFIGS_DIR / f"{name_or_path}.json"
    else:
        path = Path(name_or_path).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            shipped = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.json")))
            raise FileNotFoundError(f"ENGINE_SIM_MODEL={name_or_path!r}: not one of {shipped}, nor a config.json")
    return parse_config(json.loads(path.read_text()))


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the roofline needs of a model, from its config alone."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    layer_params: int
    """Matrix parameters of one layer (q, k, v, o, gate, up, down; biases and norms included)."""
    embedding_params: int
    lm_head_params: int
    kv_bytes_per_token: int
    """K and V of one token over all layers."""

    @classmethod
    def of(cls, c: ModelConfig) -> "ModelShape":
        attention = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
        mlp = 3 * c.hidden_size * c.intermediate_size
        biases = (c.q_size + 2 * c.kv_size) * c.qkv_bias + c.hidden_size * c.o_bias
        biases += (2 * c.intermediate_size + c.hidden_size) * c.mlp_bias
        return cls(
            num_layers=c.num_layers, hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_heads=c.num_heads,
            head_dim=c.head_dim, layer_params=attention + mlp + biases + 2 * c.hidden_size,
            embedding_params=c.vocab_size * c.hidden_size,
            lm_head_params=c.vocab_size * c.hidden_size,
            kv_bytes_per_token=2 * c.num_layers * c.kv_size * BYTES_PER_PARAM,
        )

    @property
    def weight_bytes(self) -> int:
        """Every weight once (tied embeddings counted once): what the weights take in HBM."""
        return BYTES_PER_PARAM * (self.num_layers * self.layer_params + self.hidden_size + self.embedding_params)

    def weight_bytes_in_memory(self, tied: bool) -> int:
        return self.weight_bytes + (0 if tied else BYTES_PER_PARAM * self.lm_head_params)


@dataclass(frozen=True, slots=True)
class StepCost:
    seconds: float
    bytes: float
    flops: float
    memory_s: float
    compute_s: float
    launch_s: float


def step_cost(
    shape: ModelShape,
    device: DeviceProfile,
    num_new: np.ndarray,  # [B] tokens computed this step per request
    seq_lens: np.ndarray,  # [B] context after the step
    num_sampled: int,
) -> StepCost:
    num_new = num_new.astype(np.float64)
    seq_lens = seq_lens.astype(np.float64)
    tokens = float(num_new.sum())
    streamed = BYTES_PER_PARAM * (shape.num_layers * shape.layer_params + shape.hidden_size + shape.lm_head_params)
    embedding_rows = BYTES_PER_PARAM * shape.hidden_size * tokens
    kv = shape.kv_bytes_per_token * (float(seq_lens.sum()) + tokens)  # context read + new tokens written
    logits = LOGITS_BYTES_PER_ENTRY * shape.vocab_size * num_sampled
    num_bytes = streamed + embedding_rows + kv + logits
    # New token i (0-based) of a request with c cached tokens attends to c + i + 1 positions.
    cached = seq_lens - num_new
    attended = float((num_new * cached + num_new * (num_new + 1) / 2).sum())
    flops = 2.0 * shape.num_layers * shape.layer_params * tokens + 2.0 * shape.lm_head_params * num_sampled
    flops += 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * attended
    memory_s = num_bytes / device.hbm_bytes_per_s
    compute_s = flops / device.peak_flops
    launch_s = device.step_launch_s + shape.num_layers * device.layer_launch_s
    return StepCost(max(memory_s, compute_s) + launch_s, num_bytes, flops, memory_s, compute_s, launch_s)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(model_path: Path):
    """Shared by the runners of one process (benchmarks and tests build many; loading takes about a second)."""
    return load_tokenizer(model_path)


class SimRunner(PersistentInputRunner):
    """The model runner's interface (prepare_input, execute, release, tokenizer, num_blocks, ...) on a simulated
    device. `sleep` is injectable so tests can run the simulation without waiting."""

    simulated = True

    def __init__(self, settings: EngineSettings, sleep: Callable[[float], None] = time.sleep) -> None:
        kind = settings.device.removeprefix("sim:")
        if kind not in DEVICES:
            raise ValueError(f"ENGINE_DEVICE={settings.device!r}: simulated devices are "
                             f"{', '.join('sim:' + name for name in DEVICES)}")
        self.settings = settings
        self.profile = DEVICES[kind]
        self.device = torch.device("cpu")
        self.model_path = resolve_model(settings.model)  # the tokenizer's folder; its weights are never read
        self.config = sim_config(settings.sim_model, self.model_path)
        self.shape = ModelShape.of(self.config)
        self.max_model_len = settings.max_model_len or self.config.max_position_embeddings
        self.config.check_max_model_len(self.max_model_len)
        self.block_size = settings.block_size
        self.vocab_size = self.config.vocab_size
        self.eos_token_ids = load_eos_token_ids(self.model_path, parse_config(
            json.loads((self.model_path / "config.json").read_text())))
        self.bytes_per_block = self.shape.kv_bytes_per_token * self.block_size
        self.num_blocks = self._num_blocks()
        self.inputs = PersistentInput(-(-self.max_model_len // self.block_size), self.block_size, self.device,
                                      num_rows=settings.max_num_seqs)
        self.logits_width = min(settings.sim_logits_width or self.vocab_size, self.vocab_size)
        self._sleep = sleep
        self._tokenizer = None
        self._logits: torch.Tensor | None = None  # [rows, W], background plus this step's spikes
        self._spikes: tuple[np.ndarray, np.ndarray] | None = None
        self._ordinary_ids = np.zeros(0, dtype=np.int64)
        self.last_cost: StepCost | None = None
        self.simulated_s = 0.0
        """Sum of the simulated step times so far."""
        self.waited_s = 0.0
        """Sum of the time actually spent in the waits (a sleep wakes up late by tens of microseconds or more)."""
        log.info(
            "simulated device %s, model shape %s (%d layers, %.2fB parameters, vocab %d): KV cache %d blocks x %d "
            "tokens = %d tokens (%.1f GiB, not allocated); logits width %d; max_model_len %d",
            self.profile.name, settings.sim_model or self.model_path.name, self.config.num_layers,
            self.shape.weight_bytes_in_memory(self.config.tie_word_embeddings) / BYTES_PER_PARAM / 1e9,
            self.vocab_size, self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block / 2**30, self.logits_width, self.max_model_len,
        )

    def _num_blocks(self) -> int:
        if self.settings.num_kv_blocks is not None:
            return self.settings.num_kv_blocks
        free = self.profile.hbm_bytes - self.shape.weight_bytes_in_memory(self.config.tie_word_embeddings)
        num_blocks = int(free * self.settings.kv_cache_gpu_fraction) // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"{self.profile.name} cannot hold this model's weights and one KV block")
        return num_blocks

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.model_path)
            self._build_background(self.settings.max_num_seqs)  # here, not in a step's simulated time
        return self._tokenizer

    def execute(self, model_input: ModelInput) -> torch.Tensor:  # [S, W] float32
        return self.launch(model_input).result()

    def launch(self, model_input: ModelInput) -> Launched:
        """The step's cost and logits now; `result()` waits until the simulated device is done (launch time +
        the step's time): host work between the two overlaps the device, as on a GPU."""
        start = time.perf_counter()
        attn = model_input.attn
        if attn.max_seq_len > self.max_model_len:
            raise ValueError(f"a sequence of {attn.max_seq_len} tokens exceeds max_model_len {self.max_model_len}")
        qsl = attn.query_start_loc.numpy()
        cost = step_cost(self.shape, self.profile, np.diff(qsl), attn.seq_lens.numpy(),
                         model_input.logits_indices.shape[0])
        logits = self._next_logits(model_input)
        self.last_cost = cost
        self.simulated_s += cost.seconds
        return Launched(logits, start + cost.seconds, self._wait_until)

    def _wait_until(self, ready_at: float) -> None:
        """Like a device sync: back within microseconds of ready_at, the GIL free meanwhile. time.sleep alone
        wakes up late (tens of microseconds past a millisecond sleep), which a real sync does not, so the
        last SYNC_SPIN_S are waited by yielding (time.sleep(0) releases the GIL each time)."""
        remaining = ready_at - time.perf_counter()
        if self._sleep is not time.sleep:  # tests: an injected sleep that records every wait instead of waiting
            self._sleep(max(remaining, 0.0))  # 0: the host work outran this step (a loaded machine)
            return
        if remaining <= 0:
            return
        slept = time.perf_counter()
        if remaining > SYNC_SPIN_S:
            time.sleep(remaining - SYNC_SPIN_S)
        while time.perf_counter() < ready_at:
            time.sleep(0)
        self.waited_s += time.perf_counter() - slept

    def next_token_ids(self, last_token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The greedy token after `last_token_ids[i]` at `positions[i]`: an ordinary id the tokenizer knows."""
        mixed = (last_token_ids.astype(np.int64) * 1_000_003 + positions.astype(np.int64) * 7_919 + 17) % 2_147_483_647
        return self._ordinary_ids[mixed % self._ordinary_ids.shape[0]]

    def _next_logits(self, model_input: ModelInput) -> torch.Tensor:
        rows = model_input.logits_indices.numpy()
        num_rows = rows.shape[0]
        if self._logits is None or self._logits.shape[0] < num_rows:
            self.tokenizer  # (loads it and builds the background)
            self._build_background(max(num_rows, self.settings.max_num_seqs))
        logits = self._logits.numpy()
        if self._spikes is not None:  # back to the background where the last step put its spikes
            old_rows, old_ids = self._spikes
            logits[old_rows, old_ids] = self._background[old_ids]
        targets = self.next_token_ids(model_input.input_ids.numpy()[rows], model_input.positions.numpy()[rows])
        logits[np.arange(num_rows), targets] = 8.0
        self._spikes = (np.arange(num_rows), targets)
        return self._logits[:num_rows]

    def _build_background(self, num_rows: int) -> None:
        tokenizer = self._tokenizer
        # Special tokens sit first in some vocabularies (SmolLM2's 0-16) and last in others (Llama 3's from
        # 128000), so the ordinary ids are whatever the narrowed width leaves once the specials are taken out.
        specials = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        ids = np.arange(self.logits_width)
        ordinary = ids < min(self.logits_width, len(tokenizer))
        ordinary[[i for i in specials if 0 <= i < self.logits_width]] = False
        if not ordinary.any():
            raise ValueError(f"logits width {self.logits_width} leaves no ordinary token of the tokenizer")
        self._ordinary_ids = ids[ordinary]
        background = (-4.0 * ((ids * 0.6180339887498949) % 1.0)).astype(np.float32)  # distinct values
        background[~ordinary] = -np.inf
        self._background = background
        self._logits = torch.from_numpy(np.tile(background, (num_rows, 1)))
        self._spikes = None
