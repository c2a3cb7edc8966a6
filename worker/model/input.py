"""The tensors of one forward pass, built on the runner's device from the engine's plain ints.

T = tokens scheduled this step (all requests' new tokens concatenated, request after request),
B = requests in the step, S = rows that get a next token sampled.

`PersistentInput` is what the runner uses each step (as vLLM v1's persistent input batch): each request keeps
a row of a block-table buffer from its first step until the engine releases it, and a step copies only the
block ids added since; positions, slots and the step's block tables come out of vectorized numpy operations,
with no per-token Python. `build_model_input` turns an explicit per-token `StepBatch` into the same tensors: the
reference, and what model tests build by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.model.step_batch import StepBatch, StepRequests

FREED_BLOCK = -1
"""worker.engine.block_pool.FREED_BLOCK (the model layer does not import the engine's)."""

if TYPE_CHECKING:
    from worker.model.lora import LoraStep


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] int64: flat KV slot (block_id * block_size + offset) each new token's K/V is written to; -1 skips."""
    query_start_loc: torch.Tensor
    """[B + 1] int32: cumulative new-token counts; request b's tokens are [qsl[b], qsl[b+1])."""
    seq_lens: torch.Tensor
    """[B] int32: context length of each request after this step (cached tokens + new tokens)."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32: block ids of each request, padded with 0 past its last block."""
    max_query_len: int
    max_seq_len: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor
    """[T] int64."""
    positions: torch.Tensor
    """[T] int64: position of each token in its own request."""
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    """[S] int64: indices into T whose logits are computed (last token of each request that samples)."""
    lora: LoraStep | None = None
    """The step's rows grouped by adapter (worker/model/lora.py); None when every row runs the base model."""


@dataclass(slots=True)
class StepArrays:
    """One step's inputs on the host, as `PersistentInput.arrays` derives them (numpy, int64 unless noted)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, blocks of the longest context] int32
    logits_indices: np.ndarray  # [S]
    max_query_len: int
    max_seq_len: int


def build_model_input(batch: StepBatch, device: torch.device | str) -> ModelInput:
    rows = batch.block_table_rows
    max_blocks = max((len(row) for row in rows), default=0)
    block_tables = [row + [0] * (max_blocks - len(row)) for row in rows]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    qsl = batch.query_start_loc
    attn = AttentionMetadata(
        slot_mapping=tensor(batch.slot_mapping, torch.int64),  # [T]
        query_start_loc=tensor(qsl, torch.int32),  # [B + 1]
        seq_lens=tensor(batch.seq_lens, torch.int32),  # [B]
        # reshape: with B == 0, torch.tensor([]) would be [0] rather than [0, 0].
        block_tables=tensor(block_tables, torch.int32).reshape(len(rows), max_blocks),  # [B, max_blocks]
        max_query_len=max((end - start for start, end in zip(qsl, qsl[1:])), default=0),
        max_seq_len=max(batch.seq_lens, default=0),
    )
    return ModelInput(
        input_ids=tensor(batch.input_ids, torch.int64),  # [T]
        positions=tensor(batch.positions, torch.int64),  # [T]
        attn=attn,
        logits_indices=tensor(batch.logits_indices, torch.int64),  # [S]
    )


class PersistentInput:
    """Builds a step's `ModelInput` from a `StepRequests`, keeping each request's block table between steps.

    Block tables past a request's context hold stale or zero ids (never read: attention stops at seq_lens).
    On a GPU the step's arrays go through pinned host buffers and are copied asynchronously; the next step
    rewrites those buffers only after the sampler's transfer of this step's tokens has synchronized.
    """

    def __init__(self, max_blocks_per_request: int, block_size: int, device: torch.device | str,
                 num_rows: int = 64) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.block_table = np.zeros((num_rows, max_blocks_per_request), dtype=np.int32)
        """[rows, max_blocks]: row r holds the block ids of the request that owns r."""
        self._row_of: dict[str, int] = {}
        self._num_copied: list[int] = [0] * num_rows
        """Block ids of row r copied so far."""
        self._num_freed: list[int] = [0] * num_rows
        """Leading entries of row r set to FREED_BLOCK (given back by a windowed model's request)."""
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._pinned: dict[str, torch.Tensor] = {}

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget these requests' rows (finished or preempted: a preempted request comes back with a new block
        table). Unknown ids are ignored."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._num_copied[row] = self._num_freed[row] = 0
                self._free_rows.append(row)

    def reset(self) -> None:
        """Forget every request (an engine taking over this runner starts with empty block tables)."""
        self.release(list(self._row_of))

    def _grow(self) -> None:
        old = self.block_table.shape[0]
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self._num_copied += [0] * old
        self._num_freed += [0] * old
        self._free_rows += range(2 * old - 1, old - 1, -1)

    def _rows(self, step: StepRequests) -> np.ndarray:  # [B] int64
        rows = []
        row_of, num_copied, table = self._row_of, self._num_copied, self.block_table
        num_freed = step.num_freed or [0] * len(step.request_ids)
        for request_id, block_ids, freed in zip(step.request_ids, step.block_ids, num_freed):
            row = row_of.get(request_id)
            if row is None:
                if not self._free_rows:
                    self._grow()
                    table = self.block_table
                row = row_of[request_id] = self._free_rows.pop()
            copied = num_copied[row]
            if len(block_ids) < copied:  # freed without a release (a caller's bug): copy the table afresh
                copied = 0
            if len(block_ids) > copied:
                table[row, copied : len(block_ids)] = block_ids[copied:]
                num_copied[row] = len(block_ids)
            if freed > self._num_freed[row]:
                # The ids copied earlier went back to the pool and may belong to another request now: the row
                # says FREED_BLOCK there too, so that a read of them fails instead of reading another's K/V.
                table[row, self._num_freed[row] : freed] = FREED_BLOCK
                self._num_freed[row] = freed
            rows.append(row)
        return np.array(rows, dtype=np.int64)

    def arrays(self, step: StepRequests) -> StepArrays:
        """The step's inputs as host arrays (what `build` turns into tensors; the bucketed decode path of
        worker/model/cuda_graphs.py copies them into its static buffers instead)."""
        num_requests = len(step.request_ids)
        rows = self._rows(step)  # [B]
        num_computed = np.array(step.num_computed, dtype=np.int64)  # [B]
        num_new = np.array(step.num_new, dtype=np.int64)  # [B]
        qsl = np.zeros(num_requests + 1, dtype=np.int64)
        np.cumsum(num_new, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = num_computed + num_new  # [B]
        if num_tokens == num_requests:  # every request brings one token: a decode step
            positions, token_rows = num_computed, rows  # [T]
        else:
            starts = np.repeat(num_computed - qsl[:-1], num_new)  # [T] position - token index
            positions = starts + np.arange(num_tokens)
            token_rows = np.repeat(rows, num_new)
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs] * bs + positions % bs  # [T] int64
        max_seq_len = int(seq_lens.max()) if num_requests else 0
        block_tables = self.block_table[rows, : -(-max_seq_len // bs)]  # [B, max_blocks] int32
        if step.num_logits:  # some request verifies drafts: rows for its last 1 + drafts tokens
            num_logits = np.array(step.num_logits, dtype=np.int64)  # [B]
            firsts = np.cumsum(num_logits) - num_logits  # [B] each request's first row among the S
            within = np.arange(int(num_logits.sum())) - np.repeat(firsts, num_logits)  # [S]
            logits_indices = np.repeat(qsl[1:] - num_logits, num_logits) + within
        else:
            logits_indices = qsl[1:][np.array(step.samples, dtype=bool)] - 1 if num_requests else qsl[:0]  # [S]
        return StepArrays(
            input_ids=np.array(step.input_ids, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=block_tables,
            logits_indices=logits_indices,
            max_query_len=int(num_new.max()) if num_requests else 0,
            max_seq_len=max_seq_len,
        )

    def build(self, step: StepRequests) -> ModelInput:
        return self.tensors(self.arrays(step))

    def tensors(self, a: StepArrays) -> ModelInput:
        """The step's host arrays as tensors on the device."""
        attn = AttentionMetadata(
            slot_mapping=self._tensor("slot_mapping", a.slot_mapping),
            query_start_loc=self._tensor("query_start_loc", a.query_start_loc.astype(np.int32)),
            seq_lens=self._tensor("seq_lens", a.seq_lens.astype(np.int32)),
            block_tables=self._tensor("block_tables", a.block_tables),
            max_query_len=a.max_query_len,
            max_seq_len=a.max_seq_len,
        )
        return ModelInput(
            input_ids=self._tensor("input_ids", a.input_ids),
            positions=self._tensor("positions", a.positions),
            attn=attn,
            logits_indices=self._tensor("logits_indices", a.logits_indices),
        )

    def _tensor(self, name: str, array: np.ndarray) -> torch.Tensor:
        array = np.ascontiguousarray(array)
        if self.device.type == "cpu":
            return torch.from_numpy(array)
        staging = self._pinned.get(name)
        if staging is None or staging.numel() < array.size or staging.dtype != _TORCH_DTYPES[array.dtype.type]:
            size = max(array.size, 2 * (staging.numel() if staging is not None else 1024))
            staging = self._pinned[name] = torch.empty(size, dtype=_TORCH_DTYPES[array.dtype.type]).pin_memory()
        host = staging[: array.size]
        host.numpy()[:] = array.ravel()
        return host.view(array.shape).to(self.device, non_blocking=True)


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}


class Launched:
    """A forward in flight. `logits` [S, V] float32 is its output as the device will hold it; `wait()` returns once
    the device is done with the step. A real runner's forward is already asynchronous on a GPU: its logits tensor
    is there at once, the sampler's operations queue behind the forward and its copy of the tokens to the host is
    the sync, so `wait()` has nothing left to do. The simulated device computes its logits at launch and waits
    out the step's time in `wait()`: the engine draws before waiting, so the draw, which a GPU runs on the device
    after the forward (its bytes are in the simulated step's time), overlaps the simulated step instead of
    following it. `result()`: wait, then the logits."""

    __slots__ = ("logits", "_ready_at", "_wait")

    def __init__(self, logits: torch.Tensor, ready_at: float = 0.0, wait=None) -> None:
        self.logits, self._ready_at, self._wait = logits, ready_at, wait

    def wait(self) -> None:
        if self._wait is not None:
            self._wait(self._ready_at)
            self._wait = None

    def result(self) -> torch.Tensor:
        self.wait()
        return self.logits


class PersistentInputRunner:
    """What every model runner (the real one, the simulated one) does with its `PersistentInput` rows: build a
    step's tensors from them, and free them when requests leave or a new engine takes over."""

    inputs: PersistentInput
    config: object
    """The model's shape (a ModelConfig); only num_layers is read here."""
    kv_window: int | None = None
    """The engine's scheduler gives back KV blocks this far behind each request's next token
    (ModelConfig.kv_window); None keeps every block."""

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def prepare_input(self, step: StepRequests) -> ModelInput:
        return self.input_from(step, self.prepare_arrays(step))

    def prepare_arrays(self, step: StepRequests) -> StepArrays:
        """The step's inputs on the host (block tables, positions, slots): the bulk of preparing a step, which
        async scheduling does while the previous step runs."""
        return self.inputs.arrays(step)

    def input_from(self, step: StepRequests, arrays: StepArrays) -> ModelInput:
        """The prepared arrays (their pending input ids written) as the forward's input on the device."""
        return self.inputs.tensors(arrays)

    def launch(self, model_input: ModelInput) -> Launched:
        """Start the forward; the caller may do host work before `result()` (async scheduling, engine.py)."""
        return Launched(self.execute(model_input))

    def release(self, request_ids: list[str]) -> None:
        self.inputs.release(request_ids)

    def reset(self) -> None:
        """A new engine takes over: no request holds input rows (benchmarks share one runner across engines)."""
        self.inputs.reset()

