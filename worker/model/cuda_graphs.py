"""Decode steps at a few fixed batch sizes from static input buffers, replayed as CUDA graphs (as vLLM does).

A decode-only step (every scheduled request brings exactly one new token) of B requests, B no larger than the
largest bucket (ENGINE_CUDA_GRAPH_BATCH_SIZES), runs at the smallest bucket b >= B. Its inputs are copied into
static buffers sized for the largest bucket; rows B..b-1 are padding: token 0 at position 0 with a context of
one token, its K/V written to and read from a block reserved for padding (one block past the engine's, so no
request's cache is touched), and its logits dropped. On CUDA each bucket's forward is captured once at start-up
(largest first, all sharing one memory pool) into a CUDA graph over those buffers and then replayed: one launch
in place of about ten kernel launches per layer, so a small model's decode step is no longer paced by the
host's launches. Steps with prefill tokens, and decode batches over the largest bucket, run eagerly as before.

Where nothing can be captured (the CPU, Triton's interpreter), ENGINE_CUDA_GRAPHS=on runs the same padded
static-buffer path eagerly, so the tests here check the padding, the buffers and the reserved block token for
token against the normal path; only the capture and replay themselves need a GPU.

Attention over static shapes: the Triton decode kernel reads each row's own context length from the buffer, so
a padding row costs one key. A graph cannot change its grid, so the kernel's split count is fixed per bucket
from max_model_len (split boundaries are computed per row inside the kernel, so any length is right); the
bucketed path uses that bound eagerly too, so replay and eager bucketed steps run the same kernels. The torch
backend plans each step on the host from the metadata (`.tolist()`): fine eagerly, not capturable, so capture
needs the Triton backend.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from dataclasses import dataclass

import torch

from worker.model.input import AttentionMetadata, ModelInput, PersistentInput, StepArrays
from worker.model.step_batch import StepRequests

log = logging.getLogger(__name__)


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, the multiples of 8 below max_num_seqs, and max_num_seqs (vLLM's capture sizes, capped)."""
    sizes = {n for n in (1, 2, 4) if n < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs}
    return sorted(sizes)


def batch_sizes(configured: list[int], max_num_seqs: int) -> list[int]:
    """The buckets, ascending: the configured sizes (deduplicated) or the defaults."""
    if not configured:
        return default_batch_sizes(max_num_seqs)
    if any(not 1 <= n <= max_num_seqs for n in configured):
        raise ValueError(f"cuda_graph_batch_sizes {configured} must lie in [1, max_num_seqs={max_num_seqs}]")
    return sorted(set(configured))


def pick_bucket(sizes: list[int], batch_size: int) -> int | None:
    """The smallest of `sizes` (ascending) that holds `batch_size` rows; None when none does (or the batch is
    empty): that step runs eagerly."""
    if batch_size < 1:
        return None
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (nothing to capture then)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def graph_mode(setting: str, device_type: str, backend_name: str, interpreted: bool) -> str | None:
    """What ENGINE_CUDA_GRAPHS means here: "capture" (bucketed, captured and replayed), "eager" (bucketed,
    not captured) or None (off: every step runs unpadded)."""
    if setting == "off":
        return None
    capturable = device_type == "cuda" and not interpreted
    if setting == "auto":
        return "capture" if capturable and backend_name == "triton" else None
    if setting != "on":
        raise ValueError(f"ENGINE_CUDA_GRAPHS={setting!r}: expected auto, on or off")
    if not capturable:
        return "eager"
    if backend_name != "triton":
        raise ValueError("ENGINE_CUDA_GRAPHS=on on CUDA needs the triton attention backend: the torch backend "
                         "plans each step on the host, which a CUDA graph cannot capture")
    return "capture"


@dataclass(slots=True)
class BucketedInput(ModelInput):
    """A decode step laid into the static buffers: `input_ids`, `positions` and `attn` are views of them for
    `bucket` rows, the first `num_rows` real; `logits_indices` are the rows that sample."""

    bucket: int = 0
    num_rows: int = 0


class DecodeGraphs:
    """The static buffers, one captured graph per bucket (on CUDA), and the step counts per bucket."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], inputs: PersistentInput,
                 sizes: list[int], max_model_len: int, pad_block: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.pad_block = pad_block
        self.pad_slot = pad_block * inputs.block_size
        self.device = device
        n, max_blocks = sizes[-1], inputs.block_table.shape[1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [N]
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)  # [N, max_blocks]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [N + 1]: one token a row
        self.rows = torch.arange(n, dtype=torch.int64, device=device)  # [N]: every row's logits
        self._static = {"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                        "seq_lens": self.seq_lens, "block_tables": self.block_tables}
        # The host side of each buffer: the buffer itself on the CPU; on CUDA a pinned twin, copied over
        # asynchronously. The next step rewrites the twin only after the sampler has synchronized on this
        # step's tokens (as PersistentInput's staging buffers).
        if device.type == "cpu":
            self._pinned: dict[str, torch.Tensor] = {}
            self._host = {name: t.numpy() for name, t in self._static.items()}
        else:
            self._pinned = {name: torch.zeros(t.shape, dtype=t.dtype).pin_memory() for name, t in self._static.items()}
            self._host = {name: t.numpy() for name, t in self._pinned.items()}
        self._pad_rows(0, n)
        self._copy(n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """bucket -> [bucket, V] logits the graph writes (model dtype)."""
        self._metas: dict[int, AttentionMetadata] = {}
        self.replay = False
        """True once captured: bucketed steps replay their graph; False: they run the same forward eagerly."""
        self.capture_bytes = 0
        """GPU memory the capture took (free memory before less after): the graphs' pool and outputs."""
        self.capture_s = 0.0
        self.steps_by_bucket: dict[int, int] = {}
        """How many steps ran at each bucket (for tests and benchmarks)."""
        self.num_padding_rows = 0

    # ---- per step -----------------------------------------------------------------------------------

    def bucket_for(self, step: StepRequests) -> int | None:
        num_requests = len(step.num_new)
        if len(step.input_ids) != num_requests:  # some request brings more than one token: not decode-only
            return None
        return pick_bucket(self.sizes, num_requests)

    def prepare(self, arrays: StepArrays, bucket: int) -> BucketedInput:
        """The step's host arrays (a decode step of B <= bucket requests) into the static buffers."""
        if arrays.max_seq_len > self.max_model_len:
            raise ValueError(f"a sequence of {arrays.max_seq_len} tokens exceeds max_model_len {self.max_model_len}")
        num_rows = arrays.input_ids.shape[0]
        host = self._host
        host["input_ids"][:num_rows] = arrays.input_ids
        host["positions"][:num_rows] = arrays.positions
        host["slot_mapping"][:num_rows] = arrays.slot_mapping
        host["seq_lens"][:num_rows] = arrays.seq_lens
        num_cols = arrays.block_tables.shape[1]
        host["block_tables"][:num_rows, :num_cols] = arrays.block_tables
        # Columns past a row's context keep older ids: never read (attention stops at seq_lens).
        self._pad_rows(num_rows, bucket)
        self._copy(bucket)
        if arrays.logits_indices.shape[0] == num_rows:  # every row samples (the usual decode step)
            sample_rows = self.rows[:num_rows]
        else:
            sample_rows = torch.from_numpy(arrays.logits_indices).to(self.device, non_blocking=True)
        self.steps_by_bucket[bucket] = self.steps_by_bucket.get(bucket, 0) + 1
        self.num_padding_rows += bucket - num_rows
        return BucketedInput(self.input_ids[:bucket], self.positions[:bucket], self._meta(bucket), sample_rows,
                             bucket=bucket, num_rows=num_rows)

    def execute(self, model_input: BucketedInput) -> torch.Tensor:  # [S, V] float32
        bucket = model_input.bucket
        if self.replay:
            self.graphs[bucket].replay()
            logits = self.outputs[bucket]  # [bucket, V], overwritten by the next replay
        else:
            logits = self._forward(bucket, model_input.attn)
        # index_select copies: the caller's logits never alias a graph's output.
        return logits.index_select(0, model_input.logits_indices).float()

    def _pad_rows(self, start: int, end: int) -> None:
        if start >= end:
            return
        host = self._host
        host["input_ids"][start:end] = 0
        host["positions"][start:end] = 0
        host["slot_mapping"][start:end] = self.pad_slot
        host["seq_lens"][start:end] = 1
        host["block_tables"][start:end, 0] = self.pad_block

    def _copy(self, num_rows: int) -> None:
        if self.device.type == "cpu":
            return
        # Whole rows, block tables included (contiguous, so truly asynchronous from pinned memory; at most
        # rows x max_model_len / block_size x 4 bytes, 256 KiB for 128 rows of 8k tokens).
        for name, static in self._static.items():
            static[:num_rows].copy_(self._pinned[name][:num_rows], non_blocking=True)

    def _meta(self, bucket: int) -> AttentionMetadata:
        """The bucket's metadata over the static buffers. While replaying, the captured one (its tensors are
        the graph's); eagerly, a new object each step, since the torch backend caches its plan by identity."""
        if self.replay:
            return self._metas[bucket]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # the bound the kernels size their grid by: fixed per bucket
        )

    def _forward(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:  # [bucket, V]
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta, self.rows[:bucket])

    # ---- start-up -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's forward (CUDA only), largest first into one shared memory pool; each is run
        twice eagerly first, so Triton compiles and cuBLAS picks its kernels outside the capture. The padding
        rows' K/V go to the reserved block only, so capturing touches no request's cache."""
        n = self.sizes[-1]
        self._pad_rows(0, n)
        self._copy(n)
        # torch.cuda.graph empties the allocator's cache as it starts, handing back blocks the runner's warm-up
        # left cached: measured without emptying it here first, that return hid the whole pool (0 MiB).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):
            meta = self._meta(bucket)
            for _ in range(2):
                self._forward(bucket, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self._forward(bucket, meta)
            self.graphs[bucket], self.outputs[bucket], self._metas[bucket] = graph, output, meta
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the eager runs' blocks, cached outside the graphs' pool
        free_after, _ = torch.cuda.mem_get_info(self.device)
        self.capture_bytes = max(0, free_before - free_after)
        self.capture_s = time.perf_counter() - started
        self.replay = True
        log.info("captured %d CUDA graphs for decode batches of %s requests in %.1f s; they hold %.0f MiB of GPU "
                 "memory", len(self.graphs), ",".join(map(str, self.sizes)), self.capture_s, self.capture_bytes / 2**20)
