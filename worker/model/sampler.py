"""Next-token selection: greedy argmax, or temperature -> top-k -> top-p -> a seeded random draw.

Reproducibility per request: each sampled row draws only from its own `torch.Generator` and is processed
on its own, with operations whose shape depends on that row alone. The same logits row, parameters and
generator state therefore give the same token whatever else shares the batch. (The engine seeds each
request's generator once, from the request's own seed, else from ENGINE_SEED XOR crc32(request id).)

The draw is the exponential race (argmax of p_i / E_i with E_i ~ Exp(1)), which picks token i with
probability p_i exactly, never picks a zero-probability token, and needs no cumulative sums whose rounding
could push a draw past the end. Top-p without top-k avoids sorting the whole vocabulary (slow on the CPU):
the nucleus is looked for among the top 256, then the top 4096 tokens, and only then in a full sort.

Every positive temperature is defined: below 0.01 the row max is subtracted before dividing (see `_scale`),
so a temperature just above 0 sharpens to the argmax instead of overflowing to inf and a NaN softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NUCLEUS_CANDIDATES = (256, 4096)
_SHIFT_BELOW_TEMPERATURE = 0.01
"""Temperatures from here up divide the logits as they are, as the sampler always did, so a seed keeps
giving the same tokens; logits/T overflows float32 there only for |logits| > 3e36, which no model emits."""
_MIN_DIVISOR = torch.finfo(torch.float32).tiny
"""Smallest normal float32. A smaller temperature would round to 0 (0/0 = NaN at the max) or, on a GPU,
whose division by a scalar multiplies by its reciprocal, give 1/T = inf (0*inf = NaN)."""


@dataclass(slots=True, frozen=True)
class RowSampling:
    """How one logits row picks its token. The engine derives it from a request's validated sampling
    parameters, so the model side depends on no engine type."""

    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""

    @property
    def greedy(self) -> bool:
        # top_k == 1 leaves one candidate: argmax, without spending a random draw.
        return self.temperature <= 0.0 or self.top_k == 1


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _top_p_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: [V] -> (sorted descending probabilities [n], their token ids [n]) holding the nucleus."""
    vocab = probs.shape[0]
    for k in _NUCLEUS_CANDIDATES:
        if k >= vocab:
            break
        values, ids = probs.topk(k)
        if float(values.sum()) >= top_p:
            return values, ids
    return probs.sort(descending=True)


def _scale(
    logits: torch.Tensor,  # [V] float32
    temperature: float,
) -> torch.Tensor:  # [V] float32, logits / temperature up to a shift (softmax ignores shifts)
    if temperature >= _SHIFT_BELOW_TEMPERATURE:
        return logits / temperature
    # With the max at 0 every quotient is <= 0: none can reach +inf, the max stays exactly 0 (so the softmax
    # sum is >= 1), and the others may overflow to -inf, which is probability 0, as it should be this cold.
    # Masked (-inf) logits stay -inf. Decided on the host from the temperature: no sync on a GPU.
    return (logits - logits.max()) / max(temperature, _MIN_DIVISOR)


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,  # [S, V] float32
        params: list[RowSampling],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """One token id per row. Rows that sample use generators[i] (None: torch's global RNG, not
        reproducible); a generator on another device than logits works, at the cost of a copy."""
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(params)} params and {len(generators)} generators")
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        tokens: list[int] = [0] * num_rows
        if len(greedy_rows) == num_rows:
            return logits.argmax(dim=-1).tolist()
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            for row, token in zip(greedy_rows, logits.index_select(0, index).argmax(dim=-1).tolist()):
                tokens[row] = token
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        # Tokens stay on the device until one transfer at the end (a sync per row would stall a GPU).
        drawn = torch.stack([self._sample_row(logits[i], params[i], generators[i]) for i in sampled_rows])
        for row, token in zip(sampled_rows, drawn.tolist()):
            tokens[row] = token
        return tokens

    @staticmethod
    def _sample_row(
        logits: torch.Tensor,  # [V]
        params: RowSampling,
        generator: torch.Generator | None,
    ) -> torch.Tensor:  # [] int64 token id
        x = _scale(logits.float(), params.temperature)  # [V]
        vocab = x.shape[0]
        ids: torch.Tensor | None = None  # token id of each candidate; None: candidates are the vocabulary
        if 0 < params.top_k < vocab:
            values, ids = x.topk(params.top_k)  # [k], sorted descending
            probs = values.softmax(dim=-1)  # renormalized over the top k, as top-p then sees it
        elif params.top_p < 1.0:
            probs, ids = _top_p_candidates(x.softmax(dim=-1), params.top_p)
        else:
            probs = x.softmax(dim=-1)
        if params.top_p < 1.0:
            # probs is sorted descending here: keep the shortest prefix whose mass reaches top_p.
            mass_before = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(mass_before >= params.top_p, 0.0)
        device = generator.device if generator is not None else probs.device
        noise = torch.empty(probs.shape, device=device, dtype=torch.float32).exponential_(generator=generator)
        choice = (probs / noise.to(probs.device)).argmax()
        return ids[choice] if ids is not None else choice
