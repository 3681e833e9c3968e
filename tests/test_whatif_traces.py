"""What-if by simulation on fleetscope's own traces (analysis/whatif/trace_model.py, trace_whatif.py): a synthetic
data-parallel job with a known answer, the command on a run directory, and (slow) a real 2-rank gloo job with a
planted straggler against the same job measured without it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers import fleetscope, synthetic_run_dir

from fleetscope.analysis.per_rank.collectives import CollectiveCalls
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.analysis.per_rank.steps import StepTiming
from fleetscope.analysis.whatif.model import ModelError
from fleetscope.analysis.whatif.trace_model import model_traces, read_rank_results
from fleetscope.analysis.whatif.trace_whatif import trace_what_if

COMPUTE_MS = (10.0, 5.0)
"""Every rank's compute before each of the step's two all-reduces."""
TRANSFER_MS = (2.0, 1.0)
TAIL_MS = 3.0
LATE_RANK, LATE_MS = 2, 20.0


def rank_result(rank: int, steps: int = 3, *, late_ms: float = 0.0, job_late_ms: float = 0.0,
                collectives: int = 2) -> RankResult:
    """One rank of a synchronous job, timed as it would run: each all-reduce ends when its last rank's arrival
    plus its transfer time have passed (every rank shares one clock; steps start 100 ms apart); `late_ms`: this
    rank's extra compute before the first all-reduce, `job_late_ms`: the latest rank's."""
    timings, keys, starts, ends = [], [], [], []
    for step in range(steps):
        step_start = 100_000.0 * step
        last_arrival = step_start
        mine = step_start
        for index in range(collectives):
            extra = late_ms if index == 0 else 0.0
            last_arrival += (COMPUTE_MS[index] + (job_late_ms if index == 0 else 0.0)) * 1e3
            mine += (COMPUTE_MS[index] + extra) * 1e3
            end = last_arrival + TRANSFER_MS[index] * 1e3
            keys.append((step, "gloo:all_reduce", index))
            starts.append(mine)
            ends.append(end)
            last_arrival = mine = end
        step_ms = (mine - step_start) / 1e3 + TAIL_MS
        timings.append(StepTiming(step=step, start_us=step_start, step_time_ms=step_ms, host_ms=step_ms))
    calls = CollectiveCalls(source="gloo spans", keys=keys, start_us=np.array(starts), end_us=np.array(ends),
                            interval_compute_us=np.zeros(len(keys)))
    return RankResult(label=f"rank{rank}", path=f"rank{rank}.json", window=0, rank=rank, rank_source="manifest",
                      host="node0", world_size=4, backend="gloo", base_time_ns=0, event_count=1, dropped_events={},
                      first_start_us=0.0, last_end_us=ends[-1], has_gpu=False, steps=timings,
                      step_source="ProfilerStep", utilization=None, collectives=calls)


def job(late_rank: int | None = LATE_RANK) -> list[RankResult]:
    job_late_ms = LATE_MS if late_rank is not None else 0.0
    return [rank_result(rank, late_ms=job_late_ms if rank == late_rank else 0.0, job_late_ms=job_late_ms)
            for rank in range(4)]


def test_a_late_rank_made_like_its_peers_gives_the_healthy_step():
    healthy = sum(COMPUTE_MS) + sum(TRANSFER_MS) + TAIL_MS
    result = trace_what_if(model_traces(job(), "synthetic"))
    assert result.measured_step_ms == pytest.approx(healthy + LATE_MS)
    assert result.replayed_step_ms == pytest.approx(healthy + LATE_MS)
    assert result.ideal_step_ms == pytest.approx(healthy)
    assert result.slowdown == pytest.approx((healthy + LATE_MS) / healthy)
    assert result.slowest.rank == LATE_RANK
    assert result.slowest.slowdown == pytest.approx(result.slowdown)
    assert result.slowest.what_if_step_ms == pytest.approx(healthy)
    assert result.slowest.compute_ms - result.slowest.peers_compute_ms == pytest.approx(LATE_MS)
    assert all(other.slowdown == pytest.approx(1.0) for other in result.by_rank[1:])
    assert all(step.slowest_what_if_ms == pytest.approx(healthy) for step in result.steps)


def test_the_healthy_job_has_no_slowdown():
    result = trace_what_if(model_traces(job(late_rank=None), "synthetic"))
    assert result.measured_step_ms == pytest.approx(sum(COMPUTE_MS) + sum(TRANSFER_MS) + TAIL_MS)
    assert result.slowdown == pytest.approx(1.0)
    assert result.slowest.what_if_step_ms == pytest.approx(result.measured_step_ms)


def test_a_step_whose_ranks_issued_different_collectives_is_skipped_with_why():
    ranks = job()
    ranks[3] = rank_result(3, job_late_ms=LATE_MS, collectives=1)
    with pytest.raises(ModelError, match="rank 3 issued 1 collectives"):
        model_traces(ranks, "synthetic")


def test_whatif_reads_a_run_directory(tmp_path):
    """Identical ranks (a synthetic set from one real GPU trace): no slowdown, every S_w 1."""
    run_dir = synthetic_run_dir(tmp_path / "run", 4)
    completed = fleetscope("whatif", str(run_dir), "--json", str(tmp_path / "whatif.json"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "4 data-parallel ranks" in completed.stdout
    figures = json.loads((tmp_path / "whatif.json").read_text())
    assert figures["slowdown"] == pytest.approx(1.0)
    assert all(rank["slowdown"] == pytest.approx(1.0) for rank in figures["by_rank"])


# -- ground truth: a real job with and without a planted straggler ---------------------------------------------

STRAGGLE_MS = 100.0
SHARED_WORK_MS = 200.0
"""Every rank sleeps this long in its forward (faults.slow_phase on every rank): work of each rank's own, as a
GPU job's kernels are on its own GPU. Two ranks on a loaded 2-core machine share their CPU, and a sleeping rank
hands its core to its peer, which then computes faster than in the healthy job: no per-rank model can see that,
so the CPU compute is kept small (1 sequence of 32 tokens) beside this work that does not contend. At load 4-6 on
2 cores, 100 ms of it left the what-if 0.86-1.04 of the healthy step over four pairs of runs; 200 ms, 0.98-1.07."""
WHAT_IF_TOLERANCE = 0.10


def launch(run_dir: Path, straggle_ms: float) -> Path:
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--parallel", "ddp",
                           "--device", "cpu", "--steps", "8", "--profile", "wait=1,warmup=1,active=5,repeat=1",
                           "--no-postprocess", "--set", "data.batch_size=1", "--set", "data.seq_len=32",
                           "--set", "faults.slow_phase=forward", "--set", f"faults.slow_phase_ms={SHARED_WORK_MS:g}",
                           "--set", "faults.straggle_rank=1", "--set", f"faults.straggle_ms={straggle_ms:g}",
                           timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return run_dir


@pytest.mark.slow
def test_the_straggler_made_ideal_runs_as_the_job_without_the_fault(tmp_path):
    """Two 8-step jobs of 2 CPU ranks (gloo), 5 profiled steps each, without post-processing, run side by side so
    that both see the same load (tests/test_whatif_pipeline_traces.py says why). The what-if of the straggled job
    with its slowest rank at its peer's compute, against the step time the same job measured without the fault
    (quantities.py's trace step time, medians over the profiled steps)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        run_dirs = list(pool.map(launch, (tmp_path / "healthy", tmp_path / "straggled"), (0.0, STRAGGLE_MS)))
    healthy, straggled = (trace_what_if(model_traces(read_rank_results(run_dir)[0], run_dir.name))
                          for run_dir in run_dirs)
    healthy_ms = float(np.median([step.measured_ms for step in healthy.steps]))
    what_if_ms = float(np.median([step.slowest_what_if_ms for step in straggled.steps]))
    assert straggled.slowest.rank == 1
    assert straggled.slowest.compute_ms - straggled.slowest.peers_compute_ms >= 0.8 * STRAGGLE_MS
    assert what_if_ms == pytest.approx(healthy_ms, rel=WHAT_IF_TOLERANCE), (what_if_ms, healthy_ms)
