"""LoRA adapters in PEFT's format, loaded at run time and applied per adapter segment of a mixed batch.

An adapter is a folder under ENGINE_ADAPTERS_DIR holding `adapter_config.json` and `adapter_model.safetensors`
(what PEFT's `save_pretrained` writes); the folder's name is the adapter's name. Each targeted projection W of the
base gets y = x W^T + s (x A^T) B^T, with A [r, in], B [out, r] and s = lora_alpha / r (lora_alpha / sqrt(r) with
rsLoRA); s is folded into B when the adapter is loaded.

A step's rows are grouped by adapter (as Punica's SGMV groups them into segments). With one adapter in the step,
it runs one shrink matmul (x @ A^T, the targets that share an input fused into one) and one expand over exactly
its rows, and rows of the base model cost nothing. With several, the loaded adapters' weights are stacked (a
LoraStack, built again whenever the loaded set changes): the rows are gathered into one padded block per adapter
and each fused matmul adds its LoRA in five operations (gather, two batched matmuls, a mask of the padding, a
scatter-add), however many adapters share the step. On a CPU or a GPU alike, a mixed batch of small adapters is
bound by the number of operations, not their size: one shrink and one expand per adapter per matmul cost 4x the
operations with 8 adapters. The stack holds a second copy of the loaded adapters' weights.
R = rows of the step's matmuls (tokens, or padded), T = tokens, r = rank, H = hidden size.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from worker.model.config import ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, by their Hugging Face names."""
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
"""Our fused matmuls and the projections whose outputs they hold, in row order: targets of one group read the
same input, so their A matrices are stacked into one shrink."""


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the file and the reason."""


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each targetable projection of the base model."""
    c = config
    return {"q_proj": (c.q_size, c.hidden_size), "k_proj": (c.kv_size, c.hidden_size),
            "v_proj": (c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
            "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size)}


@dataclass(slots=True)
class GroupLora:
    """One adapter's targets within one fused matmul of one layer: a shrink and an expand, whatever the number
    of targets (each a small matmul: in a batch of several adapters their count, not their size, is the cost)."""

    a: torch.Tensor
    """[sum of the targets' r, in]: the targets' A stacked, one shrink for all of them."""
    b: torch.Tensor
    """[sum of the targets' r, hi - lo]: the targets' B scaled and transposed, each in its rank's rows and its
    projection's columns, zero elsewhere: one expand into the fused output's columns lo:hi."""
    lo: int
    hi: int


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scaling: float
    layers: list[dict[str, GroupLora]]
    """Per base layer: fused matmul name ("qkv", "o", "gate_up", "down") -> its LoRA; absent where untargeted."""
    key: str
    """Names the weights' version (name, file size and mtime): the prefix cache keys blocks by it, so a changed
    adapter never meets blocks of its old weights."""
    num_bytes: int = 0


def _fail(path: Path, why: str) -> AdapterError:
    return AdapterError(f"adapter {path}: {why}")


def read_adapter_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise _fail(path, "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise _fail(path, "not a JSON object")
    return config


def _scaling(path: Path, config: dict, max_rank: int) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(path, f"peft_type {config.get('peft_type')!r}; only LORA is served")
    unsupported = {"use_dora": bool(config.get("use_dora")), "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
                   "bias": config.get("bias", "none") not in (None, "none"),
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "rank_pattern": bool(config.get("rank_pattern")), "alpha_pattern": bool(config.get("alpha_pattern")),
                   "lora_bias": bool(config.get("lora_bias")),
                   "trainable_token_indices": bool(config.get("trainable_token_indices")),
                   "layer_replication": bool(config.get("layer_replication"))}
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise _fail(path, f"uses {', '.join(named)}, which this worker does not serve")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise _fail(path, f"r must be a positive integer and lora_alpha a number, got r={rank!r} "
                    f"lora_alpha={alpha!r}")
    if rank > max_rank:
        raise _fail(path, f"rank {rank} is over this worker's limit of {max_rank} (ENGINE_MAX_LORA_RANK)")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _target(name: str, num_layers: int) -> tuple[int, str, str] | None:
    """(layer, projection, "lora_A"/"lora_B") of a PEFT tensor name such as
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight; None for another name."""
    parts = name.split(".")
    if len(parts) < 5 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B") or "layers" not in parts:
        return None
    index = parts.index("layers")
    if index + 1 >= len(parts) or not parts[index + 1].isdigit():
        return None
    layer = int(parts[index + 1])
    return (layer, parts[-3], parts[-2]) if layer < num_layers else None


def load_adapter(folder: Path, config: ModelConfig, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype) -> LoraAdapter:
    """Read and check an adapter folder; raises AdapterError naming the file and what does not fit the base."""
    rank, scaling = _scaling(folder / CONFIG_FILE, read_adapter_config(folder), max_rank)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise _fail(path, "missing (only safetensors weights are served)")
    # A mixture of experts has no single gate/up/down to adapt: its adapters target attention only.
    moe = any(config.is_moe_layer(i) for i in range(config.num_layers))
    shapes = projection_shapes(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _target(name, config.num_layers)
                if target is None:
                    raise _fail(path, f"tensor {name} is not a LoRA A or B of a base layer's projection")
                layer, projection, which = target
                if projection not in shapes or (moe and projection in GROUPS["gate_up"] + GROUPS["down"]):
                    raise _fail(path, f"tensor {name} targets {projection}, which this worker cannot adapt "
                                f"(targets: {', '.join(PROJECTIONS if not moe else PROJECTIONS[:4])})")
                found.setdefault((layer, projection), {})[which] = f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:  # a truncated or garbled file
        if isinstance(exc, AdapterError):
            raise
        raise _fail(path, f"corrupt or unreadable ({type(exc).__name__}: {exc})") from None
    if not found:
        raise _fail(path, "holds no LoRA tensors")
    layers: list[dict[str, GroupLora]] = [{} for _ in range(config.num_layers)]
    num_bytes = 0
    for layer in range(config.num_layers):
        for group, projections in GROUPS.items():
            a_parts, parts, column, row = [], [], 0, 0
            for projection in projections:
                out_size, in_size = shapes[projection]
                pair = found.get((layer, projection))
                if pair is not None:
                    if set(pair) != {"lora_A", "lora_B"}:
                        raise _fail(path, f"layer {layer} {projection} has {', '.join(pair)} but not both A and B")
                    a, b = pair["lora_A"], pair["lora_B"]
                    r = a.shape[0]
                    if a.shape != (r, in_size) or b.shape != (out_size, r) or r > max_rank:
                        raise _fail(path, f"layer {layer} {projection}: lora_A {tuple(a.shape)} and lora_B "
                                    f"{tuple(b.shape)} do not fit the base's ({out_size}, {in_size}) at a rank "
                                    f"of at most {max_rank}")
                    a_parts.append(a)
                    # Scaled in float32 before the cast: one rounding, where PEFT scales the output.
                    b_scaled = (b.float() * scaling).to(device=device, dtype=dtype)
                    parts.append((column, r, row, b_scaled))
                    column += r
                    num_bytes += (a.numel() + b.numel()) * dtype.itemsize
                row += out_size
            if parts:
                a_cat = torch.cat(a_parts).to(device=device, dtype=dtype)  # [sum r, in]
                if not (torch.isfinite(a_cat).all() and all(torch.isfinite(p[3]).all() for p in parts)):
                    raise _fail(path, f"layer {layer} {group}: weights hold NaN or infinity")
                lo, hi = parts[0][2], parts[-1][2] + parts[-1][3].shape[0]
                b_cat = torch.zeros(column, hi - lo, device=device, dtype=dtype)
                for col, r, out_row, b in parts:
                    b_cat[col : col + r, out_row - lo : out_row - lo + b.shape[0]] = b.t()
                layers[layer][group] = GroupLora(a_cat, b_cat, lo, hi)
    return LoraAdapter(folder.name, folder, rank, scaling, layers, _weights_key(folder), num_bytes)


def _weights_key(folder: Path) -> str:
    try:
        stat = (folder / WEIGHTS_FILE).stat()
    except OSError:
        return folder.name
    return f"{folder.name}:{stat.st_size}:{stat.st_mtime_ns}"


@dataclass(slots=True)
class StackedGroup:
    """One fused matmul of one layer, every loaded adapter's LoRA side by side (zeros where one has none)."""

    a: torch.Tensor
    """[S, in, C]: each slot's A transposed, its rank columns padded with zeros to the widest, C."""
    b: torch.Tensor
    """[S, C, hi - lo]: each slot's B in its rank rows and its targets' columns, zero elsewhere."""
    lo: int
    hi: int


class LoraStack:
    """The loaded adapters' weights stacked by slot, per layer and fused matmul, for steps that mix adapters."""

    def __init__(self, adapters: list[LoraAdapter], num_layers: int) -> None:
        self.slot_of = {id(adapter): slot for slot, adapter in enumerate(adapters)}
        self.num_slots = len(adapters)
        self.dtype: torch.dtype | None = None
        self.layers: list[dict[str, StackedGroup]] = []
        for layer in range(num_layers):
            groups = {}
            for group in GROUPS:
                parts = [(slot, adapter.layers[layer][group]) for slot, adapter in enumerate(adapters)
                         if group in adapter.layers[layer]]
                if not parts:
                    continue
                first = parts[0][1].a
                self.dtype = first.dtype
                lo, hi = min(g.lo for _, g in parts), max(g.hi for _, g in parts)
                width = max(g.a.shape[0] for _, g in parts)
                a = torch.zeros(len(adapters), first.shape[1], width, device=first.device, dtype=first.dtype)
                b = torch.zeros(len(adapters), width, hi - lo, device=first.device, dtype=first.dtype)
                for slot, g in parts:
                    r = g.a.shape[0]
                    a[slot, :, :r] = g.a.t()
                    b[slot, :r, g.lo - lo : g.hi - lo] = g.b
                groups[group] = StackedGroup(a, b, lo, hi)
            self.layers.append(groups)


class StackedRows:
    """A step's rows by slot of a LoraStack, in the layout its path reads. The torch path: `index` [S * L] (L =
    the most rows of any slot; padding points at row 0) and `valid` [S, L, 1] (1 for a real row, 0 for
    padding). The Triton kernel (kernels/lora.py), when `use_kernel`: `slots` [T] (each token row's slot, -1 for
    the base). The other path's fields are None."""

    __slots__ = ("stack", "index", "valid", "width", "slots", "use_kernel", "_padded")

    def __init__(self, stack: LoraStack, index: torch.Tensor | None, valid: torch.Tensor | None, width: int,
                 slots: torch.Tensor | None, use_kernel: bool) -> None:
        self.stack, self.index, self.valid, self.width = stack, index, valid, width
        self.slots, self.use_kernel = slots, use_kernel
        self._padded: torch.Tensor | None = None

    def slots_for(self, num_rows: int) -> torch.Tensor:
        """`slots` for a step whose matmuls run `num_rows` rows (row buckets pad the tokens): padding is the
        base's."""
        if num_rows == self.slots.shape[0]:
            return self.slots
        if self._padded is None or self._padded.shape[0] != num_rows:
            self._padded = torch.full((num_rows,), -1, dtype=torch.int64, device=self.slots.device)
            self._padded[: self.slots.shape[0]] = self.slots
        return self._padded


class LoraStep:
    """One step's rows grouped by adapter: for each adapter present, the token rows that use it."""

    __slots__ = ("segments", "stacked")

    def __init__(self, segments: list[tuple[LoraAdapter, slice | torch.Tensor]],
                 stacked: StackedRows | None = None) -> None:
        self.segments = segments
        """(adapter, its rows: a slice where they are contiguous, else an index tensor [n])."""
        self.stacked = stacked
        """Set when several adapters share the step and every one is in the stack: the layers use it."""

    @classmethod
    def build(cls, adapters: list[LoraAdapter | None], num_new: np.ndarray,
              device: torch.device, stack: LoraStack | None = None, use_kernel: bool = False) -> LoraStep | None:
        """`adapters` [B] (None for the base), `num_new` [B] tokens of each request this step; `stack`: the
        loaded adapters stacked, used when the step holds more than one of them; `use_kernel`: stacked steps
        run kernels/lora.py's Triton kernel (the runner's Triton attention backend) rather than torch."""
        if all(a is None for a in adapters):
            return None
        starts = np.zeros(len(adapters) + 1, dtype=np.int64)
        np.cumsum(num_new, out=starts[1:])
        rows_of: dict[int, list[int]] = {}
        by_id: dict[int, LoraAdapter] = {}
        for b, adapter in enumerate(adapters):
            if adapter is not None:
                rows_of.setdefault(id(adapter), []).append(b)
                by_id[id(adapter)] = adapter
        segments = []
        for key, requests in rows_of.items():
            if requests[-1] - requests[0] + 1 == len(requests):  # adjacent requests: contiguous rows
                rows: slice | torch.Tensor = slice(int(starts[requests[0]]), int(starts[requests[-1] + 1]))
            else:
                index = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in requests])
                rows = torch.from_numpy(index).to(device)
            segments.append((by_id[key], rows))
        stacked = None
        if stack is not None and len(rows_of) > 1 and all(key in stack.slot_of for key in rows_of):
            stacked = _stacked_rows(stack, rows_of, starts, device, adapters, num_new, use_kernel)
        return cls(segments, stacked)

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)


def _stacked_rows(stack: LoraStack, rows_of: dict[int, list[int]], starts: np.ndarray, device: torch.device,
                  adapters: list[LoraAdapter | None], num_new: np.ndarray, use_kernel: bool) -> StackedRows:
    """The layout the step's path reads: each token row's slot for the kernel, or the rows gathered by slot
    for the torch path; the other is not built."""
    if use_kernel:
        slot_of_request = np.array([-1 if a is None else stack.slot_of[id(a)] for a in adapters], dtype=np.int64)
        slots = torch.from_numpy(np.repeat(slot_of_request, num_new)).to(device)
        return StackedRows(stack, None, None, 0, slots, True)
    rows_by_slot: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * stack.num_slots
    for key, requests in rows_of.items():
        rows_by_slot[stack.slot_of[key]] = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in requests])
    width = max(len(rows) for rows in rows_by_slot)
    index = np.zeros((stack.num_slots, width), dtype=np.int64)
    valid = np.zeros((stack.num_slots, width, 1), dtype=np.float32)
    for slot, rows in enumerate(rows_by_slot):
        index[slot, : len(rows)] = rows
        valid[slot, : len(rows)] = 1.0
    return StackedRows(stack, torch.from_numpy(index.reshape(-1)).to(device),
                       torch.from_numpy(valid).to(device=device, dtype=stack.dtype), width, None, False)


class LayerLora:
    """A step's LoRA at one layer: what the layer's matmuls add to their outputs."""

    __slots__ = ("step", "index")

    def __init__(self, step: LoraStep, index: int) -> None:
        self.step, self.index = step, index

    def add(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [R, N] += each segment's x[rows] [n, in] @ A^T @ B^T, into the rows of `group`'s targets."""
        stacked = self.step.stacked
        if stacked is not None:
            lora = stacked.stack.layers[self.index].get(group)
            if lora is None:
                return out
            if stacked.use_kernel:
                from kernels.lora import add_lora

                add_lora(x, stacked.slots_for(x.shape[0]), lora.a, lora.b, out[:, lora.lo : lora.hi])
                return out
            gathered = x[stacked.index].view(stacked.stack.num_slots, stacked.width, x.shape[1])  # [S, L, in]
            expanded = torch.bmm(torch.bmm(gathered, lora.a), lora.b)  # [S, L, hi - lo]
            expanded.mul_(stacked.valid)
            out[:, lora.lo : lora.hi].index_add_(0, stacked.index, expanded.view(-1, lora.hi - lora.lo))
            return out
        for adapter, rows in self.step.segments:
            lora = adapter.layers[self.index].get(group)
            if lora is None:
                continue
            expanded = (x[rows] @ lora.a.t()) @ lora.b  # [n, hi - lo]
            if isinstance(rows, slice):
                out[rows, lora.lo : lora.hi] += expanded
            else:
                out[:, lora.lo : lora.hi].index_add_(0, rows, expanded)
        return out


class AdapterRegistry:
    """The adapters of one folder: which exist, which are loaded (at most `max_loaded`, least recently used
    evicted first, never one a running request uses), and the refusals of those that cannot be served."""

    def __init__(self, folder: str | Path, config: ModelConfig, max_loaded: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.folder = Path(folder)
        self.config, self.max_loaded, self.max_rank = config, max_loaded, max_rank
        self.device, self.dtype = device, dtype
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        """Name -> adapter, least recently used first."""
        self._refused: dict[str, tuple[tuple, str]] = {}
        """Name -> (the files' (size, mtime) when refused, why): refused again at once until the files change."""
        self.num_loads = 0
        self.num_evictions = 0
        self._listed: tuple[float, list[str]] | None = None
        self._stack: LoraStack | None = None
        """The loaded adapters stacked (LoraStack); None until a mixed step asks, and again after each change."""

    def stack(self) -> LoraStack | None:
        """The loaded adapters stacked by slot, built on first use after the loaded set changed; None when at
        most one is loaded (a step then holds one adapter at most)."""
        if len(self.loaded) < 2:
            return None
        if self._stack is None:
            self._stack = LoraStack(list(self.loaded.values()), self.config.num_layers)
        return self._stack

    def available(self) -> list[str]:
        """Names of the folders that hold an adapter config, sorted; listed again at most once a second (the
        engine's stats, which carry it, are read often)."""
        now = time.monotonic()
        if self._listed is None or now - self._listed[0] >= 1.0:
            try:
                names = sorted(p.name for p in self.folder.iterdir() if (p / CONFIG_FILE).is_file())
            except OSError:
                names = []
            self._listed = (now, names)
        return self._listed[1]

    def exists(self, name: str) -> bool:
        return _valid_name(name) and (self.folder / name / CONFIG_FILE).is_file()

    def key(self, name: str) -> str:
        """The version of an adapter's weights (LoraAdapter.key), loaded or not."""
        adapter = self.loaded.get(name)
        return adapter.key if adapter is not None else _weights_key(self.folder / name)

    def _stamp(self, name: str) -> tuple:
        stamps = []
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            try:
                stat = (self.folder / name / file).stat()
                stamps.append((stat.st_size, stat.st_mtime_ns))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def get(self, name: str, in_use: Iterable[str] = (), wanted: Iterable[str] = (),
            evict: bool = True) -> LoraAdapter | None:
        """The loaded adapter `name`, loading it where it is not. With `max_loaded` loaded, one outside `in_use`
        (adapters of running requests) is evicted: the least recently used of those outside `wanted` (adapters
        that waiting requests name, which would load again as soon as they run), else the least recently used
        of all; without `evict`, nothing is and None comes back. Raises AdapterError for an adapter that cannot
        be served, and RuntimeError when every loaded adapter is in use."""
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
            return adapter
        if not self.exists(name):
            raise AdapterError(f"unknown adapter {name!r}: no {name}/{CONFIG_FILE} under {self.folder}")
        stamp = self._stamp(name)
        refused = self._refused.get(name)
        if refused is not None and refused[0] == stamp:
            raise AdapterError(refused[1])
        if len(self.loaded) >= self.max_loaded:
            if not evict:
                return None
            busy, soon = set(in_use), set(wanted)
            victim = next((n for n in self.loaded if n not in busy and n not in soon), None) or next(
                (n for n in self.loaded if n not in busy), None)
            if victim is None:
                raise RuntimeError(f"all {self.max_loaded} loaded adapters are in use (ENGINE_MAX_LORAS)")
            del self.loaded[victim]
            self._stack = None
            self.num_evictions += 1
            log.info("adapter %s evicted (least recently used%s; ENGINE_MAX_LORAS=%d)", victim,
                     " of those no waiting request names" if victim not in soon else "", self.max_loaded)
        start = time.perf_counter()
        try:
            adapter = load_adapter(self.folder / name, self.config, self.max_rank, self.device, self.dtype)
        except AdapterError as exc:
            self._refused[name] = (stamp, str(exc))
            log.warning("%s", exc)
            raise
        self._refused.pop(name, None)
        self.loaded[name] = adapter
        self._stack = None
        self.num_loads += 1
        log.info("adapter %s loaded: rank %d, %.1f MiB, %.0f ms", name, adapter.rank, adapter.num_bytes / 2**20,
                 (time.perf_counter() - start) * 1000)
        return adapter


def _valid_name(name: str) -> bool:
    """A folder name directly under the adapters folder (no path separators, no . or ..)."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name
