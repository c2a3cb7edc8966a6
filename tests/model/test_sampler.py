"""Sampler: greedy is argmax, a seed gives the same tokens whatever the batch, top-k/top-p restrict the support,
and the draws follow the distribution they should.

Tests run twice: with the CPU's numpy operations and with the torch operations a GPU runs (`NUMPY_ON_CPU` off),
on the same CPU tensors; a few costly ones (torch's CPU sort is slow) only with numpy (`NUMPY_ONLY`).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import worker.model.sampler as sampler_module
from worker.model.sampler import RowSampling, Sampler, counter_uniforms

VOCAB = 1000


@pytest.fixture(params=["numpy", "torch"], autouse=True)
def ops(request, monkeypatch):
    monkeypatch.setattr(sampler_module, "NUMPY_ON_CPU", request.param == "numpy")
    return request.param


NUMPY_ONLY = pytest.mark.parametrize("ops", ["numpy"], indirect=True)


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:  # [rows, vocab]
    return 3.0 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_rows_are_argmax():
    logits = random_logits(5, seed=0)
    params = [RowSampling(), RowSampling(temperature=0.7, top_k=1, seed=3), RowSampling(), RowSampling(),
              RowSampling(temperature=0.0, top_p=0.5)]
    assert Sampler().sample(logits, params) == logits.argmax(-1).tolist()


def test_greedy_rows_among_sampled_rows_stay_argmax():
    logits = random_logits(4, seed=1)
    params = [RowSampling(), RowSampling(temperature=1.0, seed=1), RowSampling(), RowSampling(temperature=1.0)]
    tokens = Sampler().sample(logits, params, [0, 5, 0, 7])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


NEIGHBOURS = [RowSampling(), RowSampling(temperature=1.3, top_k=20, seed=7), RowSampling(temperature=0.5),
              RowSampling(temperature=0.9, top_p=0.5, seed=8), RowSampling(temperature=2.0, top_k=3, top_p=0.7),
              RowSampling(temperature=1e-30, seed=9), RowSampling(temperature=0.7, top_k=600, seed=10)]
MINE = [RowSampling(temperature=0.9, top_p=0.95, seed=42), RowSampling(temperature=1.1, seed=43),
        RowSampling(temperature=0.8, top_k=50, top_p=0.9, seed=44), RowSampling(temperature=1.5, top_k=7, seed=45)]


# torch at the odd vocabulary only, where vector tails fall inside rows.
@pytest.mark.parametrize("ops, vocab", [("numpy", 2048), ("numpy", 1021), ("torch", 1021)], indirect=["ops"])
@pytest.mark.parametrize("mine", MINE, ids=lambda p: f"k{p.top_k}-p{p.top_p}")
def test_seeded_tokens_do_not_depend_on_batch_composition(mine, vocab):
    sampler = Sampler()
    my_logits = random_logits(12, seed=2, vocab=vocab)  # one row per step
    alone = [sampler.sample(my_logits[i : i + 1], [mine], [i])[0] for i in range(12)]
    rng = random.Random(vocab)
    for i in range(12):
        # Other neighbours, batch sizes and positions at every step.
        size = rng.randint(1, 24)
        rows = list(random_logits(size, seed=100 + i, vocab=vocab))
        params = [rng.choice(NEIGHBOURS) for _ in range(size)]
        counters = [rng.randint(0, 500) for _ in range(size)]
        at = rng.randint(0, size)
        rows.insert(at, my_logits[i])
        params.insert(at, mine)
        counters.insert(at, i)
        assert sampler.sample(torch.stack(rows), params, counters)[at] == alone[i], i
    assert len(set(alone)) > 1  # it really sampled


def test_a_requests_seed_hash_has_the_bits_of_the_batched_one():
    seeds = [0, 1, 7, 2**63, 2**64 - 1, 2**64, -1, -(2**70) + 3, 123456789123456789]
    batched = sampler_module._seed_hashes(seeds)
    assert [sampler_module._seed_hash(seed) for seed in seeds] == [int(h) for h in batched]
    assert RowSampling(temperature=0.5, top_k=3, seed=7).draw_row == (0.5, 3, 1.0, int(batched[2]))
    assert RowSampling(temperature=0.5).draw_row[3] is None


def test_kept_step_parameters_follow_the_rows_from_step_to_step():
    """The sampler keeps a step's parameter arrays while the same requests sample in the same rows: a reused
    sampler draws what a fresh one draws when rows move, a request is replaced by one with other parameters
    (or by an equal copy), and when the same rows come back with new counters."""
    rng = random.Random(5)
    params = [RowSampling(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 1, 5, 50]),
                          top_p=rng.choice([1.0, 0.8]), seed=i) for i in range(40)]
    counters = list(range(40))
    kept = Sampler()
    steps = [(params, counters), (params, [c + 1 for c in counters]),  # the same rows: a new draw each step
             (params[::-1], counters[::-1]),  # rows moved
             (params[:7] + [RowSampling(temperature=2.0, top_k=3, seed=99)] + params[8:], counters),  # one replaced
             ([RowSampling(**{f: getattr(p, f) for f in ("temperature", "top_k", "top_p", "seed")}) for p in params],
              counters)]  # equal copies
    drawn = []
    for i, (step_params, step_counters) in enumerate(steps):
        logits = random_logits(40, seed=50)
        expected = Sampler().sample(logits.clone(), step_params, step_counters)
        got = kept.sample(logits.clone(), step_params, step_counters)
        assert got == expected, i
        drawn.append(got)
    assert drawn[0] != drawn[1] and drawn[0] == drawn[4]


def test_the_same_request_draws_anew_at_every_counter_and_per_seed():
    logits = random_logits(1, seed=3).expand(30, VOCAB)
    a = Sampler().sample(logits, [RowSampling(temperature=2.0, seed=1)] * 30, range(30))
    b = Sampler().sample(logits, [RowSampling(temperature=2.0, seed=2)] * 30, range(30))
    assert a != b and len(set(a)) > 10
    assert Sampler().sample(logits, [RowSampling(temperature=2.0, seed=1)] * 30, range(30)) == a
    # A seed is reduced modulo 2**64: the wire allows any integer.
    c = Sampler().sample(logits, [RowSampling(temperature=2.0, seed=1 - 2**64)] * 30, range(30))
    assert c == a


def test_rows_without_a_seed_sample_from_the_global_generator():
    logits = random_logits(1, seed=3).expand(200, VOCAB)
    tokens = Sampler().sample(logits, [RowSampling(temperature=2.0)] * 200)
    assert len(set(tokens)) > 20


def test_counter_uniforms_are_uniform_and_distinct():
    u = counter_uniforms([7] * 20000, range(20000))
    assert 0.0 <= u.min() and u.max() < 1.0 and len(set(u.tolist())) == 20000
    assert abs(u.mean() - 0.5) < 0.01 and abs(np.histogram(u, bins=10)[0] - 2000).max() < 200
    v = counter_uniforms(range(20000), [0] * 20000)  # neighbouring seeds, same counter: unrelated
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.03 and abs(v.mean() - 0.5) < 0.01


def _draws(logits_row: torch.Tensor, params: RowSampling, n: int, seed: int = 0) -> Counter:
    params = RowSampling(params.temperature, params.top_p, params.top_k, seed=seed)
    return Counter(Sampler().sample(logits_row.expand(n, -1), [params] * n, range(n)))


def test_top_k_restricts_support_to_the_k_best():
    row = random_logits(1, seed=4)[0]
    counts = _draws(row, RowSampling(temperature=5.0, top_k=5), n=2000)
    assert set(counts) == set(row.topk(5).indices.tolist())


def test_top_k_of_one_is_greedy():
    row = random_logits(1, seed=4)[0]
    assert set(_draws(row, RowSampling(temperature=5.0, top_k=1), n=50)) == {int(row.argmax())}


@NUMPY_ONLY
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


@NUMPY_ONLY
def test_top_p_with_a_flat_distribution_falls_back_to_a_full_sort():
    # 4500 equal tokens hold 95% of the mass, 4500 lesser ones 5%: the 0.9 nucleus is about 4250 tokens,
    # more than the 256 candidates tried first, so the full sort decides, and it must cut the tail (which
    # would otherwise get about 5% of the draws: 30 of 600, 3 sigma about 16). Ties at the threshold are kept:
    # here the whole plateau of 4500.
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


def _expected(row: list[float], params: RowSampling) -> list[float]:
    """The distribution the sampler should follow, computed in float64 from its definition."""
    x = [v / params.temperature for v in row]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(order)
    if 0 < params.top_k < len(x):
        keep = {i for i in order if x[i] >= x[order[params.top_k - 1]]}
    weights = {i: math.exp(x[i] - x[order[0]]) for i in keep}
    if params.top_p < 1.0:
        total, before, nucleus = sum(weights.values()), 0.0, set()
        for i in (i for i in order if i in keep):
            if before >= params.top_p * total:
                break
            nucleus.add(i)
            before += weights[i]
        weights = {i: w for i, w in weights.items() if x[i] >= min(x[j] for j in nucleus)}
    total = sum(weights.values())
    return [weights.get(i, 0.0) / total for i in range(len(x))]


@pytest.mark.parametrize("params", [RowSampling(temperature=1.0), RowSampling(temperature=0.7, top_k=4),
                                    RowSampling(temperature=1.2, top_p=0.8),
                                    RowSampling(temperature=1.5, top_k=5, top_p=0.9)], ids=repr)
def test_draws_pass_a_chi_square_test_against_the_definition(params):
    row = [1.0, 0.0, -1.0, 0.5, 1.5, -0.3, 0.8, -2.0]
    n = 4000
    counts = _draws(torch.tensor(row), params, n=n, seed=9)
    expected = _expected(row, params)
    assert all(counts[i] == 0 for i, p in enumerate(expected) if p == 0.0), (counts, expected)
    support = [i for i, p in enumerate(expected) if p > 0]
    chi2 = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    # Critical values at p = 0.001 for 1..7 degrees of freedom: a correct sampler fails once in a thousand.
    critical = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32][len(support) - 2]
    assert chi2 < critical, (chi2, counts, expected)


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError):
        Sampler().sample(random_logits(2, seed=0), [RowSampling()])


# What the counter-based scheme gives (logits seed 11, seed 1234, counters 0-3 for each of six rows): a change
# that moves these changes what every seeded request on the wire generates, and must say so.
PINNED_TOKENS = [
    (RowSampling(temperature=0.1),
     [44, 44, 44, 44, 657, 657, 657, 657, 69, 69, 69, 69,
      511, 511, 511, 511, 839, 839, 839, 839, 314, 314, 314, 314]),
    (RowSampling(temperature=0.7),
     [10, 44, 214, 44, 657, 657, 657, 657, 69, 69, 69, 69,
      397, 407, 511, 462, 331, 422, 839, 640, 314, 314, 337, 314]),
    (RowSampling(temperature=2.0),
     [104, 301, 606, 482, 140, 389, 661, 596, 127, 329, 604, 458,
      191, 397, 615, 511, 185, 362, 648, 500, 188, 323, 584, 463]),
    (RowSampling(temperature=0.8, top_k=50),
     [44, 10, 984, 746, 657, 657, 657, 657, 69, 69, 457, 69,
      511, 407, 615, 228, 839, 863, 778, 985, 314, 314, 526, 526]),
    (RowSampling(temperature=1.3, top_p=0.9),
     [10, 347, 301, 104, 657, 887, 87, 874, 69, 181, 907, 586,
      425, 861, 894, 424, 434, 778, 172, 597, 526, 905, 162, 605]),
    (RowSampling(temperature=0.5, top_k=40, top_p=0.95),
     [44, 44, 10, 44, 657, 657, 657, 657, 69, 69, 69, 69,
      511, 511, 425, 407, 839, 839, 863, 331, 314, 314, 314, 314]),
]


@pytest.mark.parametrize("params, expected", PINNED_TOKENS, ids=lambda v: repr(v)[:48])
def test_a_seed_keeps_its_tokens(params, expected):
    logits = random_logits(6, seed=11)
    params = RowSampling(params.temperature, params.top_p, params.top_k, seed=1234)
    tokens = [Sampler().sample(logits[i : i + 1], [params], [c])[0] for i in range(6) for c in range(4)]
    assert tokens == expected


@pytest.mark.parametrize("temperature", [1e-8, 1e-30, 1e-35, 1e-39, 1e-45, 5e-324])
@pytest.mark.parametrize("extra", [{}, {"top_k": 50}, {"top_p": 0.9}], ids=["plain", "top_k", "top_p"])
def test_a_temperature_just_above_zero_samples_the_argmax(temperature, extra):
    # Logits around +-1e4: logits/T overflowed to inf (a NaN softmax, token 0) from T = 1e-35 on, and a T
    # below float32's smallest denormal rounded to 0 (0/0). The coldest sampling is greedy.
    logits = 1e4 * torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(12))
    logits[1, ::2] = float("-inf")  # masked tokens, the argmax among them
    logits[2] = logits[2].abs().neg()  # all negative
    params = [RowSampling(temperature=temperature, seed=i, **extra) for i in range(4)]
    tokens = Sampler().sample(logits, params, [3] * 4)
    assert tokens == logits.argmax(-1).tolist()


@NUMPY_ONLY
def test_masked_logits_are_never_drawn_when_cold_or_warm():
    logits = random_logits(1, seed=13)[0]
    logits[::3] = float("-inf")
    for temperature in (1e-40, 1e-3, 0.5, 2.0):
        counts = _draws(logits, RowSampling(temperature=temperature), n=300, seed=14)
        assert all(token % 3 != 0 for token in counts), temperature


logit_rows = st.lists(st.floats(-1e4, 1e4, width=32) | st.just(float("-inf")), min_size=2, max_size=40).filter(
    lambda row: any(x != float("-inf") for x in row)
)


@settings(max_examples=40, deadline=None)
@given(
    logit_rows,
    st.floats(0.0, 2.0, exclude_min=True),
    st.integers(0, 50),
    st.floats(0.0, 1.0, exclude_min=True),
    st.integers(0, 2**64),
)
def test_any_positive_temperature_draws_a_possible_token(row, temperature, top_k, top_p, seed):
    # The wire allows any temperature in (0, 2]; whatever it is, the draw is an unmasked token, never NaN's 0.
    logits = torch.tensor(row)
    params = RowSampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    [token] = Sampler().sample(logits[None], [params], [seed % 7])
    assert 0 <= token < len(row) and row[token] != float("-inf")
    # A token 200 temperatures below the best has probability e^-200: 0 in float32, so never drawn.
    best = max(row)
    gap = max(temperature, torch.finfo(torch.float32).tiny) * 200
    if all(x == best or x < best - gap for x in row):
        assert row[token] == best


def test_ties_are_broken_by_token_id_and_the_tied_tokens_kept_are_drawn_evenly():
    # Five equal best logits and top_k 3: exactly the three lowest ids are kept, each drawn a third of the time
    # (the draw picks a rank; the rank's token is found among the equal logits in vocabulary order).
    row = torch.tensor([0.0, 2.0, 2.0, -1.0, 2.0, 2.0, 2.0, 0.5])
    counts = _draws(row, RowSampling(temperature=1.0, top_k=3), n=3000, seed=21)
    assert set(counts) == {1, 2, 4}
    assert all(abs(counts[t] / 3000 - 1 / 3) < 0.04 for t in (1, 2, 4))
    # top_p: the shortest prefix in that order reaching 0.5 of the mass: three of the five equal tokens.
    nucleus = _draws(row, RowSampling(temperature=1.0, top_p=0.5), n=600, seed=22)
    assert set(nucleus) == {1, 2, 4}


@pytest.mark.parametrize("width", [2048, 2051, 49152, 32001])
@pytest.mark.parametrize("threads", [1, 2, 7])
def test_the_cpu_draws_exp_gives_a_row_the_same_bits_wherever_it_sits(width, threads):
    """sampler_numpy._exp and the whole-row draw's block sums run through torch; the draw stays a function of
    its row only if torch's exp rounds an element, and its sum adds a block, the same whatever its offset in the
    batch and however the threads split it (the last partial vector included). A torch whose kernels finish a
    chunk with scalar code that rounds differently fails here."""
    from worker.model.sampler_numpy import _BLOCK, _block_cdf, _exp

    rows = 40 if width > 10_000 else 300
    logits = (torch.randn(rows, width, generator=torch.Generator().manual_seed(width)) * 5).numpy()
    alone = np.stack([_exp(logits[i : i + 1].copy())[0] for i in range(rows)])
    blocked = width % _BLOCK == 0  # the whole-row draw's block sums too (sampler_numpy._draw_whole_rows)
    shape = (-1, width // _BLOCK, _BLOCK)
    sums_alone = np.stack([_block_cdf(alone[i : i + 1].reshape(shape))[0] for i in range(rows)]) if blocked else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for start, stop in [(0, 1), (0, 3), (1, 18), (0, rows - 1), (1, rows), (0, rows)]:
            together = _exp(logits[start:stop].copy())
            assert np.array_equal(together.view(np.uint32), alone[start:stop].view(np.uint32)), (start, stop)
            if blocked:
                sums = _block_cdf(together.reshape(shape))
                assert np.array_equal(sums.view(np.uint64), sums_alone[start:stop].view(np.uint64)), (start, stop)
    finally:
        torch.set_num_threads(before)


@NUMPY_ONLY
def test_the_cpu_top_k_selects_the_same_values_as_a_full_sort():
    """sampler_numpy._top_sorted partitions int32 keys that order as the float32 logits do (negatives, -inf
    masks, subnormals, both zeros, exact ties) and turns the selected keys back into the same floats."""
    from worker.model.sampler_numpy import Scratch, _order_keys, _top_sorted

    rng = np.random.default_rng(5)
    rows, vocab = 40, 1024
    a = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    a[::3, ::2] = -np.inf  # grammar-masked rows
    a[1] = np.round(a[1])  # many exact ties
    a[2, :600] = -0.0
    a[2, 600:] = 0.0
    a[4, :] = -np.abs(a[4]) * 1e-40  # negative subnormals only
    a[5, 7] = np.inf
    specials = np.array([-np.inf, -3.5, -1e-45, -0.0, 0.0, 1e-45, 2.0, np.inf], dtype=np.float32)
    keys = _order_keys(specials.view(np.int32), np.empty(len(specials), np.int32))
    assert np.all(np.diff(keys) > 0)  # -0.0 gets a key just below 0.0, its only departure from the float order
    assert np.array_equal(_order_keys(keys, np.empty_like(keys)).view(np.float32).view(np.int32),
                          specials.view(np.int32))
    for width in (1, 50, 128):
        expected = np.sort(a, axis=1)[:, ::-1][:, :width]
        assert np.array_equal(_top_sorted(a, width, Scratch()), expected), width


@NUMPY_ONLY
def test_the_two_level_whole_row_draw_picks_the_tokens_of_one_running_sum():
    """sampler_numpy's whole-row draw finds the block, then the token inside it: the tokens of one running sum
    over the row (`_draw_in_one_level`, the definition as written), except where u lands within float rounding
    of a boundary; never a token of weight 0, whole blocks of them included. Just below u = 1 it draws a token
    with at most float32 rounding of the row's weight after it."""
    from worker.model.sampler_numpy import _BLOCK, Scratch, _draw_in_one_level, _draw_whole_rows

    rng = np.random.default_rng(3)
    rows, vocab = 512, 4 * 512
    a = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    a[::4, : 3 * _BLOCK] = -np.inf  # masked leading blocks
    a[1::4, -2 * _BLOCK :] = -np.inf  # masked trailing blocks
    a[2::4, _BLOCK + 5 : 5 * _BLOCK - 3] = -np.inf  # a masked run across block edges
    a[3, :] = -np.inf
    a[3, 777] = 0.0  # a single possible token
    divisor = np.full((rows, 1), 0.8, np.float32)
    none = np.zeros(rows, np.int64), np.ones(rows)
    weights = np.exp(a / np.float32(0.8))
    possible = weights > 0
    after = weights.astype(np.float64)[:, ::-1].cumsum(axis=1)[:, ::-1]  # [R, V] weight from each token on
    for u in [rng.random(rows), np.zeros(rows), np.full(rows, np.nextafter(1.0, 0.0))]:
        two = _draw_whole_rows(a, divisor, *none, u, (), Scratch())
        assert possible[np.arange(rows), two].all() and two[3] == 777
        if u[0] == np.nextafter(1.0, 0.0):
            beyond = after[np.arange(rows), two] - weights[np.arange(rows), two]
            assert (beyond <= 1e-6 * after[:, 0]).all()
        else:
            one = _draw_in_one_level(a, divisor, u, weights.copy())
            assert (two == one).sum() >= rows - 1


def test_reserved_scratch_serves_every_step_up_to_its_rows_without_new_arrays():
    """The draw's work arrays are made at their largest once (Sampler.reserve at engine start), so a burst
    that fills the batch later adds no memory; a step with more rows than reserved still gets its arrays."""
    from worker.model import sampler_numpy

    scratch = sampler_numpy.Scratch()
    scratch.reserve(8, 100)
    made = {name: id(array) for name, array in scratch._arrays.items()}
    assert set(made) == {name for name, _ in sampler_numpy._ARRAYS} | {sampler_numpy.MASK_ROW}
    rng = np.random.default_rng(0)
    for rows in (1, 3, 8):
        logits = rng.standard_normal((rows, 100)).astype(np.float32)
        sampler_numpy.draw(logits, np.full(rows, 0.8), np.full(rows, 5), np.full(rows, 0.9), rng.random(rows),
                           (16,), scratch)
        sampler_numpy.draw(logits, np.full(rows, 0.8), np.zeros(rows, np.int64), np.ones(rows), rng.random(rows),
                           (16,), scratch)
    assert {name: id(array) for name, array in scratch._arrays.items()} == made
    sampler_numpy.draw(rng.standard_normal((9, 100)).astype(np.float32), np.full(9, 0.8), np.full(9, 5),
                       np.full(9, 0.9), rng.random(9), (16,), scratch)
    assert scratch._arrays["keys"].size >= 9 * 100
