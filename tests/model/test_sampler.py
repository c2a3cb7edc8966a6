"""Sampler: greedy is argmax, a seed gives the same tokens whatever the batch, top-k/top-p restrict the support."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


# Tokens the sampler gave before temperatures near 0 were made safe (logits seed 11, generator seed 1234, four
# draws from each of six rows): the ordinary range must keep giving exactly these.
PINNED_TOKENS = [
    (RowSampling(temperature=0.1), [44, 10, 44, 44, 657, 657, 657, 657, 69, 69, 69, 69, 511, 511, 511, 511, 839,
                                    839, 839, 839, 314, 314, 314, 314]),
    (RowSampling(temperature=0.7), [104, 10, 44, 44, 657, 887, 657, 657, 457, 863, 69, 944, 511, 407, 511, 424, 839,
                                    434, 860, 331, 526, 526, 967, 162]),
    (RowSampling(temperature=2.0), [702, 159, 690, 970, 665, 273, 987, 657, 12, 347, 641, 944, 808, 91, 210, 424,
                                    215, 98, 911, 470, 526, 67, 967, 162]),
    (RowSampling(temperature=0.8, top_k=50), [10, 746, 44, 214, 657, 657, 657, 657, 289, 458, 69, 69, 511, 401, 425,
                                              407, 331, 820, 306, 249, 852, 314, 711, 194]),
    (RowSampling(temperature=1.3, top_p=0.9), [10, 10, 744, 92, 888, 933, 887, 887, 890, 267, 69, 561, 588, 511, 511,
                                               88, 971, 442, 204, 778, 165, 382, 961, 314]),
    (RowSampling(temperature=0.5, top_k=40, top_p=0.95), [10, 44, 44, 44, 657, 657, 657, 657, 69, 69, 69, 69, 615,
                                                          511, 511, 511, 839, 839, 370, 331, 526, 314, 314, 314]),
]


@pytest.mark.parametrize("params, expected", PINNED_TOKENS, ids=lambda v: repr(v)[:48])
def test_ordinary_temperatures_keep_their_tokens(params, expected):
    logits = random_logits(6, seed=11)
    generator = make_generator(1234)
    tokens = [Sampler().sample(logits[i : i + 1], [params], [generator])[0] for i in range(6) for _ in range(4)]
    assert tokens == expected


@pytest.mark.parametrize("temperature", [1e-8, 1e-30, 1e-35, 1e-39, 1e-45, 5e-324])
@pytest.mark.parametrize("extra", [{}, {"top_k": 50}, {"top_p": 0.9}], ids=["plain", "top_k", "top_p"])
def test_a_temperature_just_above_zero_samples_the_argmax(temperature, extra):
    # Logits around +-1e4: logits/T overflowed to inf (a NaN softmax, token 0) from T = 1e-35 on, and a T
    # below float32's smallest denormal rounded to 0 (0/0). The coldest sampling is greedy.
    logits = 1e4 * torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(12))
    logits[1, ::2] = float("-inf")  # masked tokens, the argmax among them
    logits[2] = logits[2].abs().neg()  # all negative
    params = [RowSampling(temperature=temperature, **extra)] * 4
    tokens = Sampler().sample(logits, params, [make_generator(i) for i in range(4)])
    assert tokens == logits.argmax(-1).tolist()


def test_masked_logits_are_never_drawn_when_cold_or_warm():
    logits = random_logits(1, seed=13)[0]
    logits[::3] = float("-inf")
    for temperature in (1e-40, 1e-3, 0.5, 2.0):
        counts = _draws(logits, RowSampling(temperature=temperature), n=300, seed=14)
        assert all(token % 3 != 0 for token in counts), temperature


logit_rows = st.lists(st.floats(-1e4, 1e4, width=32) | st.just(float("-inf")), min_size=2, max_size=40).filter(
    lambda row: any(x != float("-inf") for x in row)
)


@settings(max_examples=80, deadline=None)
@given(
    logit_rows,
    st.floats(0.0, 2.0, exclude_min=True),
    st.integers(0, 50),
    st.floats(0.0, 1.0, exclude_min=True),
    st.integers(0, 2**32),
)
def test_any_positive_temperature_draws_a_possible_token(row, temperature, top_k, top_p, seed):
    # The wire allows any temperature in (0, 2]; whatever it is, the draw is an unmasked token, never NaN's 0.
    logits = torch.tensor(row)
    params = RowSampling(temperature=temperature, top_k=top_k, top_p=top_p)
    [token] = Sampler().sample(logits[None], [params], [make_generator(seed)])
    assert 0 <= token < len(row) and row[token] != float("-inf")
    # A token 200 temperatures below the best has probability e^-200: 0 in float32, so never drawn.
    best = max(row)
    gap = max(temperature, torch.finfo(torch.float32).tiny) * 200
    if all(x == best or x < best - gap for x in row):
        assert row[token] == best
