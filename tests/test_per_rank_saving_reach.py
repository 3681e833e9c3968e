"""How much of a GPU-time saving reaches the step's end (per_rank/saving_reach.py), on hand-built timelines whose
answer follows from the mechanism: a GPU-bound step keeps it all, a gap in which the GPU waits for the host takes
its length of it, and once the host waited for the GPU (a sync) the host's later launches are early too."""

import numpy as np
import pytest

from fleetscope.analysis.per_rank.host_stalls import (GAP_CAUSES, IDLE_DEVICE, IDLE_HOST, IDLE_SHORT, IDLE_SYNC,
                                                      IdleGaps)
from fleetscope.analysis.per_rank.saving_reach import step_saving_us
from fleetscope.analysis.per_rank.steps import BOUND_GPU, StepTiming
from fleetscope.analysis.per_rank.utilization import BASIS_GPU


def _step(start_us: float, length_us: float) -> StepTiming:
    return StepTiming(step=1, start_us=start_us, step_time_ms=length_us / 1000.0, host_ms=length_us / 1000.0,
                      gpu_start_us=start_us, gpu_ms=length_us / 1000.0, bound=BOUND_GPU)


def _gaps(*gaps: tuple[float, float, str]) -> IdleGaps:
    return IdleGaps(basis=BASIS_GPU, starts_us=np.array([g[0] for g in gaps], dtype=float),
                    ends_us=np.array([g[1] for g in gaps], dtype=float),
                    cause_codes=np.array([GAP_CAUSES.index(g[2]) for g in gaps], dtype=np.int8))


def _saving(gaps: IdleGaps, ends, savings) -> float:
    return step_saving_us(gaps, [_step(0.0, 1000.0)], np.array(ends, dtype=float), np.array(savings, dtype=float))


def test_a_gpu_bound_step_keeps_every_saving():
    assert _saving(_gaps(), [100.0, 400.0], [30.0, 50.0]) == pytest.approx(80.0)


def test_a_later_wait_for_a_launch_the_host_makes_on_its_own_takes_its_length_of_the_saving():
    # the kernel ending at 100 saves 30; the GPU then waits 20 us for a launch the host makes when it gets to it:
    # 10 us reach the end; a host barely behind for one launch (2 us) takes 2; a long wait takes it all
    assert _saving(_gaps((150.0, 170.0, IDLE_HOST)), [100.0], [30.0]) == pytest.approx(10.0)
    assert _saving(_gaps((150.0, 152.0, IDLE_SHORT)), [100.0], [30.0]) == pytest.approx(28.0)
    assert _saving(_gaps((150.0, 250.0, IDLE_HOST)), [100.0], [30.0]) == pytest.approx(0.0)
    # a wait BEFORE the kernel takes nothing of its saving
    assert _saving(_gaps((50.0, 90.0, IDLE_SHORT)), [100.0], [30.0]) == pytest.approx(30.0)


def test_once_the_host_waited_for_the_gpu_its_later_launches_are_early_too():
    # the host waits for the GPU (sync), then works 40 us before its next launch, and later the GPU waits for
    # the host again: the host resumed 30 us earlier, so every later launch is 30 us earlier
    gaps = _gaps((200.0, 260.0, IDLE_SYNC), (260.0, 300.0, IDLE_HOST), (500.0, 510.0, IDLE_HOST))
    assert _saving(gaps, [100.0], [30.0]) == pytest.approx(30.0)
    # a saving made after the host's last wait is taken back by the next wait for the host (10 us of 15)
    assert _saving(gaps, [100.0, 400.0], [30.0, 15.0]) == pytest.approx(35.0)


def test_a_device_dependency_keeps_the_lead():
    assert _saving(_gaps((150.0, 170.0, IDLE_DEVICE)), [100.0], [30.0]) == pytest.approx(30.0)


def test_without_gpu_gaps_it_cannot_tell():
    assert step_saving_us(None, [_step(0.0, 1000.0)], np.array([1.0]), np.array([1.0])) is None


@pytest.mark.parametrize("seed", range(5))
def test_in_host_ranges_is_the_union_of_the_ranges_however_they_overlap(seed):
    """One search over the sorted starts gives what a scan of every range gives, for overlapping, nested,
    unsorted and empty ranges (seeded)."""
    from fleetscope.analysis.per_rank.steps import in_host_ranges

    rng = np.random.default_rng(seed)
    starts = rng.uniform(0, 1000, 40)
    lengths = rng.choice([0.0, 1.0, 30.0, 300.0], 40)
    steps = [StepTiming(step=i, start_us=float(s), step_time_ms=float(n) / 1000.0, host_ms=float(n) / 1000.0)
             for i, (s, n) in enumerate(zip(starts, lengths))]
    times = np.concatenate([rng.uniform(-10, 1400, 2000), starts, starts + lengths])
    brute = np.zeros(times.size, dtype=bool)
    for step in steps:
        brute |= (times >= step.start_us) & (times < step.end_us)
    assert np.array_equal(in_host_ranges(times, steps), brute)
    assert not in_host_ranges(times, []).any()


def _with_host(gaps: IdleGaps, ends, savings, host_ends, host_savings) -> float:
    from fleetscope.analysis.per_rank.saving_reach import HostSaving
    host = HostSaving(ends_us=np.array(host_ends, dtype=float), savings_us=np.array(host_savings, dtype=float))
    return step_saving_us(gaps, [_step(0.0, 1000.0)], np.array(ends, dtype=float), np.array(savings, dtype=float),
                          host=host)


def test_launch_calls_the_change_removes_give_a_host_bound_step_its_saving():
    # the GPU waits 100 us for the host's next launch (host-bound): the kernel's 30 us saved on the GPU are lost
    # there, but removing its launch call (a 60 us call that blocked in the driver) makes the host, and so the
    # next launch, 60 us earlier
    gaps = _gaps((150.0, 250.0, IDLE_HOST))
    assert _with_host(gaps, [100.0], [30.0], [], []) == pytest.approx(0.0)
    assert _with_host(gaps, [100.0], [30.0], [40.0], [60.0]) == pytest.approx(60.0)
    # never more than the gap plus the GPU's own lead: the GPU cannot start before the work ahead of it ends
    assert _with_host(_gaps((150.0, 160.0, IDLE_HOST)), [100.0], [30.0], [40.0], [500.0]) == pytest.approx(40.0)
    # a host saving after the step's last wait for the host reaches no gap: the GPU bounds the rest
    assert _with_host(gaps, [], [], [300.0], [60.0]) == pytest.approx(0.0)
