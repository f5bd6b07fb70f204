"""Synthetic length distributions (harness/core/workload.py): what each kind draws, and bad ones refused
before any work with an error naming the key."""
from __future__ import annotations

import numpy as np
import pytest

from harness.core.config import LengthDistConfig
from harness.errors import ConfigError
from harness.core.workload import sample_lengths, validate_length_dist


def draw(dist: LengthDistConfig, num: int = 20000, cap=None) -> np.ndarray:
    return sample_lengths(dist, num, np.random.default_rng(0), cap=cap)


def test_uniform_draws_every_integer_of_its_range_about_equally():
    lens = draw(LengthDistConfig(kind="uniform", median=200, min=100, max=300))
    assert lens.min() == 100 and lens.max() == 300
    counts = np.bincount(lens - 100, minlength=201)
    assert (counts > 0).all() and counts.max() < 2.5 * counts.mean()
    assert abs(lens.mean() - 200) < 2


def test_uniform_respects_the_generation_cap():
    lens = draw(LengthDistConfig(kind="uniform", median=200, min=100, max=300), cap=150)
    assert lens.max() == 150 and lens.min() == 100


def test_constant_and_lognormal_are_unchanged_by_the_new_kind():
    assert (draw(LengthDistConfig(kind="constant", median=256, max=512), 10) == 256).all()
    rng = np.random.default_rng(0)
    expected = np.clip(np.rint(rng.lognormal(np.log(100), 0.5, 10)), 1, 1000).astype(np.int64)
    assert (draw(LengthDistConfig(kind="lognormal", median=100, sigma=0.5, max=1000), 10) == expected).all()


@pytest.mark.parametrize("dist,message", [
    (LengthDistConfig(kind="uniform", median=150, min=100, max=300), "median=200"),
    (LengthDistConfig(kind="triangular", median=10, max=20), "kind='triangular'"),
    (LengthDistConfig(kind="constant", median=10, min=30, max=20), "1 <= min <= max"),
    (LengthDistConfig(kind="constant", median=10, min=0, max=20), "1 <= min <= max"),
])
def test_bad_distributions_are_refused_naming_the_key(dist, message):
    with pytest.raises(ConfigError, match="workload.output_len") as err:
        validate_length_dist("output_len", dist)
    assert message in str(err.value)


def test_growth_drifts_the_median_and_keeps_the_cap():
    dist = LengthDistConfig(kind="lognormal", median=100, sigma=0.5, max=100_000, growth_per_iteration=0.01)
    rng = lambda: np.random.default_rng(0)  # noqa: E731 - the same draws, only the median drifts
    first, later = (sample_lengths(dist, 50_000, rng(), iteration=k) for k in (0, 100))
    assert np.median(first) == pytest.approx(100, rel=0.02)
    assert np.median(later) == pytest.approx(100 * 1.01 ** 100, rel=0.02)
    capped = sample_lengths(dist, 1000, rng(), cap=150, iteration=100)
    assert capped.max() == 150
    still = LengthDistConfig(kind="lognormal", median=100, sigma=0.5, max=1000)
    assert (sample_lengths(still, 100, rng(), iteration=7) == sample_lengths(still, 100, rng())).all()


def test_a_shrinking_median_beyond_zero_is_refused():
    with pytest.raises(ConfigError, match="growth_per_iteration=-1"):
        validate_length_dist("output_len", LengthDistConfig(median=10, max=20, growth_per_iteration=-1.0))


def test_a_prompt_factor_correlates_a_groups_lengths_and_keeps_the_marginal():
    """sigma = 1 split into 0.8 per prompt and 0.6 per response: log lengths vary by 0.6 within a
    group of 16 and their group means by sqrt(0.8^2 + 0.6^2 / 16) across groups; the median and the
    spread of all lengths stay the lognormal's."""
    dist = LengthDistConfig(kind="lognormal", median=100, sigma=1.0, max=10**9, prompt_sigma=0.8)
    logs = np.log(sample_lengths(dist, 16 * 4000, np.random.default_rng(0), group_size=16)).reshape(-1, 16)
    assert logs.std(axis=1, ddof=1).mean() == pytest.approx(0.6, rel=0.03)
    assert logs.mean(axis=1).std() == pytest.approx(np.sqrt(0.8 ** 2 + 0.6 ** 2 / 16), rel=0.05)
    assert np.exp(np.median(logs)) == pytest.approx(100, rel=0.03) and logs.std() == pytest.approx(1.0, rel=0.03)
    independent = LengthDistConfig(kind="lognormal", median=100, sigma=1.0, max=10**9)
    assert (sample_lengths(independent, 64, np.random.default_rng(0), group_size=16)
            == sample_lengths(independent, 64, np.random.default_rng(0))).all()  # without it, the draws as before


@pytest.mark.parametrize("dist,message", [
    (LengthDistConfig(median=10, max=20, sigma=0.5, prompt_sigma=0.6), "prompt_sigma=0.6 is part of sigma=0.5"),
    (LengthDistConfig(kind="constant", median=10, max=20, prompt_sigma=0.1), "splits a lognormal's sigma"),
])
def test_a_prompt_factor_that_cannot_be_drawn_is_refused(dist, message):
    with pytest.raises(ConfigError, match=message):
        validate_length_dist("output_len", dist)


def test_prompt_factors_replay_the_batch_and_regenerate_around_them():
    """All of sigma the prompt's: a group's lengths are its median x exp(factor), which the replayed
    factors give exactly; regenerated responses keep the factor and nothing else (no spread left)."""
    from harness.core.workload import make_batch, prompt_log_factors, regenerated_lengths
    from harness.testing import run_config

    w = run_config(["+system=verl", "workload=long_reasoning", "workload.output_len.prompt_sigma=1.0",
                    "workload.max_gen_len=20480"]).workload
    w = type(w)(**{**w.__dict__, "global_batch_size": 64})
    batch, factors = make_batch(w, 3, 5, 8), prompt_log_factors(w, 3, 5, 8)
    expected = np.clip(np.rint(w.output_len.median * 1.001 ** 5 * np.exp(factors)), w.output_len.min, 20480)
    assert (batch.output_lens.reshape(8, 8) == expected[:, None]).all()
    again = regenerated_lengths(w, 3, 9, (5, 2), 1, float(factors[2]), 8)
    assert (again == np.clip(np.rint(w.output_len.median * 1.001 ** 9 * np.exp(factors[2])), 16, 20480)).all()
