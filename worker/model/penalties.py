"""What the sampler does to a row's logits before it picks a token, for the rows that ask (vLLM's semantics):

1. min_tokens: while a request has fewer than min_tokens output tokens, its stop tokens (EOS unless ignored, and
   stop_token_ids) are masked to -inf, so it cannot end yet.
2. repetition_penalty p (Keskar et al. 2019, as in vLLM and transformers' RepetitionPenaltyLogitsProcessor): for
   each token id that occurs in the prompt or the output so far, logit > 0 ? logit / p : logit * p.
3. frequency_penalty f and presence_penalty r (OpenAI's definition): logit -= f * count + r * (count > 0), the
   count being how often the token occurs in the output so far (not the prompt).

Batched and sparse: the (row, token) pairs that need a change are gathered on the host into a few flat index
arrays, once per step, and applied with one gather/scatter per kind, in place, over the rows that use them. Only
the tokens a row has seen are touched, so a row costs O(its prompt + output length), never O(vocabulary), and
rows without penalties cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

History = Callable[[int], tuple[Sequence[int], Sequence[int]]]
"""history(row) -> (prompt token ids, output token ids) of the request that row samples for."""


def apply(
    logits: torch.Tensor,  # [S, V] float32, changed in place
    rows: Sequence[int],
    params: Sequence,  # RowSampling of those rows
    counters: Sequence[int] | None,
    history: History | None,
    on_numpy: bool,
) -> None:
    vocab = logits.shape[1]
    mask_rows, mask_cols = [], []
    rep_keys, rep_rows, rep_values = [], [], []
    out_keys, out_rows = [], []
    for i, p in zip(rows, params):
        if p.min_tokens and (0 if counters is None else counters[i]) < p.min_tokens:
            stop_ids = [t for t in p.min_tokens_stop_ids if 0 <= t < vocab]
            mask_rows += [i] * len(stop_ids)
            mask_cols += stop_ids
        if not p.uses_history:
            continue
        if history is None:
            raise ValueError(f"row {i} has penalties but the sampler was given no token history")
        prompt_ids, output_ids = history(i)
        output = np.asarray(output_ids, dtype=np.int64)
        if p.repetition_penalty != 1.0:
            rep_keys.append(np.unique(np.concatenate([np.asarray(prompt_ids, dtype=np.int64), output])) + i * vocab)
            rep_rows.append(len(rep_keys[-1]))
            rep_values.append(p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(output):
            out_keys.append(output + i * vocab)
            out_rows.append((p.frequency_penalty, p.presence_penalty))
    flat = logits.view(-1)  # [S * V] a view: writes land in logits
    if mask_rows:
        keys = np.asarray(mask_rows, dtype=np.int64) * vocab + np.asarray(mask_cols, dtype=np.int64)
        _update(flat, np.unique(keys), None, "mask", on_numpy)
    if rep_keys:
        keys = np.concatenate(rep_keys)  # unique within each row, rows disjoint
        penalty = np.repeat(np.asarray(rep_values, dtype=np.float32), rep_rows)
        _update(flat, keys, penalty, "repetition", on_numpy)
    if out_keys:
        keys, counts = np.unique(np.concatenate(out_keys), return_counts=True)
        coeffs = np.asarray(out_rows, dtype=np.float32)  # [P, 2] frequency, presence
        # Which of those rows each key belongs to: keys are sorted, and the rows are in increasing order.
        starts = np.asarray([k[0] // vocab * vocab for k in out_keys], dtype=np.int64)
        which = np.searchsorted(starts, keys, side="right") - 1
        _update(flat, keys, coeffs[which, 0] * counts.astype(np.float32) + coeffs[which, 1], "subtract", on_numpy)


def _update(flat: torch.Tensor, keys: np.ndarray, values: np.ndarray | None, kind: str, on_numpy: bool) -> None:
    """flat[keys] = f(flat[keys], values), keys unique: in numpy on the CPU, in torch on the device otherwise
    (one transfer of the indices and values, one gather and one scatter)."""
    if on_numpy:
        a = flat.numpy()
        if kind == "mask":
            a[keys] = -np.inf
        elif kind == "repetition":
            x = a[keys]
            a[keys] = np.where(x > 0, x / values, x * values)
        else:
            a[keys] -= values
        return
    index = torch.from_numpy(keys).to(flat.device)
    if kind == "mask":
        flat.index_fill_(0, index, float("-inf"))
        return
    v = torch.from_numpy(values).to(flat.device)
    x = flat.index_select(0, index)
    flat.index_copy_(0, index, torch.where(x > 0, x / v, x * v) if kind == "repetition" else x - v)
