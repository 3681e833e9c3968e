"""The whole run in the merged trace: every rank's step time and lateness from its timeline, as counters
(analysis/merge/whole_run_counters.py), read back from the file and by Perfetto's engine."""

from __future__ import annotations

import pytest

from fleetscope.analysis.inputs.records import read_run_records
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.check import check_trace, iter_packets
from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.verify import verify_merge
from fleetscope.analysis.merge.whole_run_counters import MAX_SAMPLES_PER_RANK, WHOLE_RUN_PROCESS_NAME, plan_whole_run
from fleetscope.traces.timeline import TimelineWriter
from helpers import trace_processor
from hostile_runs import make_run

STEP_MS = 100.0
LATE_MS = 5.0
LATE_STEPS = range(10, 20)


def write_timelines(layout, steps: int, *, late_rank: int = 1) -> None:
    """Two ranks, 100 ms steps back to back from the same instant; `late_rank` ends LATE_MS later in LATE_STEPS."""
    start_us = 1.7e15
    for rank in (0, 1):
        writer = TimelineWriter(layout.timeline_file(rank), rank)
        for step in range(steps):
            extra = LATE_MS if rank == late_rank and step in LATE_STEPS else 0.0
            writer.append(step=step, start_us=start_us + step * STEP_MS * 1000, step_ms=STEP_MS + extra,
                          first=step == 0)
        writer.close()


def counters(path) -> dict[str, list[tuple[int, float]]]:
    check = check_trace(path)
    return {check.tracks[uuid].name: samples for uuid, samples in check.counter_values.items()
            if check.tracks[uuid].name.startswith("rank ") and check.tracks[uuid].name.endswith(("step time (ms)", "lateness (ms)"))
            and check.tracks[uuid].name.split(":")[0].count(" ") == 1}


def test_every_step_of_every_rank_is_a_counter_sample_with_its_lateness(tmp_path):
    layout = make_run(tmp_path / "run")
    write_timelines(layout, 30)
    result = merge(layout.root, tmp_path / "merged.perfetto-trace")
    assert not verify_merge(result, trace_processor=trace_processor(), engine=trace_processor() is not None)
    found = counters(result.output)
    late = dict(found["rank 1: lateness (ms)"])
    assert len(found["rank 0: step time (ms)"]) == 29 and result.whole_run_samples == 4 * 29   # the first step left out
    stamps = sorted(late)
    assert [late[t] for t in stamps[9:19]] == [LATE_MS] * 10 and set(late[t] for t in stamps[19:]) == {0.0}
    assert set(v for _, v in found["rank 0: lateness (ms)"]) == {0.0}
    assert stamps[0] - int(1.7e15 * 1000) == pytest.approx(STEP_MS * 1e6, abs=1)   # step 1's start, in ns
    processes = [p.name for p in check_trace(result.output).processes()]
    assert processes[0] == WHOLE_RUN_PROCESS_NAME


def test_a_long_run_is_binned_and_the_bins_say_so(tmp_path):
    layout = make_run(tmp_path / "run")
    write_timelines(layout, 3 * MAX_SAMPLES_PER_RANK + 1)
    result = merge(layout.root, tmp_path / "merged.perfetto-trace")
    found = counters(result.output)
    assert len(found["rank 0: step time (ms)"]) == MAX_SAMPLES_PER_RANK
    described = {p.track_descriptor.name: p.track_descriptor.description for p in iter_packets(result.output)
                 if p.HasField("track_descriptor")}
    assert described["rank 0: step time (ms)"].startswith("one sample per 3 step(s), their mean; step time from")
    # no clock files here: rank 0 is the reference, rank 1's lateness says it holds its host's clock skew
    assert "its clock offset measured" in described["rank 0: lateness (ms)"]
    assert "no measured clock offset" in described["rank 1: lateness (ms)"]
    # bins of 3 steps from step 1: steps 10-19 are bins 3-5 (10-12, 13-15, 16-18) and step 19 of bin 6 (19-21)
    late = [v for _, v in sorted(found["rank 1: lateness (ms)"])]
    assert late[2:8] == pytest.approx([0.0, LATE_MS, LATE_MS, LATE_MS, LATE_MS / 3, 0.0], abs=1e-4)


def test_no_counters_for_a_merge_of_some_steps_or_without_timelines(tmp_path):
    layout = make_run(tmp_path / "run")
    assert merge(layout.root, tmp_path / "a.perfetto-trace").whole_run_samples == 0
    write_timelines(layout, 30)
    result = merge(layout.root, tmp_path / "b.perfetto-trace", options=MergeOptions(steps=frozenset({1})))
    assert result.whole_run_samples == 0


def test_a_damaged_or_escaping_timeline_is_a_note_and_the_others_are_drawn(tmp_path):
    layout = make_run(tmp_path / "run")
    write_timelines(layout, 30)
    outside = tmp_path / "elsewhere.timeline"
    outside.write_bytes(layout.timeline_file(1).read_bytes())
    layout.timeline_file(1).unlink()
    layout.timeline_file(1).symlink_to(outside)
    result = merge(layout.root, tmp_path / "merged.perfetto-trace")
    assert "rank 0: step time (ms)" in counters(result.output) and "rank 1: step time (ms)" not in counters(result.output)
    assert any("whole-run counters: rank 1" in n.reason and "outside" in n.reason for n in result.notes)
    assert not verify_merge(result)


def test_a_resumed_run_s_repeated_steps_are_drawn_once_from_the_later_attempt(tmp_path):
    """Both ranks crash after step 29 and resume from step 20 a minute later: lateness compares each step's
    later attempt on both ranks (not the resumed records with the first attempt's ends: a minute late)."""
    layout = make_run(tmp_path / "run")
    write_timelines(layout, 30)
    resumed_us = 1.7e15 + 60e6
    for rank in (0, 1):
        writer = TimelineWriter(layout.timeline_file(rank), rank)
        for step in range(20, 30):
            writer.append(step=step, start_us=resumed_us + (step - 20) * STEP_MS * 1000, step_ms=STEP_MS,
                          first=step == 20)
        writer.close()
    plan = plan_whole_run(read_run_records(layout), [0, 1], {})
    for rank in plan.ranks:
        assert len(rank.step_ms) == 28   # steps 1-19 of the first attempt, 21-29 of the second
        assert max(value for _, value in rank.lateness_ms) == pytest.approx(LATE_MS if rank.rank == 1 else 0.0)
        stamps = [ts for ts, _ in rank.step_ms]
        assert stamps == sorted(stamps) and stamps[-1] > int(resumed_us * 1000)
