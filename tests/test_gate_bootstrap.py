"""The gate's bootstrap as arrays: the medians it takes are those of the values it draws, seeded."""

import numpy as np
import pytest

from fleetscope.analysis.gate import BootstrapDraws, _bootstrap_interval, _resampled_medians


def _runs(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.round(100 + rng.normal(0, 3, size), 1) for size in sizes]      # rounded: ties, as real step times have


@pytest.mark.parametrize("sizes", [[19, 19], [20, 20, 20], [7], [8], [19, 12, 5], [4, 9]])
def test_each_resample_median_is_the_median_of_the_values_it_drew(sizes):
    runs = _runs(sizes)
    draws = BootstrapDraws(np.random.default_rng(3), count=50)
    medians = _resampled_medians(runs, draws, "base")
    flat = np.concatenate(runs)
    for chunk in draws.of("base", tuple(sizes)):
        starts = np.concatenate([[0], np.cumsum(chunk.totals)[:-1]])
        expected = [np.median(flat[chunk.picks[s:s + t]]) for s, t in zip(starts, chunk.totals)]
        assert medians.tolist() == expected


def test_metrics_of_the_same_steps_share_the_resamples_and_a_constant_needs_none():
    draws = BootstrapDraws(np.random.default_rng(0), count=20)
    first = _resampled_medians(_runs([10, 10], seed=1), draws, "base")
    second = _resampled_medians(_runs([10, 10], seed=2), draws, "base")
    assert len(draws.drawn) == 1 and first.shape == second.shape == (20,)
    assert _resampled_medians([np.full(10, 5.0), np.full(10, 5.0)], BootstrapDraws(np.random.default_rng(0)),
                               "base").tolist() == [5.0] * 2000


def test_the_interval_is_seeded():
    base, new = _runs([30, 30, 30], seed=4), _runs([30], seed=5)
    first = _bootstrap_interval(base, new, BootstrapDraws(np.random.default_rng(0)))
    assert first == _bootstrap_interval(base, new, BootstrapDraws(np.random.default_rng(0)))
    assert first[0] < 0 < first[1]
