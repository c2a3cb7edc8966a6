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


class TokenMask(NamedTuple):
    rows: list[int]
    """Logits rows that are constrained, increasing."""
    bitmask: np.ndarray
    """[len(rows), ceil(V / 32)] int32: bitmask[i] is the allowed set of row rows[i]."""


def apply(logits: torch.Tensor, mask: TokenMask, on_numpy: bool) -> None:
    """logits [S, V] float32, contiguous, changed in place."""
    vocab = logits.shape[1]
    if on_numpy:
        a = logits.numpy()
        allowed = np.unpackbits(mask.bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")  # [R, V] 0/1
        # Branch-free: an additive row of 0 (allowed) or -inf (not), from bits. numpy's masked assignment costs
        # 5-6x more on a mask of mixed bits.
        penalty = allowed.astype(np.uint32)
        penalty -= np.uint32(1)
        penalty &= _NEG_INF_BITS
        penalty = penalty.view(np.float32)
        for i, row in enumerate(mask.rows):
            np.add(a[row], penalty[i], out=a[row])
        return
    device = logits.device
    words = torch.from_numpy(mask.bitmask).to(device)  # [R, W] int32; the buffer is reused next step
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(mask.rows), -1)[:, :vocab]  # [R, V]
    index = torch.tensor(mask.rows, device=device)
    rows = logits.index_select(0, index).masked_fill_(allowed == 0, float("-inf"))
    logits.index_copy_(0, index, rows)
