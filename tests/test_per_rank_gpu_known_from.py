"""Where a GPU trace's idle time can start, and when a GPU running behind its host bounds a step.

A trace records GPU work only from the capture's start, and the GPU may still be running work launched before
it (the profiler's warm-up drops those launches). The first recorded activity then has no launch in the trace,
or waited in the queue after it: the time before it is not idle. Where the first kernel ran as soon as it was
launched, the GPU was idle until then, and that idle counts. A step whose work waited in the queue until after
its host range ended was held back by the GPU."""

import json
from pathlib import Path

import pytest

from fleetscope.analysis.per_rank.host_stalls import find_idle_gaps
from fleetscope.analysis.per_rank.rank import read_decoded
from fleetscope.analysis.per_rank.steps import find_steps
from fleetscope.analysis.per_rank.utilization import build_timeline, gpu_known_from_us, measure_utilization


def _trace(tmp_path: Path, launch_at_us: float | None, kernel_at_us: float) -> Path:
    """One 1,000 us host step; one 200 us kernel at `kernel_at_us`, launched at `launch_at_us` (None: its launch
    is not in the trace)."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": kernel_at_us, "dur": 200.0,
         "args": {"correlation": 42, "device": 0, "stream": 7}},
    ]
    if launch_at_us is not None:
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": launch_at_us, "dur": 5.0, "args": {"correlation": 42}})
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def _measured(path: Path):
    events = read_decoded(path, path.read_bytes()).events
    steps, _ = find_steps(events)
    timeline = build_timeline(events)
    return events, measure_utilization(events, steps, timeline), find_idle_gaps(events, steps, timeline)


def test_a_first_kernel_launched_before_the_capture_starts_the_known_gpu_timeline(tmp_path):
    events, utilization, gaps = _measured(_trace(tmp_path, None, 600.0))
    assert gpu_known_from_us(events) == pytest.approx(600.0)
    assert utilization.span_us == pytest.approx(400.0)    # 600 .. 1,000: the kernel and 200 us idle after it
    assert gaps.starts_us.min() >= 600.0


def test_a_first_kernel_that_waited_in_the_queue_starts_it_too(tmp_path):
    events, utilization, _ = _measured(_trace(tmp_path, 10.0, 600.0))
    assert gpu_known_from_us(events) == pytest.approx(600.0)
    assert utilization.idle_us == pytest.approx(200.0)


def test_a_first_kernel_run_at_its_launch_leaves_the_idle_before_it_counted(tmp_path):
    events, utilization, _ = _measured(_trace(tmp_path, 590.0, 600.0))
    assert gpu_known_from_us(events) == float("-inf")
    assert utilization.idle_us == pytest.approx(800.0)     # 0 .. 600 and 800 .. 1,000


def _behind(tmp_path: Path, kernel_us: float) -> Path:
    """A 1,000 us host step that launched its one kernel at 100 us; the kernel ran (for `kernel_us`) only at
    1,500 us, behind earlier work: the host had run ahead of the GPU."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 100.0, "dur": 5.0,
         "args": {"correlation": 42}},
        {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": 1500.0, "dur": kernel_us,
         "args": {"correlation": 42, "device": 0, "stream": 7}},
    ]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_a_step_whose_work_waited_behind_earlier_work_is_bound_by_the_gpu(tmp_path):
    # its GPU work (980 us) about fills the host's range, which the host spent launching into a full queue
    (step,), _ = find_steps(read_decoded(path := _behind(tmp_path, 980.0), path.read_bytes()).events)
    assert step.bound == "gpu" and step.step_time_ms == pytest.approx(0.98)
    assert step.span_start_us == pytest.approx(1500.0)


def test_a_step_that_launched_little_keeps_its_host_range(tmp_path):
    # 4 us of GPU work, late behind work from elsewhere: the step is the host's 1,000 us, not 4 us
    (step,), _ = find_steps(read_decoded(path := _behind(tmp_path, 4.0), path.read_bytes()).events)
    assert step.bound == "host" and step.step_time_ms == pytest.approx(1.0)
