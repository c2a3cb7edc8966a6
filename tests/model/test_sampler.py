"""Sampler: greedy is argmax, a seed gives the same tokens whatever the batch, top-k/top-p restrict the support."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from worker.model.sampler import RowSampling, Sampler, make_generator

VOCAB = 1000


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:  # [rows, vocab]
    return 3.0 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_rows_are_argmax():
    logits = random_logits(5, seed=0)
    params = [RowSampling(), RowSampling(temperature=0.7, top_k=1), RowSampling(), RowSampling(),
              RowSampling(temperature=0.0, top_p=0.5)]
    assert Sampler().sample(logits, params, [None] * 5) == logits.argmax(-1).tolist()


def test_greedy_rows_among_sampled_rows_stay_argmax():
    logits = random_logits(4, seed=1)
    params = [RowSampling(), RowSampling(temperature=1.0), RowSampling(), RowSampling(temperature=1.0)]
    tokens = Sampler().sample(logits, params, [None, make_generator(1), None, make_generator(2)])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_seeded_tokens_do_not_depend_on_batch_composition():
    sampler = Sampler()
    mine = RowSampling(temperature=0.9, top_p=0.95)
    my_logits = random_logits(10, seed=2)  # one row per step
    others = [RowSampling(temperature=1.3, top_k=20), RowSampling(), RowSampling(temperature=0.5)]

    alone_gen = make_generator(42)
    alone = [sampler.sample(my_logits[i : i + 1], [mine], [alone_gen])[0] for i in range(10)]

    batched_gen = make_generator(42)
    other_gens = [make_generator(7), None, make_generator(8)]
    batched = []
    for i in range(10):
        # A different position and different neighbours at every step.
        rows = [random_logits(1, seed=100 + i)[0], random_logits(1, seed=200 + i)[0]]
        rows.insert(i % 3, my_logits[i])
        params = others[:2]
        params.insert(i % 3, mine)
        gens = other_gens[:2]
        gens.insert(i % 3, batched_gen)
        batched.append(sampler.sample(torch.stack(rows), params, gens)[i % 3])
    assert batched == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_give_different_streams():
    logits = random_logits(1, seed=3).expand(30, VOCAB)
    params = [RowSampling(temperature=2.0)] * 30
    a = Sampler().sample(logits, params, [make_generator(1)] * 30)
    b = Sampler().sample(logits, params, [make_generator(2)] * 30)
    assert a != b


def _draws(logits_row: torch.Tensor, params: RowSampling, n: int, seed: int = 0) -> Counter:
    generator = make_generator(seed)
    tokens = Sampler().sample(logits_row.expand(n, -1), [params] * n, [generator] * n)
    return Counter(tokens)


def test_top_k_restricts_support_to_the_k_best():
    row = random_logits(1, seed=4)[0]
    counts = _draws(row, RowSampling(temperature=5.0, top_k=5), n=2000)
    assert set(counts) == set(row.topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Probabilities 0.5, 0.3, 0.15, then 0.05 spread thin: top_p 0.7 keeps exactly the first two tokens.
    probs = torch.full((VOCAB,), 0.05 / (VOCAB - 3))
    probs[[17, 400, 901]] = torch.tensor([0.5, 0.3, 0.15])
    row = probs.log()
    counts = _draws(row, RowSampling(temperature=1.0, top_p=0.7), n=3000)
    assert set(counts) == {17, 400}
    # Renormalized over the kept tokens: 0.5/0.8 = 0.625 (3000 draws: 3 sigma is about 0.026).
    assert abs(counts[17] / 3000 - 0.625) < 0.03
    wide = _draws(row, RowSampling(temperature=1.0, top_p=0.9), n=3000)
    assert {17, 400, 901} <= set(wide) and len(wide) < 20 + 3


def test_top_p_with_a_flat_distribution_falls_back_to_a_full_sort():
    # 4500 equal tokens hold 95% of the mass, 4500 lesser ones 5%: the 0.9 nucleus is about 4250 tokens,
    # more than the 4096 pre-selected candidates, so the full-sort path decides, and it must cut the tail
    # (which would otherwise get about 5% of the draws: 30 of 600, 3 sigma about 16).
    row = torch.cat([torch.zeros(4500), torch.full((4500,), -3.0)])
    counts = _draws(row, RowSampling(temperature=1.0, top_p=0.9), n=600, seed=5)
    assert max(counts) < 4500 and len(counts) > 500
    untruncated = _draws(row, RowSampling(temperature=1.0), n=600, seed=5)
    assert sum(n for token, n in untruncated.items() if token >= 4500) > 10


def test_temperature_sharpens_and_flattens():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cold = _draws(row, RowSampling(temperature=0.2), n=2000)
    hot = _draws(row, RowSampling(temperature=5.0), n=2000)
    assert cold[0] > 1950
    assert min(hot.values()) > 250 and len(hot) == 4


def test_sampling_frequencies_follow_softmax():
    row = torch.tensor([1.0, 0.0, -1.0, 0.5]).log_softmax(0)
    counts = _draws(row, RowSampling(temperature=1.0), n=5000, seed=9)
    expected = row.exp()
    for token in range(4):
        assert abs(counts[token] / 5000 - expected[token].item()) < 0.025


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError):
        Sampler().sample(random_logits(2, seed=0), [RowSampling()], [None])
