"""Next-token selection for a whole step at once: greedy argmax, or temperature -> top-k -> top-p -> a seeded draw.

Batched: a fixed number of tensor operations per step, whatever the number of rows and their parameters (the
sampler this replaces looped over rows: 80-130 µs per sampled request and step on the CPU, and a kernel launch
per operation and row on a GPU). Only the final token ids cross to the host, in one transfer.

Reproducibility, counter-based. A sampled row draws with one uniform number u = hash(seed, counter), the
counter being the index of the token being generated in its request (the engine passes num_output_tokens).
There is no generator state: the same seed gives the same tokens whatever else shares the batch and in whatever
row order, after a preemption, and when the request is replayed from scratch; and a request's k-th token never
depends on how many draws came before it. Every operation works within a row (elementwise arithmetic, max,
selection, row-wise cumulative sums): no reduction whose rounding could depend on how a kernel splits the batch.
A row without a seed draws u from torch's global generator (not reproducible; the engine seeds every request).

The draw, with weights w = exp((logit - row max) / T):
- no top-k, no top-p: in vocabulary order, the first token whose cumulative weight exceeds u · sum(w);
- with a cut: tokens ranked by logit, descending, equal logits by token id; top-k keeps the first k; top-p
  keeps the shortest prefix (of those) whose weight reaches top_p times the mass it is measured against (the
  top k with top-k, the whole row without); the drawn rank is the first whose cumulative weight exceeds u times
  the kept weight, and the token is the one at that rank.
A token of weight 0 (cut, masked, or underflowed) is never drawn: its interval is empty, and the target is kept
strictly below the total. Ties are broken by token id, so a cut keeps exactly k tokens and which ones does not
depend on a kernel's tie order. For top-p without top-k the nucleus is looked for among the top 256, then the top
4096 tokens before sorting the whole vocabulary.

Every positive temperature is defined: the row max is subtracted before dividing by max(T, smallest normal
float), so a temperature just above 0 sharpens to the argmax instead of overflowing to inf and a NaN softmax.

On the CPU the draw runs in numpy (worker/model/sampler_numpy.py, same definition, several times faster).

The draw used to be an exponential race with a per-request torch.Generator, row by row; a given seed now gives
other tokens than it did then (the same ones in any batch, as before).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from worker.model import penalties, sampler_numpy, token_mask

NUCLEUS_TIERS = (256, 4096)
"""Top-p without top-k: candidates tried before the whole vocabulary (a tier is used when it is at most 1/8 of
the vocabulary; each try costs a device sync on a GPU)."""
_MIN_DIVISOR = torch.finfo(torch.float32).tiny
"""Smallest normal float32. A smaller temperature would round to 0 (0/0 = NaN at the max) or, on a GPU,
whose division by a scalar multiplies by its reciprocal, give 1/T = inf (0*inf = NaN)."""
_U64 = (1 << 64) - 1
NUMPY_ON_CPU = True
"""Logits on the CPU are drawn from in numpy and their argmax taken there. Tests turn it off to run the torch
operations a GPU uses on CPU tensors."""


@dataclass(slots=True, frozen=True)
class RowSampling:
    """How one logits row picks its token. The engine derives it from a request's validated sampling
    parameters, so the model side depends on no engine type."""

    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""
    seed: int | None = None
    """Reduced modulo 2**64. None: draws from torch's global generator (not reproducible)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """1 means none. Penalties: worker/model/penalties.py."""
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    """Masked while the row's counter (its number of output tokens) is below min_tokens: EOS and stop ids."""
    logprobs: bool = False
    """Return the chosen token's log-probability (and top_logprobs alternatives) with it."""
    top_logprobs: int = 0
    uses_history: bool = field(init=False, default=False)
    """Penalties need the request's prompt and output token ids."""
    plain: bool = field(init=False, default=True)
    """No penalty, no min_tokens, no logprobs: the sampler's fast path."""
    greedy: bool = field(init=False, default=True)
    """Temperature 0, or top_k 1 (one candidate: the argmax, without spending a draw)."""
    draw_row: tuple = field(init=False, default=(), compare=False, repr=False)
    """(temperature, top_k, top_p, the seed's half of hash(seed, counter) or None): the row's entries in a step's
    draw arrays, worked out once per request rather than at every step that rebuilds them."""

    def __post_init__(self) -> None:
        history = self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        object.__setattr__(self, "uses_history", history)
        object.__setattr__(self, "plain", not (history or self.min_tokens > 0 or self.logprobs))
        object.__setattr__(self, "greedy", self.temperature <= 0.0 or self.top_k == 1)
        seed_hash = None if self.seed is None else _seed_hash(self.seed)
        object.__setattr__(self, "draw_row", (self.temperature, self.top_k, self.top_p, seed_hash))


class SamplingPlan(NamedTuple):
    """Which rows of a step need what, worked out from its RowSampling alone (kept with the step's parameters,
    `_StepParams`)."""

    special: list[int]
    """Rows that are not `plain` (penalties, min_tokens, logprobs)."""
    sampled: list[int]
    """Rows that draw (not greedy)."""


class SampledStep(NamedTuple):
    token_ids: list[int]
    """One per logits row."""
    logprobs: dict[int, tuple[float, list[int], list[float]]]
    """For the rows that asked, by row: (the chosen token's log-probability, the top_logprobs most likely token
    ids, their log-probabilities), from log_softmax of the row's logits after penalties and min_tokens masking
    and before temperature, top-k and top-p (the model's distribution as processed, not the one drawn from)."""


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (Steele, Lea, Flood 2014): a bijection of uint64 with full avalanche."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def counter_uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:  # [n] float64 in [0, 1)
    """u = hash(seed, counter): independent uniforms per (seed, counter), 53 random bits each."""
    return _uniforms_of(_seed_hashes(seeds), counters)


def _seed_hash(seed: int) -> int:
    """_seed_hashes of one seed, in Python ints (the same bits: every step is reduced modulo 2**64)."""
    z = ((seed & _U64) + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _seed_hashes(seeds: Sequence[int]) -> np.ndarray:  # [n] uint64: the half of hash(seed, counter) a seed fixes
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2**64, as intended
        return _mix64(_u64(seeds) + np.uint64(0x9E3779B97F4A7C15))


def _uniforms_of(seed_hashes: np.ndarray, counters: Sequence[int]) -> np.ndarray:  # [n] float64 in [0, 1)
    with np.errstate(over="ignore"):
        z = _mix64(seed_hashes + _u64(counters) * np.uint64(0xD1B54A32D192ED03))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _u64(values: Sequence[int]) -> np.ndarray:
    try:
        return np.array(values, dtype=np.uint64)
    except OverflowError:  # negative, or 2**64 and above
        return np.array([x & _U64 for x in values], dtype=np.uint64)


def _on_numpy(x: torch.Tensor) -> bool:
    return NUMPY_ON_CPU and x.device.type == "cpu"


def _argmax(logits: torch.Tensor) -> torch.Tensor:  # [S] int64
    if _on_numpy(logits):
        # torch's CPU argmax is ~15x slower than numpy's vectorized one at [256, 2048]; both take the first max.
        return torch.from_numpy(logits.float().numpy().argmax(-1).astype(np.int64))
    return logits.argmax(dim=-1)


class _StepParams:
    """What a step's RowSampling list gives the draw, worked out once and kept while the same requests sample in
    the same rows, as vLLM's persistent input batch keeps its sampling parameters between steps: at 256 rows,
    reading them out of the objects again cost ~0.25 ms a step on the CPU, as much host work as the scheduler's
    update. Kept while the step's RowSampling objects are the very ones of the last step, in the same order;
    otherwise rebuilt from each request's `draw_row` (a request finishing or starting, as most steps of a busy
    engine have one)."""

    __slots__ = ("key", "plan", "picked", "temperature", "top_k", "top_p", "seed_hashes", "_on_device")

    def __init__(self, key: tuple[RowSampling, ...]) -> None:
        self.key = key
        self.plan = SamplingPlan([i for i, p in enumerate(key) if not p.plain],
                                 [i for i, p in enumerate(key) if not p.greedy])
        picked = self.picked = [key[i] for i in self.plan.sampled]
        temperature, top_k, top_p, seed_hashes = zip(*[p.draw_row for p in picked]) if picked else ((),) * 4
        self.temperature = np.array(temperature, dtype=np.float32)  # [R]
        self.top_k = np.array(top_k, dtype=np.int64)  # [R]
        self.top_p = np.array(top_p, dtype=np.float64)  # [R]
        self.seed_hashes = None if None in seed_hashes else np.array(seed_hashes, dtype=np.uint64)  # [R]
        self._on_device: tuple[tuple[int, torch.device], _DrawParams] | None = None
        for kept in (self.temperature, self.top_k, self.top_p, self.seed_hashes):
            if kept is not None:
                kept.flags.writeable = False  # shared by every step that reuses them

    def draw_params(self, vocab: int, device: torch.device) -> "_DrawParams":
        """The torch draw's parameters on `device` (what a GPU runs), made once."""
        if self._on_device is None or self._on_device[0] != (vocab, device):
            self._on_device = ((vocab, device), _draw_params(self.picked, vocab, device))
        return self._on_device[1]

    def uniforms(self, counters: list[int]) -> np.ndarray:  # [R] float64, one per picked row
        if self.seed_hashes is not None:
            return _uniforms_of(self.seed_hashes, counters)
        return _uniforms(self.picked, counters)


class Sampler:
    def __init__(self) -> None:
        self._scratch = sampler_numpy.Scratch()
        self._step_params: _StepParams | None = None

    def reserve(self, rows: int, vocab: int) -> None:
        """The CPU draw's work arrays at their largest now (sampler_numpy.Scratch.reserve)."""
        self._scratch.reserve(rows, vocab)

    def _params_of(self, params: Sequence[RowSampling]) -> _StepParams:
        kept = self._step_params
        # By identity: a dataclass __eq__ per row costs more than rebuilding when rows have shifted.
        if kept is None or len(kept.key) != len(params) or not all(map(operator.is_, kept.key, params)):
            kept = self._step_params = _StepParams(tuple(params))
        return kept

    def sample(
        self,
        logits: torch.Tensor,  # [S, V] float32
        params: Sequence[RowSampling],
        counters: Sequence[int] | None = None,
        history: penalties.History | None = None,
    ) -> list[int]:
        """One token id per row. counters[i]: the index of the token row i generates in its request (the
        draw's counter and min_tokens' count; default 0). history(i): the prompt and output token ids of row i,
        asked only for rows with penalties. Rows with penalties or min_tokens have their logits changed in
        place."""
        return self.sample_step(logits, params, counters, history).token_ids

    def sample_step(
        self,
        logits: torch.Tensor,  # [S, V] float32
        params: Sequence[RowSampling],
        counters: Sequence[int] | None = None,
        history: penalties.History | None = None,
        mask: token_mask.TokenMask | None = None,
    ) -> SampledStep:
        """`sample`, with the log-probabilities of the rows that ask for them. `mask`: the grammar masks of the
        constrained rows (structured output), applied first, in place."""
        num_rows = logits.shape[0]
        if len(params) != num_rows or (counters is not None and len(counters) != num_rows):
            raise ValueError(f"{num_rows} logits rows but {len(params)} params and "
                             f"{None if counters is None else len(counters)} counters")
        if mask is not None and mask.rows:
            logits = logits.float().contiguous()  # no copy when it already is
            on_numpy = _on_numpy(logits)
            token_mask.apply(logits, mask, on_numpy, self._scratch.mask_row(logits.shape[1]) if on_numpy else None)
        step = self._params_of(params)
        special, sampled_rows = step.plan
        if not special:
            return SampledStep(self._pick(logits, step, counters, sampled_rows), {})
        logits = logits.float().contiguous()  # no copy when it already is
        adjusted = [i for i in special if params[i].uses_history or params[i].min_tokens > 0]
        if adjusted:
            penalties.apply(logits, adjusted, [params[i] for i in adjusted], counters, history, _on_numpy(logits))
        token_ids = self._pick(logits, step, counters, sampled_rows)
        wanted = [i for i in special if params[i].logprobs]
        if not wanted:
            return SampledStep(token_ids, {})
        return SampledStep(token_ids, _logprobs(logits, wanted, [token_ids[i] for i in wanted],
                                                [params[i].top_logprobs for i in wanted]))

    def _pick(self, logits: torch.Tensor, step: _StepParams, counters: Sequence[int] | None,
              sampled_rows: list[int]) -> list[int]:
        num_rows = logits.shape[0]
        if not sampled_rows:
            return _argmax(logits).tolist()
        picked = step.picked
        if counters is None:
            counters = [0] * len(picked)
        elif len(sampled_rows) != num_rows:
            counters = [counters[i] for i in sampled_rows]
        u = step.uniforms(counters)
        if _on_numpy(logits):
            a = logits.float().numpy()
            drawn = torch.from_numpy(sampler_numpy.draw(
                a if len(sampled_rows) == num_rows else a[sampled_rows],
                step.temperature, step.top_k, step.top_p, u, NUCLEUS_TIERS, self._scratch,
            ))
        else:
            x = logits if len(sampled_rows) == num_rows else logits.index_select(
                0, torch.tensor(sampled_rows, device=logits.device))
            drawn = _draw(x.float(), step.draw_params(logits.shape[1], logits.device),
                          torch.from_numpy(u).to(logits.device))  # [R]
        if len(sampled_rows) == num_rows:
            return drawn.tolist()
        tokens = _argmax(logits)
        tokens[torch.tensor(sampled_rows, device=tokens.device)] = drawn.to(tokens.device)
        return tokens.tolist()


def _uniforms(params: list[RowSampling], counters: list[int]) -> np.ndarray:  # [R] float64
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    if len(seeded) == len(params):
        return counter_uniforms([p.seed for p in params], counters)
    u = torch.rand(len(params), dtype=torch.float64).numpy()
    if seeded:
        u[seeded] = counter_uniforms([params[i].seed for i in seeded], [counters[i] for i in seeded])
    return u


def _logprobs(
    logits: torch.Tensor,  # [S, V] float32, after penalties
    rows: list[int],
    token_ids: list[int],
    top: list[int],
) -> dict[int, tuple[float, list[int], list[float]]]:
    """log_softmax of the given rows at their chosen tokens, and their top alternatives (by log-probability,
    descending; equal ones by token id). -inf (a masked token) comes back as float32's lowest finite value, as
    JSON has no infinities."""
    k = min(max(top), logits.shape[1])
    floor = float(np.finfo(np.float32).min)
    if _on_numpy(logits):
        a = logits.numpy()[rows]  # [L, V] a copy
        m = a.max(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            lse = m + np.log(np.exp(a - m).sum(axis=1, keepdims=True))  # [L, 1]
        chosen = a[np.arange(len(rows)), token_ids] - lse[:, 0]  # [L]
        if k:
            part = np.argpartition(-a, k - 1, axis=1)[:, :k]  # [L, k] the k largest, unordered
            values = np.take_along_axis(a, part, axis=1)
            order = np.lexsort((part, -values), axis=-1)  # by value descending, then token id
            top_ids = np.take_along_axis(part, order, axis=1)
            top_lps = np.take_along_axis(values, order, axis=1) - lse
    else:
        x = torch.log_softmax(logits.index_select(0, torch.tensor(rows, device=logits.device)), dim=-1)  # [L, V]
        chosen_t = x.gather(1, torch.tensor(token_ids, device=x.device)[:, None])[:, 0]
        chosen = chosen_t.cpu().numpy()
        if k:
            top_t = x.topk(k, dim=-1)  # sorted, descending
            top_ids, top_lps = top_t.indices.cpu().numpy(), top_t.values.cpu().numpy()
    chosen = np.maximum(chosen, floor).tolist()
    if not k:
        return {row: (chosen[j], [], []) for j, row in enumerate(rows)}
    top_ids, top_lps = top_ids.tolist(), np.maximum(top_lps, floor).tolist()
    return {row: (chosen[j], top_ids[j][:n], top_lps[j][:n]) for j, (row, n) in enumerate(zip(rows, top))}


# ---- the draw in torch (any device; what a GPU runs) ------------------------------------------------------


class _CutParams(NamedTuple):
    """The top-k/top-p rows' parameters as tensors on the logits' device."""

    ks: torch.Tensor  # [Rc] int64, 0: no top-k
    max_k: int
    top_p: torch.Tensor  # [Rc] float64, inf: no top-p
    any_nucleus_only: bool
    """Some row has top-p without top-k (its nucleus is measured against the whole row's mass)."""


class _DrawParams(NamedTuple):
    """A step's draw parameters on the logits' device, built once per `_StepParams` and device: on a GPU each
    tensor made from a Python list is a host-to-device copy the host waits for."""

    divisor: torch.Tensor  # [R, 1] float32
    groups: list[tuple[bool, torch.Tensor | None, _CutParams | None]]
    """(cut, the group's rows or None for all rows, its top-k/top-p parameters when cut): whole-row draws first."""


def _draw_params(params: list[RowSampling], vocab: int, device: torch.device) -> _DrawParams:
    divisor = torch.tensor([max(p.temperature, _MIN_DIVISOR) for p in params], device=device)[:, None]  # [R, 1]
    cut = [0 < p.top_k < vocab or p.top_p < 1.0 for p in params]
    groups = []
    for want in (False, True):
        rows = [i for i, c in enumerate(cut) if c == want]
        if not rows:
            continue
        index = None if len(rows) == len(params) else torch.tensor(rows, device=device)
        groups.append((want, index, _cut_params([params[i] for i in rows], vocab, device) if want else None))
    return _DrawParams(divisor, groups)


def _cut_params(params: list[RowSampling], vocab: int, device: torch.device) -> _CutParams:
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    return _CutParams(
        ks=torch.tensor(ks, device=device),
        max_k=max(ks),
        top_p=torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device,
                           dtype=torch.float64),
        any_nucleus_only=any(p.top_p < 1.0 and k == 0 for p, k in zip(params, ks)),
    )


def _draw(
    x: torch.Tensor,  # [R, V] float32 logits of the rows that sample
    params: _DrawParams,
    u: torch.Tensor,  # [R] float64
) -> torch.Tensor:  # [R] int64 token ids
    tokens = None
    for cut, index, cut_params in params.groups:
        if index is None:
            return _draw_cut_rows(x, params.divisor, cut_params, u) if cut else _draw_whole_rows(x, params.divisor, u)
        if tokens is None:
            tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        group_x, divisor, group_u = (t.index_select(0, index) for t in (x, params.divisor, u))
        tokens[index] = (_draw_cut_rows(group_x, divisor, cut_params, group_u) if cut
                         else _draw_whole_rows(group_x, divisor, group_u))
    return tokens


def _scaled(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    # With the max at 0 every quotient is <= 0: none reaches +inf, the max stays exactly 0, and the others may
    # overflow to -inf (weight 0), as they should this cold. Masked (-inf) logits stay -inf.
    return (x - x.amax(dim=-1, keepdim=True)) / divisor


def _draw_whole_rows(x, divisor, u) -> torch.Tensor:
    """Vocabulary order: the first token whose cumulative weight exceeds u · total."""
    cdf = _scaled(x, divisor).exp().cumsum(dim=-1)  # [R, V] non-decreasing
    total = cdf[:, -1:]  # [R, 1] >= 1
    target = torch.minimum(u.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _draw_cut_rows(x, divisor, cut: _CutParams, u) -> torch.Tensor:
    """Rank order (logit descending, then token id): keep the first n, draw a rank, find its token."""
    rows, vocab = x.shape
    device = x.device
    ks, max_k, top_p = cut.ks, cut.max_k, cut.top_p  # [R], int, [R]
    nucleus_only = (ks == 0) & ~torch.isinf(top_p)
    row_max = x.amax(dim=-1, keepdim=True)
    row_mass = None
    tiers = [max_k]
    if cut.any_nucleus_only:
        tiers = [t for t in NUCLEUS_TIERS if 8 * t <= vocab] + [vocab]
        # Top-p without top-k measures the nucleus against the whole row's mass.
        row_mass = _scaled(x, divisor).exp().to(torch.float64).cumsum(dim=-1)[:, -1]
    for width in tiers:
        width = max(width, max_k)
        ordered = x.topk(width).values if width < vocab else x.sort(dim=-1, descending=True).values  # [R, K]
        weights = ((ordered - row_max) / divisor).to(torch.float64).exp()  # [R, K] the first is 1
        in_top_k = torch.arange(width, device=device)[None, :] < torch.where(ks > 0, ks, width)[:, None]
        weights = weights.masked_fill(~in_top_k, 0.0)  # top-k first
        cumulative = weights.cumsum(dim=-1)  # [R, K]
        total = cumulative[:, -1] if row_mass is None else torch.where(nucleus_only, row_mass, cumulative[:, -1])
        if width < vocab and row_mass is not None:
            # A top-p-only row's nucleus must end inside this tier, or a wider tier decides (a sync).
            if not bool((~nucleus_only | (cumulative[:, -1] >= top_p * total)).all()):
                continue
        # Top-p: the shortest prefix whose mass reaches p (>= 1 token: nothing comes before the first).
        reach = top_p * total
        num_kept = torch.minimum(torch.where(ks > 0, ks, width), ((cumulative - weights) < reach[:, None]).sum(-1))
        num_kept = num_kept.clamp(min=1)  # a top_p so small that p * total underflows still keeps the first
        kept_mass = cumulative.gather(1, (num_kept - 1)[:, None]).squeeze(1)
        target = torch.minimum(u * kept_mass, torch.nextafter(kept_mass, torch.zeros_like(kept_mass)))
        rank = (cumulative <= target[:, None]).sum(dim=-1)  # first rank whose cumulative weight exceeds it
        value = ordered.gather(1, rank[:, None])  # [R, 1]
        before = rank - (ordered > value).sum(dim=-1)  # [R] equal logits ranked before it
        equal = x == value  # [R, V]
        # The (before+1)-th token holding that logit in vocabulary order.
        at = equal & (equal.to(torch.int32).cumsum(dim=-1) == (before + 1)[:, None].to(torch.int32))
        return at.to(torch.uint8).argmax(dim=-1)
    raise AssertionError("the last tier is the whole vocabulary")
