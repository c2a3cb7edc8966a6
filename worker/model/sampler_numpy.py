"""The sampler's draw for logits on the CPU, in numpy. Same definition and, up to float rounding, the same
tokens as the torch draw in worker/model/sampler.py (whose docstring defines it).

Why numpy: torch's CPU top-k and sort are 10-20x slower than numpy's vectorized ones at [256, 2048]. Every
operation here stays within a row, and gives a row the same result wherever it sits in the batch. The one
exception to numpy is `_exp`: numpy's float32 exp is 2.5-5x slower than torch's here (1-2 ms against 0.4 ms at
[256, 2048] on an AVX2 CPU), and torch's rounds each element the same wherever it sits (tests/model/
test_sampler.py checks that a row's exp is bit-identical alone, at any offset, in batches of any size, under
1, 2 and 7 threads, for widths that are and are not multiples of the vector width).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.model import token_mask

_TINY = np.float32(np.finfo(np.float32).tiny)


class Scratch:
    """Work arrays kept from one step to the next: a fresh multi-megabyte array costs page faults at every step
    (about 0.1 ms per 2 MB here), as the allocator hands such blocks back to the system when they are freed."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        size = int(np.prod(shape))
        array = self._arrays.get(name)
        if array is None or array.size < size or array.dtype != dtype:
            array = self._arrays[name] = np.empty(size, dtype=dtype)
        return array[:size].reshape(shape)

    def reserve(self, rows: int, vocab: int) -> None:
        """Make and touch every work array at its largest (`rows` x `vocab`), so a worker's memory is at its
        high-water mark from the start rather than rising the first time a burst fills the batch."""
        for name, dtype in _ARRAYS:
            self.get(name, (rows, vocab), dtype).fill(0)
        self.mask_row(vocab).fill(0)

    def mask_row(self, vocab: int) -> np.ndarray:
        """The one row grammar masks are applied through (token_mask.apply)."""
        return self.get(MASK_ROW, (token_mask.row_scratch_size(vocab),), np.uint32)


_ARRAYS = (("weights", np.float32), ("keys", np.int32), ("equal", bool))
"""The work arrays `draw` asks Scratch for, each [rows, vocab]."""
MASK_ROW = "mask_row"
"""The name of `Scratch.mask_row`'s array."""


def draw(
    logits: np.ndarray,  # [R, V] float32
    temperature: np.ndarray,  # [R]
    top_k: np.ndarray,  # [R] int64, 0: no cut
    top_p: np.ndarray,  # [R] float64, 1: no cut
    u: np.ndarray,  # [R] float64 in [0, 1)
    nucleus_tiers: tuple[int, ...],
    scratch: Scratch | None = None,
) -> np.ndarray:  # [R] int64 token ids
    scratch = scratch or Scratch()
    rows, vocab = logits.shape
    k = np.where((top_k > 0) & (top_k < vocab), top_k, 0)
    cut = (k > 0) | (top_p < 1.0)
    tokens = np.empty(rows, dtype=np.int64)
    divisor = np.maximum(temperature.astype(np.float32), _TINY)[:, None]  # [R, 1]
    with np.errstate(over="ignore"):  # logits / a tiny temperature: -inf on purpose
        for selected, fn in ((~cut, _draw_whole_rows), (cut, _draw_cut_rows)):
            if selected.all():
                tokens[:] = fn(logits, divisor, k, top_p, u, nucleus_tiers, scratch)
            elif selected.any():
                tokens[selected] = fn(logits[selected], divisor[selected], k[selected], top_p[selected],
                                      u[selected], nucleus_tiers, scratch)
    return tokens


def _exp(x: np.ndarray) -> np.ndarray:
    """exp(x) in place, through torch (module docstring): x is float32 and C-contiguous."""
    t = torch.from_numpy(x)
    torch.exp(t, out=t)
    return x


def _scaled(a: np.ndarray, divisor: np.ndarray) -> np.ndarray:
    # With the max at 0 every quotient is <= 0: none reaches +inf, the max stays exactly 0, and the others may
    # overflow to -inf (weight 0), as they should this cold. Masked (-inf) logits stay -inf.
    y = np.subtract(a, a.max(axis=1, keepdims=True))
    return np.divide(y, _uniform(divisor), out=y)


def _uniform(divisor: np.ndarray) -> np.ndarray:  # [R, 1], or a scalar when every row has the same temperature
    """Dividing by one scalar is ~1.7x faster in numpy than by a [R, 1] column at [256, 2048] (the column
    broadcast runs row by row), and gives the same quotients: IEEE division rounds each one exactly."""
    if not divisor.size:
        return divisor
    first = divisor.flat[0]
    return first if bool((divisor == first).all()) else divisor


_SMALLEST_TOTAL = 1e-20
"""A row's unshifted weights must add up to at least this (its max logit / T >= about -57): tokens up to 30
temperatures below its best are then still normal floats; anything further is below 1e-13 of it."""


def _rows_to_redo(total: np.ndarray) -> np.ndarray:
    """Rows whose unshifted total overflowed or nearly underflowed: redone in the shifted form."""
    return np.flatnonzero(~(np.isfinite(total) & (total >= _SMALLEST_TOTAL)))


def _draw_whole_rows(a, divisor, k, top_p, u, nucleus_tiers, scratch) -> np.ndarray:
    """Vocabulary order: the first token whose cumulative weight exceeds u · total.

    The weights are exp(a / T), proportional to exp((a - max) / T) and one pass cheaper; a row whose total
    overflows or nearly underflows (a tiny temperature, huge logits) is redone in the shifted form. Which form
    a row gets depends on that row alone.

    In two levels where the vocabulary splits into blocks of _BLOCK tokens: the running sum of the blocks'
    sums finds the block the target falls in, and a running sum inside that block alone the token, instead of a
    running sum over all V (one [R, V] pass instead of two). Block sums are torch's, which add a block's
    elements the same way wherever it sits (tests/model/test_sampler.py checks it as it does for exp)."""
    rows, vocab = a.shape
    weights = _exp(np.divide(a, _uniform(divisor), out=scratch.get("weights", a.shape, np.float32)))
    if vocab % _BLOCK:
        return _draw_in_one_level(a, divisor, u, weights)
    blocks = vocab // _BLOCK
    by_block = weights.reshape(rows, blocks, _BLOCK)
    cdf = _block_cdf(by_block)  # [R, blocks] float64
    total = cdf[:, -1]
    redo = _rows_to_redo(total)
    if redo.size:
        by_block[redo] = _exp(_scaled(a[redo], divisor[redo])).reshape(redo.size, blocks, _BLOCK)
        cdf[redo] = _block_cdf(by_block[redo])
        total = cdf[:, -1]
    target = np.minimum(u * total, np.nextafter(total, 0.0))
    block = (cdf <= target[:, None]).sum(axis=1)  # the first block whose running sum exceeds the target
    index = np.arange(rows)
    offset = target - np.where(block > 0, cdf[index, block - 1], 0.0)  # what is left of it inside the block
    inside = torch.from_numpy(by_block[index, block]).cumsum(dim=1, dtype=torch.float64).numpy()  # [R, _BLOCK]
    # The first token whose running sum inside the block exceeds what is left: it has a weight > 0. Where the
    # block's sequential sum falls a rounding short of its block sum, the block's last token of weight > 0.
    token = (inside <= offset[:, None]).sum(axis=1)
    for row in np.flatnonzero(token >= _BLOCK):
        token[row] = np.flatnonzero(by_block[row, block[row]] > 0)[-1]
    return block * _BLOCK + token


_BLOCK = 64
"""Tokens per block of the whole-row draw's first level (2048: 32 blocks; 49152: 768)."""


def _block_cdf(by_block: np.ndarray) -> np.ndarray:  # [R, nb, B] float32 -> [R, nb] float64 running block sums
    # torch's CPU cumsum runs each row sequentially (2x faster than numpy's here on [256, 32]).
    return torch.from_numpy(by_block).sum(dim=2).cumsum(dim=1, dtype=torch.float64).numpy()


def _draw_in_one_level(a, divisor, u, weights) -> np.ndarray:
    """The whole-row draw for a vocabulary that does not split into blocks: one running sum over all V."""
    cdf = _cumsum_(weights)
    total = cdf[:, -1]
    redo = _rows_to_redo(total)
    if redo.size:
        shifted = _exp(_scaled(a[redo], divisor[redo]))
        cdf[redo] = torch.from_numpy(shifted).cumsum(dim=1).numpy()
    cdf = torch.from_numpy(cdf)
    total = cdf[:, -1:]
    target = torch.from_numpy(u).to(cdf.dtype)[:, None] * total
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).numpy()


def _cumsum_(weights: np.ndarray) -> np.ndarray:  # [R, V] float32, in place
    """Row-wise running sums, in place. torch's CPU cumsum runs each row sequentially in float64: exact for a
    row wherever it sits, 3x faster than numpy's float32 one. In place, the weights' buffer is the only
    [R, V] array the draw writes (a pass over 2 MB costs ~0.3 ms here when it comes from memory)."""
    torch.from_numpy(weights).cumsum_(dim=1)
    return weights


def _top_sorted(a: np.ndarray, width: int, scratch: Scratch) -> np.ndarray:  # [R, width] largest, descending
    vocab = a.shape[1]
    if width * 8 > vocab:
        return np.sort(a, axis=1)[:, : -width - 1 : -1]
    # Selected as int32 keys that order as the floats do: numpy partitions [256, 2048] int32 in ~0.67 ms against
    # ~0.92 ms for a copy of the float32 logits (p10 of 500 on an AVX2 CPU), the keys' three passes included.
    keys = _order_keys(np.ascontiguousarray(a, dtype=np.float32).view(np.int32), scratch.get("keys", a.shape, np.int32))
    keys.partition(vocab - width, axis=1)
    top = np.sort(keys[:, vocab - width :], axis=1)[:, ::-1]
    return _order_keys(top, np.empty(top.shape, np.int32)).view(np.float32)


def _order_keys(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """int32 keys in the order of the float32 values whose bits they are: a negative float's other 31 bits are
    flipped (its magnitude grows as they do). Its own inverse: the keys of keys are the float's bits again. Only
    -0.0 < 0.0 differs from the float order; both turn back into floats that compare and compute as equal."""
    np.right_shift(bits, 31, out=out)
    np.bitwise_and(out, 0x7FFFFFFF, out=out)
    return np.bitwise_xor(out, bits, out=out)


def _draw_cut_rows(a, divisor, k, top_p, u, nucleus_tiers, scratch) -> np.ndarray:
    """Rank order (logit descending, then token id): keep the first n, draw a rank, find its token."""
    rows, vocab = a.shape
    nucleus_only = (k == 0) & (top_p < 1.0)
    tokens = np.empty(rows, dtype=np.int64)
    if nucleus_only.any():
        tiers = [t for t in nucleus_tiers if 8 * t <= vocab] + [vocab]
        # Top-p without top-k measures the nucleus against the whole row's mass.
        row_mass = _exp(_scaled(a, divisor)).sum(axis=1, dtype=np.float64)
    else:
        tiers, row_mass = [int(k.max())], None
    pending = np.arange(rows)  # rows whose nucleus may lie beyond the tiers tried so far
    for width in tiers:
        ordered = _top_sorted(a, max(width, int(k.max())), scratch)  # [R, K] raw logits, descending
        width = ordered.shape[1]
        weights = np.exp((ordered - ordered[:, :1]) / divisor, dtype=np.float64)  # [R, K] the first is 1
        limit = np.where(k > 0, k, width)
        if limit.min() < width:  # top-k first, for the rows whose k is below the widest
            weights[np.arange(width)[None, :] >= limit[:, None]] = 0.0
        cumulative = np.cumsum(weights, axis=1)  # [R, K] sequential per row
        total = cumulative[:, -1] if row_mass is None else np.where(nucleus_only, row_mass, cumulative[:, -1])
        # A top-p-only row's nucleus must end inside this tier, or a wider tier decides.
        done = ~nucleus_only | (cumulative[:, -1] >= top_p * total) | (width == vocab)
        # Top-p: the shortest prefix whose mass reaches p (>= 1 token: nothing comes before the first).
        reach = np.where(top_p < 1.0, top_p, np.inf) * total
        num_kept = np.minimum(np.where(k > 0, k, width), ((cumulative - weights) < reach[:, None]).sum(axis=1))
        num_kept = np.maximum(num_kept, 1)  # a top_p so small that p * total underflows still keeps the first
        kept_mass = cumulative[np.arange(len(a)), num_kept - 1]
        target = np.minimum(u * kept_mass, np.nextafter(kept_mass, 0.0))
        rank = (cumulative <= target[:, None]).sum(axis=1)  # first rank whose cumulative weight exceeds it
        found = _token_at_rank(a, ordered, np.minimum(rank, width - 1), scratch)
        tokens[pending[done]] = found[done]
        kept = np.flatnonzero(~done)
        pending = pending[kept]
        if not pending.size:
            return tokens
        a, divisor, k, top_p, u, nucleus_only = (x[kept] for x in (a, divisor, k, top_p, u, nucleus_only))
        row_mass = row_mass[kept]
    raise AssertionError("the last tier is the whole vocabulary")


def _token_at_rank(a: np.ndarray, ordered: np.ndarray, rank: np.ndarray, scratch: Scratch) -> np.ndarray:  # [R]
    """The token at `rank` in the order (logit descending, token id ascending): the (r+1)-th token in
    vocabulary order holding that logit, r being how many equal logits come before it in rank order."""
    rows = a.shape[0]
    value = ordered[np.arange(rows), rank]  # [R]
    before = rank - (ordered > value[:, None]).sum(axis=1)  # [R] equal logits ranked before it
    equal = np.equal(a, value[:, None], out=scratch.get("equal", a.shape, bool))  # [R, V]
    tokens = equal.argmax(axis=1)
    for row in np.flatnonzero(before > 0):  # exact ties at the drawn logit: rare in float32
        tokens[row] = np.flatnonzero(equal[row])[before[row]]
    return tokens.astype(np.int64)
