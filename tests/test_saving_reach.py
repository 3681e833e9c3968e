"""How much of a GPU-time saving reaches the step's end (per_rank/saving_reach.py), on hand-built timelines whose
answer follows from the mechanism: a GPU-bound step keeps it all, a gap in which the GPU waits for the host absorbs
it, a gap in which the host waited for the GPU (a sync, and the host's work right after it) passes it on."""

import numpy as np
import pytest

from fleetscope.analysis.per_rank.host_stalls import GAP_CAUSES, IDLE_HOST, IDLE_SHORT, IDLE_SYNC, IdleGaps
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


def test_a_later_wait_for_the_host_absorbs_the_saving_up_to_its_length():
    # the kernel ending at 100 saves 30; the GPU then waits 20 us for a launch: 10 us reach the end
    assert _saving(_gaps((150.0, 170.0, IDLE_HOST)), [100.0], [30.0]) == pytest.approx(10.0)
    # a wait BEFORE the kernel absorbs nothing of its saving
    assert _saving(_gaps((50.0, 90.0, IDLE_SHORT)), [100.0], [30.0]) == pytest.approx(30.0)


def test_a_sync_and_the_host_work_right_after_it_pass_the_saving_on():
    # the host waits for the GPU (sync), then works 40 us before its next launch: all shifts earlier
    gaps = _gaps((200.0, 260.0, IDLE_SYNC), (260.0, 300.0, IDLE_HOST))
    assert _saving(gaps, [100.0], [30.0]) == pytest.approx(30.0)
    # a host gap of its own later on still absorbs
    gaps = _gaps((200.0, 260.0, IDLE_SYNC), (260.0, 300.0, IDLE_HOST), (500.0, 510.0, IDLE_HOST))
    assert _saving(gaps, [100.0], [30.0]) == pytest.approx(20.0)


def test_without_gpu_gaps_it_cannot_tell():
    assert step_saving_us(None, [_step(0.0, 1000.0)], np.array([1.0]), np.array([1.0])) is None
