"""Grammar masks on logits: the rows a grammar constrains get -inf wherever their bitmask bit is 0.

The bitmask is llguidance's (and xgrammar's) layout: int32 words, bit b of word w (least significant first)
for token 32·w + b. Only the constrained rows are touched, so a step without any costs nothing and the others
pay nothing for those that are. The sampler applies it first, before penalties and min_tokens (as vLLM applies
its grammar bitmask to the logits before sampling): logprobs then describe the constrained distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

_NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf
_BYTE_PENALTIES = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.uint32(0), _NEG_INF_BITS).astype(np.uint32)
"""[256, 8]: row x holds, for each bit of byte x (least significant first), the float32 bits of 0.0 where it is
set and of -inf where it is not."""


class TokenMask(NamedTuple):
    rows: list[int]
    """Logits rows that are constrained, increasing."""
    bitmask: np.ndarray
    """[len(rows), ceil(V / 32)] int32: bitmask[i] is the allowed set of row rows[i]."""


def row_scratch_size(vocab: int) -> int:
    """The length of the uint32 work row `apply` needs on numpy: whole 32-bit words' worth of tokens."""
    return (vocab + 31) // 32 * 32


def apply(logits: torch.Tensor, mask: TokenMask, on_numpy: bool, row_scratch: np.ndarray | None = None) -> None:
    """logits [S, V] float32, contiguous, changed in place. `row_scratch`: a uint32 array of at least
    `row_scratch_size(V)` that the numpy path works in, kept by the caller from step to step.

    The numpy path goes one row at a time through that array, and allocates no more than one row's byte
    indices (numpy's, converted for `take`: 48 KB for SmolLM2) at a time. Done for all rows at once,
    a step's work arrays were rows x vocabulary (a burst's 13 constrained rows of SmolLM2: 0.6 MB of bits and
    2.5 MB of penalties, under the 4 MiB from which blocks get pages of their own), carved from the engine
    thread's heap between the blocks requests keep: the heap stayed that much wider after a burst, and the
    live blocks later scattered across it kept its pages resident (docs/memory.md)."""
    vocab = logits.shape[1]
    if on_numpy:
        a = logits.numpy()
        by_byte = mask.bitmask.view(np.uint8)  # [R, 4W]: byte j holds tokens 8j .. 8j + 7, least significant first
        size = by_byte.shape[1] * 8
        if row_scratch is None or row_scratch.size < max(size, vocab):
            row_scratch = np.empty(max(size, vocab), np.uint32)
        if size < vocab:
            row_scratch[size:vocab] = _NEG_INF_BITS  # tokens past the bitmask's words: never allowed
        penalties = row_scratch[:size].reshape(-1, 8)  # [4W, 8]
        # Branch-free: an additive row of 0 (allowed) or -inf (not), each byte's eight looked up at once. numpy's
        # masked assignment costs 5-6x more on a mask of mixed bits. mode="clip": with the default, take works
        # in a buffer of its own (every index is in range anyway).
        penalty = row_scratch[:vocab].view(np.float32)
        for i, row in enumerate(mask.rows):
            np.take(_BYTE_PENALTIES, by_byte[i], axis=0, out=penalties, mode="clip")
            np.add(a[row], penalty, out=a[row])
        return
    device = logits.device
    words = torch.from_numpy(mask.bitmask).to(device)  # [R, W] int32; the buffer is reused next step
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(mask.rows), -1)[:, :vocab]  # [R, V]
    index = torch.tensor(mask.rows, device=device)
    rows = logits.index_select(0, index).masked_fill_(allowed == 0, float("-inf"))
    logits.index_copy_(0, index, rows)
