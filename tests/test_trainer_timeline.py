"""The whole-run timeline as the trainer and users' programs write it (metrics/rank<R>.timeline): one record per
step of every rank, its times equal to the step metrics', its flags; the straggle fault with a known start and
end (faults.slow_until_step) as ground truth."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import fleetscope, metrics, torchrun

from fleetscope.analysis.inputs.records import read_run_records
from fleetscope.trainer import user_profiling as fs
from fleetscope.trainer.config import ConfigError, FaultConfig, TrainConfig, apply_overrides
from fleetscope.trainer.profiling import plan_windows
from fleetscope.traces import launch_env
from fleetscope.traces.layout import RunLayout
from fleetscope.traces.timeline import FLAG_FIRST, FLAG_PROFILED, read_timeline

STEPS = 28
SLOW_FROM, SLOW_UNTIL, STRAGGLE_MS = 8, 20, 200.0
"""12 slow steps: over the whole-run analysis's 10-step minimum, so the finding does not rest on the stricter
rule for shorter stretches, which a loaded 2-core machine's noise can defeat. 200 ms, about 4 quiet steps (45-50
ms): the analysis weighs each signal's excess by 1 / its noise and sizes it by the median step time, so on a
loaded 2-core machine (its steps 10-20 ms noisier either way) a 40 ms sleep moved rank 1's excess level by about
its own step-to-step noise, and the search found no change (one episode over the whole run, sized 14 ms); 200 ms
moves it by several noise scales. The 12 sleeps cost 2.4 s."""
PROFILE = "wait=22,warmup=1,active=2"  # profiled steps 22-24: away from the slow steps
TOLERANCE = 0.25
"""Rank 1's lateness at the first collective, against STRAGGLE_MS: the sleep plus the difference between the
two ranks' compute before that collective, which the load of a shared 2-core machine moves by 10-20 ms a step."""
COMMON = ["-m", "fleetscope.trainer", "--device", "cpu", "--steps", str(STEPS), "--profile", PROFILE,
          "--set", "observability.clock_round_trips=0"]
slow = pytest.mark.slow


def _timeline(run_dir: Path, rank: int) -> np.ndarray:
    timeline = read_timeline(RunLayout.at(run_dir).timeline_file(rank), expected_rank=rank, memmap=False)
    assert timeline.problems == []
    return timeline.records


# --- the fault, no processes ------------------------------------------------------------------------------


@pytest.mark.parametrize("until", [0, 8, 5])
def test_slow_until_step_must_follow_slow_from_step(until):
    with pytest.raises(ConfigError, match="faults.slow_until_step"):
        apply_overrides(TrainConfig(run_dir="r"), ["faults.slow_from_step=8", f"faults.slow_until_step={until}"])


def test_the_straggle_fault_starts_and_stops_at_the_given_steps():
    faults = FaultConfig(straggle_rank=1, straggle_ms=5, slow_from_step=3, slow_until_step=6)
    assert [s for s in range(10) if faults.straggles(1, s)] == [3, 4, 5]
    assert not any(faults.straggles(0, s) for s in range(10))
    assert all(FaultConfig(straggle_rank=1, straggle_ms=5, slow_from_step=3).straggles(1, s) for s in (3, 10**6))
    with pytest.raises(ConfigError, match="faults.slow_until_step"):
        FaultConfig(slow_until_step=0)  # from the first step until before step 0: nothing would be slow


# --- a user's loop in this process -----------------------------------------------------------------------------


def _launched_here(monkeypatch, run_dir: Path, **schedule) -> None:
    for name, value in launch_env.user_environment(run_dir=str(run_dir), schedule=schedule,
                                                   scheduler="local").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "2")


def test_a_user_loop_writes_one_record_per_step_tiling_the_loop(monkeypatch, tmp_path):
    _launched_here(monkeypatch, tmp_path, wait=2, warmup=1, active=1, repeat=1)
    windows = fs.windows()
    for step in windows.steps(range(6)):
        if step % 2:
            with windows.phase("data"):
                torch.mm(torch.randn(64, 64), torch.randn(64, 64))
        torch.mm(torch.randn(32, 32), torch.randn(32, 32))
    windows.close()
    records = _timeline(tmp_path, 2)
    assert records["step"].tolist() == list(range(6))
    assert [int(f) for f in records["flags"]] == [FLAG_FIRST, 0, FLAG_PROFILED, FLAG_PROFILED, 0, 0]
    ends = records["start_us"] + records["step_ms"].astype(np.float64) * 1e3
    assert np.allclose(records["start_us"][1:], ends[:-1], atol=50)  # each step starts where the last ended
    data = records["data_ms"]
    assert np.isnan(data[::2]).all() and (data[1::2] > 0).all() and (data[1::2] <= records["step_ms"][1::2]).all()
    assert np.isnan(records["first_collective_ms"]).all() and np.isnan(records["exposed_comm_ms"]).all()


def test_step_done_records_from_the_first_seen_start_and_a_later_process_appends(monkeypatch, tmp_path):
    _launched_here(monkeypatch, tmp_path, enabled=False)
    windows = fs.windows()
    for step in range(3):
        windows.step_done(step)  # step 0's start was not seen: no record for it
    windows.close()
    windows = fs.windows(start_step=3)
    windows.step_done(3)
    windows.close()
    records = _timeline(tmp_path, 2)
    assert records["step"].tolist() == [1, 2, 3]
    assert [int(f) for f in records["flags"]] == [FLAG_FIRST, 0, FLAG_FIRST]


def test_step_done_with_the_loops_own_numbering_counts_on_instead_of_stopping_the_program(monkeypatch, tmp_path,
                                                                                          capsys):
    # an epoch loop whose counter starts at 0 again: the user's program must go on, the timeline stays one count
    _launched_here(monkeypatch, tmp_path, enabled=False)
    windows = fs.windows(start_step=0)
    for step in (0, 1, 2, 0, 1, 7):
        windows.step_done(step)
    windows.close()
    assert _timeline(tmp_path, 2)["step"].tolist() == [0, 1, 2, 3, 4, 5]
    notice = capsys.readouterr().err
    assert notice.count("fleetscope: step_done(0) while step 3 is in progress") == 1 and "counts on from 3" in notice


def test_a_loop_numbering_steps_beyond_int32_or_with_floats_is_never_stopped(monkeypatch, tmp_path, capsys):
    # a timeline record holds an int32 step: a loop counting tokens as steps (past 2^31), or a float step, must
    # run on; those steps are left out of the timeline, said once
    _launched_here(monkeypatch, tmp_path, enabled=False)
    windows = fs.windows(start_step=2**31 + 5)
    for step in range(2**31 + 5, 2**31 + 8):
        windows.step_done(step)
    windows.close()
    for start in (1.5,):
        windows = fs.windows(start_step=0)
        windows.step_done(0)
        windows.step_done(start)
        windows.close()
    assert capsys.readouterr().err.count("cannot be kept in the step timeline") >= 1


# --- real runs ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straggled(tmp_path_factory):
    """2 gloo ranks of DDP; rank 1 sleeps STRAGGLE_MS in the forward phase of steps SLOW_FROM..SLOW_UNTIL - 1.
    Clock offsets are measured (the default): the straggle shows as rank 1's late arrival at the first gradient
    all-reduce, which is compared across ranks on one clock: both ranks under the same load at the same step."""
    run_dir = tmp_path_factory.mktemp("straggled")
    measured_clocks = [arg for arg in COMMON if arg not in ("--set", "observability.clock_round_trips=0")]
    completed = torchrun(2, *measured_clocks, "--parallel", "ddp", "--run-dir", str(run_dir),
                         "--set", "faults.straggle_rank=1", "--set", f"faults.straggle_ms={STRAGGLE_MS}",
                         "--set", f"faults.slow_from_step={SLOW_FROM}", "--set", f"faults.slow_until_step={SLOW_UNTIL}")
    assert completed.returncode == 0, completed.stderr[-4000:]
    return run_dir


def _profiled_steps() -> set[int]:
    schedule = apply_overrides(TrainConfig(run_dir="r"), [f"profiler.{part}" for part in PROFILE.split(",")]).profiler
    return {s for w in plan_windows(schedule, STEPS) for s in range(w.warmup_start, w.end)}


@slow
def test_every_rank_writes_one_record_per_step_equal_to_its_step_metrics(straggled):
    profiled = _profiled_steps()
    assert profiled == {22, 23, 24}
    for rank in (0, 1):
        records, rows = _timeline(straggled, rank), metrics(straggled, rank)
        assert records["step"].tolist() == [row["step"] for row in rows] == list(range(STEPS))
        assert np.allclose(records["step_ms"], [row["step_time_ms"] for row in rows], rtol=1e-6)
        assert np.allclose(records["data_ms"], [row["data_ms"] for row in rows], rtol=1e-6, atol=1e-6)
        assert np.allclose(records["exposed_comm_ms"], [row["comm_exposed_ms"] for row in rows], rtol=1e-6, atol=1e-6)
        flags = records["flags"].tolist()
        assert flags == [(FLAG_FIRST if s == 0 else 0) | (FLAG_PROFILED if s in profiled else 0) for s in range(STEPS)]
        starts = records["start_us"]
        assert (np.diff(starts) > records["step_ms"][:-1] * 1e3 * 0.999).all()  # a step starts after the last ended
        first = records["first_collective_ms"]  # DDP: the first gradient bucket's all-reduce, inside backward
        assert np.isfinite(first).all() and (first > 0).all() and (first <= records["step_ms"]).all()


def _arrival_lateness_ms(run_dir: Path) -> np.ndarray:
    """Per step, rank 1's arrival at the first collective less rank 0's, ms, on rank 0's clock (the run's
    measured offsets): the two ranks of one step, under the same load."""
    offsets = {rank: clock.offset_us for rank, clock in read_run_records(RunLayout.at(run_dir)).clock.items()}
    arrival_us = []
    for rank in (0, 1):
        records = _timeline(run_dir, rank)
        arrival_us.append(records["start_us"] - offsets.get(rank, 0.0) + records["first_collective_ms"] * 1e3)
    return (arrival_us[1] - arrival_us[0]) / 1e3


@slow
def test_the_straggler_is_slow_exactly_from_slow_from_step_until_slow_until_step(straggled):
    records = _timeline(straggled, 1)
    slow_steps = list(range(SLOW_FROM, SLOW_UNTIL))
    # The sleep is in the step's forward phase, never its data span: no step's data time carries it.
    data = records["data_ms"]
    assert all(data[s] < STRAGGLE_MS / 4 for s in range(1, STEPS)), data.tolist()
    # a step that holds the sleep is at least the sleep long: load only lengthens it
    step_ms = records["step_ms"]
    assert all(step_ms[s] >= STRAGGLE_MS for s in slow_steps), step_ms.tolist()
    # late by about the sleep in exactly the slow steps; in the others, by what load does to one rank and not the
    # other within a step (10-20 ms), far from half the sleep
    late = _arrival_lateness_ms(straggled)
    assert [s for s in range(1, STEPS) if late[s] > STRAGGLE_MS / 2] == slow_steps, late.tolist()
    assert abs(statistics.median(late[slow_steps]) - STRAGGLE_MS) <= TOLERANCE * STRAGGLE_MS, late.tolist()


def _late_by_the_load(straggled: Path, steps: range) -> bool:
    """Whether rank 1 was late at the first collective in `steps` (steady ones: not the first, not profiled)
    without the fault: by a median of at least SLOW_EXCESS of the median step time there, what the whole-run
    analysis calls slow. A shared machine's load can do that to one rank for a while."""
    from fleetscope.analysis.cross_rank.whole_run.model import SLOW_EXCESS

    steady = [s for s in steps if s > 0 and s not in _profiled_steps()]
    if not steady:
        return False
    late, step_ms = _arrival_lateness_ms(straggled), _timeline(straggled, 0)["step_ms"]
    return statistics.median(late[steady]) >= SLOW_EXCESS * statistics.median(step_ms[steady])


@slow
def test_the_whole_run_analysis_finds_the_straggle_within_two_steps(straggled):
    from fleetscope.analysis.cross_rank.whole_run import whole_run_section
    from fleetscope.analysis.cross_rank.whole_run.model import largest_episode

    section = whole_run_section(read_run_records(RunLayout.at(straggled)))
    inside = range(SLOW_FROM + 2, SLOW_UNTIL - 2)  # the slow steps, but for the search's two steps either way
    covering = [r for r in section.slow_ranks if r.from_step <= inside[-1] and r.to_step >= inside[0]]
    assert [r.rank for r in covering] == [1], section.verdict  # rank 0 arrives first by the sleep there
    found = covering[0]
    # within two steps of the fault; or further, over steps where the load had made rank 1 late already (its
    # arrival measured against rank 0's in the same steps): the analysis joins next slow stretches of one signal
    late = _arrival_lateness_ms(straggled).round(1).tolist()
    assert found.from_step >= SLOW_FROM - 2 or _late_by_the_load(straggled, range(found.from_step, SLOW_FROM)), \
        (found, late)
    assert found.to_step <= SLOW_UNTIL + 1 or _late_by_the_load(straggled, range(SLOW_UNTIL, found.to_step + 1)), \
        (found, late)
    assert found.from_step <= SLOW_FROM + 2 and found.to_step >= SLOW_UNTIL - 3, (found, late)
    # sized as the late arrival (a median: the fault's 12 steps outnumber any stretch of load joined to them)
    assert found.signal == "late at the first collective"
    assert abs(found.excess_ms - STRAGGLE_MS) <= TOLERANCE * STRAGGLE_MS, (found, late)
    assert found.significance is not None and found.significance.stands_out, found.significance
    # The load can also make either rank late elsewhere for a while: a true (small) episode of this run; the
    # search's false alarms on stationary series are counted in tests/test_cross_rank_whole_run.py. The fault's
    # episode is the one the section puts first.
    assert largest_episode(section.slow_ranks) == found, section.verdict


@slow
def test_fsdp_ranks_time_their_reduce_scatters(tmp_path):
    run_dir = tmp_path / "run"
    completed = torchrun(2, *COMMON[:-4], "--steps", "3", "--profile", "off", "--parallel", "fsdp",
                         "--run-dir", str(run_dir), "--set", "observability.clock_round_trips=0")
    assert completed.returncode == 0, completed.stderr[-4000:]
    for rank in (0, 1):
        records = _timeline(run_dir, rank)
        assert records["step"].tolist() == [0, 1, 2]
        first = records["first_collective_ms"]
        assert np.isfinite(first).all() and (first > 0).all() and (first <= records["step_ms"]).all()
        exposed = records["exposed_comm_ms"]  # the last reduce-scatter's wait, as for DDP's last bucket
        assert np.isfinite(exposed).all() and (exposed >= 0).all() and (exposed <= records["step_ms"]).all()
        rows = metrics(run_dir, rank)
        assert [row["comm_buckets"] for row in rows] == [rows[0]["comm_buckets"]] * 3 and rows[0]["comm_buckets"] >= 2
        assert np.allclose(exposed, [row["comm_exposed_ms"] for row in rows], rtol=1e-6, atol=1e-6)
        assert all(row["comm_exposed_ms"] <= row["comm_ms"] < row["step_time_ms"] for row in rows)


USER_PROGRAM = """
import time
from fleetscope.trainer import user_profiling as fs

windows = fs.windows(start_step=0)
for step in range(8):
    with windows.phase("data"):
        time.sleep(0.002)
    time.sleep(0.01)
    windows.step_done(step)
"""


@slow
def test_a_user_program_under_launch_gets_a_timeline_without_calling_close(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text(USER_PROGRAM)
    run = tmp_path / "run"
    completed = fleetscope("launch", "--run-dir", str(run), "--nproc-per-node", "2", "--device", "cpu",
                           "--no-post", "--profile", "wait=3,warmup=1,active=1", "--", "python", str(program),
                           cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    for rank in (0, 1):
        records = _timeline(run, rank)
        assert records["step"].tolist() == list(range(8))
        assert [int(f) for f in records["flags"]] == [FLAG_FIRST, 0, 0, FLAG_PROFILED, FLAG_PROFILED, 0, 0, 0]
        assert (records["step_ms"] >= 11).all() and (records["data_ms"] >= 2).all()
        assert math.isnan(float(records["first_collective_ms"][0]))


# --- the anomaly trigger shares the change detector -----------------------------------------------------------


def _noisy(levels: list[float], seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [level * float(np.exp(rng.normal(0.0, 0.05))) for level in levels]


@pytest.mark.parametrize("seed", range(5))
def test_a_relative_trigger_fires_within_two_steps_of_a_sustained_change(seed):
    from fleetscope.trainer.triggers import LocalTriggers, parse_triggers

    local = LocalTriggers(parse_triggers("step_time>2x"), history=20)
    series = _noisy([50.0] * 40 + [90.0] * 10, seed)  # 1.8x: no single step is over 2x the median
    reasons = {step: reason for step, value in enumerate(series) if (reason := local.observe(value, 1.0))}
    first = min(reasons, default=None)
    assert first is not None and 40 <= first <= 41, reasons
    assert "a sustained change (step_time>2x): slower" in reasons[first]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("noise", [0.01, 0.05])
def test_a_sustained_slowdown_well_under_the_threshold_does_not_fire(seed, noise):
    from fleetscope.trainer.triggers import LocalTriggers, parse_triggers

    local = LocalTriggers(parse_triggers("step_time>2x"), history=20)
    rng = np.random.default_rng(seed)
    series = [level * float(np.exp(rng.normal(0.0, noise))) for level in [50.0] * 40 + [72.5] * 200]   # 1.45x
    assert not any(local.observe(value, 1.0) for value in series)


def test_a_relative_trigger_ignores_noise_a_lone_spike_and_speedups_and_absolute_ones_compare_each_step():
    from fleetscope.trainer.triggers import LocalTriggers, parse_triggers

    local = LocalTriggers(parse_triggers("step_time>2x"), history=20)
    quiet = _noisy([50.0] * 2000, seed=7)
    quiet[500] *= 1.8  # one slow step under 2x
    assert not any(local.observe(value, 1.0) for value in quiet + _noisy([30.0] * 50, seed=8))
    absolute = LocalTriggers(parse_triggers("step_time>80ms"), history=20)
    assert absolute.observe(81.0, 1.0) == "step_time 81.0 ms > 80 ms" and absolute.observe(79.0, 1.0) is None
