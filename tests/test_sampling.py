"""Tests of tp_worker/sample/sampling.py against a plain per-request NumPy reference.

The batched torch code must give, row by row, the distribution a one-request-at-a-time
implementation gives, and its noise must make each sample a function of (seed, position)
only, so that batch composition never changes what a request samples. The CPU kernel
(csrc/sample.cpp, `cpu_kernel=True`) must pick what the reference's race picks, and the same
ids in a build without AVX.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tokenmill.tp_worker.cpu import kernels as cpu_kernels
from tokenmill.tp_worker.sample import sampling
from tokenmill.tp_worker.sample.sampling import (
    Filters,
    SamplingTensors,
    exponential_noise,
    filtered_probs,
    processed_logprobs,
    sample,
)

VOCAB = 50
TEMPERATURES = [0.3, 1.0, 1.7]
TOP_KS = [0, 1, 5, 49]
TOP_PS = [1.0, 0.9, 0.5, 0.05]
MIN_PS = [0.0, 0.05, 0.3]
COMBOS = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS, MIN_PS))
BOTH_PATHS = pytest.mark.parametrize("cpu_kernel", [False, True], ids=["torch", "kernel"])


def reference_probs(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """One request, one position, float64, written out step by step."""
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    if top_k > 0:
        probs[order[top_k:]] = 0.0
        probs /= probs.sum()
    mass_before = 0.0
    for token in order:
        keep = mass_before < top_p
        mass_before += probs[token]
        if not keep:
            probs[token] = 0.0
    probs /= probs.sum()
    probs[probs < min_p * probs.max()] = 0.0
    return probs / probs.sum()


def params(
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    seed: list[int],
) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        min_p=torch.tensor(min_p, dtype=torch.float32),
        seed=torch.tensor(seed, dtype=torch.int64),
    )


def _params_of(rows: list[tuple[float, int, float, float]], seed: int = 0) -> SamplingTensors:
    columns = list(zip(*rows, strict=True)) if rows else [[], [], [], []]
    return params(*(list(c) for c in columns), seed=[seed] * len(rows))


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 3.0


def test_filtered_probs_match_reference_for_every_combo_in_one_batch() -> None:
    logits = _logits(len(COMBOS))
    got = filtered_probs(logits, _params_of(COMBOS)).double().numpy()
    for row, combo in enumerate(COMBOS):
        want = reference_probs(logits[row].numpy(), *combo)
        np.testing.assert_allclose(got[row], want, atol=1e-6, err_msg=str(combo))


@pytest.mark.parametrize("index", range(0, len(COMBOS), 7))
def test_filtered_probs_match_reference_for_a_single_row(index: int) -> None:
    combo = COMBOS[index]
    logits = _logits(4, seed=index)
    got = filtered_probs(logits, _params_of([combo] * 4)).double().numpy()
    for row in range(4):
        np.testing.assert_allclose(
            got[row], reference_probs(logits[row].numpy(), *combo), atol=1e-6
        )


def test_filtered_probs_with_no_filter_is_softmax() -> None:
    logits = _logits(3)
    got = filtered_probs(logits, _params_of([(1.0, 0, 1.0, 0.0)] * 3))
    torch.testing.assert_close(got, torch.softmax(logits, dim=-1), atol=1e-6, rtol=0)


def test_top_k_one_and_tiny_top_p_keep_only_the_argmax() -> None:
    logits = _logits(2)
    got = filtered_probs(logits, _params_of([(1.0, 1, 1.0, 0.0), (1.0, 0, 1e-6, 0.0)]))
    expected = torch.nn.functional.one_hot(logits.argmax(dim=-1), VOCAB).float()
    torch.testing.assert_close(got, expected)


@BOTH_PATHS
def test_greedy_rows_give_argmax_next_to_random_rows(cpu_kernel: bool) -> None:
    logits = _logits(6)
    rows = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.0, 5, 0.5, 0.1)] * 2
    ids = sample(logits, _params_of(rows, seed=3), torch.arange(6), cpu_kernel=cpu_kernel)
    greedy = [0, 2, 3, 5]
    assert ids[greedy].tolist() == logits.argmax(dim=-1)[greedy].tolist()


def test_all_greedy_batch_gives_argmax() -> None:
    logits = _logits(4)
    ids = sample(logits, _params_of([(0.0, 0, 1.0, 0.0)] * 4), torch.zeros(4, dtype=torch.long))
    assert ids.tolist() == logits.argmax(dim=-1).tolist()


@BOTH_PATHS
def test_sample_is_deterministic_for_same_seed_and_position(cpu_kernel: bool) -> None:
    logits = _logits(8)
    p = _params_of([(1.0, 0, 1.0, 0.0)] * 8, seed=11)
    positions = torch.arange(8) * 13
    first = sample(logits, p, positions, cpu_kernel=cpu_kernel)
    assert torch.equal(first, sample(logits.clone(), p, positions, cpu_kernel=cpu_kernel))


@BOTH_PATHS
def test_sample_does_not_depend_on_batch_composition(cpu_kernel: bool) -> None:
    logits = _logits(8, seed=5)
    rows = [COMBOS[i] for i in range(0, len(COMBOS), len(COMBOS) // 8)][:8]
    rows[3] = (1.0, 0, 1.0, 0.0)
    seeds = [101, 7, 3, 2**40 + 9, 55, 0, 99, 12345]
    batch = params(*(list(c) for c in zip(*rows, strict=True)), seed=seeds)
    positions = torch.tensor([5, 17, 3, 900, 41, 0, 8, 2**20])
    batched = sample(logits, batch, positions, cpu_kernel=cpu_kernel)
    for b in range(8):
        one = torch.tensor([b])
        alone = sample(logits[one], batch.rows(one), positions[one], cpu_kernel=cpu_kernel)
        assert alone.item() == batched[b].item(), f"row {b}"


@BOTH_PATHS
def test_different_seeds_and_positions_give_different_samples(cpu_kernel: bool) -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is decided by the noise alone
    uniform = (1.0, 0, 1.0, 0.0)

    def draw(seed: int, position: int) -> int:
        p = _params_of([uniform], seed=seed)
        return sample(logits, p, torch.tensor([position]), cpu_kernel=cpu_kernel).item()

    by_seed = {draw(s, 0) for s in range(40)}
    by_position = {draw(0, p) for p in range(40)}
    assert len(by_seed) > 15 and len(by_position) > 15


def _draws(
    logits_row: torch.Tensor,
    combo: tuple[float, int, float, float],
    n: int,
    cpu_kernel: bool = False,
) -> np.ndarray:
    """n samples of one request at positions 0..n-1 (one batch of n identical rows)."""
    p = _params_of([combo] * n, seed=2024)
    logits = logits_row.expand(n, -1).clone()
    return sample(logits, p, torch.arange(n), cpu_kernel=cpu_kernel).numpy()


@BOTH_PATHS
@pytest.mark.parametrize(
    "combo", [(1.0, 0, 1.0, 0.0), (0.7, 4, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2)]
)
def test_empirical_distribution_matches_filtered_probs(
    combo: tuple[float, int, float, float], cpu_kernel: bool
) -> None:
    logits_row = torch.tensor([[1.2, 0.3, -0.5, 0.9, -1.5, 0.0]])
    probs = filtered_probs(logits_row, _params_of([combo]))[0].double().numpy()
    draws = _draws(logits_row, combo, 4000, cpu_kernel)
    empirical = np.bincount(draws, minlength=6) / len(draws)
    assert 0.5 * np.abs(empirical - probs).sum() < 0.05
    assert set(draws.tolist()) <= set(np.flatnonzero(probs > 0).tolist())


@BOTH_PATHS
def test_filtered_tokens_are_never_sampled(cpu_kernel: bool) -> None:
    logits_row = _logits(1, vocab=VOCAB, seed=9)
    combo = (2.0, 10, 0.9, 0.1)
    allowed = filtered_probs(logits_row, _params_of([combo]))[0] > 0
    draws = _draws(logits_row, combo, 3000, cpu_kernel)
    assert allowed[torch.from_numpy(draws)].all()
    assert 1 < allowed.sum() < 10


def test_exponential_noise_is_a_pure_function() -> None:
    seeds = torch.tensor([0, 1, 2**40 + 1, -5])
    positions = torch.tensor([0, 7, 7, 123456])
    first = exponential_noise(seeds, positions, 1000)
    assert torch.equal(first, exponential_noise(seeds.clone(), positions.clone(), 1000))
    # A row's noise depends only on its own (seed, position): permuting rows permutes noise.
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(exponential_noise(seeds[perm], positions[perm], 1000), first[perm])
    # A longer vocabulary extends the noise without changing the shared prefix.
    assert torch.equal(exponential_noise(seeds, positions, 1500)[:, :1000], first)
    assert not torch.equal(first[1], first[2])


def test_exponential_noise_looks_like_exp_one() -> None:
    seeds = torch.arange(64)
    noise = exponential_noise(seeds, seeds * 3 + 1, 4096).double()
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    assert abs(noise.mean().item() - 1.0) < 0.01
    assert abs(noise.var().item() - 1.0) < 0.03
    uniform = torch.exp(-noise).flatten().numpy()  # back to U(0, 1)
    counts = np.histogram(uniform, bins=20, range=(0.0, 1.0))[0]
    expected = len(uniform) / 20
    assert np.abs(counts - expected).max() < 6 * np.sqrt(expected)


# NOTE: seed 0, position 807: token 19,777's hash is the top of the 24-bit grid, which
# rounded to u = 1 in float32 (a noise of -0.0) before the grid's top was clamped below 1.
TOP_OF_THE_GRID = (0, 807, 19777)


def test_no_noise_is_zero_at_the_top_of_the_grid() -> None:
    seed, position, token = TOP_OF_THE_GRID
    noise = exponential_noise(torch.tensor([seed]), torch.tensor([position]), 32768)[0]
    assert float(noise.min()) > 2.0**-25 and int(noise.argmin()) == token


@BOTH_PATHS
def test_an_impossible_token_at_the_top_of_the_grid_is_never_sampled(cpu_kernel: bool) -> None:
    """A noise of -0.0 made that token's race 0 / -0.0 = NaN where its probability is 0
    (200 nats below the rest here), and NaN wins an argmax: about one step in 500 at a 32K
    vocabulary sampled a token that cannot be sampled (or, in the torch path, one the
    filters removed)."""
    seed, position, token = TOP_OF_THE_GRID
    logits = torch.zeros(1, 32768)
    logits[0, token] = -200.0
    batch = params([1.0], [0], [1.0], [0.0], [seed])
    picked = sample(logits, batch, torch.tensor([position]), cpu_kernel=cpu_kernel)
    assert int(picked[0]) != token


def test_the_kernel_skips_hopeless_tokens_and_picks_as_the_torch_race() -> None:
    """A peaked distribution (a few tokens near the top, the rest 20-60 nats below, as a
    trained model's often are): the kernel computes no noise for most of the vocabulary, and
    picks what the torch path's race over every token picks, for 256 positions."""
    gen = torch.Generator().manual_seed(3)
    logits = -20.0 - 40.0 * torch.rand(256, 32768, generator=gen)
    top = torch.randint(0, 32768, (256, 8), generator=gen)
    logits.scatter_(1, top, torch.randn(256, 8, generator=gen))
    batch = params([1.0] * 256, [0] * 256, [1.0] * 256, [0.0] * 256, list(range(256)))
    positions = torch.arange(256) * 7 + 11
    ours = sample(logits, batch, positions, cpu_kernel=True)
    theirs = sample(logits, batch, positions, cpu_kernel=False)
    assert torch.equal(ours, theirs)
    assert bool((ours[:, None] == top).any(dim=1).all())  # the tail never wins here


def test_processed_logprobs_are_the_sampled_distribution() -> None:
    """--logprobs-mode processed: log of the reference distribution on the kept tokens
    (summing to 1 there), -inf on the filtered ones."""
    logits = _logits(len(COMBOS), seed=3)
    got = processed_logprobs(logits, _params_of(COMBOS)).double()
    for row, combo in enumerate(COMBOS):
        want = reference_probs(logits[row].numpy(), *combo)
        kept, finite = want > 0, np.isfinite(got[row].numpy())
        assert finite[kept].all(), combo
        # Kept here, removed there: only the reference's rounding (its top_p = 1 cumulative
        # mass reaches 1.0 before the last, vanishing tokens).
        assert (got[row].numpy()[finite & ~kept] < -20).all(), combo
        np.testing.assert_allclose(got[row].exp().numpy(), want, atol=1e-6, err_msg=str(combo))
        np.testing.assert_allclose(np.log(want[kept]), got[row].numpy()[kept], atol=1e-4)
        assert abs(got[row].exp().sum().item() - 1.0) < 1e-5


def test_processed_logprobs_of_greedy_rows_use_temperature_one_and_their_filters() -> None:
    logits = _logits(3, seed=4)
    greedy = processed_logprobs(logits, _params_of([(0.0, 5, 1.0, 0.0)] * 3))
    at_one = processed_logprobs(logits, _params_of([(1.0, 5, 1.0, 0.0)] * 3))
    assert torch.equal(greedy, at_one)
    assert bool(torch.isfinite(greedy).sum(dim=-1).eq(5).all())
    argmax = logits.argmax(dim=-1)
    assert torch.isfinite(greedy.gather(1, argmax[:, None])).all()


def _reference_pick(
    logits_row: np.ndarray, combo: tuple[float, int, float, float], seed: int, position: int
) -> int | None:
    """The id the reference's race picks, or None where its top two are within float32
    rounding of each other (either path may then pick either)."""
    probs = reference_probs(logits_row, *combo)
    noise = exponential_noise(torch.tensor([seed]), torch.tensor([position]), len(logits_row))
    race = probs / noise[0].double().numpy()
    top2 = np.sort(race)[-2:]
    return int(np.argmax(race)) if top2[1] - top2[0] > 1e-4 * top2[1] else None


@pytest.mark.parametrize("vocab, scale", [(VOCAB, 3.0), (1003, 3.0), (32000, 1.0), (32000, 8.0)])
def test_the_kernel_picks_what_the_reference_race_picks(vocab: int, scale: float) -> None:
    combos = COMBOS if vocab == VOCAB else COMBOS[::5]
    logits = torch.randn(len(combos), vocab, generator=torch.Generator().manual_seed(vocab))
    logits *= scale
    seeds = [17 * i + 3 for i in range(len(combos))]
    positions = torch.arange(len(combos)) * 31 + 5
    batch = params(*(list(c) for c in zip(*combos, strict=True)), seed=seeds)
    ids = sample(logits, batch, positions, cpu_kernel=True)
    checked = 0
    for row, combo in enumerate(combos):
        want = _reference_pick(logits[row].numpy(), combo, seeds[row], int(positions[row]))
        if want is not None:
            assert ids[row].item() == want, (row, combo)
            checked += 1
    assert checked >= 0.9 * len(combos)


def test_the_kernel_breaks_ties_by_the_smaller_id() -> None:
    uniform = torch.zeros(1, 20)  # every token ties, p = 0.05 each: the order is the id order
    for combo, kept in (((1.0, 3, 1.0, 0.0), 3), ((1.0, 0, 0.25, 0.0), 5)):
        draws = _draws(uniform, combo, 500, cpu_kernel=True)
        assert set(draws.tolist()) == set(range(kept)), combo


def test_the_kernel_gives_a_nan_row_its_nan() -> None:
    logits = _logits(3)
    logits[1, 7] = float("nan")
    ids = sample(logits, _params_of([(1.0, 0, 0.9, 0.0)] * 3), torch.arange(3), cpu_kernel=True)
    assert ids[1].item() == 7


def test_a_build_without_avx_samples_the_same_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    combos = COMBOS[::3]
    logits = torch.randn(len(combos), 1003, generator=torch.Generator().manual_seed(2)) * 4
    batch = _params_of(combos, seed=99)
    positions = torch.arange(len(combos)) * 7
    native = sample(logits, batch, positions, cpu_kernel=True)
    portable = cpu_kernels.load(cpu_kernels.build("x86-64-v2"))
    monkeypatch.setattr(sampling, "library", lambda: portable)
    assert torch.equal(sample(logits, batch, positions, cpu_kernel=True), native)


def test_the_filters_found_on_the_host_are_the_devices() -> None:
    """Filters.of (the step's host arrays: no sync on a GPU) answers what asking the device
    answers, for every mix of the three filters among the rows."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows = int(rng.integers(1, 5))
        top_k = rng.choice([0, 0, 5], rows)
        top_p = rng.choice([1.0, 1.0, 0.9], rows).astype(np.float32)
        min_p = rng.choice([0.0, 0.0, 0.1], rows).astype(np.float32)
        params = SamplingTensors(
            temperature=torch.ones(rows),
            top_k=torch.from_numpy(top_k),
            top_p=torch.from_numpy(top_p),
            min_p=torch.from_numpy(min_p),
            seed=torch.zeros(rows, dtype=torch.int64),
        )
        assert Filters.of(top_k, top_p, min_p) == Filters.on_device(params)
