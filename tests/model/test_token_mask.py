"""Grammar bitmasks on logits (worker/model/token_mask.py) and in the sampler: only the constrained rows change,
the numpy and torch paths agree with a plain reference, and every pick (greedy, sampled, logprobs) stays in the
allowed set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.model import sampler as sampler_module
from worker.model import token_mask
from worker.model.sampler import RowSampling, Sampler
from worker.model.token_mask import TokenMask

VOCAB = 1000  # not a multiple of 32: the last word is partial


def bitmask_of(allowed: list[np.ndarray], vocab: int = VOCAB) -> np.ndarray:
    """[R, ceil(V/32)] int32 with bit t of row i set for each t in allowed[i]."""
    bits = np.zeros((len(allowed), (vocab + 31) // 32 * 32), dtype=np.uint8)
    for i, ids in enumerate(allowed):
        bits[i, ids] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def reference(logits: torch.Tensor, rows: list[int], allowed: list[np.ndarray]) -> torch.Tensor:
    out = logits.clone()
    for row, ids in zip(rows, allowed):
        keep = torch.zeros(logits.shape[1], dtype=torch.bool)
        keep[torch.from_numpy(ids)] = True
        out[row, ~keep] = float("-inf")
    return out


@pytest.fixture
def case():
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.standard_normal((6, VOCAB), dtype=np.float32) * 4)
    rows = [1, 2, 5]
    allowed = [rng.choice(VOCAB, size=n, replace=False) for n in (1, 37, 600)]
    allowed[2] = np.append(allowed[2], VOCAB - 1)  # a bit in the partial last word
    return logits, rows, allowed


@pytest.mark.parametrize("on_numpy", [True, False])
def test_apply_masks_only_the_constrained_rows(case, on_numpy):
    logits, rows, allowed = case
    expected = reference(logits, rows, allowed)
    got = logits.clone()
    token_mask.apply(got, TokenMask(rows, bitmask_of(allowed)), on_numpy)
    assert torch.equal(got, expected)
    unconstrained = [r for r in range(logits.shape[0]) if r not in rows]
    assert torch.equal(got[unconstrained], logits[unconstrained])


@pytest.fixture(params=[True, False], ids=["numpy", "torch"])
def sampler_path(request, monkeypatch):
    monkeypatch.setattr(sampler_module, "NUMPY_ON_CPU", request.param)
    return request.param


def test_sampler_picks_only_allowed_tokens(case, sampler_path):
    logits, rows, allowed = case
    params = [RowSampling(), RowSampling(temperature=1.0, seed=1), RowSampling(), RowSampling(temperature=0.7, seed=2),
              RowSampling(), RowSampling(temperature=1.3, top_k=50, top_p=0.9, seed=3)]
    mask = TokenMask(rows, bitmask_of(allowed))
    for counter in range(20):
        picked = Sampler().sample_step(logits.clone(), params, [counter] * 6, mask=mask).token_ids
        for row, ids in zip(rows, allowed):
            assert picked[row] in set(ids.tolist())
    # Greedy rows take the best allowed token; unconstrained greedy rows their plain argmax.
    assert picked[2] == max(allowed[1].tolist(), key=lambda t: logits[2, t].item())
    assert picked[0] == int(logits[0].argmax()) and picked[4] == int(logits[4].argmax())


def test_unconstrained_rows_draw_the_same_tokens_with_or_without_constrained_neighbours(case, sampler_path):
    logits, rows, allowed = case
    params = [RowSampling(temperature=0.9, seed=i) for i in range(6)]
    plain = Sampler().sample(logits.clone(), params, list(range(6)))
    mask = TokenMask(rows, bitmask_of(allowed))
    masked = Sampler().sample_step(logits.clone(), params, list(range(6)), mask=mask).token_ids
    assert [masked[r] for r in (0, 3, 4)] == [plain[r] for r in (0, 3, 4)]


def test_logprobs_describe_the_constrained_distribution(case, sampler_path):
    logits, rows, allowed = case
    params = [RowSampling(logprobs=True, top_logprobs=5)] * 6
    step = Sampler().sample_step(logits.clone(), params, [0] * 6, mask=TokenMask(rows, bitmask_of(allowed)))
    floor = float(np.finfo(np.float32).min)
    # Row 1 allows one token: it is certain, and every other alternative is -inf (sent as float32's lowest).
    chosen, top_ids, top_lps = step.logprobs[1]
    assert top_ids[0] == allowed[0][0] and chosen == pytest.approx(0.0, abs=1e-6)
    assert top_lps[1:] == [floor] * 4
    # Row 2: the log-softmax over its 37 allowed tokens.
    chosen, top_ids, _ = step.logprobs[2]
    allowed_logits = logits[2, torch.from_numpy(allowed[1])]
    assert chosen == pytest.approx(float(allowed_logits.max() - torch.logsumexp(allowed_logits, 0)), abs=1e-5)
    assert set(top_ids) <= set(allowed[1].tolist())


def test_tokens_past_the_bitmask_words_are_never_allowed(case):
    """A vocabulary wider than the bitmask's words (logits padded past the tokenizer's) masks the rest."""
    logits, rows, allowed = case
    wide = torch.cat([logits, torch.zeros(logits.shape[0], 40)], dim=1)
    expected = torch.cat([reference(logits, rows, allowed), torch.zeros(logits.shape[0], 40)], dim=1)
    expected[rows, VOCAB + 24:] = float("-inf")  # the first 24 extra tokens are the last word's (zero) bits
    expected[rows, VOCAB:VOCAB + 24] = float("-inf")
    got = wide.clone()
    token_mask.apply(got, TokenMask(rows, bitmask_of(allowed)), True, np.zeros(8, np.uint32))  # too small: its own
    assert torch.equal(got, expected)


def test_a_burst_of_constrained_rows_allocates_no_rows_by_vocabulary_arrays():
    """A step's mask goes through one kept row: 64 constrained rows of a 49,152-token vocabulary once took 3 MB of
    bits and 12 MB of penalties, carved from the engine thread's heap, which stayed that much wider."""
    import tracemalloc

    vocab, rows = 49_152, 64
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.standard_normal((rows, vocab), dtype=np.float32))
    words = rng.integers(0, 2**32, size=(rows, vocab // 32), dtype=np.uint64).astype(np.uint32).view(np.int32)
    mask = TokenMask(list(range(rows)), words)
    expected = logits.clone()
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").astype(bool)
    expected[torch.from_numpy(~allowed)] = float("-inf")
    scratch = np.zeros(token_mask.row_scratch_size(vocab), np.uint32)
    tracemalloc.start()  # numpy reports its arrays' memory to tracemalloc
    try:
        token_mask.apply(logits, mask, True, scratch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(logits, expected)
    # One row's byte indices as machine integers (take's own, 48 KB) at a time; nothing rows x vocabulary.
    assert peak < 2 * vocab
