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
    draws = BootstrapDraws(3, count=50)
    medians = _resampled_medians(runs, draws, "base")
    flat = np.concatenate(runs)
    expected = [np.median(flat[picks]) for chunk in draws.of("base", tuple(sizes)) for block in chunk.blocks
                for picks in block]
    assert medians.tolist() == expected


def test_the_resamples_depend_on_the_seed_the_side_and_the_run_lengths_alone():
    draws = BootstrapDraws(0, count=20)
    same = [next(draws.of("base", (10, 10))), next(BootstrapDraws(0, count=20).of("base", (10, 10)))]
    assert same[0].blocks[0].tolist() == same[1].blocks[0].tolist()          # another metric, another gate: the same
    assert next(draws.of("new", (10, 10))).blocks[0].tolist() != same[0].blocks[0].tolist()          # sides independent
    assert next(BootstrapDraws(1, count=20).of("base", (10, 10))).blocks[0].tolist() != same[0].blocks[0].tolist()


def test_a_constant_sample_needs_no_draws():
    assert _resampled_medians([np.full(10, 5.0), np.full(10, 5.0)], BootstrapDraws(0), "base").tolist() == [5.0] * 2000


def test_the_interval_is_seeded():
    base, new = _runs([30, 30, 30], seed=4), _runs([30], seed=5)
    first = _bootstrap_interval(base, new, BootstrapDraws(0))
    assert first == _bootstrap_interval(base, new, BootstrapDraws(0))
    assert first[0] < 0 < first[1]


def test_runs_of_different_lengths_are_drawn_with_replacement_then_their_steps():
    draws = BootstrapDraws(0, count=4000)
    blocks = [block for chunk in draws.of("base", (3, 5)) for block in chunk.blocks]
    picks = np.concatenate([block.ravel() for block in blocks])
    times_run0 = np.concatenate([(block < 3).sum(axis=1) // 3 for block in blocks])    # run 0 holds values 0..2
    assert np.bincount(times_run0, minlength=3) / 4000 == pytest.approx([0.25, 0.5, 0.25], abs=0.03)
    for block in blocks:        # every resample: two runs drawn, each bringing as many steps as it has
        from_0, from_1 = (block < 3).sum(axis=1), (block >= 3).sum(axis=1)
        assert (from_0 % 3 == 0).all() and (from_1 % 5 == 0).all() and (from_0 // 3 + from_1 // 5 == 2).all()
    within_run = np.bincount(picks, minlength=8) / np.bincount(picks < 3, minlength=2)[[1, 1, 1, 0, 0, 0, 0, 0]]
    assert within_run == pytest.approx(np.r_[[1 / 3] * 3, [1 / 5] * 5], abs=0.02)        # ~4 standard errors
