"""Penalties, min_tokens and logprobs in the sampler, against direct references on small logits, with the CPU's
numpy operations and with the torch operations a GPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import worker.model.sampler as sampler_module
from worker.model.sampler import RowSampling, Sampler

VOCAB = 64
PROMPTS = {0: [1, 2, 3, 3], 1: [5], 2: [7, 8], 3: [9]}
OUTPUTS = {0: [3, 4, 4, 5, 4], 1: [], 2: [8, 8, 10], 3: [11, 12]}


@pytest.fixture(params=["numpy", "torch"], autouse=True)
def ops(request, monkeypatch):
    monkeypatch.setattr(sampler_module, "NUMPY_ON_CPU", request.param == "numpy")


def logits_for(rows: int = 4, seed: int = 0) -> torch.Tensor:  # [rows, VOCAB], with exact zeros too
    x = 3.0 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))
    x[:, 60:] = 0.0
    return x


def history(row: int):
    return PROMPTS[row], OUTPUTS[row]


def reference(logits: torch.Tensor, params: list[RowSampling], counters: list[int]) -> torch.Tensor:
    """vLLM's order, written out row by row: min_tokens mask, repetition, then frequency and presence."""
    x = logits.clone()
    for i, p in enumerate(params):
        if counters[i] < p.min_tokens:
            x[i, [t for t in p.min_tokens_stop_ids if t < VOCAB]] = float("-inf")  # ids past the vocabulary: none
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[PROMPTS[i] + OUTPUTS[i]] = True
        x[i] = torch.where(seen, torch.where(x[i] > 0, x[i] / p.repetition_penalty, x[i] * p.repetition_penalty),
                           x[i])
        counts = torch.bincount(torch.tensor(OUTPUTS[i], dtype=torch.int64), minlength=VOCAB).float()
        x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return x


CASES = {
    "repetition": [RowSampling(repetition_penalty=1.7), RowSampling(), RowSampling(repetition_penalty=0.6),
                   RowSampling()],
    "frequency_presence": [RowSampling(frequency_penalty=0.5, presence_penalty=-0.3), RowSampling(),
                           RowSampling(frequency_penalty=-2.0), RowSampling(presence_penalty=2.0)],
    "all": [RowSampling(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, min_tokens=9,
                        min_tokens_stop_ids=(0, 4)),
            RowSampling(frequency_penalty=1.0), RowSampling(min_tokens=2, min_tokens_stop_ids=(1,)),
            RowSampling(repetition_penalty=1.1, min_tokens=3, min_tokens_stop_ids=(2, 500))],
}


@pytest.mark.parametrize("case", CASES)
def test_penalties_match_the_reference_and_greedy_takes_their_argmax(case):
    params = CASES[case]
    counters = [len(OUTPUTS[i]) for i in range(4)]
    logits = logits_for()
    expected = reference(logits, params, counters)
    tokens = Sampler().sample(logits, params, counters, history)  # changes the rows with penalties in place
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert tokens == expected.argmax(-1).tolist()


def test_min_tokens_masks_stop_ids_only_below_the_count():
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 10.0  # the stop token is the favourite
    params = [RowSampling(min_tokens=3, min_tokens_stop_ids=(7,)),
              RowSampling(temperature=1.0, seed=1, min_tokens=3, min_tokens_stop_ids=(7,)), RowSampling()]
    tokens = Sampler().sample(logits.clone(), params, [2, 2, 0])
    assert tokens[0] != 7 and tokens[1] != 7 and tokens[2] == 7
    assert Sampler().sample(logits[:2].clone(), params[:2], [3, 3]) == [7, 7]


def test_rows_without_penalties_are_untouched_and_no_history_is_asked():
    logits = logits_for()
    before = logits.clone()

    def no_history(row):
        raise AssertionError("asked for a row without penalties")

    Sampler().sample(logits, [RowSampling(), RowSampling(temperature=0.9, seed=3), RowSampling(), RowSampling()],
                     [0, 1, 2, 3], no_history)
    assert torch.equal(logits, before)


def test_logprobs_are_log_softmax_of_the_processed_logits_before_temperature():
    logits = logits_for(seed=4)
    params = [RowSampling(logprobs=True, top_logprobs=5), RowSampling(),
              RowSampling(temperature=1.5, seed=2, logprobs=True, repetition_penalty=1.5),
              RowSampling(temperature=0.7, top_k=3, seed=5, logprobs=True, top_logprobs=20)]
    counters = [0, 0, 3, 2]
    processed = reference(logits, [RowSampling(), RowSampling(), params[2], RowSampling()], counters)
    step = Sampler().sample_step(logits, params, counters, history)
    assert set(step.logprobs) == {0, 2, 3}
    log_softmax = torch.log_softmax(processed, dim=-1)
    for row, (chosen, top_ids, top_lps) in step.logprobs.items():
        token = step.token_ids[row]
        assert chosen == pytest.approx(log_softmax[row, token].item(), abs=1e-5)
        n = params[row].top_logprobs
        assert len(top_ids) == len(top_lps) == n
        assert top_lps == sorted(top_lps, reverse=True)
        expected = log_softmax[row].topk(n)
        assert top_ids == expected.indices.tolist()
        np.testing.assert_allclose(top_lps, expected.values.numpy(), atol=1e-5)
    assert step.logprobs[0][1][0] == step.token_ids[0]  # greedy: the chosen token is the most likely


def test_a_masked_token_has_the_lowest_finite_logprob():
    logits = torch.zeros(1, 4)
    logits[0, 0] = 1.0
    step = Sampler().sample_step(logits, [RowSampling(min_tokens=1, min_tokens_stop_ids=(3,), logprobs=True,
                                                      top_logprobs=4)], [0])
    assert step.logprobs[0][1][-1] == 3
    assert step.logprobs[0][2][-1] == float(np.finfo(np.float32).min)
